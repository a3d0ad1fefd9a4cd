"""examples/torchrun_hsdp.py with Pitstop's lines: a lost rank takes its replica group out, the
other groups take its micro-batches, and the group comes back from a live group's shards, in
memory, no restart of the others.

    torchrun --standalone --nproc-per-node 4 examples/elastic_hsdp.py --shard-size 2
    pitstop-run --elastic --replica-size 2 --nnodes 2 --nproc-per-node 2 --node-rank $N \\
        --master-addr HOST0 --server ws://CONTROL:8000 --job NAME  examples/elastic_hsdp.py

The marked lines differ from the torchrun script: no process group and no 2-D mesh are made;
``elastic.HybridSharded`` makes the replica group's mesh, which ``fully_shard`` takes, and
``run.start`` the model and optimizer; the step asks for the loss of each of this rank's
micro-batches, addressed by (step, index). Device ``d`` is in replica group
``d // shard_size``. Every rank prints one line a step: ``rank R step S loss L world W``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.distributed.fsdp import fully_shard

from worker_agent import elastic  # Pitstop


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--micro-batches", type=int, default=4, help="the global batch's, any world")
    p.add_argument("--shard-size", type=int, default=2, help="ranks a replica group")
    p.add_argument("--width", type=int, default=64, help="the hidden layers' width")
    p.add_argument("--samples", type=int, default=16, help="samples a micro-batch")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step")
    p.add_argument(
        "--accelerator", choices=("cpu", "cuda", "auto"), default="cpu",
        help="the mesh's device: cpu (gloo), cuda (nccl), auto (CUDA when there is one)",
    )  # fmt: skip
    return p.parse_args()


def batch(step: int, index: int, samples: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``step``: ``samples`` samples, the same on any rank."""
    seed = torch.Generator().manual_seed(step * 1_000_003 + index)
    x = torch.randn(samples, 32, generator=seed)
    return x, x.sum(1, keepdim=True)


def build(width: int = 64) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )  # fmt: skip


def main() -> None:
    args = _arguments()
    run = elastic.HybridSharded(
        micro_batches=args.micro_batches, shard_size=args.shard_size, accelerator=args.accelerator
    )  # Pitstop: the replica group's process group and mesh
    model = build(args.width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=run.mesh)  # Pitstop: the replica group's mesh
    fully_shard(model, mesh=run.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.start(model, optimizer)  # Pitstop

    def loss_of(step: int, index: int) -> torch.Tensor:
        x, y = (t.to(run.mesh.device_type) for t in batch(step, index, args.samples))
        return torch.nn.functional.mse_loss(model(x), y)

    while run.step < args.steps:
        loss = run.train_step(loss_of)  # Pitstop: passes, reduce-scatter, all-reduce, step
        time.sleep(args.step_s)
        rank = run.members.index(run.device)
        line = f"rank {rank} step {run.step} loss {loss:.6f} world {len(run.members)}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
