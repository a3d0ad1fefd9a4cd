"""Step-time estimator: 1F1B pipelines (Odyssey eq. 9-11), data rerouting (eq. 12-13), comms."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import lru_cache

from controlplane.recovery import replicas
from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator.sync import SyncSegment, sync_rounds
from controlplane.recovery.model import (
    Cluster,
    ExecutionPlan,
    LayerRange,
    Layers,
    ModelProfile,
    Pipeline,
    Stage,
    bytes_per_s,
)


def symmetric_step_time(n_pp: int, n_m: int, t_f: float, t_b: float) -> float:
    """Odyssey eq. 9: one 1F1B pipeline of ``n_pp`` equal stages running ``n_m`` micro-batches."""
    return (n_pp + n_m - 1) * (t_f + t_b)


def rerouting_step_time(
    n_pp: int,
    n_m: int,
    n_dp: int,
    t_f: float,
    t_b: float,
    failed_per_stage: Sequence[int],
) -> float:
    """Odyssey eq. 13 (eq. 12 for a single failure): failed replicas' work spread over survivors.

    ``n_m`` is micro-batches per pipeline. Raises InfeasiblePlan when a stage lost every replica.
    """
    extra = 0.0
    for stage, f in enumerate(failed_per_stage):
        if f >= n_dp:
            raise InfeasiblePlan(
                f"stage {stage} lost all {n_dp} replicas; rerouting impossible",
                decline=Code.NO_LIVE_REPLICA,
            )
        if f:
            # Odyssey eq. 13: stage i's F_i·N_m micro-batches spread over its N_dp − F_i survivors
            extra += n_m * f / (n_dp - f)
    return (n_pp + n_m - 1 + extra) * (t_f + t_b)


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[bool, int]]:
    """Non-interleaved 1F1B operation order of one stage as (is_forward, micro-batch) pairs."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [(True, m) for m in range(warmup)]
    for k in range(micro_batches - warmup):
        order.append((True, warmup + k))
        order.append((False, k))
    order.extend((False, m) for m in range(micro_batches - warmup, micro_batches))
    return order


def _encoded_order(stage: int, stages: int, micro_batches: int) -> list[int]:
    """The 1F1B order with forward j as ``j`` and backward j as ``~j`` (a negative int)."""
    return [m if forward else ~m for forward, m in one_f_one_b_order(stage, stages, micro_batches)]


def pipeline_time(
    t_f: Sequence[float],
    t_b: Sequence[float],
    micro_batches: int,
    p2p_s: Sequence[float] | None = None,
) -> float:
    """Odyssey eq. 11: one pipeline's step by the start/end recurrence over the 1F1B order.

    ``start(s, j) = max(end(s, j-1), end(f1(s), f2(j)) + p2p)``; ``p2p_s[s]`` is the send time
    across the boundary between stage s and s+1. Each stage runs until its next operation waits
    on a neighbour, so every operation is visited once: O(S·M).
    """
    stages = len(t_f)
    if micro_batches <= 0 or stages == 0:
        return 0.0
    link = list(p2p_s) if p2p_s is not None else [0.0] * (stages - 1)
    orders = [_encoded_order(s, stages, micro_batches) for s in range(stages)]
    # End times; -1 marks an operation that has not run (every real end time is >= 0).
    f_end = [[-1.0] * micro_batches for _ in range(stages)]
    b_end = [[-1.0] * micro_batches for _ in range(stages)]
    cursor = [0] * stages
    clock = [0.0] * stages
    todo = list(range(stages))
    last = stages - 1
    while todo:
        s = todo.pop()
        order, c, clk = orders[s], cursor[s], clock[s]
        fwd_in = f_end[s - 1] if s > 0 else None
        bwd_in = b_end[s + 1] if s < last else f_end[s]
        delay_in = link[s - 1] if s > 0 else 0.0
        delay_out = link[s] if s < last else 0.0
        mine_f, mine_b, tf, tb = f_end[s], b_end[s], t_f[s], t_b[s]
        start = c
        while c < len(order):
            op = order[c]
            if op >= 0:
                if fwd_in is not None:
                    ready = fwd_in[op]
                    if ready < 0:
                        break
                    clk = max(clk, ready + delay_in)
                clk += tf
                mine_f[op] = clk
            else:
                ready = bwd_in[~op]
                if ready < 0:
                    break
                clk = max(clk, ready + delay_out if s < last else ready)
                clk += tb
                mine_b[~op] = clk
            c += 1
        if c > start:
            cursor[s], clock[s] = c, clk
            if s > 0:
                todo.append(s - 1)
            if s < last:
                todo.append(s + 1)
    return max(clock)


