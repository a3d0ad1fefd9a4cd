"""Estimator accuracy: the core's step time from a profiled scenario against the trainer's.

For every plan, in every round: the reference model is profiled (``worker_agent.trainer.profiler``,
per-layer medians) with as many profiling processes at once as the plan has devices, one CPU
each, so that the profile describes a device of this machine while that many compute; then the
plan is trained for real by the launcher (``worker_agent.trainer.launch.run_local``), one process
per device, device d pinned to CPU d, and its step time is the median over the steps after the
warm-up. The estimate is ``controlplane.recovery.estimator.estimate_step_time`` (what the CLI's
``estimate`` prints) on the scenario that profile writes, with the link bandwidth of a loopback
gloo all-reduce measured at the start of the round. The profile is measured before the plan runs
and knows nothing of its times: profiling right before each run only keeps a shared machine's
changing speed out of the comparison. A plan's error is the median over the rounds of
(estimate - measured) / measured.

The cost model assumes that every device computes independently. On a machine with C CPUs that
holds only for plans of at most C devices, so the plans measured by default have at most as many
devices as this process may use (``os.sched_getaffinity``); those with more are measured only
with ``--oversubscribe`` and reported apart, outside the accuracy figure, since several ranks
then take turns on one CPU, which the cost model does not describe.

The profile is taken the way a stage runs its layers (``profile_model``'s default, chained: the
layers one after another, each followed by its optimizer update, which the scenario carries as
``update_s``). Rerouted plans are estimated with ``merge_rerouted`` (a whole pipeline rerouted
runs as extra micro-batches of the survivors, as the trainer routes it); the column ``eq. 13 %``
gives the error of the paper's stage-by-stage charge instead. ``--isolated`` profiles every layer
alone (the earlier method), for comparison.

    python -m benchmarks.estimator_accuracy [--quick] [--plans NAMES] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.results import write_results
from controlplane.recovery.codec import state_from_dict
from controlplane.recovery.estimator import estimate_step_time, peak_memory, stage_peak_bytes
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.launch import Phase, run_local
from worker_agent.trainer.profiler import (
    Profile,
    link_gbps,
    model_config,
    profile_concurrently,
    profile_model,
)

TARGET_MAPE = 0.05  # the goal; Odyssey reports errors up to 8.02 %
ODYSSEY_MAX_ERROR = 0.0802

Plan = dict[str, Any]


def _stage(device: int, first: int, end: int, rerouted: bool = False) -> dict[str, Any]:
    stage: dict[str, Any] = {"devices": [device], "layers": [first, end]}
    if rerouted:
        stage["rerouted"] = True
    return stage


def _pipeline(stages: list[dict[str, Any]], micro_batches: int) -> dict[str, Any]:
    return {"stages": stages, "micro_batches": micro_batches}


@dataclass(frozen=True, slots=True)
class Case:
    """A named plan for a model of L layers, and what kind of plan it is."""

    name: str
    kind: str
    build: Callable[[int], Plan]

    def plan(self, layers: int) -> Plan:
        return self.build(layers)


def _cases() -> list[Case]:
    def half(n: int) -> int:
        return n // 2

    def split(n: int) -> int:  # an uneven cut: 3/8 of the layers, at least one
        return max(1, 3 * n // 8)

    return [
        Case("pp1-m4", "symmetric", lambda n: {"pipelines": [_pipeline([_stage(0, 0, n)], 4)]}),
        Case(
            "pp2-m4",
            "symmetric",
            lambda n: {"pipelines": [_pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 4)]},
        ),
        Case(
            "pp2-m8",
            "symmetric",
            lambda n: {"pipelines": [_pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 8)]},
        ),
        Case(
            "dp2-m2",
            "symmetric",
            lambda n: {
                "pipelines": [_pipeline([_stage(0, 0, n)], 2), _pipeline([_stage(1, 0, n)], 2)]
            },
        ),
        Case(
            "pp2-split-m4",
            "asymmetric: uneven split",
            lambda n: {
                "pipelines": [_pipeline([_stage(0, 0, split(n)), _stage(1, split(n), n)], 4)]
            },
        ),
        Case(
            "dp2-m3-m1",
            "asymmetric: uneven micro-batches",
            lambda n: {
                "pipelines": [_pipeline([_stage(0, 0, n)], 3), _pipeline([_stage(1, 0, n)], 1)]
            },
        ),
        Case(
            "dp2-reroute",
            "rerouted: device 1 lost, device 0 runs its micro-batches",
            lambda n: {
                "family": "rerouting",
                "pipelines": [
                    _pipeline([_stage(0, 0, n)], 2),
                    _pipeline([_stage(0, 0, n, rerouted=True)], 2),
                ],
            },
        ),
        Case(
            "pp2dp2-reroute-stage1",
            "rerouted: PP2 x DP2, device 3 lost, device 1 runs its stage",
            lambda n: {
                "family": "rerouting",
                "pipelines": [
                    _pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 4),
                    _pipeline([_stage(2, 0, half(n)), _stage(1, half(n), n, rerouted=True)], 4),
                ],
            },
        ),
        Case(
            "pp2dp2-reroute-pipeline",
            "rerouted: PP2 x DP2, devices 2 and 3 lost, both stages rerouted",
            lambda n: {
                "family": "rerouting",
                "pipelines": [
                    _pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 2),
                    _pipeline(
                        [_stage(0, 0, half(n), rerouted=True), _stage(1, half(n), n, True)], 2
                    ),
                ],
            },
        ),
        Case(
            "pp2dp2-m4",
            "symmetric",
            lambda n: {
                "pipelines": [
                    _pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 4),
                    _pipeline([_stage(2, 0, half(n)), _stage(3, half(n), n)], 4),
                ]
            },
        ),
        Case(
            "depths-2-1",
            "asymmetric: pipelines of depths 2 and 1",
            lambda n: {
                "pipelines": [
                    _pipeline([_stage(0, 0, half(n)), _stage(1, half(n), n)], 3),
                    _pipeline([_stage(2, 0, n)], 1),
                ]
            },
        ),
    ]


CASES = {c.name: c for c in _cases()}


def devices_of(plan: Plan) -> list[int]:
    return sorted({d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]})


def estimate(
    profile: Profile, plan: Plan, gbps: float | None
) -> tuple[float, dict[int, float], float]:
    """The core's step time and per-device peak memory of ``plan`` under ``profile``, and the
    step time by eq. 13 (rerouted stages charged one after another)."""
    state = state_from_dict(profile.scenario(plan, gbps=gbps))
    return (
        estimate_step_time(state.profile, state.cluster, state.plan, merge_rerouted=True),
        peak_memory(state.profile, state.plan),
        estimate_step_time(state.profile, state.cluster, state.plan),
    )


def measure(
    plan: Plan, config: TrainConfig, steps: int, warmup: int, cpus: list[int]
) -> list[float]:
    """Step times after the warm-up (the slowest rank's), ranks pinned one CPU each."""
    devices = devices_of(plan)
    count = 1 + max(devices)
    pinning = {d: {cpus[i % len(cpus)]} for i, d in enumerate(devices)}
    result = run_local(count, [Phase(plan, warmup + steps)], config, cpus=pinning, timeout_s=600)
    times = result.step_times(0)
    return [times[s] for s in sorted(times)[warmup:]]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _stage_rss(config: TrainConfig, first: int, end: int, in_flight: int, out: Any) -> None:
    """In a fresh process: peak RSS growth of a stage in the middle of a 1F1B step."""
    import torch

    from worker_agent.trainer.engine import Worker
    from worker_agent.trainer.model import loss_of, run_layers

    torch.set_num_threads(1)
    last = end == config.model.layers
    b, s, d = config.micro_batch, config.model.seq, config.model.d_model
    generator = torch.Generator().manual_seed(0)

    def inputs() -> torch.Tensor:
        if first == 0:
            return torch.randint(0, config.model.vocab, (b, s), generator=generator)
        return torch.randn((b, s, d), generator=generator).requires_grad_(True)

    def one(keep: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        x = inputs()
        y = run_layers(worker.layers, first, end, x)
        if last:
            y = loss_of(y, torch.randint(0, config.model.vocab, (b, s), generator=generator))
        keep.append((x, y))

    def backward(keep: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for _, y in keep:
            grad = None if last else torch.full_like(y, 1e-3)
            torch.autograd.backward(y, grad)
        keep.clear()

    # the first pass of a tiny model outside the measurement: lazy initialisations of torch
    tiny = TrainConfig(model=model_config(layers=1, d_model=8, heads=2, seq=4), micro_batch=1)
    warm = Worker(0, tiny)
    warm.hold(0, 1)
    logits = run_layers(warm.layers, 0, 1, torch.zeros((1, 4), dtype=torch.long))
    torch.autograd.backward(loss_of(logits, torch.zeros((1, 4), dtype=torch.long)))
    for optimizer in warm.optimizers.values():
        optimizer.step()
    del warm, logits
    base = _rss_kib("VmRSS")
    worker = Worker(0, config)
    worker.hold(first, end)
    keep: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(2):  # the second step has the optimizer's state; its peak is the steady one
        for _ in range(in_flight):
            one(keep)
        backward(keep)
        for optimizer in worker.optimizers.values():
            optimizer.step()
        worker.zero_grad()
    out.put((_rss_kib("VmHWM") - base) * 1024)


def stage_rss_bytes(config: TrainConfig, first: int, end: int, in_flight: int) -> float:
    """Peak RSS growth of a process running a stage of layers [first, end) with ``in_flight``
    micro-batches' activations kept at once, over its RSS before it held them."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_stage_rss, args=(config, first, end, in_flight, out), daemon=True)
    proc.start()
    try:
        return float(out.get(timeout=300))
    finally:
        proc.join(timeout=10)


def memory_rows(config: TrainConfig, profile: Profile, plans: dict[str, Plan]) -> list[Any]:
    """Eq. 14's peak of every distinct stage of the plans without rerouting, against the RSS
    growth of a process running that stage (``stage_rss_bytes``)."""
    stages: dict[tuple[int, int, int], list[str]] = {}
    for name, plan in plans.items():
        if plan.get("family") == "rerouting":
            continue
        for pipeline in plan["pipelines"]:
            depth = len(pipeline["stages"])
            for i, stage in enumerate(pipeline["stages"]):
                in_flight = min(depth - i, pipeline["micro_batches"])
                stages.setdefault((*stage["layers"], in_flight), []).append(name)
    state = state_from_dict(profile.scenario(next(iter(plans.values()))))
    rows = []
    for (first, end, in_flight), names in sorted(stages.items()):
        est = stage_peak_bytes(state.profile, (first, end), 0, in_flight, in_flight)
        rss = stage_rss_bytes(config, first, end, in_flight)
        rows.append(
            {
                "layers": [first, end],
                "in_flight": in_flight,
                "plans": sorted(set(names)),
                "estimate_bytes": est,
                "rss_growth_bytes": rss,
                "ratio": rss / est,
            }
        )
        print(
            f"stage [{first}, {end}) with {in_flight} in flight: eq. 14 {est / 2**20:7.1f} MiB, "
            f"RSS growth {rss / 2**20:7.1f} MiB ({rss / est:.2f}x)",
            flush=True,
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'plan':<25} {'devices':>7} {'estimate ms':>11} {'measured ms':>11} {'error %':>8} "
        f"{'range %':>13} {'eq. 13 %':>9}  kind"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['plan']:<25} {r['devices']:>7} {r['estimate_s'] * 1e3:>11.1f} "
            f"{r['measured_s'] * 1e3:>11.1f} {r['error'] * 100:>+8.1f} "
            f"{r['error_range'][0] * 100:>+6.1f}..{r['error_range'][1] * 100:>+5.1f} "
            f"{r['error_eq13'] * 100:>+9.1f}  {r['kind']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 steps, one round")
    parser.add_argument("--plans", help=f"comma-separated names of {', '.join(CASES)}")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per plan and round")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all plans")
    parser.add_argument("--profile-repeat", type=int, default=10, help="runs per layer")
    parser.add_argument(
        "--profile-once",
        action="store_true",
        help="one profile, alone on one CPU before all the plans, for every estimate",
    )
    parser.add_argument(
        "--no-link", action="store_true", help="no link bandwidth: communication is free"
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="profile every layer alone instead of within a pass of the whole model",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the stages' RSS against eq. 14"
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="also measure plans with more devices than CPUs (reported apart)",
    )
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.seq, args.micro_batch = 2, 32, 16, 1
        args.steps, args.warmup, args.repeats, args.profile_repeat = 2, 1, 1, 3
    cpus = sorted(os.sched_getaffinity(0))
    names = [n.strip() for n in (args.plans or ",".join(CASES)).split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        parser.error(f"unknown plans {unknown}; known: {', '.join(CASES)}")
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or args.layers < 2:
        parser.error("give at least 1 step, 1 repeat, 0 warm-up steps and 2 layers")
    config = TrainConfig(
        model=model_config(layers=args.layers, d_model=args.d_model, seq=args.seq),
        micro_batch=args.micro_batch,
    )
    cases = [CASES[n] for n in names]
    fits = [c for c in cases if len(devices_of(c.plan(args.layers))) <= len(cpus)]
    over = [c for c in cases if c not in fits]
    if over and not args.oversubscribe:
        if args.plans:
            parser.error(
                f"plans {[c.name for c in over]} need more than {len(cpus)} CPUs "
                "(--oversubscribe measures them apart)"
            )
        cases = fits
    load_before = os.getloadavg()
    plans = {c.name: c.plan(args.layers) for c in cases}
    widths = sorted({min(len(devices_of(plan)), len(cpus)) for plan in plans.values()})

    chained = not args.isolated

    def profiled(width: int, repeat: int | None = None) -> Profile:
        """The profile of a device while ``width`` devices compute, one CPU each."""
        repeat = repeat or args.profile_repeat
        if width > 1:
            return profile_concurrently(
                config, width, warmup=2, repeat=repeat, cpus=cpus[:width], chained=chained
            )
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
        try:
            return profile_model(config, warmup=2, repeat=repeat, chained=chained)
        finally:
            os.sched_setaffinity(0, mask)

    grads = int(sum(p.m_g for p in profiled(1, repeat=1).layers))
    rounds: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    profiles: list[dict[str, Any]] = []
    once = profiled(1) if args.profile_once else None
    for r in range(args.repeats):
        gbps = link_gbps(grads, cpus=cpus) if widths[-1] > 1 and not args.no_link else None
        for case in cases:
            plan = plans[case.name]
            width = 1 if once else min(len(devices_of(plan)), len(cpus))
            profile = once or profiled(width)  # measured apart, before the plan runs
            est, peaks, eq13 = estimate(profile, plan, gbps)
            times = measure(plan, config, args.steps, args.warmup, cpus)
            measured = statistics.median(times)
            rounds[case.name].append(
                {
                    "estimate_s": est,
                    "measured_s": measured,
                    "error": (est - measured) / measured,
                    "estimate_eq13_s": eq13,
                    "step_times_s": times,
                    "link_gbps": gbps,
                    "profile_fwd_bwd_s": sum(p.fwd_s + p.bwd_s for p in profile.layers),
                    "load_average": os.getloadavg()[0],
                    "peak_memory_bytes": {str(d): b for d, b in sorted(peaks.items())},
                }
            )
            profiles.append({"round": r, "plan": case.name, **profile.to_dict()})
            print(
                f"round {r + 1}/{args.repeats} {case.name:<25} estimate {est * 1e3:8.1f} ms  "
                f"measured {measured * 1e3:8.1f} ms  {(est - measured) / measured * 100:+6.1f} %"
                f"  (profile of {width} busy CPU(s), load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    rows = []
    for case in cases:
        plan = plans[case.name]
        runs = rounds[case.name]
        errors = [x["error"] for x in runs]
        by_eq13 = [(x["estimate_eq13_s"] - x["measured_s"]) / x["measured_s"] for x in runs]
        rows.append(
            {
                "plan": case.name,
                "kind": case.kind,
                "devices": len(devices_of(plan)),
                "oversubscribed": case in over,
                "estimate_s": statistics.median(x["estimate_s"] for x in runs),
                "measured_s": statistics.median(x["measured_s"] for x in runs),
                "error": statistics.median(errors),
                "error_range": [min(errors), max(errors)],
                "error_eq13": statistics.median(by_eq13),
                "rounds": runs,
                "plan_json": plan,
            }
        )
    memory = [] if args.quick or args.no_memory else memory_rows(config, profiled(1), plans)
    inside = [r for r in rows if not r["oversubscribed"]]
    print()
    print(table(inside))
    mape = statistics.fmean(abs(r["error"]) for r in inside) if inside else float("nan")
    mape_eq13 = statistics.fmean(abs(r["error_eq13"]) for r in inside) if inside else float("nan")
    print(
        f"mean absolute percentage error: {mape * 100:.1f} % over {len(inside)} plans "
        f"(goal {TARGET_MAPE * 100:.0f} %, Odyssey's worst {ODYSSEY_MAX_ERROR * 100:.2f} %); "
        f"{mape_eq13 * 100:.1f} % with eq. 13 for the rerouted plans"
    )
    outside = [r for r in rows if r["oversubscribed"]]
    if outside:
        print(f"\nmore devices than the {len(cpus)} CPUs (not in the figure above):")
        print(table(outside))
    speeds = [x["profile_fwd_bwd_s"] for runs in rounds.values() for x in runs]
    print(
        f"profiles' fwd+bwd of all layers: {min(speeds) * 1e3:.0f}-{max(speeds) * 1e3:.0f} ms; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    write_results(
        Path(args.out) / "estimator_accuracy.json",
        {
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": cpus,
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
            "config": {
                "layers": args.layers,
                "d_model": args.d_model,
                "seq": args.seq,
                "micro_batch": args.micro_batch,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "profile_once": args.profile_once,
                "chained": chained,
                "link": not args.no_link,
            },
            "mape": mape,
            "mape_eq13": mape_eq13,
            "profiles": profiles,
            "rows": rows,
            "memory": memory,
        },
    )


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the launcher's ranks and the profiling processes are ended
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
