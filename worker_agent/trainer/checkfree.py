"""Rebuilding a stage that has no live copy from its pipeline neighbours (CheckFree, CheckFree+).

CheckFree (Blagoev et al.) recovers a lost intermediate stage without a checkpoint: its weights
become the average of the two neighbouring stages' weights, each weighted by the norm of that
stage's gradients in the last step, and its optimizer starts afresh. CheckFree+ also recovers the
first and last stages: they are trained out of order with their neighbours (stage 0 swaps with 1,
the last with the one before it), so a lost edge stage, or its swap partner, is copied from the
partner. Which stages are the sources is the core's ``policies.checkfree.sources``.

Layers map by position in the stage: the lost stage's j-th layer is rebuilt from each source
stage's j-th layer, tensor by tensor by name (a block from the blocks). The embedding of layer 0
and the final norm and LM head of the last layer (``model.edge_parts``) are in no other layer:
under CheckFree+ (``TrainConfig.checkfree_plus``) the swap partners of the edge stages keep exact
copies of them (``TrainPlan.copies``), trained with them, so a lost edge stage takes its blocks
from its partner's and its edge parts, weights and optimizer state, from the partner's copy
(``Rebuild.edge``); without such a copy the layer cannot be rebuilt: ``NoSource``. After every
plan change ``share_copies`` gives each copy holder of the new plan its copy again from the
layer's holder. Rebuilds are computed alike on every device from the plans, before anything
moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from controlplane.recovery.model import ExecutionPlan
from controlplane.recovery.policies.checkfree import sources
from worker_agent.trainer.comm import Generation
from worker_agent.trainer.engine import TrainPlan, Worker
from worker_agent.trainer.handover import NoHolder, held_layers
from worker_agent.trainer.model import ModelConfig, build_layer, edge_parts

# rebuild messages' tags start here (a handover tags a layer with its index)
TAG_BASE = 1 << 20
# the tag offset, within a rebuilt layer's tags, of its edge parts from a copy
EDGE_TAG = 7
# ``share_copies``' tags start here
COPY_TAG = 1 << 21


class NoSource(NoHolder):
    """A lost layer cannot be rebuilt from its neighbours (none live, or a layout mismatch)."""


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Layer ``layer`` of device ``dst`` is rebuilt from ``sources``: (device, layer) pairs;
    its ``edge_parts``, when no source layer has them, from device ``edge``'s copy."""

    layer: int
    dst: int
    sources: tuple[tuple[int, int], ...]
    edge: int | None = None


def names(config: ModelConfig, index: int) -> list[str]:
    """Layer ``index``'s parameter names in ``export_layer`` order."""
    return [name for name, _ in build_layer(config, index).named_parameters()]


def edge_names(config: ModelConfig, index: int) -> set[str]:
    """The names of layer ``index``'s ``edge_parts`` parameters (``embed.weight``, ...)."""
    parts = edge_parts(config, index)
    return {name for name in names(config, index) if name.split(".")[0] in parts}


def unsourced(old: ExecutionPlan, new: ExecutionPlan, live: Iterable[int]) -> set[int]:
    """Layers the new plan needs that no live device holds under the old one."""
    before = held_layers(old, live)
    needed = {k for first, end in TrainPlan.of(new).held.values() for k in range(first, end)}
    return {k for k in needed if not any(k in r for r in before.values())}


def rebuilds(
    old: ExecutionPlan,
    new: ExecutionPlan,
    live: Iterable[int],
    config: ModelConfig,
    *,
    plus: bool,
    copies: Mapping[int, Iterable[int]] | None = None,
) -> list[Rebuild]:
    """Every unsourced layer of every device of ``new``, with the neighbours it is rebuilt from.

    For each lost layer the first pipeline of ``old`` whose stage held it and whose source
    stages are all live is used. ``copies``: the devices that kept copies of edge layers'
    parts under ``old`` (``TrainPlan.copies``; CheckFree+). Raises ``NoSource`` when no
    pipeline has them.
    """
    alive = set(live)
    kept = {d: set(ks) for d, ks in (copies or {}).items() if d in alive}
    lost = unsourced(old, new, alive)
    plan = {}
    for k in sorted(lost):
        plan[k] = _sources_of(old, k, alive, config, plus=plus, copies=kept)
    out = []
    for dst, (first, end) in sorted(TrainPlan.of(new).held.items()):
        for k in range(first, end):
            if k in plan:
                found, edge = plan[k]
                out.append(Rebuild(layer=k, dst=dst, sources=found, edge=edge))
    return out


def _sources_of(
    old: ExecutionPlan,
    layer: int,
    alive: set[int],
    config: ModelConfig,
    *,
    plus: bool,
    copies: dict[int, set[int]],
) -> tuple[tuple[tuple[int, int], ...], int | None]:
    why = f"layer {layer} has no live copy and no pipeline with live neighbours to rebuild it"
    for pipeline in old.pipelines:
        stages = [s for s in pipeline.stages if not s.rerouted]
        for position, stage in enumerate(stages):
            first, end = stage.layers
            if not first <= layer < end:
                continue
            if not plus and position in (0, len(stages) - 1):
                why = f"layer {layer} is in an edge stage: CheckFree needs two neighbours"
                continue
            found: list[tuple[int, int]] = []
            for j in sources(position, len(stages), plus=plus):
                if not 0 <= j < len(stages):
                    break
                other = stages[j]
                if other.layers[1] - other.layers[0] != end - first or not alive & set(
                    other.devices
                ):
                    break
                found.append((min(alive & set(other.devices)), other.layers[0] + layer - first))
            else:
                missing = set(names(config, layer)) - {
                    n for _, k in found for n in names(config, k)
                }
                edge = None
                if missing and missing <= edge_names(config, layer):
                    # the edge parts from a source that keeps a copy of them (CheckFree+)
                    edge = next((d for d, _ in found if layer in copies.get(d, ())), None)
                    if edge is not None:
                        missing = set()
                if missing:
                    why = (
                        f"layer {layer}'s {sorted(missing)} are in none of the neighbours' "
                        f"layers {[k for _, k in found]}, and no neighbour keeps a copy of "
                        "them (CheckFree+ keeps them on the swap partners of ranks started "
                        "with --checkfree-plus)"
                    )
                    continue
                return tuple(found), edge
    raise NoSource(why)


