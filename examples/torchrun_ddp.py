"""A plain torchrun DDP script: nothing of Pitstop in it. It trains a small model on CPU gloo (or
nccl where every rank has a GPU), keeps a checkpoint, and resumes from it when started again, as
a script meant for ``torchrun --max-restarts`` does.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --checkpoint-dir ckpt
    python -m worker_agent launch --standalone --nproc-per-node 2 \\
        --server ws://127.0.0.1:8000 --job NAME    examples/torchrun_ddp.py --checkpoint-dir ckpt

Every rank prints one line a step: ``rank R step S loss L restart N world W``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--checkpoint-dir", type=Path, help="keep a checkpoint here, resume from it")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step")
    return p.parse_args()


@record
def main() -> None:
    args = _arguments()
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net.to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    path = args.checkpoint_dir / "checkpoint.pt" if args.checkpoint_dir else None
    if path is not None and path.exists():
        state = torch.load(path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    while step < args.steps:
        seed = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 32, generator=seed).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        time.sleep(args.step_s)
        # one write a line: the ranks share the launcher's stdout, and print writes the end of
        # the line apart (unbuffered, under ``python -u``), so lines of two ranks could mix
        line = f"rank {rank} step {step} loss {loss.item():.6f} restart {restart} world {world}"
        sys.stdout.write(line + "\n")
        if path is not None and step % args.checkpoint_every == 0:
            if rank == 0:  # one copy: DDP's replicas are the same
                path.parent.mkdir(parents=True, exist_ok=True)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, path.with_suffix(".tmp"))
                path.with_suffix(".tmp").replace(path)
            dist.barrier()  # no rank runs ahead of the checkpoint it would resume from
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
