"""One torchft replica group of one process: examples/elastic_ddp.py's model, data, optimizer
and step sleep under torchft 0.2.0, for ``benchmarks/torchft_side_by_side.py``.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT REPLICA_GROUP_ID=R NUM_REPLICA_GROUPS=N \\
        python -u benchmarks/torchft_replica.py [--micro-batches 12] [--step-s 0.05] \\
        [--timeout-s S] [--quorum-timeout-s S] [--connect-timeout-s S] [--pg-timeout-s S] \\
        [--heartbeat-ms MS]

Set up as torchft's ``train_ddp.py`` sets up a replica group: a ``ProcessGroupGloo`` that the
``Manager`` reconfigures at each new quorum, ``torchft.Optimizer`` (the quorum started in
``zero_grad``, the optimizer stepped only when ``should_commit``), checkpoints for a healing
replica sent over the process group (``PGTransport``); the gradients are averaged over the
step's participants by ``Manager.allreduce``, one all-reduce of them flattened (as Pitstop's
step does). Not ``torchft.DistributedDataParallel``: in torchft 0.2.0 its comm hook fails
(``assert fut._fut`` in ``torchft/ddp.py``) when the all-reduce raises, so a peer killed during
the all-reduce crashes the survivor rather than failing the step. The group's store, which
torchrun's agent would host, is hosted here (one process a group). A timeout not given is
torchft's default (60 s for the manager, its quorum, its connections and gloo).

Replica group ``R`` computes its fixed share of the step's ``--micro-batches`` global micro-batches
(``elastic.share``: contiguous, as Pitstop shares them among a full world), addressed by
(step, index) exactly as elastic_ddp.py does; torchft does not reassign a lost group's share,
so after a loss the step's batch is the survivors' shares. A committed step prints
``rank R step S loss L world W``: the replica group, the manager's committed step, the mean loss
of this group's micro-batches, the replica groups that took part in the step. A step that does
not commit (an all-reduce failed) prints nothing.

Everything listens on, or advertises, 127.0.0.1 (gloo on ``lo`` when the caller sets
``GLOO_SOCKET_IFNAME=lo``; the manager's server is bound to 127.0.0.1 rather than torchft's
``[::]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torchft.manager  # type: ignore[import-untyped]
from torch.distributed import TCPStore
from torchft import Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport  # type: ignore[import-untyped]

from worker_agent import elastic

ROOT = Path(__file__).resolve().parents[1]


def _example() -> Any:
    """examples/elastic_ddp.py as a module, for its ``batch``: the very same samples."""
    spec = importlib.util.spec_from_file_location("elastic_ddp", ROOT / "examples/elastic_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loopback_server(**kwargs: Any) -> Any:
    """torchft's ``ManagerServer`` bound to 127.0.0.1 (torchft binds ``[::]``)."""
    kwargs["bind"] = "127.0.0.1:0"
    return _SERVER(**kwargs)


_SERVER = torchft.manager.ManagerServer
torchft.manager.ManagerServer = _loopback_server


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--micro-batches", type=int, default=4, help="the global batch's")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    seconds = {
        "--timeout-s": "the manager's timeout: collectives, should_commit, checkpoints",
        "--quorum-timeout-s": "the manager's wait for a quorum",
        "--connect-timeout-s": "the manager's RPC connections (its server, the lighthouse)",
        "--pg-timeout-s": "ProcessGroupGloo's timeout (its store and its collectives)",
    }
    for flag, what in seconds.items():
        p.add_argument(flag, type=float, default=None, help=f"{what}; default torchft's")
    p.add_argument(
        "--heartbeat-ms", type=float, default=None, help="the manager's heartbeat interval"
    )
    return p.parse_args()


def main() -> None:
    args = _arguments()
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    batch = _example().batch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if args.optimizer == "sgd":
        inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def given(value: float | None) -> timedelta | None:
        return None if value is None else timedelta(seconds=value)

    # the replica group's store (torchrun's agent hosts it for a group of several processes)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg_timeout = given(args.pg_timeout_s)
    pg = ProcessGroupGloo(**({} if pg_timeout is None else {"timeout": pg_timeout}))
    manager_kwargs: dict[str, Any] = {
        name: value
        for name, value in (
            ("timeout", given(args.timeout_s)),
            ("quorum_timeout", given(args.quorum_timeout_s)),
            ("connect_timeout", given(args.connect_timeout_s)),
            (
                "heartbeat_interval",
                None if args.heartbeat_ms is None else timedelta(milliseconds=args.heartbeat_ms),
            ),
        )
        if value is not None
    }
    transport = PGTransport(
        pg, timeout=manager_kwargs.get("timeout", timedelta(seconds=60)), device=torch.device("cpu")
    )
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"replica_{group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        checkpoint_transport=transport,
        **manager_kwargs,
    )
    optimizer = Optimizer(manager, inner)
    params = list(model.parameters())
    mine = elastic.share(range(groups), group, args.micro_batches)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # torchft: the step's quorum starts
        samples = [batch(step, index) for index in mine]
        x = torch.cat([s[0] for s in samples])
        y = torch.cat([s[1] for s in samples])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        # torchft: the gradients averaged over the step's participants, one all-reduce of them
        # flattened; a failure is reported to the manager (the step then does not commit)
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        manager.allreduce(flat).wait()
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()  # torchft: stepped only if every group's should_commit
        time.sleep(args.step_s)
        if manager.current_step() > step:
            world = manager.num_participants()
            line = (
                f"rank {group} step {manager.current_step()} loss {loss.item():.6f} world {world}"
            )
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
