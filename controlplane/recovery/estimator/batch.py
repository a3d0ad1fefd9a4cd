"""Eq. 11 for many layer splits of one pipeline at once, as numpy arrays over the splits."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from controlplane.recovery.estimator.time import one_f_one_b_order

Array = npt.NDArray[np.float64]
# One 1F1B operation: (stage, is_forward, micro-batch).
Operation = tuple[int, bool, int]


@lru_cache(maxsize=1024)
def dependency_order(stages: int, micro_batches: int) -> tuple[Operation, ...]:
    """A topological order of every operation of a 1F1B pipeline.

    Which operation waits on which depends only on the shape, never on durations, so one order
    serves every split: each stage runs its 1F1B order until the next operation waits on a
    neighbour's, then the neighbours go on.
    """
    orders = [one_f_one_b_order(s, stages, micro_batches) for s in range(stages)]
    done_f = [[False] * micro_batches for _ in range(stages)]
    done_b = [[False] * micro_batches for _ in range(stages)]
    cursor = [0] * stages
    out: list[Operation] = []
    todo = list(range(stages))
    while todo:
        s = todo.pop()
        start = cursor[s]
        while cursor[s] < len(orders[s]):
            forward, m = orders[s][cursor[s]]
            if forward:
                ready = s == 0 or done_f[s - 1][m]
            else:
                ready = done_b[s + 1][m] if s < stages - 1 else done_f[s][m]
            if not ready:
                break
            (done_f if forward else done_b)[s][m] = True
            out.append((s, forward, m))
            cursor[s] += 1
        if cursor[s] > start:
            todo.extend(n for n in (s - 1, s + 1) if 0 <= n < stages)
    return tuple(out)


def pipeline_times(t_f: Array, t_b: Array, micro_batches: int) -> Array:
    """Eq. 11 step time of each row: ``t_f``, ``t_b`` have shape (splits, stages)."""
    splits, stages = t_f.shape
    if micro_batches <= 0 or stages == 0:
        return np.zeros(splits)
    f_end = np.zeros((stages, micro_batches, splits))
    b_end = np.zeros((stages, micro_batches, splits))
    clock = np.zeros((stages, splits))
    fwd = t_f.T.copy()
    bwd = t_b.T.copy()
    last = stages - 1
    for s, forward, m in dependency_order(stages, micro_batches):
        if forward:
            if s > 0:
                np.maximum(clock[s], f_end[s - 1, m], out=clock[s])
            clock[s] += fwd[s]
            f_end[s, m] = clock[s]
        else:
            ready = b_end[s + 1, m] if s < last else f_end[s, m]
            np.maximum(clock[s], ready, out=clock[s])
            clock[s] += bwd[s]
            b_end[s, m] = clock[s]
    result: Array = clock.max(axis=0)
    return result
