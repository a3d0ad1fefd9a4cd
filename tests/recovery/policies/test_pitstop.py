"""Pitstop's policy: eq. 8 over rerouting, swapping onto spares and re-planning with or without."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.recovery.codes import Option
from controlplane.recovery.model import Assumptions, ClusterState, Failure, FailureKind
from controlplane.recovery.policies.dynamic import plan_dynamic
from controlplane.recovery.policies.flashrecovery import plan_flashrecovery
from controlplane.recovery.policies.odyssey import choose_family
from controlplane.recovery.policies.pitstop import (
    choose_any_family,
)
from controlplane.recovery.policies.rerouting import plan_rerouting
from tests.recovery.builders import examples, grid_state
from tests.recovery.policies.checks import assert_valid_plan
from tests.recovery.policies.test_odyssey import failed_states

HOUR_S = 3600.0


def crash(*devices: int) -> Failure:
    return Failure(kind=FailureKind.CRASH, devices=frozenset(devices))


def two_replicas_one_spare(restart_s: float) -> ClusterState:
    """Two data-parallel copies of an 8-layer model, one device each; device 1 failed, spare 2.

    Every layer takes 1 s forward and 2 s backward, 4 micro-batches per copy (B = 8), links are
    free and no step was running, so every eq. 8 term can be worked out by hand.
    """
    state = grid_state(
        layers=8,
        pp=1,
        dp=2,
        micro_batches=4,
        spares=1,
        failed=[1],
        failure_rate=0.1,
        assumptions=Assumptions(restart_s=restart_s),
    )
    return replace(state, interrupted_step_s=0.0)


def eq8(step_s: float, transition_s: float, devices: int, rate: float = 0.1) -> float:
    """Odyssey eq. 8 for B = 8 and ``rate`` failures per device-hour."""
    t_state = HOUR_S / (rate * devices)
    return 8 / step_s * t_state / (t_state + transition_s)


# eq. 9: (PP + micro-batches − 1)(t_f + t_b); the whole model is 8 s forward, 16 s backward
STEP_S = (1 + 4 - 1) * 24.0
# eq. 12: the lost copy's 4 micro-batches go to the one survivor, on top of its own
REROUTED_STEP_S = (1 + 4 - 1 + 4) * 24.0


def test_swap_wins_when_a_replan_restart_costs_more_than_the_in_place_one() -> None:
    state = two_replicas_one_spare(restart_s=300.0)
    ours = choose_any_family("pitstop", state, crash(1))
    theirs = choose_family("odyssey_spares", state, use_spares=True)
    swap = eq8(STEP_S, 1.0 + 85.0, devices=2)  # FlashRecovery: 1 s setup, 85 s restart
    replan = eq8(STEP_S, 300.0, devices=2)  # the same shape on devices 0 and 2
    reroute = 8 / REROUTED_STEP_S  # no transition
    assert swap > replan > reroute
    assert ours.option == Option.SWAP, ours.note
    assert ours.objective == pytest.approx(swap, rel=1e-12)
    assert ours.plan is not None and ours.plan.devices() == {0, 2}
    # Odyssey with spares has the same devices but no swap: it pays the re-plan's restart
    assert theirs.objective == pytest.approx(replan, rel=1e-12)
    assert_valid_plan(ours.plan, state)


def test_with_a_cheap_restart_it_replans_onto_the_spare_as_odyssey_with_spares_does() -> None:
    state = two_replicas_one_spare(restart_s=2.0)
    ours = choose_any_family("pitstop", state, crash(1))
    theirs = choose_family("odyssey_spares", state, use_spares=True)
    assert ours.option == Option.REPLAN_WITH_SPARES, ours.note
    assert ours.objective == pytest.approx(eq8(STEP_S, 2.0, devices=2), rel=1e-12)
    assert ours.plan == theirs.plan and ours.objective == theirs.objective
    # backup-free Odyssey can only reroute or re-plan on device 0 alone: rerouting wins
    assert choose_family("odyssey", state).objective == pytest.approx(8 / REROUTED_STEP_S)


@given(restart_s=st.floats(0.0, 1000.0), flash_restart_s=st.floats(0.0, 500.0))
@settings(max_examples=30, deadline=None)
def test_the_swap_is_chosen_exactly_when_its_transition_is_the_shorter(
    restart_s: float, flash_restart_s: float
) -> None:
    # the swap and the re-plan onto the spare run the same step on the same two devices, so
    # eq. 8 prefers whichever transition is shorter: the 1 s setup plus the in-place restart,
    # or the re-plan's restart
    swap_s = 1.0 + flash_restart_s
    assume(abs(restart_s - swap_s) > 1e-6)
    state = two_replicas_one_spare(restart_s=restart_s)
    chosen = choose_any_family("pitstop", state, crash(1), swap_restart_s=flash_restart_s)
    expected = Option.SWAP if swap_s < restart_s else Option.REPLAN_WITH_SPARES
    # rerouting halves the throughput: it never wins over a transition this short
    assert eq8(STEP_S, max(swap_s, restart_s), devices=2) > 8 / REROUTED_STEP_S
    assert chosen.option == expected, chosen.note
    assert chosen.objective == pytest.approx(eq8(STEP_S, min(swap_s, restart_s), devices=2))


def test_reroutes_when_faults_come_too_fast_for_any_transition() -> None:
    state = two_replicas_one_spare(restart_s=300.0)
    state = replace(state, cluster=replace(state.cluster, failure_rate_per_device_hour=60.0))
    # t_state = 30 s on two devices: a transition eats most of the time before the next fault
    reroute = 8 / REROUTED_STEP_S
    swap = eq8(STEP_S, 86.0, devices=2, rate=60.0)
    assert reroute > swap > eq8(STEP_S, 300.0, devices=2, rate=60.0)
    chosen = choose_any_family("pitstop", state, crash(1))
    assert chosen.option == Option.REROUTE, chosen.note
    assert chosen.objective == pytest.approx(reroute)


@given(state=failed_states())
@settings(max_examples=examples(40), deadline=None)
def test_without_spares_it_chooses_what_odyssey_chooses(state: ClusterState) -> None:
    failure = crash(*state.failed)
    ours = choose_any_family("pitstop", state, failure)
    theirs = choose_family("odyssey", state)
    assert ours.feasible == theirs.feasible
    if theirs.feasible:
        assert ours.objective == pytest.approx(theirs.objective, rel=1e-12)
        assert ours.plan == theirs.plan


@st.composite
def states_with_spares(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 3))
    devices = pp * dp
    spares = draw(st.integers(1, 4))
    failed = draw(st.sets(st.integers(0, devices + spares - 1), min_size=1, max_size=3))
    return grid_state(
        layers=draw(st.integers(pp, 8)),
        pp=pp,
        dp=dp,
        micro_batches=draw(st.integers(1, 4)),
        failed=sorted(failed),
        spares=spares,
        devices_per_node=draw(st.sampled_from([1, 2, 4])),
        failure_rate=draw(st.sampled_from([0.01, 0.1, 10.0])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0), (10.0, 1.0)])),
        assumptions=Assumptions(restart_s=draw(st.sampled_from([2.0, 60.0, 300.0]))),
    )


@given(state=states_with_spares(), swap_restart_s=st.sampled_from([5.0, 85.0]))
@settings(max_examples=examples(40), deadline=None)
def test_its_cuts_never_lose_the_best_of_the_four_options(
    state: ClusterState, swap_restart_s: float
) -> None:
    # each option scored on its own, every re-plan placed: the dominance cuts must not drop
    # the best of them
    failure = crash(*state.failed)
    options = [
        plan_rerouting("x", state),
        plan_flashrecovery("x", state, failure, restart_s=swap_restart_s),
        plan_dynamic("x", state, exhaustive=True),
        plan_dynamic("x", state, exhaustive=True, include_spares=True),
    ]
    feasible = [c.objective for c in options if c.feasible]
    chosen = choose_any_family("pitstop", state, failure, swap_restart_s=swap_restart_s)
    assert chosen.feasible == bool(feasible)
    if feasible:
        assert chosen.objective == pytest.approx(max(feasible), rel=1e-9)
        assert chosen.plan is not None
        assert_valid_plan(chosen.plan, state)


def test_declines_with_every_reason_when_nothing_is_feasible() -> None:
    state = grid_state(layers=2, pp=2, dp=1, micro_batches=2, failed=[0, 1])
    candidate = choose_any_family("pitstop", state, crash(0, 1))
    assert not candidate.feasible
    assert "replica" in candidate.note
