"""HSDP under plain torchrun: ``fully_shard`` over a 2-D mesh, replica groups × shards.

    torchrun --standalone --nproc-per-node 4 examples/torchrun_hsdp.py --shard-size 2

Each replica group of ``--shard-size`` ranks holds one copy of the model, sharded among its
ranks (FSDP2); the groups are data-parallel replicas, their gradients all-reduced by FSDP over
the mesh's ``replicate`` dimension. A lost rank ends the run, as under torchrun. The same file
with Pitstop's lines, which survives it in memory, is ``examples/elastic_hsdp.py``. Every rank
prints one line a step: ``rank R step S loss L world W``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--micro-batches", type=int, default=4, help="the global batch's")
    p.add_argument("--shard-size", type=int, default=2, help="ranks a replica group")
    p.add_argument("--width", type=int, default=64, help="the hidden layers' width")
    p.add_argument("--samples", type=int, default=16, help="samples a micro-batch")
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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(
        "cpu", (world // args.shard_size, args.shard_size), mesh_dim_names=("replicate", "shard")
    )
    model = build(args.width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mine = range(rank, args.micro_batches, world)  # the global batch dealt round the ranks
    for step in range(args.steps):
        loss = torch.zeros(())
        for index in mine:
            x, y = batch(step, index, args.samples)
            loss = loss + torch.nn.functional.mse_loss(model(x), y) / len(mine)
        loss.backward()  # FSDP averages the gradients over every rank
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        sys.stdout.write(
            f"rank {rank} step {step + 1} loss {float(mean) / world:.6f} world {world}\n"
        )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # without tearing the groups down (gloo's teardown may abort a rank)


if __name__ == "__main__":
    main()
