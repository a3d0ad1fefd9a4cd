"""``decision.grow``: a job running rerouted takes its devices back, or keeps its plan."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codes import Code
from controlplane.recovery.decision import KEEP, grow
from controlplane.recovery.model import ClusterState, Failure, FailureKind
from controlplane.recovery.policies.rerouting import reroute
from tests.recovery.builders import grid_state

SECONDS_PER_HOUR = 3600.0


@st.composite
def rerouted_states(draw: st.DrawFn) -> tuple[ClusterState, frozenset[int]]:
    """A grid job that lost devices of one or more pipelines (never every replica of a stage)
    and runs rerouted, and the devices it lost, healthy again (``failed`` empty)."""
    pp, dp = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    tp = draw(st.integers(1, 2))
    state = grid_state(layers=pp * 2, pp=pp, dp=dp, tp=tp, micro_batches=draw(st.integers(1, 8)))
    hit = draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp - 1))
    lost = frozenset(
        d for p in hit for _, stage in enumerate(state.plan.pipelines[p].stages)
        for d in stage.devices if draw(st.booleans()) or d == stage.devices[0]
    )  # fmt: skip
    plan = reroute(state.plan, lost)
    assert not isinstance(plan, str)
    return replace(state, plan=plan), lost


def own_devices(state: ClusterState) -> set[int]:
    return {d for _, _, stage in state.plan.stages() if not stage.rerouted for d in stage.devices}


@settings(max_examples=60, deadline=None)
@given(rerouted_states())
def test_the_growth_gives_every_rerouted_stage_its_own_group_of_devices_that_came_back(
    case: tuple[ClusterState, frozenset[int]],
) -> None:
    state, back = case
    decision = grow(state, Failure(FailureKind.CRASH, back), policies=["flashrecovery"])
    keep, growth = decision.candidates
    assert keep.policy == KEEP and keep.plan == state.plan
    assert keep.transition.total_s == 0
    assert growth.policy == "flashrecovery" and growth.feasible, growth.note
    assert growth.plan is not None
    running = own_devices(state)
    taken: list[int] = []
    for old, new in zip(state.plan.pipelines, growth.plan.pipelines, strict=True):
        assert new.micro_batches == old.micro_batches
        for before, after in zip(old.stages, new.stages, strict=True):
            assert not after.rerouted and after.layers == before.layers
            if before.rerouted:
                assert len(after.devices) == state.plan.tp
                taken.extend(after.devices)
            else:
                assert after == before
    # the new groups are devices the running plan does not use, each taken once
    assert len(taken) == len(set(taken)) and not set(taken) & running
    # nothing was detected, and the new devices' state comes over the network
    assert growth.transition.detection_s == 0
    assert growth.transition.weight_transfer_s > 0


def test_growth_wins_when_the_next_fault_is_far_and_the_running_plan_keeps_it_otherwise() -> None:
    base = grid_state(pp=2, dp=2, micro_batches=4)
    plan = reroute(base.plan, frozenset({2, 3}))  # pipeline 1 rerouted onto pipeline 0
    assert not isinstance(plan, str)
    failure = Failure(FailureKind.NODE_LOST, frozenset({2, 3}))
    for rate, chosen in ((1e-6, 1), (1e3, 0)):
        cluster = replace(base.cluster, failure_rate_per_device_hour=rate)
        decision = grow(replace(base, plan=plan, cluster=cluster), failure,
                        policies=["flashrecovery"])  # fmt: skip
        keep, growth = decision.candidates
        # eq. 8 by hand: samples a second over the time to the next fault and the transition
        t_state = SECONDS_PER_HOUR / (rate * 4)
        by_hand = 8 / growth.est_step_time_s * t_state / (growth.transition.total_s + t_state)
        assert abs(growth.objective - by_hand) <= 1e-9 * by_hand
        assert growth.est_step_time_s < keep.est_step_time_s  # two pipelines again
        assert decision.chosen == chosen, (rate, keep.objective, growth.objective)


def test_with_the_devices_still_down_there_is_nothing_to_grow_onto() -> None:
    base = grid_state(pp=2, dp=2)
    plan = reroute(base.plan, frozenset({3}))
    assert not isinstance(plan, str)
    state = replace(base, plan=plan, failed=frozenset({3}))  # 3 down, the others in use
    decision = grow(state, Failure(FailureKind.CRASH, frozenset({3})), policies=["flashrecovery"])
    _, growth = decision.candidates
    assert decision.chosen == 0
    assert growth.code is Code.NO_SPARE and "0 available" in growth.note


def test_a_plan_with_nothing_rerouted_and_a_policy_that_does_not_grow_keep_the_plan() -> None:
    state = grid_state(pp=2, dp=2, spares=2)
    failure = Failure(FailureKind.CRASH, frozenset({4}))
    decision = grow(state, failure, policies=["flashrecovery", "rerouting", "dynamic"])
    assert [c.policy for c in decision.candidates] == [KEEP]
    assert decision.chosen == 0


def test_a_node_back_of_two_lost_grows_the_job_by_the_one_replica_it_can_hold() -> None:
    base = grid_state(pp=1, dp=3, micro_batches=2, failure_rate=1e-6)
    plan = reroute(base.plan, frozenset({1, 2}))  # replicas 1 and 2 on replica 0
    assert not isinstance(plan, str)
    state = replace(base, plan=plan, failed=frozenset({2}))  # device 1 back, 2 still down
    decision = grow(state, Failure(FailureKind.NODE_LOST, frozenset({1})),
                    policies=["flashrecovery"])  # fmt: skip
    keep, growth = decision.candidates
    assert decision.chosen == 1 and growth.plan is not None
    stages = [p.stages[0] for p in growth.plan.pipelines]
    assert [(s.devices, s.rerouted) for s in stages] == [((0,), False), ((1,), False),
                                                          ((0, 1), True)]  # fmt: skip
    assert growth.est_step_time_s < keep.est_step_time_s
