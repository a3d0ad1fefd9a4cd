"""Planner: Odyssey Algorithm 1 as an exact branch-and-bound search, plus the reference version.

A plan shape is a multiset of pipeline lengths (in tensor-parallel groups) with a batch split and
a layer split per pipeline. The search visits shapes for DP widths near the old one:

* ``distribute_batch`` is Algorithm 1's rule: shares by pipeline length, leftovers one by one in
  list order (longest first), then refill of empty pipelines from the largest.
* a pipeline of S stages with m micro-batches gets the best even layer split over every
  placement of the remainder layers, memory-checked with eq. 14 and timed with eq. 11
  (``PipelineOracle``: a branch-and-bound over placements with a proven bound, memoised on
  (S, m)).
* the fast search enumerates partitions as counts per pipeline length, longest first, and prunes
  every length whose bound (the best time its pipelines can reach with the micro-batches they
  surely get, leftovers included) cannot beat the threshold. ``exhaustive`` enumerates every
  partition and times every placement that fits, without pruning; with ``memo=False`` every
  pipeline's every split is also simulated on its own, which is the straightforward Algorithm 1
  that benchmarks compare against.

``SearchResult.complete`` means proven optimal: no budget cut the search or an oracle short, and
everything skipped was skipped by a bound that is proven (``StageTable``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import combinations
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator.batch import pipeline_times
from controlplane.recovery.estimator.memory import stage_peak_bytes
from controlplane.recovery.estimator.time import (
    pipeline_floor_s,
    pipeline_time,
    shortest_pipeline_sync_floor_s,
    split_sync_floor_s,
)
from controlplane.recovery.model import (
    Cluster,
    ClusterState,
    ExecutionPlan,
    Family,
    Layers,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.restorer import Placement, place

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class PipelineShape:
    layers: Layers
    micro_batches: int


@dataclass(frozen=True, slots=True)
class PlanShape:
    """A plan without devices; ``compute_time_s`` is eq. 10/11 without communication."""

    pipelines: tuple[PipelineShape, ...]
    compute_time_s: float
    # its distinct pipelines where the search knew them: at scale a shape holds tens of
    # thousands of pipelines and a handful of kinds
    known_kinds: frozenset[PipelineShape] | None = field(default=None, compare=False, repr=False)

    @property
    def kinds(self) -> frozenset[PipelineShape]:
        """Its distinct pipelines (layer split and micro-batches)."""
        if self.known_kinds is not None:
            return self.known_kinds
        return frozenset(self.pipelines)

    @property
    def splits(self) -> frozenset[Layers]:
        """Its pipelines' distinct layer splits."""
        return frozenset(p.layers for p in self.kinds)

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
    # one division per distinct length: at scale there are tens of thousands of pipelines
    share = {length: micro_batches * length // total for length in set(lengths)}
    shares = list(map(share.__getitem__, lengths))
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


def heavy_placements(stages: int, remainder: int) -> Iterator[tuple[int, ...]]:
    """Which stages take one of the ``remainder`` extra layers of an even split: every choice."""
    return combinations(range(stages), remainder)


def even_splits(layers: int, stages: int) -> Iterator[Layers]:
    """Even splits of ``layers`` over ``stages``: base layers each, the remainder anywhere."""
    if layers // stages == 0:
        return
    for heavy in heavy_placements(stages, layers % stages):
        yield _split_from_heavy(layers, stages, heavy)


# Relative difference under which two step times count as equal.
TIE_TOLERANCE = 1e-9

# Rows of float64 that one batch of placements may fill in eq. 11's arrays (about 32 MB each).
BATCH_CELLS = 1 << 22

# Placements the fast oracle may simulate for one (S, m) before it stops trying to prove its
# best split optimal; past it the oracle says so and the search reports itself incomplete.
PLACEMENT_BUDGET = 50_000


@dataclass(frozen=True, slots=True)
class StageTable:
    """Every layer range a stage can hold in an even split of a pipeline, with its bounds.

    An even split of L layers over S stages gives every stage ``base = L // S`` layers and
    ``r = L mod S`` stages one more. Stage i, after k heavier stages, holds layers
    ``[i·base + k, i·base + k + base + h)`` with h = 1 when it is heavier itself, so a split is a
    path through the states (i, k) and every per-stage quantity is a function of (i, k, h).
    Arrays are indexed [i, k, h]; ``term`` is infinite where the state is impossible or the
    stage does not fit memory (eq. 14).

    ``term`` is a lower bound on the pipeline's eq. 11 time that holds for every split through
    that state; with stage work ``w_i = f_i + b_i`` it is

        Σ_{s<i} w_s  +  m·w_i  +  max(0, Σ_{s>i} w_s − (n_i − 1)·f_i),   n_i = min(S − i, m).

    Proof: micro-batch 0 reaches stage i no sooner than Σ_{s<i} f_s; the stage then runs its
    2m passes, m·w_i in all, one at a time. In the 1F1B order its first backward comes after
    n_i forwards, and it needs micro-batch 0's gradient, which leaves stage i's first forward
    and crosses every later stage forward and backward: Σ_{s>i} w_s, of which the stage can
    fill at most its other n_i − 1 forwards, so it idles for the rest. Its last backward's
    gradient then crosses every earlier stage backward: Σ_{s<i} b_s. The slowest stage's term
    is the split's bound (``completion`` takes the least over splits of the greatest term).
    Odyssey's eq. 9 is the last stage's term for equal stages, so the bound is tight there.
    """

    base: int
    remainder: int
    starts: IntArray
    ends: IntArray
    term: FloatArray
    # completion[i, k]: least, over the ways to finish a split from state (i, k) within memory,
    # of the greatest term of stages i..S-1 (−inf at the end state, inf where none finishes)
    completion: FloatArray

    @property
    def bound(self) -> float:
        """The least bound over every even split that fits memory; inf when none fits."""
        return float(self.completion[0, 0])

    def rows(self, heavy: Sequence[Sequence[int]]) -> tuple[IntArray, IntArray]:
        """Start and end layers (one row per split) of splits given as 0/1 heavy flags."""
        flags = np.asarray(heavy, dtype=np.int64)
        stages = flags.shape[1]
        starts = np.arange(stages) * self.base + np.cumsum(flags, axis=1) - flags
        return starts, starts + self.base + flags


class PipelineOracle:
    """Best layer split and its time for a pipeline of S stages and m micro-batches.

    ``best`` is exact: it visits the even splits through the states of a ``StageTable``,
    skipping only those whose bound already exceeds the fastest split timed so far, and times
    the rest with eq. 11 in batches. ``exhaustive`` times every split that fits memory;
    ``memo=False`` is the straightforward Algorithm 1, one split at a time, nothing remembered.
    """

    def __init__(
        self,
        profile: ModelProfile,
        capacity_bytes: float,
        tp: int,
        *,
        memo: bool = True,
        exhaustive: bool = False,
        placement_budget: int = PLACEMENT_BUDGET,
    ) -> None:
        self.profile = profile
        self.capacity = capacity_bytes
        self.tp = tp
        self.memo = memo
        self.exhaustive = exhaustive
        self.placement_budget = placement_budget
        # True once a budget cut some ``best`` short: its answer is then not proven optimal.
        self.incomplete = False
        self._best: dict[tuple[int, int], tuple[float, Layers] | None] = {}
        self._tables: dict[tuple[int, int], StageTable | None] = {}
        # the (S, m) whose ``best`` a budget cut short: a search that reads one again is
        # incomplete too (one oracle serves many searches, ``search``)
        self._cut: set[tuple[int, int]] = set()
        # ``pipeline_floor_s`` of the splits it gave, by (cluster, split, micro-batches)
        self.floors: dict[tuple[Cluster, Layers, int], float] = {}

    def best(self, stages: int, micro_batches: int) -> tuple[float, Layers] | None:
        """Least (time, split) over memory-feasible even splits; None when none fits."""
        key = (stages, micro_batches)
        if self.memo and key in self._best:
            if key in self._cut:
                self.incomplete = True
            return self._best[key]
        earlier, self.incomplete = self.incomplete, False
        found = self._search(stages, micro_batches)
        if self.incomplete:
            self._cut.add(key)
        self.incomplete = self.incomplete or earlier
        if self.memo:
            self._best[key] = found
        return found

    def split_bound(self, stages: int, micro_batches: int) -> float:
        """A lower bound on ``best(stages, micro_batches)``, exact once that is known."""
        if (stages, micro_batches) in self._best or not self.memo:
            best = self.best(stages, micro_batches)
            return math.inf if best is None else best[0]
        table = self.table(stages, micro_batches)
        return math.inf if table is None else table.bound

    def table(self, stages: int, micro_batches: int) -> StageTable | None:
        """The ``StageTable`` of a pipeline shape; None when the layers cannot fill the stages."""
        key = (stages, micro_batches)
        if key not in self._tables:
            self._tables[key] = self._build_table(stages, micro_batches)
        return self._tables[key]

    def _build_table(self, stages: int, micro_batches: int) -> StageTable | None:
        layers = self.profile.layers
        base, remainder = divmod(layers, stages)
        if base == 0:
            return None
        i = np.arange(stages)[:, None, None]
        k = np.arange(remainder + 1)[None, :, None]
        h = np.arange(2)[None, None, :]
        # k heavier stages before i, and the heavier ones still to come fit after it
        possible = (k <= i) & (k + h <= remainder) & (remainder - k - h <= stages - 1 - i)
        starts = np.where(possible, i * base + k, 0)
        ends = np.where(possible, starts + base + h, 0)
        fwd, bwd, static, act = self._prefix_arrays
        m = micro_batches
        in_flight = np.minimum(stages - i, m)
        # eq. 14 per stage, as stage_peak_bytes computes it
        peak = (static[ends] - static[starts] + in_flight * (act[ends] - act[starts])) / self.tp
        t_f = fwd[ends] - fwd[starts]
        work = t_f + bwd[ends] - bwd[starts]
        before = fwd[starts] + bwd[starts]
        after = fwd[layers] + bwd[layers] - fwd[ends] - bwd[ends]
        term = before + m * work + np.maximum(0.0, after - (in_flight - 1) * t_f)
        term = np.where(possible & (peak <= self.capacity), term, math.inf)
        completion = np.full((stages + 1, remainder + 1), math.inf)
        completion[stages, remainder] = -math.inf
        for s in reversed(range(stages)):
            light = np.maximum(term[s, :, 0], completion[s + 1])
            heavy = np.maximum(term[s, :-1, 1], completion[s + 1, 1:])
            completion[s] = light
            completion[s, :-1] = np.minimum(light[:-1], heavy)
        return StageTable(base, remainder, starts, ends, term, completion)

    def _search(self, stages: int, micro_batches: int) -> tuple[float, Layers] | None:
        if not self.memo:
            # The straightforward Algorithm 1: every split checked and simulated on its own.
            feasible = [
                s for s in even_splits(self.profile.layers, stages) if self._fits(s, micro_batches)
            ]
            return min(((self._time(s, micro_batches), s) for s in feasible), default=None)
        table = self.table(stages, micro_batches)
        if table is None or math.isinf(table.bound):
            return None
        return self._branch_and_bound(table, stages, micro_batches)

    def _branch_and_bound(
        self, table: StageTable, stages: int, micro_batches: int
    ) -> tuple[float, Layers]:
        """The fastest fitting split, timing splits in batches as eq. 11 rows.

        Splits are walked depth first, the child with the smaller bound first, so a fast split
        comes early; a subtree is skipped when its bound exceeds the fastest time so far by more
        than the tie tolerance, so every split that could tie or win is timed and the least
        (time, split) is the same as over all splits. The exhaustive oracle skips nothing.
        """
        fwd, bwd, _, _ = self._prefix_arrays
        best: tuple[float, Layers] | None = None
        limit = math.inf
        batch: list[list[int]] = []
        size = 1
        timed = 0
        cap = max(1, BATCH_CELLS // (stages * micro_batches))

        def flush() -> None:
            nonlocal best, limit, size, timed
            starts, ends = table.rows(batch)
            times = pipeline_times(fwd[ends] - fwd[starts], bwd[ends] - bwd[starts], micro_batches)
            # the least (time, split): the least time, then the least split among its rows
            least = times.min()
            rows = np.flatnonzero(times == least)
            found = min(
                (float(least), tuple(zip(starts[r].tolist(), ends[r].tolist(), strict=True)))
                for r in rows
            )
            best = found if best is None else min(best, found)
            if not self.exhaustive:
                limit = best[0] * (1 + TIE_TOLERANCE)
            timed += len(batch)
            batch.clear()
            size = min(size * 8, cap)

        term, completion = table.term, table.completion
        path: list[int] = []

        def walk(s: int, k: int, high: float) -> bool:
            """Visit the splits below state (s, k); False once the budget is spent."""
            if s == stages:
                batch.append(path.copy())
                if len(batch) >= size:
                    flush()
                return True
            children = []
            for h in (0, 1):
                if k + h > table.remainder:
                    continue
                bound = max(high, term[s, k, h], completion[s + 1, k + h])
                if bound < math.inf:
                    children.append((bound, h))
            for bound, h in sorted(children):
                if bound > limit:
                    continue
                if not self.exhaustive and timed + len(batch) >= self.placement_budget:
                    return False
                path.append(h)
                finished = walk(s + 1, k + h, max(high, float(term[s, k, h])))
                path.pop()
                if not finished:
                    return False
            return True

        if not walk(0, 0, -math.inf):
            self.incomplete = True
        if batch:
            flush()
        assert best is not None  # the table's finite bound promises a fitting split
        return best

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
    # heap of the top_k, worst on top: (-time, the runs of lengths as (-length, -count), leaf)
    found: list[tuple[float, tuple[tuple[int, int], ...], Leaf]]
    nodes: int = 0
    shortest: int = 1
    stopped: bool = False
    # Once top_k shapes are in hand, only strictly faster ones can enter; ties go to the earlier.
    strict: bool = False

    @property
    def exhausted(self) -> bool:
        if not self.stopped and (self.nodes >= self.budget or time.perf_counter() > self.deadline):
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
        # Lengths whose own bound is past the threshold hold no pipeline (``_extend``), so the
        # shortest a pipeline can have is the first one that is not: the bounds that keep the
        # groups left able to fill the pipelines left then see it, where with memory-bound
        # short lengths the search would otherwise walk subtrees that can close on none.
        while self.shortest < longest and self._pruned(self.shortest):
            self.shortest += 1
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

    def _first_unpruned(self, counts: dict[int, int], length: int, low: int, high: int) -> int:
        """The greatest k in [low, high] that ``_leftover_pruned`` keeps with ``length`` × k
        (``low`` when it keeps none: k = 0 is never pruned), found by bisection.

        A greater k forces at least as many leftovers onto the same lengths, so the lengths
        checked only grow with k and pruning is monotone: the k above the answer are exactly
        those ``_extend`` would try and skip one by one (at scale, tens of thousands a node).
        ``high`` is checked first, as the linear walk would, so the oracle sees the same calls.
        """

        def pruned(k: int) -> bool:
            counts[length] = k
            try:
                return k > 0 and self._leftover_pruned(counts)
            finally:
                counts.pop(length)

        if high <= low or not pruned(high):
            return high
        keep, drop = low, high  # pruned(drop); pruned(keep) only when keep == low
        while drop - keep > 1:
            middle = (keep + drop) // 2
            if pruned(middle):
                drop = middle
            else:
                keep = middle
        return keep

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
        for k in range(self._first_unpruned(counts, length, low, high), low - 1, -1):
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
        runs = [(s, counts[s]) for s in sorted(counts, reverse=True) if counts[s]]
        # (length, micro-batches, pipelines) in list order: at scale a shape has tens of
        # thousands of pipelines and a handful of runs
        split = distribute_runs(self.micro_batches, runs)
        if split is None:
            return
        pairs = list(dict.fromkeys((length, m) for length, m, _ in split))
        # Pipelines of one length differ only by one micro-batch: score each (S, m) pair once.
        if self.oracle.memo and not self.exhaustive:
            # a pipeline's bound already past the threshold puts the shape past it: its best
            # split need not be searched (the same proven bound as ``_pruned``)
            for pair in pairs:
                if self._beyond(self.oracle.split_bound(*pair)):
                    return
        step = 0.0
        best_of: dict[tuple[int, int], tuple[float, Layers]] = {}
        # The straightforward Algorithm 1 (no memo) scores every pipeline on its own.
        scored = (
            pairs if self.oracle.memo else [(length, m) for length, m, n in split for _ in range(n)]
        )
        for length, m in scored:
            best = self.oracle.best(length, m)
            if best is None:
                return
            best_of[(length, m)] = best
            step = max(step, best[0])
        if self._beyond(step):
            return
        # Rank by time, then by the more even partition: the reverse-sorted lengths compare
        # smaller, and so do their runs as (-length, -count), every shape holding ``groups``.
        rank = (-step, tuple((-length, -count) for length, count in runs))
        if any(e[1] == rank[1] for e in self.found):
            return
        if len(self.found) >= self.top_k and rank <= self.found[0][:2]:
            return
        shape_of = {pair: PipelineShape(best[1], pair[1]) for pair, best in best_of.items()}
        # the shape's tens of thousands of pipelines are listed for the shapes kept at the end
        entry = (*rank, Leaf(tuple(split), shape_of, step))
        if len(self.found) < self.top_k:
            heapq.heappush(self.found, entry)
        else:
            heapq.heapreplace(self.found, entry)
        if len(self.found) >= self.top_k and not self.exhaustive:
            self.threshold = min(self.threshold, -self.found[0][0])
            self.strict = True


@dataclass(frozen=True, slots=True)
class Leaf:
    """A shape the search keeps, as runs of (length, micro-batches, pipelines) and the pipeline
    each (length, micro-batches) pair gets; ``shape`` lists its pipelines."""

    runs: tuple[tuple[int, int, int], ...]
    pipeline_of: dict[tuple[int, int], PipelineShape]
    time_s: float

    def shape(self) -> PlanShape:
        pipelines = tuple(
            itertools.chain.from_iterable(
                itertools.repeat(self.pipeline_of[(length, m)], n) for length, m, n in self.runs
            )
        )
        return PlanShape(pipelines, self.time_s, frozenset(self.pipeline_of.values()))


def distribute_runs(
    micro_batches: int, runs: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int]] | None:
    """``distribute_batch`` over runs of (length, pipelines), as runs of (length, micro-batches,
    pipelines) in list order; the same shares without listing every pipeline."""
    pipelines = sum(n for _, n in runs)
    if micro_batches < pipelines:
        return None
    total = sum(length * n for length, n in runs)
    share = {length: micro_batches * length // total for length, _ in runs}
    # leftovers one by one in list order: every pipeline gets ``each`` more, the first ``first``
    # one more again
    each, first = divmod(micro_batches - sum(share[length] * n for length, n in runs), pipelines)
    if any(share[length] + each == 0 for length, _ in runs):
        # empty shares are refilled one by one: the pipelines listed
        lengths = [length for length, n in runs for _ in range(n)]
        shares = distribute_batch(micro_batches, lengths)
        assert shares is not None
        return [(length, m, 1) for length, m in zip(lengths, shares, strict=True)]
    split = []
    for length, n in runs:
        more = min(first, n)
        first -= more
        for m, k in ((share[length] + each + 1, more), (share[length] + each, n - more)):
            if k:
                split.append((length, m, k))
    return split


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
    options = (symmetric_only, top_k, exhaustive, max_step_time_s, node_budget, spread)
    key: tuple[Any, ...] = (profile, cluster.device_memory_bytes, training.micro_batches)
    key += (groups, tp, tuple(dp_options), *options)
    # A time budget makes the answer depend on the clock; memo=False is timed by benchmarks.
    remembered = memo and time_budget_s is None
    if remembered and key in _MEMO.searches:
        _MEMO.searches.move_to_end(key)
        found = _MEMO.searches[key]
        return replace(found, shapes=list(found.shapes))
    if memo:
        oracle = _oracle(profile, cluster.device_memory_bytes, tp, exhaustive)
        oracle.incomplete = False
    else:
        oracle = PipelineOracle(
            profile, cluster.device_memory_bytes, tp, memo=memo, exhaustive=exhaustive
        )
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
    result = SearchResult(
        shapes=[leaf.shape() for _, _, leaf in ranked],
        complete=not state.stopped and not oracle.incomplete,
        nodes=state.nodes,
    )
    if remembered:
        _remember(_MEMO.searches, key, replace(result, shapes=list(result.shapes)), MEMO_SEARCHES)
    return result


# Shapes told apart by their longest and shortest pipelines: the split sets one such class may
# hold, enumerated at most this many (``every_shape_reaches``); beyond it the class is not told.
CLASS_SPLIT_SETS = 4_096


def every_shape_reaches(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    *,
    groups: int,
    tp: int,
    dp: int,
    step_s: float,
) -> bool | None:
    """Whether every shape ``search`` can return with ``dp`` pipelines over ``groups`` groups
    takes at least ``step_s`` a step once placed, wherever: its slowest pipeline with its sends,
    plus its gradient sync.

    Returns False where one might not, None where this cannot tell (fewer micro-batches than
    groups, a class of too many split sets, an oracle answer a budget cut short: the search
    would be incomplete too; or no pipeline long enough fits, where the search says why).

    Such a shape uses every group. With at least as many micro-batches N as groups G, a pipeline
    of S stages gets its share N·S // G or one more (the leftovers, fewer than the pipelines, go
    one each to the first ones), and its split is the oracle's for that (S, m). Its longest
    pipeline, of L ≥ ceil(G / dp) stages, comes first in Algorithm 1's list, so it takes a
    leftover once its share is not exact. Its shortest, of s ≤ G // dp stages, has a stage of
    ceil(layers / s) layers whose gradients go in rounds of their own
    (``shortest_pipeline_sync_floor_s``). So each class (L, s) of shapes is bounded by its
    longest pipeline's floor with sends (``pipeline_floor_s``) plus that sync; a class that
    bound does not rule out is bounded by each split set its shapes can have: the slowest of its
    pipelines' floors, plus its own splits' sync (``split_sync_floor_s``).
    """
    n = training.micro_batches
    if n < groups or not 1 <= dp <= groups:
        return None
    oracle = _oracle(profile, cluster.device_memory_bytes, tp, False)
    earlier, oracle.incomplete = oracle.incomplete, False
    found: dict[tuple[int, int], Pair | None] = {}
    floors = oracle.floors  # a pipeline's floor with its sends, by cluster, split and m

    def pair(length: int, m: int) -> Pair | None:
        """A pipeline of this length and micro-batches: (floor with sends, split), None where
        no split fits. Asked only as needed: a long pipeline's best split is costly cold."""
        if (length, m) not in found:
            best = oracle.best(length, m)
            if best is None:
                found[(length, m)] = None
            else:
                key = (cluster, best[1], m)
                if key not in floors:
                    floors[key] = pipeline_floor_s(profile, cluster, best[1], m, tp)
                found[(length, m)] = (floors[key], best[1])
        return found[(length, m)]

    def pipelines_of(length: int, *, longest: bool) -> tuple[list[Pair], Pair | None]:
        """The pipelines a length can have in a shape, with its share or with a leftover, and
        the one every such shape has: the leftover's, when it is the shape's longest and its
        share is not exact (its other pipelines may still run their share alone). No pipelines
        where the one every shape needs does not fit."""
        share, rest = divmod(n * length, groups)
        leftover = pair(length, share + 1)
        if longest and rest and leftover is None:
            return [], None
        both = [p for p in (pair(length, share), leftover) if p is not None]
        return both, leftover if longest and rest else None

    def least_first(length: int) -> float | None:
        """The least floor of a shape's longest pipeline of this length; None if none fits."""
        share, rest = divmod(n * length, groups)
        # it takes a leftover when its share is not exact: only then is its share's split unasked
        shares = (share + 1,) if rest else (share, share + 1)
        fitting = [p[0] for m in shares if (p := pair(length, m)) is not None]
        return min(fitting) if fitting else None

    fits = False  # some longest pipeline fits: without one there is no shape to bound
    try:
        for longest in range(-(-groups // dp), min(profile.layers, groups - dp + 1) + 1):
            least = least_first(longest)
            if least is None:
                continue  # no pipeline of this length fits: no such shape
            fits = True
            # shorter shortest pipelines have wider stages, whose sync takes no less: once one
            # class is ruled out so is every class below it
            for shortest in range(min(longest, groups // dp), 0, -1):
                sync = shortest_pipeline_sync_floor_s(
                    profile, cluster, stages=shortest, dp=dp, tp=tp
                )
                if least + sync >= step_s:
                    break
                if not _class_possible(groups, dp, longest, shortest):
                    continue
                choices = [
                    pipelines_of(length, longest=length == longest)
                    for length in range(longest, shortest - 1, -1)
                ]
                bound = _class_floor(profile, cluster, tp, dp, choices)
                if bound is None:
                    return None
                if bound < step_s:
                    return None if oracle.incomplete else False
        return None if oracle.incomplete or not fits else True
    finally:
        oracle.incomplete = oracle.incomplete or earlier


# A pipeline's floor with its sends, and its layer split.
Pair = tuple[float, Layers]


def _class_possible(groups: int, dp: int, longest: int, shortest: int) -> bool:
    """Whether ``dp`` pipelines of ``shortest`` to ``longest`` stages, one of each, can hold
    exactly ``groups`` groups."""
    if dp == 1:
        return longest == shortest == groups
    if longest == shortest:
        return dp * longest == groups
    rest = groups - longest - shortest
    return (dp - 2) * shortest <= rest <= (dp - 2) * longest


def _class_floor(
    profile: ModelProfile,
    cluster: Cluster,
    tp: int,
    dp: int,
    choices: list[tuple[list[Pair], Pair | None]],
) -> float | None:
    """The least bound over the split sets a class of shapes can have (``every_shape_reaches``):
    ``choices`` holds the pipelines each length can have and the one it must (``pipelines_of``),
    longest first, shortest last; those two lengths are in every shape of the class, the others
    may be absent. None when the split sets are too many to enumerate."""
    # per length, what its pipelines can add: their splits, with the least floor among the
    # pipelines that add those splits (the slowest of them is at least that slow)
    added = []
    for index, (found, required) in enumerate(choices):
        least_by_splits: dict[frozenset[Layers], float] = {}
        for r in range(1, len(found) + 1):
            for chosen in combinations(found, r):
                if required is not None and required not in chosen:
                    continue
                splits = frozenset(split for _, split in chosen)
                floor = max(f for f, _ in chosen)
                least_by_splits[splits] = min(floor, least_by_splits.get(splits, math.inf))
        if 0 < index < len(choices) - 1:
            least_by_splits[frozenset()] = 0.0
        if not least_by_splits:
            return math.inf  # a length every shape of the class needs has no pipeline that fits
        added.append(tuple(least_by_splits.items()))
    if math.prod(len(a) for a in added) > CLASS_SPLIT_SETS:
        return None
    key = (profile, cluster, tp, dp, tuple(added))
    if key in _MEMO.classes:
        _MEMO.classes.move_to_end(key)
        return _MEMO.classes[key]
    least = math.inf
    for combo in itertools.product(*added):
        splits = frozenset[Layers]().union(*(s for s, _ in combo))
        floor = max(f for _, f in combo)
        least = min(least, floor + split_sync_floor_s(profile, cluster, splits, dp=dp, tp=tp))
    _remember(_MEMO.classes, key, least, MEMO_CLASSES)
    return least


# A simulated job or a worker's planner asks the same searches again and again: a failure
# rarely changes the number of groups by more than a few, and a pipeline shape (S, m) recurs
# across searches. Each thread remembers its last searches and the oracles of its last profiles;
# the answers are the same as computed afresh (the searches are deterministic without a time
# budget), only sooner.
MEMO_SEARCHES = 256
MEMO_ORACLES = 4
MEMO_CLASSES = 1_024


class _Memo(threading.local):
    def __init__(self) -> None:
        self.searches: OrderedDict[tuple[Any, ...], SearchResult] = OrderedDict()
        self.oracles: OrderedDict[tuple[Any, ...], PipelineOracle] = OrderedDict()
        self.classes: OrderedDict[tuple[Any, ...], float] = OrderedDict()


_MEMO = _Memo()


def forget() -> None:
    """Drop this thread's remembered searches and oracles (for benchmarks that time a cold one)."""
    _MEMO.searches.clear()
    _MEMO.oracles.clear()
    _MEMO.classes.clear()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def _oracle(profile: ModelProfile, capacity: float, tp: int, exhaustive: bool) -> PipelineOracle:
    key = (profile, capacity, tp, exhaustive)
    oracle = _MEMO.oracles.get(key)
    if oracle is None:
        oracle = PipelineOracle(profile, capacity, tp, exhaustive=exhaustive)
        _remember(_MEMO.oracles, key, oracle, MEMO_ORACLES)
    else:
        _MEMO.oracles.move_to_end(key)
    return oracle


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
        raise InfeasiblePlan("no healthy device group left", decline=Code.NO_DEVICE_GROUP)
    return sorted({min(max(d, 1), groups) for d in (old_dp - 1, old_dp, old_dp + 1)})
