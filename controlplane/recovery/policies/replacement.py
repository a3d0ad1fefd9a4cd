"""Replacing the broken tensor-parallel groups of the current plan with groups of spare devices."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.model import (
    Cluster,
    ClusterState,
    ExecutionPlan,
    Family,
    Pipeline,
    Stage,
)

# (pipeline index, stage index) of a stage in the current plan
StageKey = tuple[int, int]


def broken_stages(state: ClusterState) -> tuple[StageKey, ...]:
    """Stages that have no group of their own any more, in plan order.

    A failed device takes its whole tensor-parallel group down with it; a stage rerouted by an
    earlier recovery lost its group then, so replacing groups repairs it too.
    """
    return tuple(
        (p, s)
        for p, s, stage in state.plan.stages()
        if stage.rerouted or not state.failed.isdisjoint(stage.devices)
    )


def spare_shortage(count: int, tp: int, spares: int) -> str:
    """Why ``count`` groups of ``tp`` devices cannot be made from ``spares`` devices."""
    return (
        f"needs {count} spare group{'s' * (count != 1)} of {tp} device{'s' * (tp != 1)}, "
        f"{spares // tp} available ({spares} spare device{'s' * (spares != 1)} free)"
    )


def pick_spare_groups(
    cluster: Cluster, spares: Iterable[int], count: int, tp: int
) -> list[tuple[int, ...]]:
    """``count`` groups of ``tp`` spare devices, as few nodes as possible, each group on one node.

    All groups come from one node when one can hold them (the one with the fewest whole groups
    that still fits, so larger blocks stay free); otherwise nodes are taken fullest first. Only
    when whole groups run out does a group span nodes, taking the lowest ids left. Ties go to the
    lower id, so the choice is deterministic. Raises InfeasiblePlan when spares are too few.
    """
    free = sorted(spares)
    if len(free) < count * tp:
        raise InfeasiblePlan(spare_shortage(count, tp, len(free)), decline=Code.NO_SPARE)
    by_node: dict[int, list[int]] = {}
    for device in free:
        by_node.setdefault(cluster.node_of(device), []).append(device)
    whole = {node: len(ids) // tp for node, ids in by_node.items()}
    fitting = sorted((n, node) for node, n in whole.items() if n >= count)
    # one node when one fits (best fit), else fullest nodes first
    nodes = [fitting[0][1]] if fitting else sorted(whole, key=lambda node: (-whole[node], node))
    groups: list[tuple[int, ...]] = []
    for node in nodes:
        ids = by_node[node]
        for i in range(min(whole[node], count - len(groups))):
            groups.append(tuple(ids[i * tp : (i + 1) * tp]))
    taken = {d for group in groups for d in group}
    rest = [d for d in free if d not in taken]
    while len(groups) < count:
        groups.append(tuple(rest[:tp]))
        rest = rest[tp:]
    return groups


@dataclass(frozen=True, slots=True)
class Replacement:
    """The current plan with a spare group in place of each replaced stage's group."""

    plan: ExecutionPlan
    groups: Mapping[StageKey, tuple[int, ...]]


def replace_stages(state: ClusterState, stages: Sequence[StageKey]) -> Replacement:
    """Give each stage in ``stages`` a spare group; layers, micro-batches and shape stay.

    Survivors of a replaced group are left idle. Raises InfeasiblePlan when spares are too few.
    """
    plan = state.plan
    tp = plan.tp
    groups = dict(
        zip(
            stages,
            pick_spare_groups(state.cluster, state.spare_devices(), len(stages), tp),
            strict=True,
        )
    )
    pipelines = tuple(
        Pipeline(
            stages=tuple(
                Stage(devices=groups[(p, s)], layers=stage.layers) if (p, s) in groups else stage
                for s, stage in enumerate(pipeline.stages)
            ),
            micro_batches=pipeline.micro_batches,
        )
        for p, pipeline in enumerate(plan.pipelines)
    )
    return Replacement(
        plan=ExecutionPlan(pipelines=pipelines, family=Family.DYNAMIC), groups=groups
    )


@dataclass(frozen=True, slots=True)
class Copy:
    """One point-to-point transfer of ``nbytes`` from a live device to a replacement."""

    source: int
    target: int
    nbytes: float


def copy_time_s(cluster: Cluster, copies: Iterable[Copy]) -> float:
    """Seconds until every copy has landed, all running at once.

    A device that sends or receives k copies shares its link k ways, so each of them runs at
    1/k of the link's bandwidth (CheckFree §6.4: "if links are shared, divide the available
    bandwidth"; FlashRecovery §6's k_nic). Raises InfeasiblePlan for a link with no bandwidth.
    """
    copies = list(copies)
    sends = Counter(c.source for c in copies)
    receives = Counter(c.target for c in copies)
    slowest = 0.0
    for c in copies:
        bandwidth = cluster.bandwidth_bytes_per_s(c.source, c.target)
        if bandwidth <= 0:
            raise InfeasiblePlan(
                f"no usable link from device {c.source} to spare {c.target}", decline=Code.NO_LINK
            )
        if math.isinf(bandwidth):
            continue
        sharing = max(sends[c.source], receives[c.target])
        slowest = max(slowest, c.nbytes * sharing / bandwidth)
    return slowest
