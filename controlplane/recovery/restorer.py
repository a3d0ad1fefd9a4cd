"""Restorer: map surviving device groups onto a new plan's stages and order its gradient sync."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from typing import Any

import numpy as np

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan, InvalidScenario
from controlplane.recovery.model import Cluster, ExecutionPlan, Group, LayerRange, ModelProfile

# bytes a group lacks for a slot, and its pieces: (layers, bytes, ranges of holders to ask)
_Pieces = tuple[float, list[tuple[LayerRange, float, list[LayerRange]]]]

# Residual problems with at most this many (group, slot) pairs are solved on the paper's dense
# Kuhn-Munkres matrix; larger ones as a min-cost flow between classes of interchangeable groups and
# slots (both exact; the dense matrix of a 16k-device decision would not fit in memory).
DENSE_PAIRS_LIMIT = 250_000


@dataclass(frozen=True, slots=True)
class Placement:
    """Which device group takes each slot of a new plan, and what moving the weights costs.

    ``bytes_moved`` counts every byte of parameters and optimizer state a device of the new plan
    lacks (all devices together, each receiving its 1/tp shard), including the ``unsourced_bytes``
    of ``unsourced_layers``, which no live group holds and which must come from a checkpoint.
    ``transfer_s`` is the makespan of the peer-to-peer part only.
    """

    groups: tuple[Group, ...]
    bytes_moved: float
    transfer_s: float
    unsourced_layers: tuple[LayerRange, ...] = ()
    unsourced_bytes: float = 0.0


def held_ranges(plan: ExecutionPlan | None) -> dict[Group, LayerRange]:
    """Layers each device group holds under ``plan``: the range of its own (not rerouted) stage."""
    if plan is None:
        return {}
    return {stage.devices: stage.layers for _, _, stage in plan.stages() if not stage.rerouted}


def missing_ranges(held: LayerRange | None, slot: LayerRange) -> list[LayerRange]:
    """The parts of ``slot`` outside ``held`` (surplus held layers are dropped for free)."""
    first, end = slot
    if held is None or held[1] <= first or held[0] >= end:
        return [slot]
    out = []
    if first < held[0]:
        out.append((first, held[0]))
    if held[1] < end:
        out.append((held[1], end))
    return out


def missing_bytes(profile: ModelProfile, held: LayerRange | None, slot: LayerRange) -> float:
    """State bytes (over the whole TP group) a group holding ``held`` must receive for ``slot``."""
    return sum(profile.state_bytes(*part) for part in missing_ranges(held, slot))


def place(
    profile: ModelProfile,
    cluster: Cluster,
    old_plan: ExecutionPlan | None,
    groups: Sequence[Group],
    slots: Sequence[LayerRange],
) -> Placement:
    """Odyssey §IV-B: give each slot a group so that the fewest weight bytes move (Kuhn-Munkres).

    ``groups`` are the healthy, disjoint tensor-parallel groups; a group holds the layers of
    ``old_plan``'s stage whose device tuple it is, otherwise nothing. ``slots`` are the new plan's
    stage layer ranges, pipeline after pipeline. Surplus groups stay idle. The result does not
    depend on the order of ``groups``.
    """
    survivors = _survivors(profile, cluster, old_plan, groups, slots)
    chosen = _assign(profile, survivors, slots)
    return _evaluate(profile, cluster, survivors, chosen, slots)


def place_in_device_order(
    profile: ModelProfile,
    cluster: Cluster,
    old_plan: ExecutionPlan | None,
    groups: Sequence[Group],
    slots: Sequence[LayerRange],
) -> Placement:
    """The naive mapping, groups in device order onto slots in order: the baseline KM improves."""
    survivors = _survivors(profile, cluster, old_plan, groups, slots)
    return _evaluate(profile, cluster, survivors, survivors.groups[: len(slots)], slots)


@dataclass(frozen=True, slots=True)
class _Survivors:
    """The usable groups in device order, the live holders' layers and each group's nodes.

    A group's nodes are listed rank by rank: shard k of a layer moves between the k-th ranks.
    """

    groups: list[Group]
    held: dict[Group, LayerRange]
    nodes: dict[Group, tuple[int, ...]]


def _survivors(
    profile: ModelProfile,
    cluster: Cluster,
    old_plan: ExecutionPlan | None,
    groups: Sequence[Group],
    slots: Sequence[LayerRange],
) -> _Survivors:
    ordered = _checked_groups(profile, cluster, groups, slots)
    nodes = {g: tuple(cluster.node_of(d) for d in g) for g in ordered}
    held = {g: r for g, r in held_ranges(old_plan).items() if g in nodes}
    return _Survivors(groups=ordered, held=held, nodes=nodes)


def _checked_groups(
    profile: ModelProfile,
    cluster: Cluster,
    groups: Sequence[Group],
    slots: Sequence[LayerRange],
) -> list[Group]:
    for first, end in slots:
        if not 0 <= first < end <= profile.layers:
            raise InvalidScenario(
                f"slot [{first}, {end}) is not a non-empty range of the model's "
                f"{profile.layers} layers",
                field="slots",
            )
    if len(groups) < len(slots):
        raise InfeasiblePlan(
            f"{len(slots)} stages need as many device groups, got {len(groups)}",
            decline=Code.NO_FITTING_PLAN,
        )
    sizes = {len(g) for g in groups}
    if len(sizes) > 1 or 0 in sizes:
        raise InvalidScenario(
            f"device groups must share one tensor-parallel size, got {sorted(sizes)}",
            field="groups",
        )
    devices = [d for g in groups for d in g]
    if len(set(devices)) != len(devices):
        raise InvalidScenario("device groups overlap", field="groups")
    if devices and not 0 <= min(devices) <= max(devices) < cluster.total_devices:
        for d in devices:
            cluster.check_device(d, field="groups")
    return sorted(groups)


def _class_key(held: LayerRange | None) -> LayerRange:
    return (-1, -1) if held is None else held


def _assign(
    profile: ModelProfile, survivors: _Survivors, slots: Sequence[LayerRange]
) -> list[Group]:
    held = survivors.held
    chosen: list[Group | None] = [None] * len(slots)
    groups_by_held: dict[LayerRange | None, list[Group]] = defaultdict(list)
    for g in survivors.groups:
        groups_by_held[held.get(g)].append(g)
    slots_by_range: dict[LayerRange, list[int]] = defaultdict(list)
    for j, slot in enumerate(slots):
        slots_by_range[slot].append(j)

    # A group g holding exactly slot j's range can take j at cost 0 without losing optimality:
    # in an optimum where g takes k and h takes j, swapping costs c(g,j) + c(h,k) = c(h,k)
    # <= c(g,k) + c(h,j), since a layer of k that h lacks is either outside j (so g lacks it) or
    # inside j (so it counts in c(h,j)); if g was idle, handing j from h to g saves c(h,j) >= 0.
    for layers, ids in slots_by_range.items():
        holders = groups_by_held.get(layers, [])
        k = min(len(ids), len(holders))
        for j, g in zip(ids[:k], holders[:k], strict=True):
            chosen[j] = g
        slots_by_range[layers] = ids[k:]
        groups_by_held[layers] = holders[k:]

    # What remains is a transportation problem: groups holding the same range cost the same on
    # every slot, and slots of the same range are interchangeable.
    group_classes = sorted(
        ((r, gs) for r, gs in groups_by_held.items() if gs), key=lambda c: _class_key(c[0])
    )
    slot_classes = sorted((r, ids) for r, ids in slots_by_range.items() if ids)
    if slot_classes:
        cost = np.array(
            [[missing_bytes(profile, gr, sr) for sr, _ in slot_classes] for gr, _ in group_classes],
            dtype=float,
        )
        supply = [len(gs) for _, gs in group_classes]
        demand = [len(ids) for _, ids in slot_classes]
        if sum(supply) * sum(demand) <= DENSE_PAIRS_LIMIT:
            flows = _flows_by_matrix(cost, supply, demand)
        else:
            flows = _flows_by_network(cost, supply, demand)
        taken = _pick_groups(profile, survivors, group_classes, slot_classes, flows)
        for (_, ids), gs in zip(slot_classes, taken, strict=True):
            for j, g in zip(ids, sorted(gs), strict=True):
                chosen[j] = g
    out = [g for g in chosen if g is not None]
    assert len(out) == len(slots)
    return out


def _flows_by_matrix(
    cost: np.ndarray[Any, np.dtype[np.float64]], supply: list[int], demand: list[int]
) -> list[list[int]]:
    """Kuhn-Munkres on the matrix expanded to one row per group and one column per slot."""
    from scipy.optimize import linear_sum_assignment  # scipy loads only when a plan is placed

    rows = np.repeat(np.arange(len(supply)), supply)
    cols = np.repeat(np.arange(len(demand)), demand)
    picked_rows, picked_cols = linear_sum_assignment(cost[np.ix_(rows, cols)])
    flows = np.zeros(cost.shape, dtype=np.int64)
    np.add.at(flows, (rows[picked_rows], cols[picked_cols]), 1)
    return [[int(x) for x in row] for row in flows]


def _flows_by_network(
    cost: np.ndarray[Any, np.dtype[np.float64]], supply: list[int], demand: list[int]
) -> list[list[int]]:
    """Min-cost flow between classes, on integer costs equal to the float costs scaled exactly."""
    exact = [[Fraction(float(c)) for c in row] for row in cost]
    # floats are dyadic rationals, so the largest denominator is a common one: no rounding
    scale = max(f.denominator for row in exact for f in row)
    import networkx as nx  # loads only for placements too large for the dense matrix

    graph: Any = nx.DiGraph()
    graph.add_node("idle", demand=sum(supply) - sum(demand))
    for b, d in enumerate(demand):
        graph.add_node(f"s{b}", demand=d)
    for a, s in enumerate(supply):
        graph.add_node(f"g{a}", demand=-s)
        graph.add_edge(f"g{a}", "idle", weight=0)
        for b in range(len(demand)):
            graph.add_edge(f"g{a}", f"s{b}", weight=int(exact[a][b] * scale))
    _, flow = nx.network_simplex(graph)
    return [[int(flow[f"g{a}"][f"s{b}"]) for b in range(len(demand))] for a in range(len(supply))]


def _union(ranges: list[LayerRange]) -> list[LayerRange]:
    out: list[LayerRange] = []
    for first, end in sorted(ranges):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


def _pick_groups(
    profile: ModelProfile,
    survivors: _Survivors,
    group_classes: list[tuple[LayerRange | None, list[Group]]],
    slot_classes: list[tuple[LayerRange, list[int]]],
    flows: list[list[int]],
) -> list[list[Group]]:
    """Turn class flows into groups, preferring groups whose node holds what they will lack."""
    on_node: dict[tuple[int, ...], list[LayerRange]] = defaultdict(list)
    for g, r in survivors.held.items():
        on_node[survivors.nodes[g]].append(r)
    local_union = {nodes: tuple(_union(rs)) for nodes, rs in on_node.items()}
    # most nodes hold the same layers (a whole old pipeline), so score per distinct union
    cache: dict[tuple[tuple[LayerRange, ...], LayerRange | None, LayerRange], float] = {}

    def local_bytes(nodes: tuple[int, ...], own: LayerRange | None, slot: LayerRange) -> float:
        key = (local_union.get(nodes, ()), own, slot)
        if key not in cache:
            cache[key] = sum(
                profile.state_bytes(max(first, a), min(end, b))
                for first, end in missing_ranges(own, slot)
                for a, b in key[0]
                if max(first, a) < min(end, b)
            )
        return cache[key]

    taken: list[list[Group]] = [[] for _ in slot_classes]
    for (own, gs), row in zip(group_classes, flows, strict=True):
        targets = [b for b, n in enumerate(row) if n]
        if not targets:
            continue
        scores: dict[tuple[int, ...], list[float]] = {}
        pairs: list[tuple[float, int, Group]] = []
        for g in gs:
            nodes = survivors.nodes[g]
            if nodes not in scores:
                scores[nodes] = [local_bytes(nodes, own, slot_classes[b][0]) for b in targets]
            pairs.extend((-score, b, g) for score, b in zip(scores[nodes], targets, strict=True))
        pairs.sort()
        quota = list(row)
        used: set[Group] = set()
        for _, b, g in pairs:
            if quota[b] and g not in used:
                taken[b].append(g)
                quota[b] -= 1
                used.add(g)
    return taken


def _evaluate(
    profile: ModelProfile,
    cluster: Cluster,
    survivors: _Survivors,
    chosen: Sequence[Group],
    slots: Sequence[LayerRange],
) -> Placement:
    """Bytes, sources and makespan of the transfer that ``chosen`` implies.

    Each missing piece comes from a live holder, on the receiver's node if one is there, else the
    least loaded; each device's time is its received (or sent) bytes over the links it uses.
    """
    held, nodes = survivors.held, survivors.nodes
    bounds = sorted({x for r in held.values() for x in r})
    held_set = sorted(set(held.values()))
    load = dict.fromkeys(held, 0.0)
    heaps: dict[object, list[tuple[float, Group]]] = defaultdict(list)
    for g, r in sorted(held.items()):
        heaps[r].append((0.0, g))
        heaps[(nodes[g], r)].append((0.0, g))
    # what a group holding `own` lacks for `slot`: pieces cut where holders' ranges change,
    # each with its bytes and the ranges of the holders it can come from
    pieces_of: dict[tuple[LayerRange | None, LayerRange], _Pieces] = {}

    def pieces(own: LayerRange | None, slot: LayerRange) -> _Pieces:
        key = (own, slot)
        if key not in pieces_of:
            total, out = 0.0, []
            for first, end in missing_ranges(own, slot):
                total += profile.state_bytes(first, end)
                cuts = bounds[bisect_right(bounds, first) : bisect_right(bounds, end - 1)]
                for u, v in pairwise([first, *cuts, end]):
                    cover = [r for r in held_set if r[0] <= u and v <= r[1]]
                    out.append(((u, v), profile.state_bytes(u, v), cover))
            pieces_of[key] = (total, out)
        return pieces_of[key]

    def least_loaded(key: object) -> Group | None:
        heap = heaps.get(key)
        if not heap:
            return None
        # one entry per holder, refreshed lazily: a stale entry carries a smaller load
        while heap[0][0] != load[heap[0][1]]:
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        return heap[0][1]

    def source(receiver: Group, cover: list[LayerRange]) -> Group | None:
        where = nodes[receiver]
        for keys in ([(where, r) for r in cover], cover):
            best: Group | None = None
            for key in keys:
                h = least_loaded(key)
                if h is not None and (best is None or (load[h], h) < (load[best], best)):
                    best = h
            if best is not None:
                return best
        return None

    recv_s: dict[int, float] = defaultdict(float)
    send_s: dict[int, float] = defaultdict(float)
    bytes_moved = 0.0
    unsourced: set[LayerRange] = set()
    unsourced_bytes = 0.0
    for receiver, slot in zip(chosen, slots, strict=True):
        total, todo = pieces(held.get(receiver), slot)
        bytes_moved += total
        for piece, nbytes, cover in todo:
            sender = source(receiver, cover)
            if sender is None:
                unsourced.add(piece)
                unsourced_bytes += nbytes
                continue
            load[sender] += nbytes
            shard = nbytes / len(receiver)
            for a, b in zip(receiver, sender, strict=True):
                seconds = shard / cluster.bandwidth_bytes_per_s(a, b)
                recv_s[a] += seconds
                send_s[b] += seconds
    transfer_s = max([0.0, *recv_s.values(), *send_s.values()])
    return Placement(
        groups=tuple(chosen),
        bytes_moved=bytes_moved,
        transfer_s=transfer_s,
        unsourced_layers=tuple(_union(sorted(unsourced))),
        unsourced_bytes=unsourced_bytes,
    )
