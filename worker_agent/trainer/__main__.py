"""The reference trainer's commands.

``python -m worker_agent.trainer local --devices 8 --plan FILE --steps N [--json OUT]`` runs it on
this machine, one process per device over loopback, and prints a table of the steps: the loss
(the global-batch mean) and the step time (the slowest rank's).

``python -m worker_agent.trainer rank --plan FILE`` is one rank under the agent
(``serve.py``): the agent gives it its device, the store and the generation.

``python -m worker_agent.trainer profile [--out FILE]`` measures the model's per-layer costs here
and writes a scenario for the core (``profiler.py``).

FILE is a plan in the core's format or a scenario file (its ``plan`` is used, and its
``training.micro_batch`` unless ``--micro-batch`` is given); the model gets the plan's number
of layers. ``--accelerator auto|cpu|cuda|npu`` (all three commands; default ``auto``) says where
the ranks compute and so which backend their collectives use (``device.py``); one that is not
here is refused in one line, status 2, as is ``rank --resume`` without a complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from worker_agent.link import TrainerLink
from worker_agent.trainer import checkpoint, device, profiler
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.handover import NoHolder
from worker_agent.trainer.launch import Phase, run_local
from worker_agent.trainer.model import ModelConfig
from worker_agent.trainer.rank import BadRestore
from worker_agent.trainer.serve import serve


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="plan or scenario JSON file")
    parser.add_argument("--micro-batch", type=int, help="samples per micro-batch (default 2)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--checkfree-plus",
        action="store_true",
        help="train as CheckFree+ does: pipelines of 4 stages or more out of order, with copies "
        "of the embedding and LM head on the swap partners (restore: neighbours_plus)",
    )
    device.add_option(parser)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker_agent.trainer")
    commands = parser.add_subparsers(dest="command", required=True)
    local = commands.add_parser("local", help="train a plan with one process per device here")
    _model_options(local)
    local.add_argument("--devices", type=int, help="processes (default: the plan's devices)")
    local.add_argument("--steps", type=int, default=5)
    local.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    local.add_argument("--json", type=Path, help="also write the steps to this file")
    rank = commands.add_parser("rank", help="one rank under the agent (or alone, with --device)")
    _model_options(rank)
    rank.add_argument("--device", type=int, help="without an agent: this rank's device")
    rank.add_argument("--store", help="without an agent: HOST:PORT of the job's TCPStore")
    rank.add_argument("--steps", type=int, help="stop after this many steps (default: never)")
    rank.add_argument("--checkpoint-dir", type=Path, help="where the layers' checkpoints go")
    rank.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)"
    )
    rank.add_argument(
        "--resume", action="store_true", help="start from the newest checkpoint in the directory"
    )
    rank.add_argument("--dump", type=Path, help="write the rank's state here (drills, tests)")
    profiler.add_parser(commands)
    return parser


def _config(args: argparse.Namespace, plan: dict[str, Any], micro_batch: int | None) -> TrainConfig:
    layers = max(stage["layers"][1] for p in plan["pipelines"] for stage in p["stages"])
    ffn = (8 * args.d_model // 3 + 7) // 8 * 8  # about 8/3 of d_model, a multiple of 8
    model = ModelConfig(
        layers=layers, d_model=args.d_model, heads=args.heads, ffn=ffn, seq=args.seq
    )
    return TrainConfig(
        model=model,
        micro_batch=args.micro_batch or micro_batch or 2,
        optimizer=args.optimizer,
        lr=args.lr,
        accelerator=device.resolve(args.accelerator),
        checkfree_plus=args.checkfree_plus,
    )


def _rank(args: argparse.Namespace) -> int:
    plan, scenario_micro_batch = _read_plan(args.plan)
    config = _config(args, plan, scenario_micro_batch)
    if args.resume:  # refused here, before anything starts, rather than by the first restore
        if args.checkpoint_dir is None:
            print("rank: --resume needs --checkpoint-dir DIR", file=sys.stderr)
            return 2
        why = checkpoint.missing(args.checkpoint_dir, config.model.layers)
        if why is not None:
            print(f"rank: --resume: {why}", file=sys.stderr)
            return 2
    link = TrainerLink.from_env()
    rank_device = link.device if link.device is not None else args.device
    store = link.store or args.store
    if rank_device is None or store is None:
        print("rank: no agent: give --device and --store", file=sys.stderr)
        return 2
    device.select(config.accelerator, device=rank_device)  # LOCAL_RANK out of range: refused
    host, _, port = store.rpartition(":")
    torch.set_num_threads(1)
    try:
        code = serve(
            link,
            plan,
            config,
            host=host,
            port=int(port),
            device=rank_device,
            max_steps=args.steps,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            dump=args.dump,
        )
    except (NoHolder, BadRestore) as exc:  # the start's restore: the checkpoint went meanwhile
        print(f"rank: --resume: {exc}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on the threads of abandoned groups


def _read_plan(path: Path) -> tuple[dict[str, Any], int | None]:
    data = json.loads(path.read_text())
    if "plan" in data:
        return data["plan"], data.get("training", {}).get("micro_batch")
    return data, None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "rank":
            return _rank(args)
        if args.command == "profile":
            return profiler.run(args)
        return _local(args)
    except device.Unavailable as exc:  # the accelerator asked for is not here: one line
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2


def _local(args: argparse.Namespace) -> int:
    plan, scenario_micro_batch = _read_plan(args.plan)
    config = _config(args, plan, scenario_micro_batch)
    layers, micro_batch = config.model.layers, config.micro_batch
    devices = args.devices or 1 + max(
        d for p in plan["pipelines"] for stage in p["stages"] for d in stage["devices"]
    )
    device.check_ranks(config.accelerator, devices)
    result = run_local(devices, [Phase(plan, args.steps)], config, timeout_s=args.timeout)
    losses, times = result.losses(0), result.step_times(0)
    samples = sum(p["micro_batches"] for p in plan["pipelines"]) * micro_batch
    where = f"{config.accelerator} ({device.BACKENDS[config.accelerator]})"
    print(
        f"{devices} devices, {layers} layers, {samples} samples per step, on {where}",
        file=sys.stderr,
    )
    print(f"{'step':>5} {'loss':>9} {'step time':>10} {'samples/s':>10}")
    for step in sorted(losses):
        t = times[step]
        print(f"{step:>5} {losses[step]:>9.4f} {t * 1e3:>8.1f}ms {samples / t:>10.1f}")
    steady = [times[s] for s in sorted(times)[1:]] or list(times.values())
    median = statistics.median(steady)
    print(f"median step time after the first: {median * 1e3:.1f} ms")
    if args.json:
        builds = [b for _, _, b in result.builds]
        report = {
            "plan": plan,
            "devices": devices,
            "accelerator": config.accelerator,
            "model": {"layers": layers, "d_model": args.d_model, "seq": args.seq},
            "micro_batch": micro_batch,
            "samples_per_step": samples,
            "steps": [
                {"step": s, "loss": losses[s], "step_time_s": times[s]} for s in sorted(losses)
            ],
            "median_step_time_s": median,
            "generation_build_s": max(builds, default=0.0),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
