"""An independent brute force of the planner's problem, for the tests to compare against.

Nothing here imports the planner or the estimators: it is the problem as Odyssey states it,
solved the slow way.

* A pipeline's step (eq. 11) is the longest path through its 1F1B operations: each operation
  ends ``duration`` after both the stage's previous operation and the operation it consumes
  (forward j of the stage before; backward j of the stage after, or, on the last stage, its own
  forward j). Computed by relaxation to a fixed point, not by the estimator's sweep.
* Memory (eq. 14): stage i of S holds its layers' parameters, optimizer state and gradients,
  plus the activations of min(S − i, m) micro-batches.
* Layer splits: every even split (L // S layers per stage, the remainder on any stages).
* Plans: every partition of the groups into ``dp`` pipelines for each allowed width, the batch
  split by Algorithm 1's rule (shares by length, leftovers longest first, empty shares refilled
  from the largest), the step being the slowest pipeline's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class Layers:
    """Per-layer forward and backward seconds, static bytes (m_p + m_o + m_g) and activations."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    static: tuple[float, ...]
    act: tuple[float, ...]

    @property
    def count(self) -> int:
        return len(self.fwd)


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The non-interleaved 1F1B order of one stage: warm-up forwards, pairs, cool-down."""
    warmup = min(stages - stage - 1, micro_batches)
    ops = [("F", j) for j in range(warmup)]
    backward = 0
    for forward in range(warmup, micro_batches):
        ops += [("F", forward), ("B", backward)]
        backward += 1
    ops += [("B", j) for j in range(backward, micro_batches)]
    return ops


def step_time(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int) -> float:
    """Eq. 11: when the last operation of a 1F1B pipeline with these stage times ends.

    Longest path by relaxation: sweep every operation, setting its end to its duration after
    the later of its two predecessors' ends, until nothing changes (at most one sweep per
    operation, as in Bellman-Ford; a pipeline needs about one per stage).
    """
    stages = len(fwd)
    orders = [one_f_one_b(s, stages, micro_batches) for s in range(stages)]
    end: dict[tuple[int, str, int], float] = {}
    changed = True
    while changed:
        changed = False
        for stage, order in enumerate(orders):
            previous = 0.0
            for kind, j in order:
                if kind == "F":
                    ready = end.get((stage - 1, "F", j), 0.0) if stage > 0 else 0.0
                    duration = fwd[stage]
                else:
                    after = (stage + 1, "B", j) if stage < stages - 1 else (stage, "F", j)
                    ready = end.get(after, 0.0)
                    duration = bwd[stage]
                value = max(previous, ready) + duration
                if end.get((stage, kind, j)) != value:
                    end[(stage, kind, j)] = value
                    changed = True
                previous = value
    return max(end.values())


def even_splits(layers: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    base, remainder = divmod(layers, stages)
    if base == 0:
        return
    for heavy in combinations(range(stages), remainder):
        split, first = [], 0
        for s in range(stages):
            size = base + (s in heavy)
            split.append((first, first + size))
            first += size
        yield split


def fits(model: Layers, split: list[tuple[int, int]], micro_batches: int, capacity: float) -> bool:
    stages = len(split)
    for i, (a, b) in enumerate(split):
        in_flight = min(stages - i, micro_batches)
        if sum(model.static[a:b]) + in_flight * sum(model.act[a:b]) > capacity:
            return False
    return True


def best_pipeline(
    model: Layers, stages: int, micro_batches: int, capacity: float
) -> tuple[float, list[tuple[int, int]]] | None:
    """The fastest even split of a pipeline that fits memory, or None."""
    best: tuple[float, list[tuple[int, int]]] | None = None
    for split in even_splits(model.count, stages):
        if not fits(model, split, micro_batches, capacity):
            continue
        fwd = [sum(model.fwd[a:b]) for a, b in split]
        bwd = [sum(model.bwd[a:b]) for a, b in split]
        time = step_time(fwd, bwd, micro_batches)
        if best is None or time < best[0]:
            best = (time, split)
    return best


def batch_shares(micro_batches: int, lengths: Sequence[int]) -> list[int] | None:
    """Algorithm 1's batch split over pipelines listed longest first."""
    if micro_batches < len(lengths):
        return None
    groups = sum(lengths)
    shares = [micro_batches * s // groups for s in lengths]
    leftovers = micro_batches - sum(shares)
    for i in range(leftovers):
        shares[i % len(shares)] += 1
    while 0 in shares:
        shares[shares.index(max(shares))] -= 1
        shares[shares.index(0)] += 1
    return shares


def partitions(total: int, parts: int, largest: int) -> Iterator[list[int]]:
    """Every way to write ``total`` as ``parts`` lengths, longest first, none above largest."""
    if parts == 0:
        if total == 0:
            yield []
        return
    for first in range(min(total - parts + 1, largest), 0, -1):
        if first * parts < total:
            break
        for rest in partitions(total - first, parts - 1, first):
            yield [first, *rest]


def best_plan_time(
    model: Layers, groups: int, micro_batches: int, widths: Sequence[int], capacity: float
) -> float | None:
    """The least step time over every plan the planner may choose, or None if none fits."""
    pipelines: dict[tuple[int, int], float | None] = {}

    def pipeline(stages: int, m: int) -> float | None:
        if (stages, m) not in pipelines:
            found = best_pipeline(model, stages, m, capacity)
            pipelines[(stages, m)] = None if found is None else found[0]
        return pipelines[(stages, m)]

    best: float | None = None
    for dp in sorted({w for w in widths if 1 <= w <= groups}):
        for lengths in partitions(groups, dp, groups):
            shares = batch_shares(micro_batches, lengths)
            if shares is None:
                continue
            times = [pipeline(s, m) for s, m in zip(lengths, shares, strict=True)]
            if any(t is None for t in times):
                continue
            step = max(t for t in times if t is not None)
            if best is None or step < best:
                best = step
    return best
