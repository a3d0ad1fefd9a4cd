"""The engine: deterministic runs, conservation of samples, the recovery semantics it promises."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.causes import Cause
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
)
from controlplane.recovery.policies.base import SteadyCosts
from controlplane.recovery.policies.varuna import VarunaPolicy
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.experiment import Experiment, run_experiment
from controlplane.recovery.simulator.metrics import summarize
from controlplane.recovery.simulator.timeline import Run
from controlplane.recovery.simulator.traces import Trace, TraceFailure, TraceSpec, generate
from tests.recovery.builders import grid_state

HOUR = 3600.0
# The small job: 8 layers at 1 s forward + 2 s backward per micro-batch, 2 stages of 4 layers,
# 4 pipelines of 4 micro-batches (B = 16). Eq. 9 with 1F1B: (m + PP − 1) micro-batch slots of
# the slowest stage, (4 + 2 − 1) × 4 × (1 + 2) = 60 s per step.
B = 16
STEP_S = (4 + 2 - 1) * 4 * (1.0 + 2.0)
# A checkpoint restart of 8 devices takes the 60 s floor of full_restart_s.
FULL_RESTART_S = 60.0


def small_state(**changes: object) -> ClusterState:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, devices_per_node=4, **changes)  # type: ignore[arg-type]
    assert state.training.global_batch == B
    assert estimate_step_time(state.profile, state.cluster, state.plan) == STEP_S
    return state


def trace(*rows: tuple[float, tuple[int, ...], float | None]) -> Trace:
    return Trace(tuple(TraceFailure(t, devices, FailureKind.CRASH, r) for t, devices, r in rows))


def down_pieces(run: Run, at_s: float) -> list[tuple[Cause, float]]:
    """The transition of the recovery decided at ``at_s``, as the timeline shows it."""
    (recovery,) = [r for r in run.recoveries if r.at_s == pytest.approx(at_s)]
    return [(cause, seconds) for cause, seconds in recovery.transition if seconds > 0]


def assert_tiled(run: Run) -> None:
    """Segments tile the horizon in order, and nothing is trained while the job is down."""
    assert run.segments[0].start_s == 0
    assert run.segments[-1].end_s == pytest.approx(run.horizon_s)
    for a, b in zip(run.segments, run.segments[1:], strict=False):
        assert a.end_s == pytest.approx(b.start_s)
        assert a.end_s >= a.start_s
    for s in run.segments:
        if s.cause is not Cause.RUNNING:
            before, after = run.cumulative_samples([s.start_s, s.end_s])
            assert before == after, f"samples accrued while down ({s.cause})"
    up = sum(s.duration_s for s in run.segments if s.cause is Cause.RUNNING)
    assert up + run.downtime_s == pytest.approx(run.horizon_s)


def steps_of_a_job_that_rolls_back(
    run: Run, trace: Trace, interval: int
) -> list[tuple[float, float]]:
    """(time, steps kept) at the start of every running segment, for a job that really rolls back.

    The real job makes one step per STEP_S while it runs and while it redoes lost work. A fault
    that stops it (a running segment ending before the horizon, or a redo ending at a fault on
    the plan) sends it back to its last checkpoint, taken every ``interval`` steps. The engine
    instead keeps the samples and charges the redo as downtime; both must agree whenever the job
    runs.
    """
    # the simulated clock adds up the trace's gaps, so its times match the trace's to rounding
    decided = {r.at_s: set(r.devices) for r in run.recoveries}
    steps = 0.0
    out = []
    for s in run.segments:
        stopped = False
        if s.cause is Cause.RUNNING:
            out.append((s.start_s, steps))
            steps += s.duration_s / STEP_S
            stopped = s.end_s < run.horizon_s
        elif s.cause is Cause.LOST_WORK:
            steps += s.duration_s / STEP_S
            hit = next((d for t, d in decided.items() if math.isclose(t, s.end_s)), set())
            stopped = any(
                math.isclose(f.time_s, s.end_s) and hit & set(f.devices) for f in trace.failures
            )
        if stopped:
            steps = math.floor(steps) // interval * interval
    return out


@dataclass(frozen=True)
class Unbreakable(SteadyCosts):
    """A test policy that keeps its plan at no cost whatever fails."""

    name: ClassVar[str] = "unbreakable"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            Candidate(
                policy=self.name,
                plan=state.plan,
                est_step_time_s=STEP_S,
                objective=1,
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
    assert_tiled(run)
    for r in run.recoveries:
        if r.feasible:
            assert r.plan_devices > 0
            assert all(seconds >= 0 for _, seconds in r.transition)


@given(
    policy_interval=st.sampled_from(
        [("checkpoint", 1), ("checkpoint", 7), ("checkpoint", 100), ("flashrecovery", 1)]
    ),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([0.1, 0.5, 2.0]),
    spares=st.sampled_from([0, 4, 16]),
    detection=st.sampled_from([0.0, 7.0]),
)
@settings(max_examples=40, deadline=None)
def test_lost_work_is_what_a_rolled_back_job_redoes(
    policy_interval: tuple[str, int], seed: int, rate: float, spares: int, detection: float
) -> None:
    """Conservation: samples kept by the engine = steps of a job that really rolls back."""
    policy, interval = policy_interval
    assumptions = Assumptions(
        detection_s=detection, checkpoint_interval_steps=interval, checkpoint_load_s=10.0
    )
    state = small_state(spares=spares, assumptions=assumptions)
    spec = TraceSpec(failure_rate_per_device_hour=rate)
    horizon = 6 * HOUR
    failures = generate(spec, state.cluster, horizon, seed)
    run = simulate(state, policy, failures, horizon)
    assert_tiled(run)
    # spares on a free network keep the step time, so the redo runs at STEP_S
    assert {s.step_s for s in run.segments if s.cause is Cause.RUNNING} == {STEP_S}
    for time_s, steps in steps_of_a_job_that_rolls_back(run, failures, interval):
        [samples] = run.cumulative_samples([time_s])
        assert samples == pytest.approx(B * steps, rel=1e-9, abs=1e-6)


@given(
    seed=st.integers(0, 10_000),
    kept=st.integers(0, 40),
    policy=st.sampled_from(["checkpoint", "flashrecovery"]),
)
@settings(max_examples=30, deadline=None)
def test_more_failures_never_train_more(seed: int, kept: int, policy: str) -> None:
    # the trace's first ``kept`` failures against all of them: the runs are the same up to the
    # first failure dropped, and from there one trains on while the other is hit again. Dropping
    # failures anywhere is no such order: a failure during another's restart loses nothing more,
    # so without the earlier one it can cost more (seed 404 found one: 445 samples against 463)
    state = small_state(spares=8, assumptions=Assumptions(detection_s=5, checkpoint_load_s=10))
    horizon = 8 * HOUR
    spec = TraceSpec(failure_rate_per_device_hour=0.3)
    full = generate(spec, state.cluster, horizon, seed)
    fewer = Trace(full.failures[:kept])
    assert simulate(state, policy, fewer, horizon).samples >= simulate(
        state, policy, full, horizon
    ).samples * (1 - 1e-12)


def test_zero_cost_policy_trains_as_much_as_a_failure_free_job() -> None:
    state = small_state()
    spec = TraceSpec(failure_rate_per_device_hour=1.0, repair_hours=0.5)
    horizon = 5 * HOUR
    run = simulate(state, Unbreakable(), generate(spec, state.cluster, horizon, 1), horizon)
    assert run.recovery_count > 5
    assert run.downtime_s == 0
    assert run.samples == pytest.approx(B * horizon / STEP_S, rel=1e-12)


def test_failure_free_run_reaches_the_bound() -> None:
    state = small_state()
    run = simulate(state, "odyssey", Trace(()), HOUR)
    assert run.segments == (run.segments[0],)
    assert run.samples == pytest.approx(B * HOUR / STEP_S)


def test_failure_of_an_unused_device_only_leaves_the_pool() -> None:
    state = small_state(spares=2)
    run = simulate(state, "odyssey", trace((100.0, (8,), None), (200.0, (9,), 50.0)), HOUR)
    assert run.recoveries == ()
    assert run.samples == pytest.approx(B * HOUR / STEP_S)


def test_transition_is_split_by_cause_in_order() -> None:
    assumptions = Assumptions(detection_s=3.0, search_s=1.0, restart_s=2.0)
    state = small_state(assumptions=assumptions, failure_rate=0.0001)
    run = simulate(state, "dynamic", trace((100.0, (1,), None)), HOUR)
    (recovery,) = run.recoveries
    down = [s for s in run.segments if s.cause is not Cause.RUNNING]
    assert [s.cause for s in down] == [Cause.DETECTION, Cause.PLANNING, Cause.RESTART,
                                       Cause.LOST_WORK]  # fmt: skip
    # 100 s into the run, the second step was 40 s along: that is what is redone
    assert [s.duration_s for s in down] == pytest.approx([3.0, 1.0, 2.0, 40.0])
    assert down[0].start_s == 100.0
    assert recovery.downtime_s == pytest.approx(6.0 + 40.0)
    assert_tiled(run)


def test_failure_100_s_in_loses_100_s_with_a_checkpoint_policy() -> None:
    # the checkpoint at step 0 is the last one: the step done and the 40 s of the next are lost
    assumptions = Assumptions(detection_s=5.0, checkpoint_load_s=10.0)
    state = small_state(spares=2, assumptions=assumptions)
    run = simulate(state, "checkpoint", trace((100.0, (1,), None)), HOUR)
    assert down_pieces(run, 100.0) == [
        (Cause.DETECTION, 5.0),
        (Cause.WEIGHT_TRANSFER, 10.0),
        (Cause.RESTART, FULL_RESTART_S),
        (Cause.LOST_WORK, pytest.approx(100.0)),
    ]
    # the job restarts from step 0 once detected, reloaded and restarted: at 175 s
    assert run.samples == pytest.approx(B * (HOUR - 175.0) / STEP_S)


def test_rollback_reaches_back_to_the_last_checkpoint_and_the_next_one_follows() -> None:
    assumptions = Assumptions(checkpoint_interval_steps=10, checkpoint_load_s=10.0)
    state = small_state(spares=4, assumptions=assumptions)
    # 23 steps and 15 s at 1395 s: checkpoint at step 20, so 3 steps and 15 s are lost
    first = 23 * STEP_S + 15.0
    lost_first = 3 * STEP_S + 15.0
    back_at = first + 10.0 + FULL_RESTART_S + lost_first
    # 6.75 more steps take the job to step 30 (a checkpoint), 15 s later the next fault
    second = back_at + 6.75 * STEP_S + 15.0
    run = simulate(state, "checkpoint", trace((first, (1,), None), (second, (2,), None)), HOUR)
    assert [r.at_s for r in run.recoveries] == pytest.approx([first, second])
    assert dict(down_pieces(run, first))[Cause.LOST_WORK] == pytest.approx(lost_first)
    assert dict(down_pieces(run, second))[Cause.LOST_WORK] == pytest.approx(15.0)


def test_second_failure_during_a_restart_is_not_charged_twice() -> None:
    assumptions = Assumptions(detection_s=5.0, checkpoint_load_s=10.0)
    state = small_state(spares=4, assumptions=assumptions)
    run = simulate(state, "checkpoint", trace((100.0, (1,), None), (101.0, (5,), None)), HOUR)
    first, second = run.recoveries
    assert first.devices == (1,) and second.devices == (5,)
    # the first restart redoes the 100 s since the checkpoint; the second finds nothing to redo
    assert dict(first.transition)[Cause.LOST_WORK] == pytest.approx(100.0)
    assert second.at_s == pytest.approx(100.0 + 5.0 + 10.0 + FULL_RESTART_S + 100.0)
    assert down_pieces(run, second.at_s) == [
        (Cause.DETECTION, 5.0),
        (Cause.WEIGHT_TRANSFER, 10.0),
        (Cause.RESTART, FULL_RESTART_S),
    ]
    # trained: the first 100 s, then everything after the second restart
    resumed = second.at_s + 5.0 + 10.0 + FULL_RESTART_S
    assert run.samples == pytest.approx(B * (100.0 + HOUR - resumed) / STEP_S)
    assert_tiled(run)


def test_failure_during_the_redo_stops_it_and_owes_it_again() -> None:
    assumptions = Assumptions(checkpoint_load_s=10.0)
    state = small_state(spares=4, assumptions=assumptions)
    # restarted at 170 s, the job has redone 30 of its 100 s when device 5 fails at 200 s
    run = simulate(state, "checkpoint", trace((100.0, (1,), None), (200.0, (5,), None)), HOUR)
    first, second = run.recoveries
    assert dict(first.transition)[Cause.LOST_WORK] == pytest.approx(30.0)
    assert second.at_s == pytest.approx(200.0)
    assert dict(second.transition)[Cause.LOST_WORK] == pytest.approx(100.0)
    # back at step 0 again: 10 s of load, 60 s of restart, 100 s of redo, then new steps
    resumed = 200.0 + 10.0 + FULL_RESTART_S + 100.0
    assert run.samples == pytest.approx(B * (100.0 + HOUR - resumed) / STEP_S)
    assert_tiled(run)


def test_failure_during_a_transition_charges_no_interrupted_step() -> None:
    assumptions = Assumptions(detection_s=3.0, restart_s=2.0)
    state = small_state(assumptions=assumptions, failure_rate=0.0001)
    run = simulate(state, "dynamic", trace((100.0, (1,), None), (101.0, (2,), None)), HOUR)
    _, second = run.recoveries
    assert second.at_s == pytest.approx(100.0 + 3.0 + 2.0 + 40.0)
    assert Cause.LOST_WORK not in dict(down_pieces(run, second.at_s))
    assert dict(down_pieces(run, second.at_s))[Cause.DETECTION] == 3.0


def test_infeasible_job_waits_for_a_repair_then_restarts() -> None:
    # checkpoint-and-restart without spares cannot recover until the device is back
    state = small_state(assumptions=Assumptions(restart_s=2.0))
    run = simulate(state, "checkpoint", trace((100.0, (1,), 1000.0)), HOUR)
    infeasible, resumed = run.recoveries
    assert not infeasible.feasible and infeasible.code == "no_spare"
    assert resumed.feasible and resumed.after_wait and resumed.at_s == 1100.0
    causes = [(s.cause, s.start_s, s.end_s) for s in run.segments[:4]]
    # the wait charged nothing: the step done since the checkpoint and the 40 s of the next
    # are redone after it
    assert causes == [
        (Cause.RUNNING, 0.0, 100.0),
        (Cause.INFEASIBLE, 100.0, 1100.0),
        (Cause.RESTART, 1100.0, 1102.0),
        (Cause.LOST_WORK, 1102.0, pytest.approx(1202.0)),
    ]
    assert run.infeasible_count == 1 and run.recovery_count == 1
    assert_tiled(run)


def test_job_never_repaired_stays_down_to_the_end() -> None:
    state = small_state()
    run = simulate(state, "checkpoint", trace((100.0, (1,), None)), HOUR)
    assert run.segments[-1].cause is Cause.INFEASIBLE
    assert run.segments[-1].end_s == HOUR
    assert run.samples == pytest.approx(B * 100.0 / STEP_S)


def test_repaired_devices_return_for_a_later_replan() -> None:
    state = small_state()
    failures = ((100.0, (1,), 500.0), (2000.0, (2,), None))
    with_repair = simulate(state, "dynamic", trace(*failures), HOUR)
    without = simulate(state, "dynamic", trace((100.0, (1,), None), (2000.0, (2,), None)), HOUR)
    assert [r.plan_devices for r in with_repair.recoveries] == [7, 7]
    assert [r.plan_devices for r in without.recoveries] == [7, 6]


def test_simultaneous_failures_make_one_decision() -> None:
    state = small_state()
    run = simulate(state, "dynamic", trace((100.0, (1,), None), (100.0, (6,), None)), HOUR)
    (recovery,) = run.recoveries
    assert recovery.devices == (1, 6)
    assert recovery.plan_devices == 6


def test_bamboo_pays_its_redundant_forward_passes_while_running() -> None:
    # each stage also runs its successor's 4 forward layers: (12 + 4) / 12 as long a step
    run = simulate(small_state(), "bamboo", Trace(()), HOUR)
    assert run.samples == pytest.approx(B * HOUR / (STEP_S * 16 / 12))


def test_varuna_pays_its_checkpoints_while_running() -> None:
    # a 30 s blocking checkpoint every 10 steps: 10 steps per 10 × 60 + 30 s
    run = simulate(small_state(), VarunaPolicy(checkpoint_s=30.0), Trace(()), HOUR)
    assert run.samples == pytest.approx(B * 10 * HOUR / (10 * STEP_S + 30.0))


def test_failures_after_the_horizon_are_ignored() -> None:
    state = small_state()
    run = simulate(state, "odyssey", trace((HOUR + 1, (1,), None)), HOUR)
    assert run.recoveries == ()
    assert math.isclose(run.samples, B * HOUR / STEP_S)


def test_scenario_failed_devices_start_healthy() -> None:
    state = replace(small_state(), failed=frozenset({1}))
    run = simulate(state, "odyssey", Trace(()), HOUR)
    assert run.recoveries == ()
