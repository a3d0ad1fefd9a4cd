"""The ideal: free, instant recoveries onto the fastest plan; a bound on every policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery import policies
from controlplane.recovery.causes import Cause
from controlplane.recovery.model import ClusterState, FailureKind
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.experiment import (
    Experiment,
    planning_rate,
    run_experiment,
    run_ideal,
)
from controlplane.recovery.simulator.ideal import ideal_run
from controlplane.recovery.simulator.metrics import summarize
from controlplane.recovery.simulator.traces import Trace, TraceFailure, TraceSpec, generate
from tests.recovery.builders import examples, grid_state

HOUR = 3600.0
# 8 layers at 1 s forward + 2 s backward per micro-batch, 16 micro-batches of one sample. The
# starting plan, 2 stages × 4 pipelines of 4 micro-batches, takes (4 + 2 − 1) × 4 × 3 = 60 s a
# step (eq. 9). With no memory limit and free communication, the fastest plan on 8 devices is
# 8 one-stage pipelines of 2 micro-batches: 2 × 8 × 3 = 48 s, no bubble and a perfect balance
# (16 × 8 × 3 device-seconds of work over 8 devices).
B = 16


def test_a_failure_with_a_spare_moves_to_the_fastest_plan_at_once() -> None:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, devices_per_node=4, spares=1)
    run = ideal_run(state, Trace((TraceFailure(HOUR, (0,)),)), 2 * HOUR)
    # an hour at 60 s, then 7 survivors and the spare run the 48 s plan from the fault on
    assert run.samples == pytest.approx(B * HOUR / 60 + B * HOUR / 48)
    assert run.downtime_s == 0
    (recovery,) = run.recoveries
    assert (recovery.step_before_s, recovery.step_after_s, recovery.downtime_s) == (60, 48, 0)


def test_with_no_plan_left_the_ideal_waits_for_the_repair() -> None:
    # one pipeline of 2 stages (4 samples a step, 60 s) loses its node for half an hour; back on
    # 2 devices the fastest plan is 2 one-stage pipelines of 2 micro-batches (48 s)
    state = grid_state(layers=8, pp=2, dp=1, micro_batches=4, devices_per_node=4)
    node = TraceFailure(HOUR, (0, 1), FailureKind.NODE_LOST, repair_s=HOUR / 2)
    run = ideal_run(state, Trace((node,)), 2 * HOUR)
    assert run.samples == pytest.approx(4 * HOUR / 60 + 4 * (HOUR / 2) / 48)
    assert run.downtime_by_cause_s()[Cause.INFEASIBLE] == pytest.approx(HOUR / 2)
    assert [r.feasible for r in run.recoveries] == [False, True]
    assert run.recoveries[1].after_wait


@st.composite
def small_jobs(draw: st.DrawFn) -> tuple[ClusterState, Trace]:
    pp, dp = draw(st.integers(2, 3)), draw(st.integers(2, 3))
    state = grid_state(
        layers=pp * draw(st.integers(1, 2)),
        pp=pp,
        dp=dp,
        micro_batches=draw(st.sampled_from([1, 2, 4])),
        spares=draw(st.integers(0, 2)),
        devices_per_node=draw(st.sampled_from([1, 2, 4])),
        bandwidth_gbps=draw(st.sampled_from([None, (100.0, 10.0)])),
    )
    spec = TraceSpec(
        failure_rate_per_device_hour=draw(st.sampled_from([0.1, 0.3, 0.6])),
        node_failure_prob=draw(st.sampled_from([0.0, 0.3])),
        repair_hours=draw(st.sampled_from([None, 0.5, 2.0])),
    )
    return state, generate(spec, state.cluster, 3 * HOUR, draw(st.integers(0, 10_000)))


# Policies that start a crashed process again on its own device, which the ideal does not do
# (docs/simulator.md, "Known gap"): bounded by the run with no failure at all instead.
IN_PLACE = frozenset({"restart", "restart_shrink"})


@settings(max_examples=examples(15), deadline=None)
@given(small_jobs())
def test_no_policy_trains_more_than_the_ideal(job: tuple[ClusterState, Trace]) -> None:
    state, trace = job
    bound = ideal_run(state, trace, 3 * HOUR)
    unfailed = ideal_run(state, Trace(()), 3 * HOUR)
    for name in policies.names():
        run = simulate(state, name, trace, 3 * HOUR)
        limit = unfailed if name in IN_PLACE else bound
        assert run.samples <= limit.samples * (1 + 1e-9), name


def test_summary_gives_each_policy_its_share_of_the_ideal() -> None:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, devices_per_node=4, spares=1)
    trace = TraceSpec(failure_rate_per_device_hour=0.3, repair_hours=1.0)
    experiment = Experiment(hours=3, policies=("odyssey", "rerouting"), trace=trace, seeds=3)
    runs, traces = run_experiment(state, experiment)
    ideal = run_ideal(state, experiment, traces)
    summary = summarize(runs, ideal=ideal)
    assert [r.seed for r in ideal] == [0, 1, 2]
    for name, policy_runs in runs.items():
        share = summary["share_of_ideal"][name]
        per_seed = [r.samples / b.samples for r, b in zip(policy_runs, ideal, strict=True)]
        assert share["mean"] == pytest.approx(sum(per_seed) / 3)
        assert share["ci95"][0] <= share["mean"] <= share["ci95"][1] <= 1 + 1e-9
    assert summary["ideal"]["samples_mean"] == pytest.approx(sum(r.samples for r in ideal) / 3)
    assert json.loads(json.dumps(summary)) == summary


def test_the_ideal_leaves_the_policies_runs_alone(tmp_path: Path) -> None:
    """Adding the ideal is an extra run: every policy's timeline is what it was without it."""
    from controlplane.recovery import simulator

    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, devices_per_node=4)
    spec = TraceSpec(failure_rate_per_device_hour=0.3)
    experiment = Experiment(hours=2, policies=("odyssey", "oobleck"), trace=spec, seeds=2)
    simulator.run(state, experiment, out_dir=tmp_path, report=False)
    planned = planning_rate(state, experiment)  # policies plan with the trace's rate
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    for name in experiment.policies:
        for seed, written in enumerate(timeline[name]):
            trace = generate(spec, state.cluster, 2 * HOUR, seed)
            alone = simulate(planned, name, trace, 2 * HOUR, seed=seed)
            assert written == json.loads(json.dumps(alone.to_dict()))
    assert [run["policy"] for run in timeline["ideal"]] == ["ideal", "ideal"]
