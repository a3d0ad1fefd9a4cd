"""Oobleck pipeline templates: node range, GPU-stage mapping DP, instantiation and batch split."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Any

import numpy as np

from controlplane.recovery.estimator.batch import pipeline_times
from controlplane.recovery.model import Layers, ModelProfile

FloatArray = np.ndarray[Any, np.dtype[np.float64]]

# Oobleck §4.1.2: the bubble is negligible with N_b ≥ 4S' micro-batches, so planning assumes 4S'.
NB_PLANNING_FACTOR = 4


@dataclass(frozen=True, slots=True)
class PipelineTemplate:
    """One layer-to-stage mapping for a pipeline of ``nodes`` nodes (Oobleck §4.1).

    Stage k runs on the k-th tensor-parallel group of the pipeline's nodes, in node order;
    ``time_s`` is the template's T1 + T2 + T3 with ``NB_PLANNING_FACTOR``·S micro-batches. A
    pipeline instantiated from it runs the split ``split_at`` picks for its micro-batch count.
    """

    nodes: int
    layers: Layers
    time_s: float

    @property
    def stages(self) -> int:
        return len(self.layers)


@dataclass(frozen=True, slots=True)
class TemplateSet:
    """Templates for n0 … n_max nodes (§4.1.1); a size with no split within memory is absent."""

    n0: int
    n_max: int
    stages_per_node: int
    templates: tuple[PipelineTemplate, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t.nodes for t in self.templates)

    def get(self, nodes: int) -> PipelineTemplate | None:
        for template in self.templates:
            if template.nodes == nodes:
                return template
        return None


@dataclass(frozen=True, slots=True)
class _Tables:
    """Per-layer prefix sums of a profile as (L+1)×(L+1) matrices over layer ranges [x, e)."""

    fwd: FloatArray  # F of [0, e), by e
    bwd: FloatArray  # B of [0, e), by e
    work: FloatArray  # F + B of [x, e)
    suffix: FloatArray  # F + B of [x, L)
    static: FloatArray
    activations: FloatArray
    empty: np.ndarray[Any, np.dtype[np.bool_]]  # x ≥ e


@lru_cache(maxsize=16)
def _tables(profile: ModelProfile) -> _Tables:
    ends = range(profile.layers + 1)
    # the profile's own prefix sums, so that memory matches stage_peak_bytes bit for bit
    fwd = np.array([profile.fwd(0, i) for i in ends])
    bwd = np.array([profile.bwd(0, i) for i in ends])
    work = fwd + bwd
    static = np.array([profile.static_bytes(0, i) for i in ends])
    act = np.array([profile.activation_bytes(0, i) for i in ends])
    x = np.arange(profile.layers + 1)
    return _Tables(
        fwd=fwd,
        bwd=bwd,
        work=work[None, :] - work[:, None],
        suffix=work[-1] - work,
        static=static[None, :] - static[:, None],
        activations=act[None, :] - act[:, None],
        empty=x[:, None] >= x[None, :],
    )


def template_time(profile: ModelProfile, layers: Layers, micro_batches: int | None = None) -> float:
    """Oobleck §4.1.2 eq. 1-4 for one split: T1 + T2 + T3 with the paper's T2.

    T1 = Σ(F+B), T2 = (N_b − S + k* − 1)(F+B)_{k*}, T3 = Σ_{k ≥ k*}(F+B), k* 0-based. k* is the
    stage whose T2 + T3 is largest: the critical path, which is the paper's slowest stage unless a
    later stage is nearly as slow (then the path through it is longer, since the terms of stages k
    and k+1 differ by (N_b − S + k)·(c_{k+1} − c_k)). ``micro_batches`` defaults to 4S.
    """
    stages = len(layers)
    nb = NB_PLANNING_FACTOR * stages if micro_batches is None else micro_batches
    work = [profile.fwd(*r) + profile.bwd(*r) for r in layers]
    t1 = sum(work)
    tail = [sum(work[k:]) for k in range(stages)]
    return t1 + max((nb - stages + k - 1) * work[k] + tail[k] for k in range(stages))


@lru_cache(maxsize=4096)
def best_split(
    profile: ModelProfile,
    stages: int,
    tp: int,
    capacity_bytes: float,
    micro_batches: int | None = None,
) -> tuple[Layers, float] | None:
    """The split of the layers over ``stages`` stages with the least ``template_time``.

    T1 is the same for every split, and T2 + T3 of stage k depends only on its own range and
    position, so the least maximum over stages is an exact min-max partition DP, O(S·L²) with
    numpy, instead of the paper's divide and conquer over (S', u, v, d). Stages over eq. 14 device
    memory with S − k micro-batches in flight are excluded (Oobleck's code has no
    filter). ``micro_batches`` (default 4S) is the N_b of T2; the memory filter always counts
    S − k micro-batches in flight, so the splits considered do not depend on it. Returns the split
    and its time, or None when no split fits.
    """
    layers = profile.layers
    if not 1 <= stages <= layers:
        return None
    t = _tables(profile)
    nb = NB_PLANNING_FACTOR * stages if micro_batches is None else micro_batches
    columns = np.arange(layers + 1)
    best = np.full(layers + 1, math.inf)
    choices: list[np.ndarray[Any, np.dtype[np.intp]]] = []
    for k in range(stages):
        # Oobleck eq. 2 and 3: T2 + T3 of stage k on layers [x, e)
        cost = (nb - stages + k - 1) * t.work + t.suffix[:, None]
        bad = t.empty
        if math.isfinite(capacity_bytes):
            bad = bad | _over_memory(t.static, t.activations, stages - k, tp, capacity_bytes)
        cost = np.where(bad, math.inf, cost)
        if k == 0:
            best = cost[0].copy()
            choices.append(np.zeros(layers + 1, dtype=np.intp))
            continue
        candidates = np.maximum(best[:, None], cost)
        arg = np.argmin(candidates, axis=0)
        best = candidates[arg, columns]
        choices.append(arg)
    if not math.isfinite(best[layers]):
        return None
    cuts = [layers]
    for k in range(stages - 1, 0, -1):
        cuts.append(int(choices[k][cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    split = tuple(pairwise(cuts))
    return split, template_time(profile, split, micro_batches)


def _over_memory(
    static: FloatArray,
    activations: FloatArray,
    in_flight: int | np.ndarray[Any, np.dtype[np.intp]],
    tp: int,
    capacity_bytes: float,
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Odyssey eq. 14 over device memory, with ``in_flight`` micro-batches' activations held.

    Stage k of S holds S − k (its 1F1B warm-up plus the one it runs) whenever N_b ≥ S. Planning
    counts that many whatever a pipeline's share turns out to be, so a split fits every share.
    """
    over: np.ndarray[Any, np.dtype[np.bool_]] = (
        static + in_flight * activations
    ) / tp > capacity_bytes
    return over


