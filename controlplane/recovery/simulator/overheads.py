"""Steady costs a policy pays while it runs, as the policy itself states them (``SteadyCosts``)."""

from __future__ import annotations

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import ClusterState
from controlplane.recovery.policies.base import Policy


def starting_step_s(policy: Policy, state: ClusterState) -> float:
    """Step time of the scenario's plan under ``policy`` before any failure."""
    return estimate_step_time(state.profile, state.cluster, state.plan) * policy.step_factor(state)


def effective_step_s(policy: Policy, state: ClusterState, step_s: float) -> float:
    """Wall time per step of samples once steady overheads are paid (``state.plan`` running).

    The samples a segment yields are B·Δt / this; it equals ``step_s`` for most policies.
    """
    step_s *= policy.convergence_factor(state)
    busy = policy.busy_share(state, step_s)
    if busy == 0:
        return step_s
    return step_s / (1 - busy) if busy < 1 else float("inf")
