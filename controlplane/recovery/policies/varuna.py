"""Varuna as Oobleck compares it: checkpoint, restart and re-plan the best PP × DP grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.codes import Code
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    ModelProfile,
    TransitionCost,
    bytes_per_s,
)
from controlplane.recovery.planner import realize, search, usable_groups
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score, unchanged
from controlplane.recovery.policies.checkpoint import rollback_steps
from controlplane.recovery.policies.replacement import broken_stages


def checkpoint_bytes(profile: ModelProfile) -> float:
    """One copy of the model's parameters and optimizer state (m_p + m_o of every layer)."""
    return profile.state_bytes(0, profile.layers)


def checkpoint_write_s(
    profile: ModelProfile, assumptions: Assumptions, measured_s: float | None = None
) -> float:
    """Seconds one blocking checkpoint stalls training (artifact: 11-120 s by model): the
    measured time when given, else the checkpoint's bytes over the storage bandwidth."""
    if measured_s is not None:
        return measured_s
    return checkpoint_bytes(profile) / bytes_per_s(assumptions.storage_gbps)


def checkpoint_overhead(step_time_s: float, checkpoint_s: float, interval_steps: int) -> float:
    """Oobleck §7.1 and its artifact's simulator: share of failure-free wall time spent
    checkpointing, c / (k·t_step + c).

    Not part of a candidate's step time; the simulator charges it while Varuna runs.
    """
    busy = interval_steps * step_time_s + checkpoint_s
    return checkpoint_s / busy if busy > 0 else 0.0


def restart_s(profile: ModelProfile, assumptions: Assumptions, init_s: float) -> float:
    """Oobleck's artifact simulator: init_s + checkpoint bytes / storage bandwidth (the load cannot
    overlap)."""
    load = assumptions.checkpoint_load_s
    if load is None:
        load = checkpoint_bytes(profile) / bytes_per_s(assumptions.storage_gbps)
    return init_s + load


@dataclass(frozen=True)
class VarunaPolicy(SteadyCosts):
    """Varuna: stop on any failure, reload the last checkpoint on the best grid of survivors.

    As Oobleck compares it (Oobleck §7.1): a synchronous checkpoint every
    ``checkpoint_interval_steps`` iterations, each blocking for ``checkpoint_s`` (None: its bytes
    over the storage bandwidth; the artifact measures 11-120 s), and a restart pause of
    ``init_s`` before the checkpoint load (the artifact's r − c for BERT-Large, 71.3 − 15.8 s).
    """

    checkpoint_interval_steps: int = 10
    init_s: float = 55.5
    checkpoint_s: float | None = None
    name: ClassVar[str] = "varuna"

    def busy_share(self, state: ClusterState, step_s: float) -> float:
        """A blocking checkpoint every k steps: c / (k·t_step + c) of the running time."""
        write_s = checkpoint_write_s(state.profile, state.assumptions, self.checkpoint_s)
        return checkpoint_overhead(step_s, write_s, self.checkpoint_interval_steps)

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [self._candidate(state)]

    def _candidate(self, state: ClusterState) -> Candidate:
        if not broken_stages(state):
            return unchanged(self.name, state)
        # job morphing restarts on whatever healthy devices there are, spares included
        groups = usable_groups(state, include_spares=True)
        micro_batches = state.training.micro_batches
        # every data-parallel replica takes the same share of the global batch
        widths = [d for d in range(1, len(groups) + 1) if micro_batches % d == 0]
        found = search(
            state.profile,
            state.cluster,
            state.training,
            groups=len(groups),
            tp=state.plan.tp,
            dp_options=widths,
            symmetric_only=True,
            top_k=1,
        )
        if not found.shapes:
            return Candidate.declined(
                self.name,
                Code.NO_FITTING_PLAN,
                f"no PP × DP grid of the {len(groups)} surviving device groups "
                f"fits memory and {micro_batches} micro-batches",
            )
        # the new grid loads the checkpoint, so where its groups sit moves no weights
        plan, _ = realize(state, found.shapes[0], groups)
        assumptions = state.assumptions
        old_step = estimate_step_time(state.profile, state.cluster, state.plan)
        transition = TransitionCost(
            detection_s=assumptions.detection_s,
            search_s=assumptions.search_s,
            restart_s=restart_s(state.profile, assumptions, self.init_s),
            lost_work_s=interrupted_work_s(state)
            + rollback_steps(self.checkpoint_interval_steps) * old_step,
        )
        return score(self.name, state, plan, transition)


__all__ = [
    "VarunaPolicy",
    "checkpoint_bytes",
    "checkpoint_overhead",
    "checkpoint_write_s",
    "restart_s",
]
