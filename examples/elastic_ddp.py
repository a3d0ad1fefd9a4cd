"""examples/torchrun_ddp.py's model and data with Pitstop's data parallelism instead of DDP: a
lost replica's micro-batches go to the survivors and training goes on in memory, no restart.

    torchrun --standalone --nproc-per-node 2 examples/elastic_ddp.py     # as plain DDP
    pitstop-run --elastic --nnodes 2 --nproc-per-node 1 --node-rank $N --master-addr HOST0 \\
        --server ws://CONTROL:8000 --job NAME    examples/elastic_ddp.py

The difference from a DDP script is the marked lines: the model is not wrapped in
``DistributedDataParallel`` and no process group is made; ``elastic.DataParallel`` takes the
model and the optimizer, and the step asks for the loss of each of this rank's micro-batches,
addressed by (step, index), so that whichever rank computes one computes the same samples.
Every rank prints one line a step: ``rank R step S loss L world W`` (the device's rank among
the members, the global batch's mean loss, the members).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch

from worker_agent import elastic  # Pitstop


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--micro-batches", type=int, default=4, help="the global batch's, any world")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    p.add_argument("--samples", type=int, default=16, help="samples a micro-batch")
    p.add_argument(
        "--digest", action="store_true", help="also print a digest of the weights each step"
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: the model on cuda:LOCAL_RANK, its collectives over nccl",
    )  # fmt: skip
    return p.parse_args()


def batch(step: int, index: int, samples: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``step``: ``samples`` samples, the same on any rank."""
    seed = torch.Generator().manual_seed(step * 1_000_003 + index)
    x = torch.randn(samples, 32, generator=seed)
    return x, x.sum(1, keepdim=True)


def main() -> None:
    args = _arguments()
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model.to(device)
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(step: int, index: int) -> torch.Tensor:
        x, y = (t.to(device) for t in batch(step, index, args.samples))
        return torch.nn.functional.mse_loss(model(x), y)

    run = elastic.DataParallel(model, optimizer, micro_batches=args.micro_batches)  # Pitstop
    while run.step < args.steps:
        loss = run.train_step(loss_of)  # Pitstop: forward, backward, all-reduce, step
        time.sleep(args.step_s)
        rank = run.members.index(run.device)
        line = f"rank {rank} step {run.step} loss {loss:.6f} world {len(run.members)}"
        sys.stdout.write(line + "\n")
        if args.digest:  # the weights' bytes: replicas hold the same ones, bit for bit
            weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
            sys.stdout.write(
                f"rank {rank} step {run.step} digest {hashlib.sha1(weights).hexdigest()}\n"
            )


if __name__ == "__main__":
    main()
