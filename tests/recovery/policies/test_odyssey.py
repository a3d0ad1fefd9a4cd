"""Odyssey's policies: dynamic re-planning, rerouting and the eq. 8 choice between them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery import policies
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
    Family,
)
from controlplane.recovery.objective import expected_time_to_failure_s, objective
from controlplane.recovery.policies.dynamic import plan_dynamic
from controlplane.recovery.policies.odyssey import choose_family
from controlplane.recovery.policies.rerouting import plan_rerouting
from tests.recovery.builders import examples, grid_state, uniform_profile
from tests.recovery.policies.checks import assert_valid_plan


def test_objective_vector_prefers_replan_then_reroute() -> None:
    t_state = expected_time_to_failure_s(0.1, 31)
    assert t_state == pytest.approx(1161.29, rel=1e-4)
    reroute = objective(global_batch=64, step_time_s=1.2, transition_s=0, t_state_s=t_state)
    replan = objective(global_batch=64, step_time_s=1.0, transition_s=120, t_state_s=t_state)
    assert reroute == pytest.approx(53.33, rel=1e-3)
    assert replan > reroute
    # With t_state / (t_transition + t_state) the break-even is D* = 120 · 1.0 / 0.2 = 600 s
    # (the clamped reading of eq. 8 gives 720 s): shorter intervals favour rerouting.
    at = {
        d: objective(global_batch=64, step_time_s=1.0, transition_s=120, t_state_s=d)
        for d in (500, 600, 700)
    }
    assert at[600] == pytest.approx(64 / 1.2)
    assert at[500] < 64 / 1.2 < at[700]


@given(
    step=st.floats(0.01, 100),
    transition=st.floats(0, 1000),
    more=st.floats(0.01, 100),
    t_state=st.floats(1, 1e6),
)
def test_objective_decreases_in_step_and_transition(
    step: float, transition: float, more: float, t_state: float
) -> None:
    base = objective(global_batch=64, step_time_s=step, transition_s=transition, t_state_s=t_state)
    assert objective(global_batch=64, step_time_s=step, transition_s=0, t_state_s=math.inf) == (
        pytest.approx(64 / step)
    )
    assert base >= objective(
        global_batch=64, step_time_s=step + more, transition_s=transition, t_state_s=t_state
    )
    assert base >= objective(
        global_batch=64, step_time_s=step, transition_s=transition + more, t_state_s=t_state
    )


def test_rerouting_keeps_the_plan_and_borrows_peers() -> None:
    state = grid_state(layers=8, pp=2, dp=3, micro_batches=4, failed=[2])
    candidate = plan_rerouting("rerouting", state)
    assert candidate.feasible and candidate.plan is not None
    assert candidate.plan.family is Family.REROUTING
    stage = candidate.plan.pipelines[1].stages[0]
    assert stage.rerouted and set(stage.devices) == {0, 4}
    assert candidate.transition.restart_s == 0
    assert_valid_plan(candidate.plan, state)


def test_rerouting_infeasible_when_stage_loses_all_replicas() -> None:
    state = grid_state(layers=8, pp=2, dp=2, micro_batches=4, failed=[1, 3])
    candidate = plan_rerouting("rerouting", state)
    assert not candidate.feasible
    assert "lost every replica" in candidate.note


def test_dynamic_replans_over_survivors() -> None:
    state = grid_state(layers=9, pp=3, dp=3, micro_batches=4, failed=[4])
    candidate = plan_dynamic("dynamic", state)
    assert candidate.feasible and candidate.plan is not None
    assert len(candidate.plan.devices()) == 8
    assert candidate.transition.restart_s == state.assumptions.restart_s
    assert_valid_plan(candidate.plan, state)


@st.composite
def failed_states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 6))
    devices = pp * dp
    failed = draw(st.sets(st.integers(0, devices - 1), min_size=1, max_size=max(1, devices // 2)))
    layers = draw(st.integers(pp, 10))
    fwd = draw(st.lists(st.floats(0.1, 2.0), min_size=layers, max_size=layers))
    profile = uniform_profile(layers)
    profile = type(profile)(
        name="random",
        fwd_s=tuple(fwd),
        bwd_s=tuple(2 * f for f in fwd),
        m_p=(1e9,) * layers,
        m_o=(6e9,) * layers,
        m_g=(1e9,) * layers,
        m_a=(1e9,) * layers,
    )
    return grid_state(
        layers=layers,
        pp=pp,
        dp=dp,
        micro_batches=draw(st.integers(1, 6)),
        failed=sorted(failed),
        profile=profile,
        devices_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        memory_bytes=draw(st.sampled_from([math.inf, 60e9, 120e9])),
        failure_rate=draw(st.sampled_from([0.0, 0.1, 10.0])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0), (10.0, 1.0)])),
        assumptions=Assumptions(restart_s=draw(st.sampled_from([0.0, 2.0, 60.0]))),
    )


@given(state=failed_states())
@settings(max_examples=examples(80), deadline=None)
def test_fast_dynamic_policy_matches_exhaustive_objective(state: ClusterState) -> None:
    fast = plan_dynamic("dynamic", state)
    exhaustive = plan_dynamic("dynamic", state, exhaustive=True)
    assert fast.feasible == exhaustive.feasible
    assert fast.objective == pytest.approx(exhaustive.objective, rel=1e-9)
    assert not fast.caveats and not exhaustive.caveats
    if fast.feasible:
        assert fast.plan is not None
        assert_valid_plan(fast.plan, state)
        assert max(fast.peak_memory_bytes.values()) <= state.cluster.device_memory_bytes


@given(state=failed_states())
@settings(max_examples=60, deadline=None)
def test_odyssey_picks_the_family_with_the_best_objective(state: ClusterState) -> None:
    options = [plan_rerouting("odyssey", state), plan_dynamic("odyssey", state)]
    chosen = choose_family("odyssey", state)
    feasible = [c for c in options if c.feasible]
    assert chosen.feasible == bool(feasible)
    if feasible:
        assert chosen.objective == max(c.objective for c in feasible)
        assert chosen.plan is not None
        assert chosen.option == ("reroute" if chosen.plan.family == "rerouting" else "replan")
        assert_valid_plan(chosen.plan, state)
    else:
        assert chosen.code == "no_option"
        for option in options:  # each option's own code is in the note
            assert f"[{option.code}]" in chosen.note


def test_odyssey_reroutes_when_faults_come_fast() -> None:
    frequent = grid_state(
        layers=8,
        pp=2,
        dp=4,
        micro_batches=4,
        failed=[3],
        failure_rate=50.0,
        assumptions=Assumptions(restart_s=60.0),
    )
    rare = grid_state(
        layers=8,
        pp=2,
        dp=4,
        micro_batches=4,
        failed=[3],
        failure_rate=0.001,
        assumptions=Assumptions(restart_s=60.0),
    )
    assert _family(choose_family("odyssey", frequent)) is Family.REROUTING
    assert _family(choose_family("odyssey", rare)) is Family.DYNAMIC


def test_odyssey_with_spares_replans_onto_them_where_odyssey_leaves_them_idle() -> None:
    # two copies of an 8-layer model (1 s forward, 2 s backward a layer, 4 micro-batches each),
    # device 1 lost, device 2 a spare, free links, no step running
    state = grid_state(
        layers=8, pp=1, dp=2, micro_batches=4, failed=[1], spares=1, failure_rate=0.1
    )
    state = replace(state, interrupted_step_s=0.0)
    failure = Failure(kind=FailureKind.CRASH, devices=frozenset({1}))
    backup_free = policies.get("odyssey").propose(state, failure)[0]
    with_spares = policies.get("odyssey_spares").propose(state, failure)[0]
    # eq. 12: the survivor takes the lost copy's 4 micro-batches, (1 + 4 - 1 + 4) x 24 s
    assert backup_free.objective == pytest.approx(8 / 192)
    assert backup_free.plan is not None and backup_free.plan.family is Family.REROUTING
    # eq. 9 on devices 0 and 2, (1 + 4 - 1) x 24 s, after a 2 s restart; t_state = 18,000 s
    assert with_spares.policy == "odyssey_spares"
    assert with_spares.objective == pytest.approx(8 / 96 * 18_000 / 18_002)
    assert with_spares.plan is not None and with_spares.plan.devices() == {0, 2}


def _family(candidate: Candidate) -> Family:
    assert candidate.plan is not None
    return candidate.plan.family


def test_failure_kind_values_match_design() -> None:
    assert {k.value for k in FailureKind} == {
        "crash",
        "hang",
        "straggler",
        "nan",
        "link",
        "node_lost",
        "never_joined",
    }
    assert Failure(kind=FailureKind.CRASH, devices=frozenset({1})).detected_by == "scenario"
