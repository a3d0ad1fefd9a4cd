"""Planner: Odyssey Algorithm 1 as an exact branch-and-bound search, plus the reference version.

A plan shape is a multiset of pipeline lengths (in tensor-parallel groups) with a batch split and
a layer split per pipeline. The search visits shapes for DP widths near the old one:

* ``distribute_batch`` is Algorithm 1's rule: shares by pipeline length, leftovers one by one in
  list order (longest first), then refill of empty pipelines from the largest.
* a pipeline of S stages with m micro-batches gets the best even layer split: every placement of
  the remainder layers (at most ``MAX_PLACEMENTS``), memory-checked with eq. 14 and timed with
  eq. 11, all placements at once as numpy rows, memoised on (S, m).
* the fast search enumerates partitions as counts per pipeline length, longest first, and prunes
  every length whose bound (the best time its pipelines can reach with the micro-batches they
  surely get, leftovers included) cannot beat the threshold. ``exhaustive`` enumerates every
  partition without pruning; with ``memo=False`` every pipeline's every split is also simulated
  on its own, which is the straightforward Algorithm 1 that benchmarks compare against.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from itertools import combinations, islice

import numpy as np
import numpy.typing as npt

from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator.batch import pipeline_times
from controlplane.recovery.estimator.memory import stage_peak_bytes
from controlplane.recovery.estimator.time import pipeline_time
from controlplane.recovery.model import (
    Cluster,
    ClusterState,
    ExecutionPlan,
    Family,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.restorer import Placement, place

Layers = tuple[tuple[int, int], ...]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Placements of the remainder layers tried per (S, m) in the fast search; C(S, r) explodes past
# 16 stages (C(32, 16) ≈ 6·10^8), and lower-bound ordering finds the best one early.
MAX_PLACEMENTS = 256


@dataclass(frozen=True, slots=True)
class PipelineShape:
    layers: Layers
    micro_batches: int


@dataclass(frozen=True, slots=True)
class PlanShape:
    """A plan without devices; ``compute_time_s`` is eq. 10/11 without communication."""

    pipelines: tuple[PipelineShape, ...]
    compute_time_s: float

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(p.layers) for p in self.pipelines)

    @property
    def slots(self) -> list[tuple[int, int]]:
        return [layers for p in self.pipelines for layers in p.layers]


def distribute_batch(micro_batches: int, lengths: Sequence[int]) -> list[int] | None:
    """Algorithm 1's batch split: proportional shares, leftovers in list order, refill empties."""
    if micro_batches < len(lengths):
        return None
    total = sum(lengths)
    shares = [micro_batches * length // total for length in lengths]
    for k in range(micro_batches - sum(shares)):
        shares[k % len(shares)] += 1
    while 0 in shares:
        shares[shares.index(max(shares))] -= 1
        shares[shares.index(0)] += 1
    return shares


def _split_from_heavy(layers: int, stages: int, heavy: Sequence[int]) -> Layers:
    base = layers // stages
    extra = set(heavy)
    bounds = []
    first = 0
    for s in range(stages):
        end = first + base + (s in extra)
        bounds.append((first, end))
        first = end
    return tuple(bounds)


def heavy_placements(
    stages: int, remainder: int, limit: int | None = None
) -> Iterator[tuple[int, ...]]:
    """Which stages take one of the ``remainder`` extra layers of an even split.

    With ``limit``, at most that many placements: heavy-early ones first (eq. 11 favours them),
    then heavy-late ones (eq. 14 favours them), then evenly spaced; duplicates skipped.
    """
    if limit is None or math.comb(stages, remainder) <= limit:
        yield from combinations(range(stages), remainder)
        return
    seen: set[tuple[int, ...]] = set()
    early = combinations(range(stages), remainder)
    late = (
        tuple(stages - 1 - s for s in reversed(c)) for c in combinations(range(stages), remainder)
    )
    spaced = [tuple(round(i * stages / remainder) for i in range(remainder))]
    for source in (spaced, islice(early, limit // 2), islice(late, limit // 2)):
        for heavy in source:
            if heavy not in seen:
                seen.add(heavy)
                yield heavy


def even_splits(layers: int, stages: int, limit: int | None = None) -> Iterator[Layers]:
    """Even splits of ``layers`` over ``stages``: base layers each, the remainder anywhere."""
    if layers // stages == 0:
        return
    for heavy in heavy_placements(stages, layers % stages, limit):
        yield _split_from_heavy(layers, stages, heavy)


class PipelineOracle:
    """Best layer split and its time for a pipeline of S stages and m micro-batches."""

    def __init__(
        self,
        profile: ModelProfile,
        capacity_bytes: float,
        tp: int,
        *,
        memo: bool = True,
    ) -> None:
        self.profile = profile
        self.capacity = capacity_bytes
        self.tp = tp
        self.memo = memo
        self._best: dict[tuple[int, int], tuple[float, Layers] | None] = {}

    def best(self, stages: int, micro_batches: int) -> tuple[float, Layers] | None:
        """Least (time, split) over memory-feasible even splits; None when none fits."""
        key = (stages, micro_batches)
        if self.memo and key in self._best:
            return self._best[key]
        found = self._search(stages, micro_batches)
        if self.memo:
            self._best[key] = found
        return found

    def _search(self, stages: int, micro_batches: int) -> tuple[float, Layers] | None:
        if self.memo:
            return self._search_together(stages, micro_batches)
        # The straightforward Algorithm 1: every split checked and simulated on its own.
        feasible = [
            s for s in even_splits(self.profile.layers, stages) if self._fits(s, micro_batches)
        ]
        return min(((self._time(s, micro_batches), s) for s in feasible), default=None)

    def _fits(self, split: Layers, micro_batches: int) -> bool:
        stages = len(split)
        return all(
            stage_peak_bytes(self.profile, layers, i, stages, micro_batches, self.tp)
            <= self.capacity
            for i, layers in enumerate(split)
        )

    def _time(self, split: Layers, micro_batches: int) -> float:
        t_f = [self.profile.fwd(*layers) for layers in split]
        t_b = [self.profile.bwd(*layers) for layers in split]
        return pipeline_time(t_f, t_b, micro_batches)

    def _fitting_splits(self, stages: int, micro_batches: int) -> tuple[IntArray, IntArray] | None:
        """Start and end layers (rows = splits) of the even splits that fit memory (eq. 14)."""
        base, remainder = divmod(self.profile.layers, stages)
        if base == 0:
            return None
        heavy = list(heavy_placements(stages, remainder, MAX_PLACEMENTS))
        sizes = np.full((len(heavy), stages), base, dtype=np.int64)
        for row, extra in enumerate(heavy):
            sizes[row, list(extra)] += 1
        ends = np.cumsum(sizes, axis=1)
        starts = ends - sizes
        _, _, static, act = self._prefix_arrays
        in_flight = np.minimum(stages - np.arange(stages), micro_batches)
        # eq. 14 per stage, as stage_peak_bytes computes it
        peak = (static[ends] - static[starts] + in_flight * (act[ends] - act[starts])) / self.tp
        fits = (peak <= self.capacity).all(axis=1)
        if not fits.any():
            return None
        return starts[fits], ends[fits]

    def _search_together(self, stages: int, micro_batches: int) -> tuple[float, Layers] | None:
        """The same search with every split as a row of numpy arrays: memory filter and eq. 11.

        The arithmetic is the scalar path's, operation for operation, so times and ties agree.
        """
        found = self._fitting_splits(stages, micro_batches)
        if found is None:
            return None
        starts, ends = found
        fwd, bwd, _, _ = self._prefix_arrays
        times = pipeline_times(fwd[ends] - fwd[starts], bwd[ends] - bwd[starts], micro_batches)
        splits = [
            tuple(zip(row_s, row_e, strict=True))
            for row_s, row_e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
        return min(zip(times.tolist(), splits, strict=True))

    def split_bound(self, stages: int, micro_batches: int) -> float:
        """A bound on ``best(stages, micro_batches)`` without simulating: the least, over fitting
        splits, of the busiest-stage bound (odyssey.md §5.1 item 3). Infinite when none fits.
        """
        if not self.memo or (stages, micro_batches) in self._best:
            best = self.best(stages, micro_batches)
            return math.inf if best is None else best[0]
        found = self._fitting_splits(stages, micro_batches)
        if found is None:
            return math.inf
        starts, ends = found
        fwd, bwd, _, _ = self._prefix_arrays
        t_f, t_b = fwd[ends] - fwd[starts], bwd[ends] - bwd[starts]
        # stage b waits for micro-batch 0, runs m passes, and its last gradient travels back
        before = np.cumsum(t_f + t_b, axis=1) - (t_f + t_b)
        bound = (before + micro_batches * (t_f + t_b)).max(axis=1)
        return float(bound.min())

    @cached_property
    def _prefix_arrays(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Prefix sums over layers of forward, backward, static and activation terms."""
        layers = range(self.profile.layers + 1)
        p = self.profile
        return (
            np.array([p.fwd(0, i) for i in layers]),
            np.array([p.bwd(0, i) for i in layers]),
            np.array([p.static_bytes(0, i) for i in layers]),
            np.array([p.activation_bytes(0, i) for i in layers]),
        )

    def quick_bound(self, stages: int, micro_batches: int) -> float:
        """A bound on every even split's eq. 11 time that needs no split.

        The busiest stage b runs m forward+backward passes after the others' share of micro-batch
        0 (odyssey.md §5.1 item 3), so t ≥ W − w_b + m·w_b = W + (m − 1)·w_b, W being the work of
        all layers. w_b is at least the average W/S and at least the lightest run of ceil(L/S)
        consecutive layers, since an even split gives some stage that many. For equal layers
        dividing evenly this is eq. 9 exactly.
        """
        layers = self.profile.layers
        total = self.profile.fwd(0, layers) + self.profile.bwd(0, layers)
        return total + (micro_batches - 1) * max(total / stages, self._lightest_run(stages))

    @cache  # noqa: B019 - one oracle lives for one search; the cache dies with it
    def _lightest_run(self, stages: int) -> float:
        widest = -(-self.profile.layers // stages)
        return min(
            self.profile.fwd(i, i + widest) + self.profile.bwd(i, i + widest)
            for i in range(self.profile.layers - widest + 1)
        )


# Relative difference under which two step times count as equal.
TIE_TOLERANCE = 1e-9

# Branch-and-bound nodes the fast search may visit per call before it returns the best so far.
DEFAULT_NODE_BUDGET = 50_000


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Shapes fastest first; ``complete`` is False when the node budget cut the search short."""

    shapes: list[PlanShape]
    complete: bool
    nodes: int


@dataclass
class _Search:
    """Branch-and-bound over partitions of ``groups`` into pipelines, as counts per length.

    Pipelines of equal length are interchangeable, so a partition is a count for every length,
    chosen longest first. A length whose own bound exceeds the threshold gets count 0: each of
    its pipelines runs at least its guaranteed micro-batches, and a pipeline's best time never
    falls as micro-batches grow. Near-even partitions are scored first to seed the threshold.
    """

    oracle: PipelineOracle
    micro_batches: int
    groups: int
    max_depth: int
    exhaustive: bool
    top_k: int
    threshold: float
    budget: float
    deadline: float
    spread: int | None
    found: list[tuple[float, tuple[int, ...], PlanShape]]  # heap of the top_k, worst on top
    nodes: int = 0
    shortest: int = 1
    stopped: bool = False
    # Once top_k shapes are in hand, only strictly faster ones can enter; ties go to the earlier.
    strict: bool = False

    @property
    def exhausted(self) -> bool:
        if not self.stopped and (
            self.nodes >= self.budget
            or (self.nodes % 64 == 0 and time.perf_counter() > self.deadline)
        ):
            self.stopped = True
        return self.stopped

    def near_even(self, dp: int) -> None:
        base, extra = divmod(self.groups, dp)
        if base >= 1:
            self._leaf({base + 1: extra, base: dp - extra})

    def partitions(self, dp: int) -> None:
        longest = min(self.max_depth, self.groups - dp + 1)
        self.shortest = 1
        if self.spread is not None:
            # Algorithm 1's R_pp as a band around the mean pipeline length.
            longest = min(longest, -(-self.groups // dp) + self.spread)
            self.shortest = max(1, self.groups // dp - self.spread)
        self._extend({}, longest, self.groups, dp)

    def grids(self, dp: int) -> None:
        for depth in range(1, min(self.max_depth, self.groups // dp) + 1):
            self._leaf({depth: dp})

    def _guaranteed(self, length: int) -> int:
        """Micro-batches a pipeline of this length surely gets under Algorithm 1's rule."""
        if self.micro_batches >= self.groups:
            return self.micro_batches * length // self.groups  # no empty share: leftovers only add
        return 1

    def _pruned(self, length: int) -> bool:
        if self.exhaustive:
            return False
        m = self._guaranteed(length)
        if self._beyond(self.oracle.quick_bound(length, m)):
            return True
        if self._beyond(self.oracle.split_bound(length, m)):
            return True
        best = self.oracle.best(length, m)
        return best is None or self._beyond(best[0])

    def _beyond(self, time: float) -> bool:
        # Times summed in different orders differ in the last bits; such ties are ties.
        if self.strict:
            return time >= self.threshold * (1 - TIE_TOLERANCE)
        return time > self.threshold * (1 + TIE_TOLERANCE)

    def _leftover_pruned(self, counts: dict[int, int]) -> bool:
        """Bound on the leftover micro-batches the longest pipelines must take.

        With no empty share, leftovers number ``r = Σ_S c_S (N_m·S mod G) / G`` exactly, so the
        lengths chosen so far force at least the ceiling of their part of that sum, and the first
        r pipelines (the longest) each run one micro-batch more than their share.
        """
        if self.exhaustive or self.micro_batches < self.groups:
            return False
        forced = -(
            -sum(k * (self.micro_batches * s % self.groups) for s, k in counts.items())
            // self.groups
        )
        before = 0
        for length in sorted(counts, reverse=True):
            if before >= forced:
                break
            best = self.oracle.best(length, self._guaranteed(length) + 1)
            if best is None or self._beyond(best[0]):
                return True
            before += counts[length]
        return False

    def _extend(self, counts: dict[int, int], length: int, remaining: int, count: int) -> None:
        """Choose how many pipelines have ``length`` stages, then recurse to shorter ones."""
        self.nodes += 1
        if count == 0:
            if remaining == 0:
                self._leaf(counts)
            return
        if length < self.shortest or self.exhausted:
            return
        # Pipelines left after this length are shortest..length-1 long; bound k so they can close.
        shorter = length - 1
        if shorter < self.shortest:
            low = high = count if remaining == count * length else -1
        else:
            low = max(0, remaining - count * shorter)
            high = min(count, (remaining - count * self.shortest) // (length - self.shortest))
        if low > high:
            return
        if high > 0 and self._pruned(length):
            if low > 0:
                return
            high = 0
        # More pipelines of the longest length first: the near-even partitions come early.
        for k in range(high, low - 1, -1):
            if k:
                counts[length] = k
                if self._leftover_pruned(counts):
                    counts.pop(length)
                    continue
            self._extend(counts, length - 1, remaining - k * length, count - k)
            counts.pop(length, None)
            if self.exhausted:
                return

    def _leaf(self, counts: dict[int, int]) -> None:
        lengths = tuple(sorted((s for s, k in counts.items() for _ in range(k)), reverse=True))
        shares = distribute_batch(self.micro_batches, lengths)
        if shares is None:
            return
        # Pipelines of one length differ only by one micro-batch: score each (S, m) pair once.
        step = 0.0
        best_of: dict[tuple[int, int], tuple[float, Layers]] = {}
        pairs = zip(lengths, shares, strict=True)
        # The straightforward Algorithm 1 (no memo) scores every pipeline on its own.
        for length, m in set(pairs) if self.oracle.memo else list(pairs):
            best = self.oracle.best(length, m)
            if best is None:
                return
            best_of[(length, m)] = best
            step = max(step, best[0])
        if self._beyond(step):
            return
        pipelines = tuple(
            PipelineShape(best_of[(length, m)][1], m)
            for length, m in zip(lengths, shares, strict=True)
        )
        # Rank by time, then by the more even partition (reverse-sorted lengths compare smaller).
        entry = (-step, tuple(-x for x in lengths), PlanShape(pipelines, step))
        if any(e[1] == entry[1] for e in self.found):
            return
        if len(self.found) < self.top_k:
            heapq.heappush(self.found, entry)
        elif entry[:2] > self.found[0][:2]:
            heapq.heapreplace(self.found, entry)
        if len(self.found) >= self.top_k and not self.exhaustive:
            self.threshold = min(self.threshold, -self.found[0][0])
            self.strict = True


def search(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    *,
    groups: int,
    tp: int,
    dp_options: Sequence[int],
    symmetric_only: bool = False,
    top_k: int = 8,
    exhaustive: bool = False,
    max_step_time_s: float = math.inf,
    node_budget: int | None = DEFAULT_NODE_BUDGET,
    time_budget_s: float | None = None,
    spread: int | None = None,
    memo: bool = True,
) -> SearchResult:
    """The ``top_k`` fastest plan shapes over ``groups`` TP groups whose time is at most
    ``max_step_time_s``, fastest first.

    Non-symmetric shapes use every group (Algorithm 1 re-plans over all survivors); symmetric
    shapes (a PP × DP grid) may leave groups idle. Ties go to the more even partition.
    ``exhaustive`` visits every partition (no pruning, no node budget unless one is given,
    ``top_k`` still applies). ``spread`` keeps pipeline lengths within that many of the mean;
    ``memo=False`` re-scores every pipeline, as a straightforward implementation would.
    The search stops at ``node_budget`` nodes or after ``time_budget_s`` seconds, returning the
    best shapes so far with ``complete=False``.
    """
    oracle = PipelineOracle(profile, cluster.device_memory_bytes, tp, memo=memo)
    state = _Search(
        oracle=oracle,
        micro_batches=training.micro_batches,
        groups=groups,
        max_depth=profile.layers,
        exhaustive=exhaustive,
        top_k=top_k,
        threshold=max_step_time_s,
        budget=math.inf
        if node_budget is None or (exhaustive and node_budget == DEFAULT_NODE_BUDGET)
        else node_budget,
        deadline=math.inf if time_budget_s is None else time.perf_counter() + time_budget_s,
        spread=spread,
        found=[],
    )
    widths = sorted({d for d in dp_options if 1 <= d <= groups})
    for dp in widths:
        if symmetric_only:
            state.grids(dp)
        else:
            state.near_even(dp)
    if not symmetric_only:
        for dp in widths:
            state.partitions(dp)
    ranked = sorted(state.found, key=lambda e: e[:2], reverse=True)
    return SearchResult(
        shapes=[shape for _, _, shape in ranked],
        complete=not state.stopped,
        nodes=state.nodes,
    )


def usable_groups(state: ClusterState, *, include_spares: bool = False) -> list[tuple[int, ...]]:
    """Healthy tensor-parallel groups: intact groups of the plan, then regrouped loose devices.

    Healthy devices outside an intact group are regrouped only within a node (tensor parallelism
    does not cross nodes); spares join when asked.
    """
    tp = state.plan.tp
    intact = [g for g in dict.fromkeys(state.plan.own_groups()) if not state.failed & set(g)]
    taken = {d for g in intact for d in g}
    spares = set(state.cluster.spare_ids)
    loose: dict[int, list[int]] = {}
    for device in sorted(state.healthy - taken):
        if device in spares and not include_spares:
            continue
        loose.setdefault(state.cluster.node_of(device), []).append(device)
    regrouped = [
        tuple(devices[i : i + tp])
        for _, devices in sorted(loose.items())
        for i in range(0, len(devices) - tp + 1, tp)
    ]
    return intact + regrouped


def realize(
    state: ClusterState,
    shape: PlanShape,
    groups: Sequence[tuple[int, ...]],
    family: Family = Family.DYNAMIC,
) -> tuple[ExecutionPlan, Placement]:
    """Put device groups on a shape's stages so that the least state moves (Kuhn-Munkres)."""
    placement = place(state.profile, state.cluster, state.plan, groups, shape.slots)
    chosen = iter(placement.groups)
    pipelines = tuple(
        Pipeline(
            stages=tuple(Stage(devices=next(chosen), layers=layers) for layers in p.layers),
            micro_batches=p.micro_batches,
        )
        for p in shape.pipelines
    )
    return ExecutionPlan(pipelines=pipelines, family=family), placement


def dp_window(old_dp: int, groups: int) -> list[int]:
    """Algorithm 1's DP widths: the new width rarely differs from the old one by 2 or more.

    Widths beyond the surviving groups are clipped to them (many failures at once).
    """
    if groups < 1:
        raise InfeasiblePlan("no healthy device group left")
    return sorted({min(max(d, 1), groups) for d in (old_dp - 1, old_dp, old_dp + 1)})
