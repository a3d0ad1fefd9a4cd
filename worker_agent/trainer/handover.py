"""Moving layer weights and optimizer state from one plan to the next, peer to peer.

When a new plan gives a device layers it does not hold (a dynamic re-plan), it receives them
from a device that held them under the old plan and is still alive. The core's restorer
(``restorer.place``) chose which device takes which stage so that the fewest bytes move; here
``transfers`` only picks, for every layer a device lacks, one live holder to send it (spreading
the layers over the holders), and ``handover`` runs the sends and receives over a generation
that includes every sender and receiver.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from controlplane.recovery.model import ExecutionPlan
from controlplane.recovery.restorer import held_ranges
from worker_agent.trainer.comm import Generation
from worker_agent.trainer.engine import TrainPlan, Worker


class NoHolder(RuntimeError):
    """A layer the new plan needs has no live holder: only a checkpoint has it."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """Layer ``layer`` (weights and optimizer state) goes from device ``src`` to ``dst``."""

    layer: int
    src: int
    dst: int


def held_layers(plan: ExecutionPlan | None, live: Iterable[int]) -> dict[int, range]:
    """Layers each live device holds under ``plan`` (tp = 1: a group is one device)."""
    alive = set(live)
    out: dict[int, range] = {}
    for group, (first, end) in held_ranges(plan).items():
        for d in group:
            if d in alive:
                out[d] = range(first, end)
    return out


def transfers(
    old: ExecutionPlan | None,
    new: ExecutionPlan,
    live: Iterable[int],
    *,
    skip: Collection[int] = (),
) -> list[Transfer]:
    """Every layer a device of ``new`` lacks, each from one live holder under ``old``; layers
    in ``skip`` are left out (restored otherwise: rebuilt from neighbours, a checkpoint).

    Holders are chosen deterministically, each layer from the holder that sends the fewest
    layers so far (lowest device id on ties), so every rank computes the same list.
    """
    before = held_layers(old, live)
    after = TrainPlan.of(new).held
    load = dict.fromkeys(before, 0)
    out: list[Transfer] = []
    for dst, (first, end) in sorted(after.items()):
        for k in range(first, end):
            if k in before.get(dst, range(0)) or k in skip:
                continue
            holders = [d for d, r in sorted(before.items()) if k in r]
            if not holders:
                raise NoHolder(f"layer {k} has no live holder to take it from")
            src = min(holders, key=lambda d: (load[d], d))
            load[src] += 1
            out.append(Transfer(layer=k, src=src, dst=dst))
    return out


def participants(moves: Sequence[Transfer], new: ExecutionPlan) -> list[int]:
    """Devices that take part in a handover: the new plan's and every sender."""
    return sorted(set(TrainPlan.of(new).held) | {t.src for t in moves})


def handover(worker: Worker, gen: Generation, moves: Sequence[Transfer], new: TrainPlan) -> None:
    """Send and receive this device's share of ``moves``, then hold its stage of ``new``.

    Layers the device keeps stay as they are; layers it no longer needs are dropped after they
    are sent. Raises ``comm.Aborted`` if the generation is aborted meanwhile (nothing changes).
    """
    me = worker.device
    sends = gen.stream("handover sends")
    recvs = gen.stream("handover receives")
    received: dict[int, torch.Tensor] = {}
    try:

        def run() -> None:
            for t in moves:
                if t.dst == me:
                    buf = torch.empty(worker.state_numel(t.layer), device=worker.where)
                    gen.recv(recvs, buf, t.src, t.layer)
                    received[t.layer] = buf
            for t in moves:
                if t.src == me:
                    gen.send(sends, worker.export_layer(t.layer), t.dst, t.layer)
            recvs.wait_for(recvs.count, gen.abort)
            sends.wait_for(sends.count, gen.abort)

        gen.guard(run)
    finally:
        sends.close()
        recvs.close()
    keep = range(*new.held[me]) if me in new.held else range(0)
    for k in list(worker.layers):
        if k not in keep:
            del worker.layers[k]
            del worker.optimizers[k]
    for k, flat in received.items():
        worker.import_layer(k, flat)
