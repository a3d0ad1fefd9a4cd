"""The ideal: what a job could train on a trace if every recovery were free and instant.

At every failure and every repair the fastest plan the healthy devices (spares included) allow
is in place at once: no detection, no planning, no transfer, no restart, no lost work, no steady
overhead. Its samples bound what any policy trains on the same trace, so a policy's share of
them says how much of the reachable work it kept. The ideal is a reference the simulator runs
beside the policies, not a policy a job could pick: no real recovery is free.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from controlplane.recovery.causes import Cause
from controlplane.recovery.codes import Code
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.estimator.time import gradient_sync_floor_s
from controlplane.recovery.model import (
    Candidate,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    ModelProfile,
    Training,
    TransitionCost,
)
from controlplane.recovery.planner import PlanShape, realize, search, usable_groups
from controlplane.recovery.policies.base import score
from controlplane.recovery.policies.flashrecovery import plan_flashrecovery
from controlplane.recovery.policies.rerouting import plan_rerouting
from controlplane.recovery.simulator.engine import FAIL, Progress, trace_events
from controlplane.recovery.simulator.timeline import Recovery, Run, Segment
from controlplane.recovery.simulator.traces import Trace

IDEAL = "ideal"


# Shapes placed and estimated beyond the fastest by compute time, at most: with communication
# the fastest estimate may be another shape, and each placement costs O(groups).
WINDOW_TOP_K = 256


def fastest_replan(state: ClusterState) -> Candidate | None:
    """The fastest plan the planner finds over every healthy group, spares included.

    Unlike a policy's re-plan, every data-parallel width is searched (Varuna's job morphing
    searches them all, Odyssey's Algorithm 1 only the old width ± 1), and the transfer the
    placement implies costs nothing. A shape's step is at least its compute time plus a floor on
    its gradient sync, so only shapes whose floor beats the best estimate so far are placed.
    """
    groups = usable_groups(state, include_spares=True)
    if not groups:
        return None

    def fastest(top_k: int, max_step_time_s: float = math.inf) -> tuple[PlanShape, ...]:
        return _shapes(
            state.profile,
            state.cluster,
            state.training,
            len(groups),
            state.plan.tp,
            top_k,
            max_step_time_s,
        )

    first = fastest(1)
    if not first:
        return None
    best = _place(state, first[0], groups)
    if not best.feasible:
        return None
    floors: dict[int, float] = {}  # gradient sync floor by data-parallel width
    for shape in fastest(WINDOW_TOP_K, best.est_step_time_s):  # fastest compute first
        if shape.compute_time_s >= best.est_step_time_s:
            break
        dp = len(shape.pipelines)
        if dp not in floors:
            floors[dp] = gradient_sync_floor_s(
                state.profile, state.cluster, groups=len(groups), dp=dp, tp=state.plan.tp
            )
        if shape.compute_time_s + floors[dp] >= best.est_step_time_s:
            continue
        candidate = _place(state, shape, groups)
        if candidate.feasible and candidate.est_step_time_s < best.est_step_time_s:
            best = candidate
    return best


@lru_cache(maxsize=4096)
def _shapes(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    groups: int,
    tp: int,
    top_k: int,
    max_step_time_s: float,
) -> tuple[PlanShape, ...]:
    """The planner's fastest shapes over ``groups`` groups at every data-parallel width.

    Shapes name no device, so the runs of an experiment, which lose groups one by one on
    every seed, ask for the same searches again and again: they are kept.
    """
    found = search(
        profile,
        cluster,
        training,
        groups=groups,
        tp=tp,
        dp_options=range(1, groups + 1),
        top_k=top_k,
        max_step_time_s=max_step_time_s,
    )
    return tuple(found.shapes)


def _place(state: ClusterState, shape: PlanShape, groups: list[tuple[int, ...]]) -> Candidate:
    plan, _ = realize(state, shape, groups)
    return score(IDEAL, state, plan, TransitionCost())


def fastest_plan(state: ClusterState, start: ExecutionPlan) -> Candidate | None:
    """The fastest feasible plan on ``state``'s healthy devices, or None when there is none.

    The options are the ways the policies reach a plan: rerouting around the failed devices
    (of the plan in place, and of the starting plan, which the rerouting policy keeps for the
    whole run), swapping failed groups for spares (trusting every replica, whatever the fault),
    and a re-plan over every healthy group, spares included. The other policies' plans
    (Oobleck's templates, CheckFree's merged stages, a checkpoint restart's re-plan) are not
    options of their own: the tests check that no registered policy trains more than the ideal
    on random small jobs and traces.
    """
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    options = [
        plan_rerouting(IDEAL, state),
        plan_rerouting(IDEAL, state.with_plan(start)),
        plan_flashrecovery(IDEAL, state, failure),
        fastest_replan(state),
    ]
    feasible = [c for c in options if c is not None and c.feasible]
    return min(feasible, key=lambda c: c.est_step_time_s, default=None)


def ideal_run(
    state: ClusterState,
    trace: Trace,
    horizon_s: float,
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> Run:
    """The ideal from the scenario's plan, every device healthy, through ``trace``.

    Running segments carry the plan's step; when no plan is feasible the job waits (cause
    ``infeasible``) until a repair makes one feasible, as every policy must. Each change of plan
    is a recovery with no transition.
    """
    start = state.plan
    state = replace(state, failed=frozenset())
    step_s = estimate_step_time(state.profile, state.cluster, start)
    since = 0.0
    segments: list[Segment] = []
    recoveries: list[Recovery] = []
    for time_s, what, _, failure in trace_events(trace):
        if time_s >= horizon_s:
            break
        if what == FAIL:
            state = replace(state, failed=state.failed.union(failure.devices))
        else:
            state = replace(state, failed=state.failed.difference(failure.devices))
        if progress is not None:
            progress(time_s)
        # a plan no fault touched stays in place unless a faster one is found
        intact = math.isfinite(step_s) and not state.failed & state.plan.devices()
        best = fastest_plan(state, start)
        if best is None or best.plan is None:
            if intact or math.isinf(step_s):
                continue  # running on, or still waiting for a repair
            plan, new_step_s = state.plan, math.inf
        elif intact and best.est_step_time_s >= step_s:
            continue
        else:
            plan, new_step_s = best.plan, best.est_step_time_s
        if time_s > since:
            segments.append(_segment(since, time_s, step_s))
        since = time_s
        recoveries.append(
            Recovery(
                at_s=time_s,
                devices=tuple(sorted(failure.devices)),
                kind=failure.kind.value,
                feasible=math.isfinite(new_step_s),
                code=Code.NO_FITTING_PLAN if math.isinf(new_step_s) else Code.OK,
                note="no plan fits the healthy devices"
                if math.isinf(new_step_s)
                else "the fastest plan on the healthy devices",
                family=plan.family.value if math.isfinite(new_step_s) else None,
                step_before_s=step_s,
                step_after_s=new_step_s,
                plan_devices=len(plan.devices()),
                after_wait=math.isinf(step_s),
            )
        )
        state, step_s = state.with_plan(plan), new_step_s
    if horizon_s > since:
        segments.append(_segment(since, horizon_s, step_s))
    if progress is not None:
        progress(horizon_s)
    return Run(
        policy=IDEAL,
        seed=seed,
        horizon_s=horizon_s,
        global_batch=state.training.global_batch,
        segments=tuple(segments),
        recoveries=tuple(recoveries),
    )


def _segment(start_s: float, end_s: float, step_s: float) -> Segment:
    if math.isinf(step_s):
        return Segment(start_s, end_s, Cause.INFEASIBLE)
    return Segment(start_s, end_s, Cause.RUNNING, step_s)
