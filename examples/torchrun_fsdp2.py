"""A plain torchrun FSDP2 script: nothing of Pitstop in it. ``fully_shard`` over every linear
layer and the model (CPU gloo, or nccl where every rank has a GPU), AdamW, a sharded checkpoint
through ``torch.distributed.checkpoint`` saved asynchronously, and a resume from it on any
number of ranks (the checkpoint is resharded as it loads), as a script meant for
``torchrun --max-restarts`` does.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_fsdp2.py --checkpoint-dir ckpt
    pitstop-run --nnodes 1:2 --nproc-per-node 1 --node-rank $N --master-addr HOST0 \\
        --max-restarts 3 --server ws://CONTROL:8000 --job NAME \\
        examples/torchrun_fsdp2.py --checkpoint-dir /shared/ckpt

The global batch is ``--micro-batches`` micro-batches of 16 samples whatever the world: each
rank computes its share (micro-batch ``index`` of ``step`` is the same samples on any rank), so
a run resumed on fewer ranks trains on what the uninterrupted one would have. Every rank prints
one line a step, ``rank R step S loss L restart N world W`` (the global batch's mean loss), and
one line to stderr per checkpoint: how long the save blocked the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--micro-batches", type=int, default=4, help="the global batch's, any world")
    p.add_argument("--checkpoint-dir", type=Path, help="keep a checkpoint here, resume from it")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step")
    return p.parse_args()


def share(step_rank: int, world: int, total: int) -> range:
    """This rank's micro-batch indices: ``total`` shared evenly, the first ranks one more."""
    each, extra = divmod(total, world)
    first = step_rank * each + min(step_rank, extra)
    return range(first, first + each + (1 if step_rank < extra else 0))


def latest(directory: Path | None) -> int:
    """The step of the newest complete checkpoint (rank 0 names it once its save is done)."""
    marker = directory / "latest" if directory else None
    return int(marker.read_text()) if marker is not None and marker.exists() else 0


@record
def main() -> None:
    args = _arguments()
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model.to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the saves' collectives on a group of their own: an asynchronous save's would otherwise
    # interleave with the training's on the default group
    saves = dist.new_group(backend="gloo")
    step = latest(args.checkpoint_dir)
    if step and args.checkpoint_dir is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=args.checkpoint_dir / f"step-{step}", process_group=saves)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    saving: Any = None
    while step < args.steps:
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for index in share(rank, world, args.micro_batches):
            seed = torch.Generator().manual_seed(step * 1_000_003 + index)
            x = torch.randn(16, 32, generator=seed).to(device)
            total = total + torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        # FSDP averages the gradients over the ranks: scaled so the step is the global mean
        (total * world / args.micro_batches).backward()
        optimizer.step()
        loss = (total.detach() / args.micro_batches).reshape(1)
        dist.all_reduce(loss)
        step += 1
        time.sleep(args.step_s)
        # one write a line: the ranks share the launcher's stdout (print writes the end apart)
        line = f"rank {rank} step {step} loss {loss.item():.6f} restart {restart} world {world}"
        sys.stdout.write(line + "\n")
        if args.checkpoint_dir is not None and step % args.checkpoint_every == 0:
            began = time.perf_counter()
            if saving is not None:
                saving.result()  # the previous save is done before the next begins
            model_state, optimizer_state = get_state_dict(model, optimizer)
            saving = dcp.async_save(
                {"model": model_state, "optimizer": optimizer_state},
                checkpoint_id=args.checkpoint_dir / f"step-{step}",
                process_group=saves,
            )
            if rank == 0:
                saving.add_done_callback(
                    lambda future, done=step: _mark(args.checkpoint_dir, done, future)
                )
            blocked = time.perf_counter() - began
            sys.stderr.write(f"rank {rank} checkpoint step {step}: blocked {blocked:.3f} s\n")
    if saving is not None:
        saving.result()
    dist.barrier()
    dist.destroy_process_group()


def _mark(directory: Path, step: int, saved: Any) -> None:
    """Name the checkpoint of ``step`` the newest complete one (atomically), if its save did
    not fail (a peer lost in the middle of it: the one before stays the newest)."""
    if saved.exception() is not None:
        sys.stderr.write(f"checkpoint step {step} not saved: {saved.exception()}\n")
        return
    (directory / "latest.tmp").write_text(str(step))
    (directory / "latest.tmp").replace(directory / "latest")


if __name__ == "__main__":
    main()