def step_time(profile: ModelProfile, layers: Layers, micro_batches: int) -> float:
    """Odyssey eq. 11 of one pipeline with this split running ``micro_batches`` micro-batches.

    The 1F1B recurrence without point-to-point sends: like the template DP, a split is ranked on
    its compute alone.
    """
    t = _tables(profile)
    cuts = np.array([[x for x, _ in layers] + [layers[-1][1]]])
    return float(_split_times(t, cuts, micro_batches)[0])


def _split_times(
    t: _Tables, cuts: np.ndarray[Any, np.dtype[np.intp]], micro_batches: int
) -> FloatArray:
    """Eq. 11 of each row of ``cuts`` (stage boundaries 0 = c_0 < … < c_S = L) at once."""
    fwd = t.fwd[cuts[:, 1:]] - t.fwd[cuts[:, :-1]]
    bwd = t.bwd[cuts[:, 1:]] - t.bwd[cuts[:, :-1]]
    return pipeline_times(fwd, bwd, micro_batches)


@lru_cache(maxsize=4096)
def split_at(
    profile: ModelProfile, stages: int, tp: int, capacity_bytes: float, micro_batches: int
) -> Layers | None:
    """The split a pipeline of ``stages`` stages runs when its share is ``micro_batches``.

    T1 + T2 + T3 is a proxy for the 1F1B step, and its N_b = 4S is a guess at the share: the
    split it ranks first can be slower than another at the pipeline's real count. So the
    template DP proposes its best splits at 4S (the template's own) and at the real count, the
    faster of the two by eq. 11 at that count is kept, and a descent then moves one stage
    boundary by one layer at a time while eq. 11 strictly drops. Every split visited fits memory
    as ``best_split`` requires, the result is never slower than the template's split at this
    count, and no single-boundary move improves it (a local optimum: eq. 11 has no min-max
    structure that an exact DP could use). None when no split fits.
    """
    proposed = [best_split(profile, stages, tp, capacity_bytes)]
    proposed.append(best_split(profile, stages, tp, capacity_bytes, micro_batches))
    seeds = [split for split, _ in filter(None, proposed)]
    if not seeds:
        return None
    t = _tables(profile)
    rows = np.array([[x for x, _ in split] + [profile.layers] for split in seeds])
    times = _split_times(t, rows, micro_batches)
    first = int(np.argmin(times))  # ties keep the template's split
    cuts, best = rows[first], float(times[first])
    in_flight = stages - np.arange(stages)
    while stages > 1:
        moves = np.repeat(cuts[None, :], 2 * (stages - 1), axis=0)
        inner = np.arange(1, stages)
        moves[2 * inner - 2, inner] -= 1
        moves[2 * inner - 1, inner] += 1
        starts, ends = moves[:, :-1], moves[:, 1:]
        valid = np.all(starts < ends, axis=1)
        over = _over_memory(
            t.static[starts, ends], t.activations[starts, ends], in_flight, tp, capacity_bytes
        )
        fits = ~over.any(axis=1)
        moves = moves[valid & fits]
        if not len(moves):
            break
        times = _split_times(t, moves, micro_batches)
        pick = int(np.argmin(times))
        if not times[pick] < best * (1 - 1e-12):
            break
        cuts, best = moves[pick], float(times[pick])
    return tuple((int(x), int(e)) for x, e in pairwise(cuts))


