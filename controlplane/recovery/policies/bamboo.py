"""Bamboo (NSDI '23) as Oobleck compares it: redundant computation, the predecessor takes over.

After a loss the predecessor runs the lost stage at once (backward RC), then Bamboo pauses to
reconfigure: the artifact simulator charges a rebalance pause right after the takeover, and
after it the pipeline runs rebalanced. The candidate's plan is that rebalanced pipeline (the
surviving stages of each hit pipeline with an even split of its layers, the fastest by the
estimator that fits memory) and its transition charges the pause; the unbalanced takeover only
lasts through the pause, so it never sets the step time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from controlplane.recovery.codes import Code
from controlplane.recovery.estimator import estimate_step_time, peak_memory
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    ModelProfile,
    Pipeline,
    Stage,
    TransitionCost,
)
from controlplane.recovery.planner import even_splits
from controlplane.recovery.policies.base import SteadyCosts, score


def successor(stage: int, stages: int) -> int:
    """The stage whose state and forward pass ``stage`` shadows: the next one, in a ring.

    The last stage shadows the first, as in the artifact simulator's search for the
    predecessor of stage 0 (Bamboo as Oobleck §7.1 describes it).
    """
    return (stage + 1) % stages


def redundancy_step_factor(profile: ModelProfile, plan: ExecutionPlan) -> float:
    """Bamboo's step-time factor without failures: every stage also runs its successor's forward.

    Pitstop's model of forward RC (Oobleck §7.1): the slowest stage takes (F_s + B_s +
    F_{s+1})/(F_s + B_s) as
    long, 4/3 with B = 2F. Here the new bottleneck max_s(F_s + B_s + F_{s+1}) over the old one
    max_s(F_s + B_s), worst pipeline; a one-stage pipeline has no one to shadow. Candidates of
    this policy include it; the simulator multiplies a failure-free Bamboo step by it.
    """
    factor = 1.0
    for pipeline in plan.pipelines:
        stages = pipeline.depth
        if stages < 2:
            continue
        fwd = [profile.fwd(*s.layers) for s in pipeline.stages]
        work = [f + profile.bwd(*s.layers) for f, s in zip(fwd, pipeline.stages, strict=True)]
        slowest = max(work)
        if slowest > 0:
            shadowed = max(work[s] + fwd[successor(s, stages)] for s in range(stages))
            factor = max(factor, shadowed / slowest)
    return factor


def shadow_memory(profile: ModelProfile, plan: ExecutionPlan) -> dict[int, float]:
    """Peak bytes per device: eq. 14 plus the successor stage's m_p + m_o + m_g (no activation
    checkpointing, Oobleck §7.1).

    Bamboo keeps no activation checkpoints, which eq. 14's full activations already assume.
    """
    peaks = peak_memory(profile, plan)
    tp = plan.tp
    for pipeline in plan.pipelines:
        stages = pipeline.depth
        if stages < 2:
            continue
        for s, stage in enumerate(pipeline.stages):
            if stage.rerouted:
                continue
            shadow = pipeline.stages[successor(s, stages)].layers
            for device in stage.devices:
                peaks[device] += profile.static_bytes(*shadow) / tp
    return peaks


def _over_memory(state: ClusterState, plan: ExecutionPlan, peaks: dict[int, float]) -> str | None:
    """Which stage and its shadow exceed device memory; None when every stage fits."""
    capacity = state.cluster.device_memory_bytes
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            peak = max(peaks.get(d, 0.0) for d in stage.devices)
            if peak > capacity:
                return (
                    f"stages {s},{successor(s, pipeline.depth)} of pipeline {p} "
                    f"exceed device memory ({peak:.3g} > {capacity:.3g} bytes)"
                )
    return None


def take_over(plan: ExecutionPlan, lost: set[tuple[int, int]]) -> tuple[ExecutionPlan, list[int]]:
    """The plan after each lost stage's predecessor runs it (backward RC, Oobleck §7.1).

    A lost stage s > 0 joins its predecessor's group, which holds its state. Stage 0's shadow is
    the last stage, but a stage is one contiguous layer range, so stage 1's group runs it after
    a copy from the shadow; the returned list names the pipelines that copy. Callers rule out
    adjacent losses first.
    """
    pipelines = []
    copies: list[int] = []
    for p, pipeline in enumerate(plan.pipelines):
        stages: list[Stage] = []
        pending_first: int | None = None
        for s, stage in enumerate(pipeline.stages):
            if (p, s) not in lost:
                first = stage.layers[0] if pending_first is None else pending_first
                stages.append(Stage(devices=stage.devices, layers=(first, stage.layers[1])))
                pending_first = None
            elif s == 0:
                pending_first = 0
                if pipeline.depth > 2:
                    copies.append(p)
            else:
                before = stages[-1]
                stages[-1] = Stage(
                    devices=before.devices, layers=(before.layers[0], stage.layers[1])
                )
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=pipeline.micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines), family=plan.family), copies


def rebalance(state: ClusterState, plan: ExecutionPlan, pipelines: set[int]) -> ExecutionPlan:
    """``plan`` with each of ``pipelines`` re-split over the stages it kept, after a takeover.

    The options are the pipeline's takeover layout and every even split of the model's layers
    over its stages (the planner's ``even_splits``: base layers each, the remainder on any
    stages); the one kept is the fastest as Bamboo runs it (the estimator's step times the
    redundancy factor) with its shadow state within device memory, the takeover layout on ties.
    A pipeline that lost no stage is left alone.
    """
    capacity = state.cluster.device_memory_bytes
    rebuilt = list(plan.pipelines)
    for p in sorted(pipelines):
        pipeline = plan.pipelines[p]
        options = [pipeline] + [
            replace(
                pipeline,
                stages=tuple(
                    Stage(devices=stage.devices, layers=layers)
                    for stage, layers in zip(pipeline.stages, split, strict=True)
                ),
            )
            for split in even_splits(state.profile.layers, pipeline.depth)
        ]
        best: tuple[float, Pipeline] | None = None
        for option in options:
            alone = ExecutionPlan(pipelines=(option,), family=plan.family)
            if max(shadow_memory(state.profile, alone).values()) > capacity:
                continue
            step = estimate_step_time(state.profile, state.cluster, alone)
            step *= redundancy_step_factor(state.profile, alone)
            if best is None or step < best[0]:
                best = (step, option)
        if best is not None:
            rebuilt[p] = best[1]
    return replace(plan, pipelines=tuple(rebuilt))


def _shadow_copy_s(state: ClusterState, copies: list[int]) -> float:
    """Seconds to move stage 0's state from its shadow (the last stage) to stage 1's group."""
    slowest = 0.0
    for p in copies:
        stages = state.plan.pipelines[p].stages
        sender, receiver = stages[-1].devices, stages[1].devices
        shard = state.profile.state_bytes(*stages[0].layers) / len(receiver)
        for a, b in zip(sender, receiver, strict=True):
            slowest = max(slowest, shard / state.cluster.bandwidth_bytes_per_s(a, b))
    return slowest


@dataclass(frozen=True)
class BambooPolicy(SteadyCosts):
    """Bamboo: shadow every stage on its predecessor, take over on failure, restart on two.

    As Oobleck's artifact simulates it: the step hit by a failure runs ``fallback_slowdown``
    times slower, then a rebalance pause of ``rebalance_s`` follows (76 s for BERT-Large in the
    artifact, 80-450 s for the other models).
    """

    fallback_slowdown: float = 1.5
    rebalance_s: float = 76.0
    name: ClassVar[str] = "bamboo"

    def step_factor(self, state: ClusterState) -> float:
        """Every stage also runs its successor's forward pass, failures or not."""
        return redundancy_step_factor(state.profile, state.plan)

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [self._candidate(state)]

    def _candidate(self, state: ClusterState) -> Candidate:
        plan = state.plan
        lost = {
            (p, s)
            for p, s, stage in plan.stages()
            if stage.rerouted or not state.failed.isdisjoint(stage.devices)
        }
        for p, pipeline in enumerate(plan.pipelines):
            hit = sorted(s for q, s in lost if q == p)
            if hit and pipeline.depth == 1:
                return Candidate.declined(
                    self.name,
                    Code.ADJACENT_STAGES_LOST,
                    f"stage 0 of pipeline {p} lost and a one-stage pipeline "
                    "has no shadow; restart from checkpoint",
                )
            for s in hit:
                nxt = successor(s, pipeline.depth)
                if nxt in hit:
                    return Candidate.declined(
                        self.name,
                        Code.ADJACENT_STAGES_LOST,
                        f"stages {s},{nxt} of pipeline {p} lost; restart from checkpoint",
                    )
        if lost:
            taken_over, copies = take_over(plan, lost)
            new_plan = rebalance(state, taken_over, {p for p, _ in lost})
            assumptions = state.assumptions
            old_step = estimate_step_time(state.profile, state.cluster, plan)
            transition = TransitionCost(
                detection_s=assumptions.detection_s,
                weight_transfer_s=_shadow_copy_s(state, copies),
                # artifact simulator: a rebalance pause follows the takeover at once; it also
                # covers moving the layers whose stage changed in the rebalanced split
                restart_s=self.rebalance_s,
                # the step hit by the failure runs 1.5x slower instead of being lost
                lost_work_s=(self.fallback_slowdown - 1) * old_step,
            )
        else:
            # the fault hit no stage of the plan: training never stopped
            new_plan, transition = plan, TransitionCost()
        peaks = shadow_memory(state.profile, new_plan)
        over = _over_memory(state, new_plan, peaks)
        if over is not None:
            return Candidate.declined(self.name, Code.OUT_OF_MEMORY, over)
        candidate = score(
            self.name,
            state,
            new_plan,
            transition,
            step_time_factor=redundancy_step_factor(state.profile, new_plan),
        )
        if not candidate.feasible:
            return candidate
        return replace(candidate, peak_memory_bytes=peaks)


__all__ = [
    "BambooPolicy",
    "rebalance",
    "redundancy_step_factor",
    "shadow_memory",
    "successor",
    "take_over",
]
