"""The policy interface and the scoring every policy shares: estimates, OOM filter, objective."""

from __future__ import annotations

from typing import ClassVar, Protocol

from controlplane.recovery import replicas
from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.estimator.memory import device_peaks, devices_above, highest_peak
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    TransitionCost,
)
from controlplane.recovery.objective import expected_time_to_failure_s, objective


class Policy(Protocol):
    """A recovery policy: proposes candidates for a failure, or explains why it cannot."""

    @property
    def name(self) -> str:
        """The registry name (read-only, so a class attribute satisfies it too)."""
        ...

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        """Candidates for recovering ``state`` (whose ``failed`` already includes ``failure``)."""
        ...

    @property
    def grows(self) -> bool:
        """Whether ``grow`` may offer anything (a caller asks only when one of its policies
        does)."""
        ...

    def grow(self, state: ClusterState) -> list[Candidate]:
        """Candidates that give a running job devices back (``decision.grow``): none, unless
        the policy can use the spares a node that came back brings."""
        ...

    @property
    def rolls_back(self) -> bool:
        """Whether a recovery returns to the last checkpoint, throwing away the steps since it
        (the simulator then charges what its clock says ran since, not the expectation)."""
        ...

    def step_factor(self, state: ClusterState) -> float:
        """Factor on the plain step of ``state.plan`` that the policy's layout always pays."""
        ...

    def busy_share(self, state: ClusterState, step_s: float) -> float:
        """Share of running time spent on something other than steps (blocking checkpoints)."""
        ...

    def convergence_factor(self, state: ClusterState) -> float:
        """Factor on the steps needed to converge: each step yields fewer useful samples."""
        ...


class SteadyCosts:
    """Standing costs a policy pays whether or not anything fails: none, unless it says so.

    Policies inherit this and override what they pay (Bamboo's redundant forward pass, Varuna's
    blocking checkpoints, CheckFree+'s swap schedule). Candidates' step times already include
    ``step_factor``; the simulator charges the other two while the policy runs.
    """

    rolls_back: ClassVar[bool] = False
    grows: ClassVar[bool] = False

    def grow(self, state: ClusterState) -> list[Candidate]:
        return []

    def step_factor(self, state: ClusterState) -> float:
        return 1.0

    def busy_share(self, state: ClusterState, step_s: float) -> float:
        return 0.0

    def convergence_factor(self, state: ClusterState) -> float:
        return 1.0


def score(
    policy: str,
    state: ClusterState,
    plan: ExecutionPlan,
    transition: TransitionCost,
    *,
    step_time_factor: float = 1.0,
    extra_memory_bytes: float = 0.0,
) -> Candidate:
    """Estimate a plan and wrap it as a candidate: infeasible if it is over memory or broken.

    ``step_time_factor`` and ``extra_memory_bytes`` let a policy charge costs its layout implies
    beyond the plain plan (Bamboo's redundant forward pass, its shadow stage's state).
    """
    try:
        step_time = estimate_step_time(state.profile, state.cluster, plan) * step_time_factor
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))
    peaks = device_peaks(state.profile, state.cluster, plan)
    if extra_memory_bytes:
        peaks = {d: b + extra_memory_bytes for d, b in peaks.items()}
    capacity = state.cluster.device_memory_bytes
    over = devices_above(peaks, capacity)
    if over:
        return Candidate(
            policy=policy,
            code=Code.OUT_OF_MEMORY,
            note=f"out of memory on devices {sorted(over)[:8]}: peak {highest_peak(peaks):.3g} "
            f"bytes > capacity {capacity:.3g}",
            plan=plan,
            est_step_time_s=step_time,
            transition=transition,
            peak_memory_bytes=peaks,
        )
    # t_state: the job is interrupted by a fault of any device its plan runs on
    t_state = expected_time_to_failure_s(
        state.cluster.failure_rate_per_device_hour, replicas.device_count(plan, state.cluster)
    )
    return Candidate(
        policy=policy,
        plan=plan,
        est_step_time_s=step_time,
        transition=transition,
        peak_memory_bytes=peaks,
        objective=objective(
            global_batch=state.training.global_batch,
            step_time_s=step_time,
            transition_s=transition.total_s,
            t_state_s=t_state,
        ),
    )


def unchanged(policy: str, state: ClusterState, *, extra_memory_bytes: float = 0.0) -> Candidate:
    """The current plan at no cost: the fault hit no device the plan uses, so training never
    stopped (a spare or an idle device failed)."""
    return score(policy, state, state.plan, TransitionCost(), extra_memory_bytes=extra_memory_bytes)


def interrupted_work_s(state: ClusterState) -> float:
    """Work lost to a fault under every policy: the interrupted step, redone after recovery.

    The part of the step done when the fault came is lost (``state.interrupted_step_s``, none
    when no step was running); without a clock to tell, the whole step, the worst case. The time
    the fault went unnoticed is charged apart, as ``TransitionCost.detection_s``.
    """
    lost = state.interrupted_step_s
    if lost is None:
        lost = estimate_step_time(state.profile, state.cluster, state.plan)
    return lost