@lru_cache(maxsize=64)
def build_templates(
    profile: ModelProfile,
    nodes: int,
    stages_per_node: int,
    f: int,
    tp: int = 1,
    capacity_bytes: float = math.inf,
) -> TemplateSet | None:
    """Oobleck §4.1.1: templates for n0 … min(N − f·n0, L / stages per node) nodes.

    n0 is the fewest nodes whose pipeline fits memory; the largest template leaves f pipelines of
    n0 nodes beside it (§4.1: the paper's range, capped at L, not its code's n_mem
    … N). A pipeline has one stage per tensor-parallel group, ``stages_per_node`` per node. None
    when no node count up to the cap fits memory (template_oom).
    """
    cap = profile.layers // stages_per_node
    n0 = next(
        (
            n
            for n in range(1, min(cap, nodes) + 1)
            if best_split(profile, n * stages_per_node, tp, capacity_bytes) is not None
        ),
        None,
    )
    if n0 is None:
        return None
    n_max = min(nodes - f * n0, cap)
    templates = []
    for n in range(n0, n_max + 1):
        found = best_split(profile, n * stages_per_node, tp, capacity_bytes)
        if found is not None:
            templates.append(PipelineTemplate(nodes=n, layers=found[0], time_s=found[1]))
    return TemplateSet(
        n0=n0, n_max=n_max, stages_per_node=stages_per_node, templates=tuple(templates)
    )


def instantiation_options(sizes: Sequence[int], nodes: int, f: int = 0) -> list[tuple[int, ...]]:
    """Oobleck §4.2.1 eq. 5: every X with Σ x_j·n_j = ``nodes`` and Σ x_j ≥ f + 1, sorted.

    Coin change: X(p', N') = X(p'−1, N') ⧺ θ(X(p', N' − n_p'), p'), θ adding one pipeline of
    template p'. Exponential in general; the policy uses ``best_instantiation`` instead.
    """
    width = len(sizes)
    table: list[list[tuple[int, ...]]] = [[(0,) * width]] + [[] for _ in range(nodes)]
    for j, size in enumerate(sizes):
        for total in range(size, nodes + 1):
            table[total] = table[total] + [
                (*x[:j], x[j] + 1, *x[j + 1 :]) for x in table[total - size]
            ]
    return sorted(x for x in table[nodes] if sum(x) >= f + 1)


def fill_time(fill_s: float, period_s: float, micro_batches: int) -> float:
    """1F1B time of k micro-batches: fill and drain once, then one bottleneck period each.

    Eq. 9 for equal stages; for unequal ones the fill-and-drain bound that choosing the set of
    templates (``best_instantiation``) uses.
    """
    return fill_s + (micro_batches - 1) * period_s


