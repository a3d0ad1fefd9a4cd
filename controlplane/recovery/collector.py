"""Python's cyclic garbage collector, paused while a large decision is made.

A decision at 16,384 devices and more makes millions of objects that live until it ends (the
plans of every candidate, their placements, the JSON a worker writes), and the collections they
set off walk every live object again and again. Measured: a worker's planning task at 2,048
nodes of 8 devices, 2.90 s with the collector running and 1.62 s paused
(``python -m benchmarks.planning_task``); the simulator's decisions at 131,072 devices after
2,186 failures, 4.6 s and 3.1 s. Nothing a decision makes depends on the collector, so the
answers are the same either way; what it leaves in cycles is collected once the collector runs
again. The collector is the process's: a decision in one thread pauses it for the others too,
which only delays their collections; it is on again when the block that found it on ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """The collector off while the block runs, on again afterwards (also when the block
    raises); a collector that was off already stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