@lru_cache(maxsize=65536)
def cached_pipeline_time(
    t_f: tuple[float, ...],
    t_b: tuple[float, ...],
    micro_batches: int,
    p2p_s: tuple[float, ...],
) -> float:
    if len(set(t_f)) == 1 and len(set(t_b)) == 1 and not any(p2p_s):
        return symmetric_step_time(len(t_f), micro_batches, t_f[0], t_b[0])
    return pipeline_time(t_f, t_b, micro_batches, p2p_s)


def stage_times(profile: ModelProfile, stages: Sequence[Stage]) -> tuple[tuple[float, ...], ...]:
    """Per-stage forward and backward seconds of one micro-batch."""
    return (
        tuple(profile.fwd(*s.layers) for s in stages),
        tuple(profile.bwd(*s.layers) for s in stages),
    )


def p2p_times(
    profile: ModelProfile, cluster: Cluster, stages: Sequence[Stage], tp: int
) -> tuple[float, ...]:
    """Send time of one micro-batch's boundary tensor across each stage boundary."""
    if cluster.communication_is_free:
        return (0.0,) * max(len(stages) - 1, 0)
    out = []
    for a, b in itertools.pairwise(stages):
        bandwidth = cluster.bandwidth_bytes_per_s(a.devices[0], b.devices[0])
        out.append(profile.boundary_bytes_after(a.layers[1] - 1) / tp / bandwidth)
    return tuple(out)


def estimate_pipeline(
    profile: ModelProfile, cluster: Cluster, pipeline: Pipeline, tp: int = 1
) -> float:
    t_f, t_b = stage_times(profile, pipeline.stages)
    p2p = p2p_times(profile, cluster, pipeline.stages, tp)
    return cached_pipeline_time(t_f, t_b, pipeline.micro_batches, p2p)


def rerouted_extra_time(profile: ModelProfile, plan: ExecutionPlan) -> float:
    """Extra seconds from rerouted stages, generalising eq. 13 to any layer ranges.

    The failed replica's micro-batches of a layer range are spread evenly over the live replicas of
    the same range; as in eq. 13 the extra work adds to the step in full, stage by stage.
    """
    by_range: dict[tuple[int, int], list[int]] = {}
    live_replicas: dict[tuple[int, int], int] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            if stage.rerouted:
                by_range.setdefault(stage.layers, []).append(pipeline.micro_batches)
            else:
                live_replicas[stage.layers] = live_replicas.get(stage.layers, 0) + 1
    return _spread_time(
        profile,
        ((layers, sum(lost), live_replicas.get(layers, 0)) for layers, lost in by_range.items()),
    )


def _spread_time(
    profile: ModelProfile, ranges: Iterable[tuple[tuple[int, int], int, int]]
) -> float:
    """Eq. 13's extra seconds, summed in the given order over (layer range, micro-batches
    rerouted off it, its live replicas)."""
    extra = 0.0
    for layers, lost, survivors in ranges:
        if survivors == 0:
            raise InfeasiblePlan(
                f"layers {list(layers)} have no live replica to reroute to",
                decline=Code.NO_LIVE_REPLICA,
            )
        extra += lost / survivors * (profile.fwd(*layers) + profile.bwd(*layers))
    return extra


