"""Steady costs a policy pays while it runs, read from the policy modules, not written here."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import ClusterState
from controlplane.recovery.policies.bamboo import redundancy_step_factor
from controlplane.recovery.policies.checkfree import swap_step_inflation
from controlplane.recovery.policies.varuna import checkpoint_overhead, checkpoint_write_s

# Factors on the failure-free step of the starting plan. Candidates already carry them.
_STEP_FACTOR: Mapping[str, Callable[[ClusterState], float]] = {
    # Bamboo: every stage also runs its successor's forward pass (oobleck.md §5)
    "bamboo": lambda state: redundancy_step_factor(state.profile, state.plan),
}


def _varuna_busy_share(state: ClusterState, step_s: float) -> float:
    # Varuna: a blocking checkpoint every k steps, c / (k·t_step + c) of the time (oobleck.md §5)
    write_s = checkpoint_write_s(state.profile, state.assumptions)
    interval = state.assumptions.varuna_checkpoint_interval_steps
    return checkpoint_overhead(step_s, write_s, interval)


# Shares of running time spent on something other than steps. Candidates leave them out.
_BUSY_SHARE: Mapping[str, Callable[[ClusterState, float], float]] = {
    "varuna": _varuna_busy_share,
}


# Factors on the steps needed to converge: each step yields fewer useful samples. Candidates
# leave them out.
_CONVERGENCE_FACTOR: Mapping[str, Callable[[ClusterState], float]] = {
    # CheckFree+: the swap schedule's standing inflation s (checkfree.md §6.5)
    "checkfree_plus": lambda state: swap_step_inflation(state.assumptions),
}


def starting_step_s(policy: str, state: ClusterState) -> float:
    """Step time of the scenario's plan under ``policy`` before any failure."""
    step_s = estimate_step_time(state.profile, state.cluster, state.plan)
    factor = _STEP_FACTOR.get(policy)
    return step_s * factor(state) if factor else step_s


def effective_step_s(policy: str, state: ClusterState, step_s: float) -> float:
    """Wall time per step of samples once steady overheads are paid (``state.plan`` running).

    The samples a segment yields are B·Δt / this; it equals ``step_s`` for most policies.
    """
    convergence = _CONVERGENCE_FACTOR.get(policy)
    if convergence is not None:
        step_s *= convergence(state)
    share = _BUSY_SHARE.get(policy)
    if share is None:
        return step_s
    busy = share(state, step_s)
    return step_s / (1 - busy) if busy < 1 else float("inf")