def water_fill(micro_batches: int, finish_s: Sequence[Callable[[int], float]]) -> list[int] | None:
    """Batch distribution (§4.2.2, §5.2, as Oobleck's 2024 code does it): one micro-batch each,
    then each to the lowest finish.

    ``finish_s[i](k)`` is pipeline i's step with k micro-batches. Greedy is optimal for the least
    maximum of increasing functions; it stands in for §4.2.2 eq. 6, whose integer program mixes
    per-pipeline and per-template indices (eq. 6 mixes the two). None when there are fewer
    micro-batches than pipelines. Ties go to the lower index.
    """
    count = len(finish_s)
    if micro_batches < count or count == 0:
        return None
    shares = [1] * count
    heap = [(finish_s[i](2), i) for i in range(count)]
    heapq.heapify(heap)
    for _ in range(micro_batches - count):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (finish_s[i](shares[i] + 1), i))
    return shares


def _capacity(fill_s: float, period_s: float, limit_s: float, micro_batches: int) -> int:
    """Most micro-batches a pipeline finishes within ``limit_s`` (at most ``micro_batches``)."""
    if fill_s > limit_s * (1 + 1e-12):
        return 0
    if period_s <= 0:
        return micro_batches
    return min(micro_batches, math.floor((limit_s - fill_s) / period_s * (1 + 1e-12)) + 1)


def _best_counts(
    caps: Mapping[int, int], nodes: int, f: int, micro_batches: int
) -> tuple[int, list[int]]:
    """Unbounded knapsack: the most micro-batches pipelines of these sizes can take in all.

    Uses exactly ``nodes`` nodes and f + 1 … micro-batches pipelines. Returns the total and the
    pipeline sizes (ascending), or (−1, []) when no such set exists.
    """
    sizes = sorted(n for n, c in caps.items() if c > 0)
    if not sizes:
        return -1, []
    most_pipelines = nodes // sizes[0]
    # the upper bound on pipelines only binds when micro-batches are fewer than possible pipelines
    exact = micro_batches < most_pipelines
    rows = micro_batches if exact else f + 1
    worst = -1
    value = [[worst] * (nodes + 1) for _ in range(rows + 1)]
    came: list[list[tuple[int, int]]] = [[(0, 0)] * (nodes + 1) for _ in range(rows + 1)]
    value[0][0] = 0
    for total in range(1, nodes + 1):
        for size in sizes:
            if size > total:
                break
            before = total - size
            gain = caps[size]
            for row in range(rows + 1):
                v = value[row][before]
                if v == worst:
                    continue
                to = row + 1 if exact else min(row + 1, rows)
                if to > rows:
                    continue
                if v + gain > value[to][total]:
                    value[to][total] = v + gain
                    came[to][total] = (size, row)
    best_row = max(range(f + 1, rows + 1), key=lambda r: value[r][nodes], default=None)
    if best_row is None or value[best_row][nodes] == worst:
        return -1, []
    out = []
    row, total = best_row, nodes
    while total:
        size, row = came[row][total]
        out.append(size)
        total -= size
    return value[best_row][nodes], sorted(out)


def best_instantiation(
    fill_s: Mapping[int, float],
    period_s: Mapping[int, float],
    nodes: int,
    f: int,
    micro_batches: int,
) -> tuple[list[int], float] | None:
    """§4.2: the X over templates (size → fill, period) with the least water-filled step time.

    Instead of enumerating eq. 5's sets (millions of sets at 64 nodes), bisect the step time T:
    each template finishes cap(T) micro-batches, and T is reachable when some X with the f + 1
    constraint holds at least B/b of them, an unbounded knapsack.
    Returns the pipeline sizes, ascending, and T; None when no X exists.
    """
    sizes = sorted(fill_s)
    if not sizes or micro_batches < f + 1:
        return None
    limits = np.unique(
        np.concatenate(
            [fill_s[n] + period_s[n] * np.arange(micro_batches, dtype=float) for n in sizes]
        )
    )

    def reachable(limit: float) -> tuple[bool, list[int]]:
        caps = {n: _capacity(fill_s[n], period_s[n], limit, micro_batches) for n in sizes}
        total, chosen = _best_counts(caps, nodes, f, micro_batches)
        return total >= micro_batches, chosen

    ok, chosen = reachable(float(limits[-1]))
    if not ok:
        return None
    low, high = 0, len(limits) - 1
    while low < high:
        mid = (low + high) // 2
        ok, found = reachable(float(limits[mid]))
        if ok:
            high, chosen = mid, found
        else:
            low = mid + 1
    return chosen, float(limits[high])
