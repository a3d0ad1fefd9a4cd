"""Checkpoint-and-restart: the same plan on spare groups, every device reloading the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    ModelProfile,
    TransitionCost,
    bytes_per_s,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score, unchanged
from controlplane.recovery.policies.replacement import broken_stages, replace_stages


@dataclass(frozen=True)
class FullRestart:
    """Seconds to recreate every container and rebuild the communication group of N devices.

    FlashRecovery §3, §4 Table II, §6 baseline: the group is rebuilt serially and every container
    starts at once, so the restart grows with N: max(60, 0.244·N − 198) s (a least-squares fit
    over 1.8k-5.5k devices; the 60 s floor is ours).
    """

    s_per_device: float = 0.244
    offset_s: float = -198.0
    min_s: float = 60.0

    def seconds(self, devices: int) -> float:
        return max(self.min_s, self.s_per_device * devices + self.offset_s)


def checkpoint_load_s(
    profile: ModelProfile, plan: ExecutionPlan, assumptions: Assumptions
) -> float:
    """Seconds until the slowest device has read its stage's share of the checkpoint.

    Every device reads its own shard (weights + optimizer state, m_p + m_o) at the storage
    bandwidth in parallel; ``checkpoint_load_s`` overrides the estimate when measured.
    """
    if assumptions.checkpoint_load_s is not None:
        return assumptions.checkpoint_load_s
    tp = plan.tp
    largest = max(profile.state_bytes(*stage.layers) / tp for _, _, stage in plan.stages())
    return largest / bytes_per_s(assumptions.storage_gbps)


def rollback_steps(interval_steps: int) -> float:
    """Completed steps thrown away on top of the interrupted one, on average.

    With faults uniform over a checkpoint interval of n steps, 0..n−1 completed steps are lost,
    (n − 1)/2 on average; with the interrupted step that every policy pays, (n + 1)/2 in all
    (FlashRecovery §1, §6: "redo t_ckpt/2").
    """
    return max(interval_steps - 1, 0) / 2


def rollback_s(state: ClusterState, step_s: float) -> float:
    """Seconds of completed steps a restart from the last checkpoint throws away.

    What ran since the checkpoint when the caller knows it (``completed_since_checkpoint_s``,
    0 for a fault during a restart whose rollback is already charged), else the expectation,
    ``rollback_steps`` steps of ``step_s``.
    """
    if state.completed_since_checkpoint_s is not None:
        return state.completed_since_checkpoint_s
    return rollback_steps(state.assumptions.checkpoint_interval_steps) * step_s


def plan_checkpoint(
    policy: str, state: ClusterState, restart: FullRestart = FullRestart()
) -> Candidate:
    """Restart the whole job on the same plan, broken groups swapped for spares."""
    broken = broken_stages(state)
    if not broken:
        return unchanged(policy, state)
    try:
        replacement = replace_stages(state, broken)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, f"{exc}; the job would wait for repair")
    assumptions = state.assumptions
    # the rolled-back steps were run on the current plan
    step_s = estimate_step_time(state.profile, state.cluster, state.plan)
    transition = TransitionCost(
        detection_s=assumptions.detection_s,
        weight_transfer_s=checkpoint_load_s(state.profile, replacement.plan, assumptions),
        restart_s=restart.seconds(len(replacement.plan.devices())),
        lost_work_s=interrupted_work_s(state) + rollback_s(state, step_s),
    )
    return score(policy, state, replacement.plan, transition)


@dataclass(frozen=True)
class CheckpointPolicy(SteadyCosts):
    """Roll back to the last checkpoint and restart the same plan on spare devices.

    The restart takes max(restart_min_s, restart_s_per_device·N + restart_offset_s) for N devices
    (``FullRestart``: FlashRecovery's measurements of a full restart).
    """

    restart_s_per_device: float = FullRestart.s_per_device
    restart_offset_s: float = FullRestart.offset_s
    restart_min_s: float = FullRestart.min_s
    name: ClassVar[str] = "checkpoint"
    rolls_back: ClassVar[bool] = True

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        restart = FullRestart(self.restart_s_per_device, self.restart_offset_s, self.restart_min_s)
        return [plan_checkpoint(self.name, state, restart)]