def _pipeline_like(known: replicas.Replicas, cluster: Cluster, links: replicas.Links) -> Pipeline:
    """A pipeline of the split with the given ``Links``: every pipeline with them takes the same
    eq. 11 time (its stages' first devices only tell ``p2p_times`` whether they share a node)."""
    micro_batches, same_node = links
    nodes = itertools.accumulate((not same for same in same_node), initial=0)
    return Pipeline(
        stages=tuple(
            Stage(devices=(node * cluster.devices_per_node,), layers=layers)
            for node, layers in zip(nodes, known.split, strict=True)
        ),
        micro_batches=micro_batches,
    )


def _rerouted_extra_time(profile: ModelProfile, known: replicas.Replicas) -> float:
    """``rerouted_extra_time`` from the replicas, the stages summed in the order it meets them."""
    first = sorted((min(lost), s) for s, lost in enumerate(known.rerouted) if lost)
    return _spread_time(
        profile,
        ((known.split[s], sum(known.rerouted[s].values()), len(known.live[s])) for _, s in first),
    )


def update_time(profile: ModelProfile, plan: ExecutionPlan) -> float:
    """The optimizer update after the gradient sync: the slowest device's, each device updating
    every layer it holds once (a device serving a rerouted stage holds those layers already)."""
    if not profile.has_update:
        return 0.0
    held: dict[int, set[tuple[int, int]]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            for d in stage.devices:
                held.setdefault(d, set()).add(stage.layers)
    return max(sum(profile.update(*r) for r in ranges) for ranges in held.values())


def merged_reroutes(plan: ExecutionPlan) -> tuple[dict[int, int], frozenset[int]]:
    """Whole pipelines rerouted onto whole live pipelines, as their micro-batches' extra count.

    A pipeline every stage of which is rerouted, where stage s lists the devices ``d_0 … d_{r-1}``
    and live pipelines ``Q_0 … Q_{r-1}`` of the same layer split have ``d_j`` as their stage s,
    hands its micro-batch m to ``Q_{m mod r}``: each ``Q_j`` then runs its own micro-batches and
    those, through its own stages (the reference trainer's routing, ``docs/trainer.md``).
    Returns the extra micro-batches per live pipeline index and the merged pipelines' indices;
    pipelines rerouted otherwise are left to eq. 13.
    """
    live: dict[tuple[tuple[int, int], ...], dict[tuple[int, ...], int]] = {}
    for q, pipeline in enumerate(plan.pipelines):
        if not any(s.rerouted for s in pipeline.stages):
            split = tuple(s.layers for s in pipeline.stages)
            live.setdefault(split, {})[tuple(s.devices[0] for s in pipeline.stages)] = q
    extra: dict[int, int] = {}
    merged: set[int] = set()
    for p, pipeline in enumerate(plan.pipelines):
        stages = pipeline.stages
        if not all(s.rerouted for s in stages) or plan.tp != 1:
            continue
        width = len(stages[0].devices)
        if any(len(s.devices) != width for s in stages):
            continue
        by_devices = live.get(tuple(s.layers for s in stages), {})
        found = (by_devices.get(tuple(s.devices[j] for s in stages)) for j in range(width))
        targets = [q for q in found if q is not None]
        if len(targets) != width:
            continue
        merged.add(p)
        for m in range(pipeline.micro_batches):
            extra[targets[m % width]] = extra.get(targets[m % width], 0) + 1
    return extra, frozenset(merged)


def estimate_step_time(
    profile: ModelProfile,
    cluster: Cluster,
    plan: ExecutionPlan,
    *,
    sync_s: float | None = None,
    merge_rerouted: bool = False,
) -> float:
    """Odyssey eq. 10: the slowest pipeline, plus rerouted work and data-parallel gradient sync,
    plus the optimizer update when the profile has one (``update_time``; zero in the papers'
    profiles).

    With free communication (no bandwidths) and no update term this is exactly eqs. 9-13.
    ``sync_s`` may be passed when the caller has already computed the gradient sync time.
    ``merge_rerouted`` charges a whole pipeline rerouted onto whole live pipelines as extra
    micro-batches flowing through them (``merged_reroutes``) instead of eq. 13's stage-by-stage
    sum, which counts the rerouted stages one after another as if they did not overlap.
    """
    tp = plan.tp  # a property that walks the plan: read it once
    if merge_rerouted and plan.has_rerouted_stages:
        extra, merged = merged_reroutes(plan)
        compute = max(
            estimate_pipeline(
                profile, cluster, replace(p, micro_batches=p.micro_batches + extra.get(q, 0)), tp
            )
            for q, p in enumerate(plan.pipelines)
            if q not in merged
        )
        rest = replace(
            plan, pipelines=tuple(p for q, p in enumerate(plan.pipelines) if q not in merged)
        )
        compute += rerouted_extra_time(profile, rest)
    elif (known := replicas.of(plan, cluster)) is not None:
        compute = max(
            estimate_pipeline(profile, cluster, _pipeline_like(known, cluster, links), tp)
            for links in known.links
        )
        compute += _rerouted_extra_time(profile, known)
    else:
        compute = max(estimate_pipeline(profile, cluster, p, tp) for p in plan.pipelines)
        compute += rerouted_extra_time(profile, plan)
    if sync_s is None:
        sync_s = gradient_sync_time(profile, cluster, plan)
    return compute + sync_s + update_time(profile, plan)


def ring_allreduce_s(nbytes: float, group_size: int, bandwidth_bytes_per_s: float) -> float:
    """Ring all-reduce: every member sends and receives 2(g-1)/g of the buffer."""
    if group_size <= 1 or math.isinf(bandwidth_bytes_per_s):
        return 0.0
    return 2 * (group_size - 1) / group_size * nbytes / bandwidth_bytes_per_s


def gradient_sync_floor_s(
    profile: ModelProfile, cluster: Cluster, *, groups: int, dp: int, tp: int
) -> float:
    """A floor on ``gradient_sync_time`` of every plan of ``dp`` pipelines over ``groups`` groups:
    its shortest pipeline has at most groups // dp stages (``shortest_pipeline_sync_floor_s``).
    """
    if groups < dp:
        return 0.0
    return shortest_pipeline_sync_floor_s(profile, cluster, stages=groups // dp, dp=dp, tp=tp)


@lru_cache(maxsize=4096)
def shortest_pipeline_sync_floor_s(
    profile: ModelProfile, cluster: Cluster, *, stages: int, dp: int, tp: int
) -> float:
    """A floor on ``gradient_sync_time`` of every plan of ``dp`` pipelines, one of which has at
    most ``stages`` stages.

    Every layer is all-reduced over the dp disjoint groups holding it, and the segments one stage
    holds go in different rounds (they share its devices), so the sync takes at least one stage's
    gradients through a ring of dp groups at the fastest bandwidth such a ring can have. A
    pipeline of at most ``stages`` stages has a stage of at least ceil(L / stages) consecutive
    layers.
    """
    if cluster.communication_is_free or dp <= 1 or stages < 1:
        return 0.0
    layers = profile.layers
    widest = -(-layers // min(stages, layers))
    least = min(profile.grad_bytes(i, i + widest) for i in range(layers - widest + 1))
    return ring_allreduce_s(least / tp, dp, _fastest_ring_bytes_per_s(cluster, dp, tp))


def split_sync_floor_s(
    profile: ModelProfile, cluster: Cluster, splits: Iterable[Layers], *, dp: int, tp: int
) -> float:
    """A floor on ``gradient_sync_time`` of every plan of ``dp`` pipelines, none rerouted, whose
    pipelines' layer splits are exactly ``splits`` (each split once, however many pipelines).

    A plan's segments and rounds (Odyssey Fig. 4) follow from its distinct splits alone: a
    segment's groups are the dp pipelines' holders of its layers, and two segments share a round
    only when no split puts them on one stage. So the rounds are those of a plan with one pipeline
    per split; only the bandwidth depends on where the groups are, and the floor takes the
    fastest a ring of dp groups can have. It is the placed plan's sync wherever that ring
    crosses nodes.
    """
    if cluster.communication_is_free or dp <= 1:
        return 0.0
    fastest = _fastest_ring_bytes_per_s(cluster, dp, tp)
    return sum(
        max(ring_allreduce_s(profile.grad_bytes(*layers) / tp, dp, fastest) for layers in round_)
        for round_ in split_rounds(frozenset(splits))
    )


@lru_cache(maxsize=4096)
def split_rounds(splits: frozenset[Layers]) -> tuple[tuple[LayerRange, ...], ...]:
    """The sync rounds (their segments' layers) of any plan whose pipelines' splits are these."""
    if len(splits) == 1:
        return (next(iter(splits)),)
    groups = itertools.count()
    plan = ExecutionPlan(
        pipelines=tuple(
            Pipeline(
                stages=tuple(Stage(devices=(next(groups),), layers=r) for r in split),
                micro_batches=1,
            )
            for split in sorted(splits)
        )
    )
    return tuple(tuple(segment.layers for segment in round_) for round_ in sync_rounds(plan))


def pipeline_floor_s(
    profile: ModelProfile, cluster: Cluster, split: Layers, micro_batches: int, tp: int
) -> float:
    """A floor on ``estimate_pipeline`` of a pipeline with this split wherever it is placed:
    eq. 11 with every send at the fastest link a boundary can have (eq. 11's times only grow
    with its sends)."""
    fastest = max(bytes_per_s(cluster.intra_node_gbps), bytes_per_s(cluster.inter_node_gbps))
    p2p = tuple(
        0.0
        if cluster.communication_is_free
        else profile.boundary_bytes_after(end - 1) / tp / fastest
        for _, end in split[:-1]
    )
    t_f = tuple(profile.fwd(*layers) for layers in split)
    t_b = tuple(profile.bwd(*layers) for layers in split)
    return cached_pipeline_time(t_f, t_b, micro_batches, p2p)


def _fastest_ring_bytes_per_s(cluster: Cluster, dp: int, tp: int) -> float:
    """The fastest link a ring of dp groups of tp devices can have: one node's, if it fits."""
    fastest = bytes_per_s(cluster.inter_node_gbps)
    if dp * tp <= cluster.devices_per_node:
        fastest = max(fastest, bytes_per_s(cluster.intra_node_gbps))
    return fastest


def gradient_sync_time(profile: ModelProfile, cluster: Cluster, plan: ExecutionPlan) -> float:
    """Data-parallel all-reduce time, one round per colour of the restorer's group colouring.

    In a plan whose pipelines share one layer split, every stage's replicas form one group and
    all groups run in a single round; other plans go through the restorer's segments.
    """
    if cluster.communication_is_free or plan.dp <= 1:
        return 0.0
    known = replicas.of(plan, cluster)
    if known is not None:
        # one segment per stage, its live replicas' groups, all in one round (no device holds
        # two stages): what the general path below finds for such a plan
        slowest = 0.0
        for s, layers in enumerate(known.split):
            gbps = cluster.intra_node_gbps if known.one_node(s) else cluster.inter_node_gbps
            nbytes = profile.grad_bytes(*layers) / known.tp
            slowest = max(slowest, ring_allreduce_s(nbytes, len(known.live[s]), bytes_per_s(gbps)))
        return slowest
    if _same_split(plan):
        rounds = [
            [
                SyncSegment(
                    layers=stage.layers,
                    groups=tuple(p.stages[s].devices for p in plan.pipelines),
                )
                for s, stage in enumerate(plan.pipelines[0].stages)
            ]
        ]
    else:
        rounds = sync_rounds(plan)
    tp = plan.tp
    total = 0.0
    for round_ in rounds:
        slowest = 0.0
        for segment in round_:
            bandwidth = cluster.group_bandwidth_bytes_per_s(
                [d for group in segment.groups for d in group]
            )
            nbytes = profile.grad_bytes(*segment.layers) / tp
            slowest = max(slowest, ring_allreduce_s(nbytes, len(segment.groups), bandwidth))
        total += slowest
    return total


def _same_split(plan: ExecutionPlan) -> bool:
    shape = [s.layers for s in plan.pipelines[0].stages]
    return not plan.has_rerouted_stages and all(
        [s.layers for s in p.stages] == shape for p in plan.pipelines
    )
