"""FlashRecovery: spare groups in place, state restored from a live data-parallel replica."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codes import Code
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
)
from controlplane.recovery.policies import get
from controlplane.recovery.policies.flashrecovery import FlashRecoveryPolicy
from tests.recovery.builders import grid_state, uniform_profile
from tests.recovery.policies.checks import assert_replaced_on_spares, failed_states

GB = 1e9


def propose(state: ClusterState, kind: FailureKind = FailureKind.CRASH) -> Candidate:
    failure = Failure(kind=kind, devices=state.failed)
    [candidate] = FlashRecoveryPolicy().propose(state, failure)
    assert candidate.policy == "flashrecovery"
    return candidate


def broken(state: ClusterState) -> set[tuple[int, int]]:
    return {(p, s) for p, s, stage in state.plan.stages() if state.failed & set(stage.devices)}


def test_registered_under_its_name() -> None:
    assert isinstance(get("flashrecovery"), FlashRecoveryPolicy)


def test_with_spares_replaces_exactly_the_broken_stage() -> None:
    state = grid_state(pp=4, dp=2, tp=2, spares=8, failed=[5])
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    assert_replaced_on_spares(state, candidate)
    assert candidate.plan is not None
    assert candidate.plan.pipelines[0].stages[2].devices == (16, 17)


def test_without_spares_is_infeasible_and_names_the_shortage() -> None:
    state = grid_state(pp=2, dp=2, tp=2, spares=1, failed=[0, 4])
    candidate = propose(state)
    assert not candidate.feasible
    assert "spare" in candidate.note
    assert "needs 2 spare groups of 2 devices, 0 available" in candidate.note


def test_infeasible_when_no_data_parallel_replica_survives() -> None:
    state = grid_state(pp=2, dp=1, spares=4, failed=[1])
    candidate = propose(state)
    assert not candidate.feasible
    assert candidate.code == "no_live_replica"


def test_infeasible_when_both_replicas_of_a_stage_fail() -> None:
    state = grid_state(pp=2, dp=2, spares=4, failed=[1, 3])
    assert propose(state).code == "no_live_replica"


def test_crossed_tensor_parallel_failures_restore_from_survivors() -> None:
    # pipeline 0 lost rank 0 of stage 0, pipeline 1 lost rank 1: each shard still has a copy
    state = grid_state(pp=2, dp=2, tp=2, spares=4, devices_per_node=4, failed=[0, 5])
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    assert_replaced_on_spares(state, candidate)


def test_nan_fault_is_not_restored_from_replicas() -> None:
    state = grid_state(pp=2, dp=2, spares=2, failed=[1])
    candidate = propose(state, FailureKind.NAN)
    assert not candidate.feasible
    assert candidate.code == "untrusted_state"


def test_failed_spare_is_never_used() -> None:
    state = grid_state(pp=2, dp=2, spares=2, failed=[1, 4])
    candidate = propose(state)
    assert candidate.feasible
    assert candidate.plan is not None
    assert 4 not in candidate.plan.devices()
    assert candidate.plan.pipelines[0].stages[1].devices == (5,)


def test_fault_outside_the_plan_costs_nothing() -> None:
    state = grid_state(pp=2, dp=2, spares=2, failed=[4])
    candidate = propose(state)
    assert candidate.feasible
    assert candidate.plan == state.plan
    assert candidate.transition.total_s == 0


def test_tensor_parallel_group_stays_on_one_node() -> None:
    # spares 8..15 on nodes 2 and 3; 8 failed, so the lowest ids 9, 10 | 11, 12 would span nodes
    state = grid_state(pp=2, dp=2, tp=2, spares=8, devices_per_node=4, failed=[0, 2, 8])
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    assert candidate.plan is not None
    new = [candidate.plan.pipelines[0].stages[s].devices for s in (0, 1)]
    assert new == [(12, 13), (14, 15)]
    assert all(len({d // 4 for d in group}) == 1 for group in new)


def test_restart_does_not_grow_with_cluster_size() -> None:
    small = grid_state(layers=8, pp=4, dp=4, tp=2, spares=8, failed=[0])
    large = grid_state(layers=32, pp=8, dp=64, tp=8, spares=8, failed=[0])
    assert len(large.plan.devices()) == 4096
    costs = [propose(s) for s in (small, large)]
    assert all(c.feasible for c in costs)
    assert costs[0].transition.restart_s == costs[1].transition.restart_s
    assert costs[1].transition.restart_s == FlashRecoveryPolicy().restart_s == 85.0


def test_restore_moves_the_lost_stage_state_over_the_link() -> None:
    # 2 layers of 1 GB weights + 6 GB optimizer state over a 100 Gbit/s inter-node link
    profile = uniform_profile(4, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB)
    state = grid_state(
        layers=4,
        pp=2,
        dp=2,
        spares=2,
        devices_per_node=4,
        failed=[1],
        profile=profile,
        bandwidth_gbps=(800, 100),
    )
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    setup = FlashRecoveryPolicy().restore_setup_s
    assert candidate.transition.weight_transfer_s == pytest.approx(14 * GB / 12.5e9 + setup)


def test_copies_from_one_replica_share_its_link() -> None:
    profile = uniform_profile(4, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB)
    # two of three pipelines lose stage 1: both replacements pull from pipeline 2's device 5
    state = grid_state(
        layers=4, pp=2, dp=3, spares=2, failed=[1, 3], profile=profile, bandwidth_gbps=(100, 100)
    )
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    setup = FlashRecoveryPolicy().restore_setup_s
    assert candidate.transition.weight_transfer_s == pytest.approx(2 * 14 * GB / 12.5e9 + setup)


def test_detection_then_the_interrupted_step_are_charged() -> None:
    state = grid_state(pp=2, dp=2, spares=1, failed=[1], assumptions=Assumptions(detection_s=7))
    candidate = propose(state)
    step = estimate_step_time(state.profile, state.cluster, state.plan)
    assert candidate.transition.detection_s == 7
    assert candidate.transition.lost_work_s == pytest.approx(step)
    assert candidate.est_step_time_s == pytest.approx(step)


def reference_feasible(state: ClusterState) -> bool:
    """Brute force: enough spare devices, and every shard of a broken stage has a live copy."""
    tp = state.plan.tp
    hit = broken(state)
    if len(state.spare_devices()) < len(hit) * tp:
        return False
    for p, s in hit:
        layers = state.plan.pipelines[p].stages[s].layers
        for rank in range(tp):
            if all(
                stage.layers != layers or stage.devices[rank] in state.failed
                for _, _, stage in state.plan.stages()
            ):
                return False
    return True


@settings(max_examples=300, deadline=None)
@given(failed_states())
def test_random_failures_keep_invariants(state: ClusterState) -> None:
    candidate = propose(state)
    assert candidate.feasible == reference_feasible(state), candidate.note
    if candidate.feasible:
        assert_replaced_on_spares(state, candidate)
        assert math.isfinite(candidate.est_step_time_s)
    else:
        assert candidate.note


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_on_the_same_devices_a_crashed_replica_starts_again_from_a_live_one(
    data: st.DataObject,
) -> None:
    dp = data.draw(st.integers(2, 6))
    crashed = data.draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp - 1))
    state = grid_state(layers=4, pp=1, dp=dp, micro_batches=dp, failed=sorted(crashed))
    policy = FlashRecoveryPolicy(same_devices=True, restart_s=3.0)
    (candidate,) = policy.propose(state, Failure(kind=FailureKind.CRASH, devices=state.failed))
    assert candidate.feasible, candidate.note
    assert candidate.plan == state.plan  # every replica where it was, none lost
    t = candidate.transition
    assert t.restart_s == 3.0 and t.weight_transfer_s > 0  # its state copied from a peer
    # the device itself lost (its node): no spare to start on, declined
    lost = FlashRecoveryPolicy(same_devices=True).propose(
        state, Failure(kind=FailureKind.NODE_LOST, devices=state.failed)
    )
    assert [c.code for c in lost] == [Code.NO_SPARE]
    # without the option, the paper's: spares only
    assert (
        not FlashRecoveryPolicy()
        .propose(state, Failure(kind=FailureKind.CRASH, devices=state.failed))[0]
        .feasible
    )
