"""The one Django-side door to the recovery core's internals (an import-linter contract).

``vocabulary`` re-exports the core's stable words (failure kinds, candidate codes, options,
timeline causes, policy names) for model choices and API schemas; ``rows`` turns database rows
into core objects and back (a job into a ``ClusterState``, a ``Decision`` into its JSON).
"""
