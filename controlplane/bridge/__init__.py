"""The one Django-side door to the recovery core's internals (an import-linter contract).

``vocabulary`` re-exports the core's stable words (failure kinds, candidate codes, options,
timeline causes, policy names) for model choices and API schemas; ``rows`` turns database rows
into core objects and back (a job into a ``ClusterState``, a ``Decision`` into its JSON);
``collector_paused`` is the core's pause of Python's garbage collector, for the tasks that plan.
"""

from controlplane.recovery.collector import paused as collector_paused

__all__ = ["collector_paused"]
