"""Data-parallel gradient synchronisation: which groups all-reduce which layers, in which round.

Odyssey §IV-C, Fig. 4: after an asymmetric re-plan the replicas of a layer sit on stages with
different layer ranges, so the all-reduce runs per segment of the layer axis, and segments that
share a device run in different rounds. The step-time estimator charges these rounds; nothing
here needs more than the plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from controlplane.recovery.model import ExecutionPlan, Group, LayerRange


@dataclass(frozen=True, slots=True)
class SyncSegment:
    """A maximal run of layers held by the same device groups: one fused all-reduce."""

    layers: LayerRange
    groups: tuple[Group, ...]


def sync_segments(plan: ExecutionPlan) -> list[SyncSegment]:
    """Odyssey Fig. 4: the layer axis cut where any pipeline's holder changes, runs merged.

    Rerouted stages are skipped: they borrow replicas that already hold their layers, so a
    segment's groups are its distinct live holders, in pipeline order.
    """
    cuts = sorted({x for _, _, stage in plan.stages() for x in stage.layers})
    index = {c: i for i, c in enumerate(cuts)}
    holders: list[list[Group | None]] = [[None] * plan.dp for _ in cuts[1:]]
    for p, _, stage in plan.stages():
        if not stage.rerouted:
            for k in range(index[stage.layers[0]], index[stage.layers[1]]):
                holders[k][p] = stage.devices
    segments = []
    start = 0
    for k in range(1, len(holders) + 1):
        if k == len(holders) or holders[k] != holders[start]:
            live = dict.fromkeys(g for g in holders[start] if g is not None)
            segments.append(SyncSegment(layers=(cuts[start], cuts[k]), groups=tuple(live)))
            start = k
    return segments


def sync_rounds(plan: ExecutionPlan) -> list[list[SyncSegment]]:
    """Odyssey Fig. 4: segments sharing a device all-reduce in different rounds (graph colouring).

    Returns the rounds in colour order, each with its segments in layer order.
    """
    segments = sync_segments(plan)
    owners: dict[int, list[int]] = defaultdict(list)
    for i, segment in enumerate(segments):
        for group in segment.groups:
            for d in group:
                owners[d].append(i)
    earlier: list[set[int]] = [set() for _ in segments]
    for ids in {tuple(v) for v in owners.values()}:
        for i in ids:
            earlier[i].update(j for j in ids if j < i)
    # Greedy in layer order, not largest first. Two segments conflict only when one stage holds
    # both (stages own disjoint devices), and a stage holds a run of consecutive segments, so the
    # conflict graph is an interval graph: left-to-right greedy colours it with its clique number.
    # The first and last segments of a clique share a stage, which then holds the whole clique,
    # so that number is the most segments on one device, a lower bound: the colouring is optimal.
    # Largest first would take 3 rounds on Fig. 4's path of 6 segments.
    colour: list[int] = []
    for i in range(len(segments)):
        used = {colour[j] for j in earlier[i]}
        c = 0
        while c in used:
            c += 1
        colour.append(c)
    rounds: list[list[SyncSegment]] = [[] for _ in range(max(colour, default=-1) + 1)]
    for segment, c in zip(segments, colour, strict=True):
        rounds[c].append(segment)
    return rounds