def rebuild(worker: Worker, gen: Generation, plan: Sequence[Rebuild]) -> None:
    """Send this device's layers to the rebuilds that need them, and rebuild its own lost layers.

    A source sends its layer's state with its stage's last gradient norm appended; the rebuilt
    layer's tensors are the sources' same-named tensors averaged with those norms as weights
    (equal weights if every norm is 0), with a fresh optimizer. Its edge parts, when they come
    from a copy (``Rebuild.edge``), are the copy's weights and optimizer state as they are.
    Raises ``comm.Aborted`` if the generation is aborted meanwhile (nothing changes).
    """
    me = worker.device
    config = worker.config.model
    sends = gen.stream("rebuild sends")
    recvs = gen.stream("rebuild receives")
    received: dict[tuple[int, int], torch.Tensor] = {}
    try:

        def run() -> None:
            for r in plan:
                for i, (src, k) in enumerate(r.sources):
                    if r.dst == me:
                        buf = torch.empty(worker.state_numel(k) + 1, device=worker.where)
                        gen.recv(recvs, buf, src, TAG_BASE + r.layer * 8 + i)
                        received[(r.layer, i)] = buf
                if r.dst == me and r.edge is not None:
                    buf = torch.empty(worker.edge_numel(r.layer), device=worker.where)
                    gen.recv(recvs, buf, r.edge, TAG_BASE + r.layer * 8 + EDGE_TAG)
                    received[(r.layer, EDGE_TAG)] = buf
            for r in plan:
                for i, (src, k) in enumerate(r.sources):
                    if src == me:
                        norm = torch.tensor(
                            [worker.grad_norm], dtype=torch.float32, device=worker.where
                        )
                        flat = torch.cat([worker.export_layer(k), norm])
                        gen.send(sends, flat, r.dst, TAG_BASE + r.layer * 8 + i)
                if r.edge == me:
                    edge = worker.export_edge(r.layer)
                    gen.send(sends, edge, r.dst, TAG_BASE + r.layer * 8 + EDGE_TAG)
            recvs.wait_for(recvs.count, gen.abort)
            sends.wait_for(sends.count, gen.abort)

        gen.guard(run)
    finally:
        sends.close()
        recvs.close()
    for r in plan:
        if r.dst != me:
            continue
        parts = [
            (parameters(config, k, received[(r.layer, i)][:-1]), float(received[(r.layer, i)][-1]))
            for i, (_, k) in enumerate(r.sources)
        ]
        worker.layers[r.layer] = worker.build(r.layer)
        worker.optimizers[r.layer] = worker.fresh_optimizer(worker.layers[r.layer])
        with torch.no_grad():
            for name, p in worker.layers[r.layer].named_parameters():
                found = [(tensors[name], w) for tensors, w in parts if name in tensors]
                if found:  # the rest are the edge parts, from the copy
                    p.copy_(average(found))
        if r.edge is not None:
            worker.import_edge(r.layer, received[(r.layer, EDGE_TAG)], into_layer=True)


def share_copies(worker: Worker, gen: Generation, plan: TrainPlan) -> None:
    """Give every copy holder of ``plan`` (CheckFree+) its copy of the edge parts from the
    layer's lowest holder, weights and optimizer state, and drop the copies the plan does not
    keep here; after every plan change, so that the copies equal the layers again whatever
    moved, was rebuilt, rolled back or loaded. Nothing is sent without copies.
    """
    me = worker.device
    keep = set(plan.copies.get(me, ()))
    for k in set(worker.copies) - keep:
        del worker.copies[k], worker.copy_optimizers[k]
    if not plan.copies:
        return
    owner = {
        k: min(d for d, (first, end) in plan.held.items() if first <= k < end)
        for ks in plan.copies.values()
        for k in ks
    }
    sends = gen.stream("copy sends")
    recvs = gen.stream("copy receives")
    received: dict[int, torch.Tensor] = {}
    try:

        def run() -> None:
            for k in sorted(keep):
                buf = torch.empty(worker.edge_numel(k), device=worker.where)
                gen.recv(recvs, buf, owner[k], COPY_TAG + k)
                received[k] = buf
            for dst, ks in sorted(plan.copies.items()):
                for k in ks:
                    if owner[k] == me:
                        gen.send(sends, worker.export_edge(k), dst, COPY_TAG + k)
            recvs.wait_for(recvs.count, gen.abort)
            sends.wait_for(sends.count, gen.abort)

        gen.guard(run)
    finally:
        sends.close()
        recvs.close()
    for k, flat in received.items():
        worker.import_edge(k, flat)


def parameters(config: ModelConfig, index: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer ``index``'s parameters by name, from its ``export_layer`` tensor."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, p in build_layer(config, index).named_parameters():
        out[name] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return out


def average(weighted: Sequence[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """Σ wᵢ·xᵢ / Σ wᵢ (the plain mean when every weight is 0)."""
    total = sum(w for _, w in weighted)
    if total <= 0:
        weighted = [(x, 1.0) for x, _ in weighted]
        total = float(len(weighted))
    out = torch.zeros_like(weighted[0][0])
    for x, w in weighted:
        out += x * (w / total)
    return out
