"""The engine: deterministic runs, conservation of samples, the recovery semantics it promises."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
)
from controlplane.recovery.policies.bamboo import redundancy_step_factor
from controlplane.recovery.policies.varuna import checkpoint_overhead
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.experiment import Experiment, run_experiment
from controlplane.recovery.simulator.metrics import summarize
from controlplane.recovery.simulator.timeline import Cause, Run
from controlplane.recovery.simulator.traces import Trace, TraceFailure, TraceSpec, generate
from tests.recovery.builders import grid_state

HOUR = 3600.0
# 2 stages × 4 pipelines of 4 layers at 1 s + 2 s per layer: (2 + 4 − 1)·12 = 60 s per step
STEP_S = 60.0


def small_state(**changes: object) -> ClusterState:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, devices_per_node=4, **changes)  # type: ignore[arg-type]
    assert estimate_step_time(state.profile, state.cluster, state.plan) == STEP_S
    return state


def trace(*rows: tuple[float, tuple[int, ...], float | None]) -> Trace:
    return Trace(tuple(TraceFailure(t, devices, FailureKind.CRASH, r) for t, devices, r in rows))


def assert_conserved(run: Run) -> None:
    """Segments tile the horizon, and only running segments yield samples, B per step."""
    assert run.segments[0].start_s == 0
    assert run.segments[-1].end_s == pytest.approx(run.horizon_s)
    for a, b in zip(run.segments, run.segments[1:], strict=False):
        assert a.end_s == pytest.approx(b.start_s)
        assert a.end_s >= a.start_s
    running = [s for s in run.segments if s.cause is Cause.RUNNING]
    expected = sum(run.global_batch * s.duration_s / s.step_s for s in running)
    assert run.samples == pytest.approx(expected)
    for s in run.segments:
        if s.cause is not Cause.RUNNING:
            before, after = run.cumulative_samples([s.start_s, s.end_s])
            assert before == after, f"samples accrued while down ({s.cause})"
    up = sum(s.duration_s for s in running)
    assert up + run.downtime_s == pytest.approx(run.horizon_s)


@dataclass(frozen=True)
class Unbreakable:
    """A test policy that keeps its plan at no cost whatever fails."""

    name: ClassVar[str] = "unbreakable"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        step = estimate_step_time(state.profile, state.cluster, state.plan)
        return [
            Candidate(
                policy=self.name, feasible=True, plan=state.plan, est_step_time_s=step, objective=1
            )
        ]


def test_same_seed_gives_identical_summaries_and_timelines() -> None:
    state = small_state(spares=2)
    experiment = Experiment(
        hours=6,
        policies=("odyssey", "rerouting", "checkpoint", "oobleck"),
        trace=TraceSpec(failure_rate_per_device_hour=0.2, repair_hours=1.0, node_failure_prob=0.1),
        seeds=3,
    )
    first, traces = run_experiment(state, experiment)
    again, traces_again = run_experiment(state, experiment)
    assert traces == traces_again
    assert summarize(first) == summarize(again)
    assert [[r.to_dict() for r in runs] for runs in first.values()] == [
        [r.to_dict() for r in runs] for runs in again.values()
    ]
    assert sum(r.recovery_count for runs in first.values() for r in runs) > 0


POLICIES = ["odyssey", "rerouting", "dynamic", "oobleck", "checkpoint", "flashrecovery",
            "bamboo", "varuna", "checkfree"]  # fmt: skip


@given(
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([0.05, 0.3, 1.0]),
    repair=st.sampled_from([None, 0.5, 3.0]),
    spares=st.sampled_from([0, 2]),
)
@settings(max_examples=40, deadline=None)
def test_no_samples_accrue_while_the_job_is_down(
    policy: str, seed: int, rate: float, repair: float | None, spares: int
) -> None:
    state = small_state(spares=spares, assumptions=Assumptions(detection_s=5, search_s=1))
    spec = TraceSpec(failure_rate_per_device_hour=rate, repair_hours=repair)
    horizon = 4 * HOUR
    run = simulate(state, policy, generate(spec, state.cluster, horizon, seed), horizon)
    assert_conserved(run)
    for r in run.recoveries:
        if r.feasible:
            assert r.plan_devices > 0
            assert all(seconds >= 0 for _, seconds in r.transition)


def test_zero_cost_policy_trains_as_much_as_a_failure_free_job() -> None:
    state = small_state()
    spec = TraceSpec(failure_rate_per_device_hour=1.0, repair_hours=0.5)
    horizon = 5 * HOUR
    run = simulate(state, Unbreakable(), generate(spec, state.cluster, horizon, 1), horizon)
    assert run.recovery_count > 5
    assert run.downtime_s == 0
    assert run.samples == pytest.approx(state.training.global_batch * horizon / STEP_S, rel=1e-12)


def test_failure_free_run_reaches_the_bound() -> None:
    state = small_state()
    run = simulate(state, "odyssey", Trace(()), HOUR)
    assert run.segments == (run.segments[0],)
    assert run.samples == pytest.approx(16 * HOUR / STEP_S)


def test_failure_of_an_unused_device_only_leaves_the_pool() -> None:
    state = small_state(spares=2)
    run = simulate(state, "odyssey", trace((100.0, (8,), None), (200.0, (9,), 50.0)), HOUR)
    assert run.recoveries == ()
    assert run.samples == pytest.approx(16 * HOUR / STEP_S)


def test_transition_is_split_by_cause_in_order() -> None:
    assumptions = Assumptions(detection_s=3.0, search_s=1.0, restart_s=2.0)
    state = small_state(assumptions=assumptions, failure_rate=0.0001)
    run = simulate(state, "dynamic", trace((100.0, (1,), None)), HOUR)
    (recovery,) = run.recoveries
    down = [s for s in run.segments if s.cause is not Cause.RUNNING]
    assert [s.cause for s in down] == [Cause.DETECTION, Cause.PLANNING, Cause.RESTART,
                                       Cause.LOST_WORK]  # fmt: skip
    assert [s.duration_s for s in down] == pytest.approx([3.0, 1.0, 2.0, STEP_S])
    assert down[0].start_s == 100.0
    assert recovery.downtime_s == pytest.approx(6.0 + STEP_S)
    assert_conserved(run)


def test_infeasible_job_waits_for_a_repair_then_restarts() -> None:
    # checkpoint-and-restart without spares cannot recover until the device is back
    state = small_state(assumptions=Assumptions(restart_s=2.0))
    run = simulate(state, "checkpoint", trace((100.0, (1,), 1000.0)), HOUR)
    infeasible, resumed = run.recoveries
    assert not infeasible.feasible and "no_spare_device" in infeasible.reason
    assert resumed.feasible and resumed.after_wait and resumed.at_s == 1100.0
    causes = [(s.cause, s.start_s, s.end_s) for s in run.segments[:4]]
    assert causes == [
        (Cause.RUNNING, 0.0, 100.0),
        (Cause.INFEASIBLE, 100.0, 1100.0),
        (Cause.RESTART, 1100.0, 1102.0),
        (Cause.LOST_WORK, 1102.0, 1102.0 + STEP_S),
    ]
    assert run.infeasible_count == 1 and run.recovery_count == 1
    assert_conserved(run)


def test_job_never_repaired_stays_down_to_the_end() -> None:
    state = small_state()
    run = simulate(state, "checkpoint", trace((100.0, (1,), None)), HOUR)
    assert run.segments[-1].cause is Cause.INFEASIBLE
    assert run.segments[-1].end_s == HOUR
    assert run.samples == pytest.approx(16 * 100.0 / STEP_S)


def test_repaired_devices_return_for_a_later_replan() -> None:
    state = small_state()
    failures = ((100.0, (1,), 500.0), (2000.0, (2,), None))
    with_repair = simulate(state, "dynamic", trace(*failures), HOUR)
    without = simulate(state, "dynamic", trace((100.0, (1,), None), (2000.0, (2,), None)), HOUR)
    assert [r.plan_devices for r in with_repair.recoveries] == [7, 7]
    assert [r.plan_devices for r in without.recoveries] == [7, 6]


def test_failures_during_a_transition_are_handled_after_it() -> None:
    # checkpoint restarts take ≥ 60 s: the second failure lands inside the first transition
    state = small_state(spares=4)
    run = simulate(state, "checkpoint", trace((100.0, (1,), None), (101.0, (5,), None)), HOUR)
    first, second = run.recoveries
    assert first.devices == (1,) and second.devices == (5,)
    assert second.at_s == pytest.approx(100.0 + first.downtime_s)
    assert_conserved(run)


def test_simultaneous_failures_make_one_decision() -> None:
    state = small_state()
    run = simulate(state, "dynamic", trace((100.0, (1,), None), (100.0, (6,), None)), HOUR)
    (recovery,) = run.recoveries
    assert recovery.devices == (1, 6)
    assert recovery.plan_devices == 6


def test_bamboo_pays_its_redundant_forward_passes_while_running() -> None:
    state = small_state()
    factor = redundancy_step_factor(state.profile, state.plan)
    assert factor > 1
    run = simulate(state, "bamboo", Trace(()), HOUR)
    assert run.samples == pytest.approx(16 * HOUR / (STEP_S * factor))


def test_varuna_pays_its_checkpoints_while_running() -> None:
    state = small_state(assumptions=Assumptions(varuna_checkpoint_s=30.0))
    busy = checkpoint_overhead(STEP_S, 30.0, state.assumptions.varuna_checkpoint_interval_steps)
    run = simulate(state, "varuna", Trace(()), HOUR)
    assert run.samples == pytest.approx(16 * HOUR / STEP_S * (1 - busy))


def test_failures_after_the_horizon_are_ignored() -> None:
    state = small_state()
    run = simulate(state, "odyssey", trace((HOUR + 1, (1,), None)), HOUR)
    assert run.recoveries == ()
    assert math.isclose(run.samples, 16 * HOUR / STEP_S)


def test_scenario_failed_devices_start_healthy() -> None:
    state = replace(small_state(), failed=frozenset({1}))
    run = simulate(state, "odyssey", Trace(()), HOUR)
    assert run.recoveries == ()
