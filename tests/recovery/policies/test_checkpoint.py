"""Checkpoint-and-restart: the same plan on spares, rolled back to the last checkpoint."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
)
from controlplane.recovery.policies import get
from controlplane.recovery.policies.checkpoint import CheckpointPolicy
from tests.recovery.builders import grid_state, uniform_profile
from tests.recovery.policies.checks import assert_replaced_on_spares, failed_states

GB = 1e9


def propose(state: ClusterState, name: str = "checkpoint") -> Candidate:
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    [candidate] = get(name).propose(state, failure)
    assert candidate.policy == name
    return candidate


def test_registered_under_its_name() -> None:
    assert isinstance(get("checkpoint"), CheckpointPolicy)


def test_with_spares_restarts_the_same_plan_on_them() -> None:
    state = grid_state(pp=2, dp=1, tp=2, spares=2, failed=[3])
    candidate = propose(state)
    assert candidate.feasible, candidate.note
    assert_replaced_on_spares(state, candidate)
    assert candidate.plan is not None
    assert candidate.plan.pipelines[0].stages[1].devices == (4, 5)


def test_without_spares_waits_for_repair() -> None:
    state = grid_state(pp=2, dp=2, tp=2, spares=2, failed=[0, 4])
    candidate = propose(state)
    assert not candidate.feasible
    assert "needs 2 spare groups of 2 devices, 1 available" in candidate.note
    assert "wait for repair" in candidate.note


def test_lost_work_is_half_an_interval_plus_the_interrupted_step() -> None:
    assumptions = Assumptions(detection_s=5, checkpoint_interval_steps=101)
    state = grid_state(pp=2, dp=2, spares=1, failed=[1], assumptions=assumptions)
    step = estimate_step_time(state.profile, state.cluster, state.plan)
    # steps 0..100 done since the checkpoint are lost with equal odds: 50 on average, plus one
    assert propose(state).transition.detection_s == 5
    assert propose(state).transition.lost_work_s == pytest.approx(51 * step)


def test_checkpoint_is_read_in_parallel_at_the_storage_bandwidth() -> None:
    profile = uniform_profile(8, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB)
    state = grid_state(
        pp=2, dp=2, tp=2, spares=2, failed=[1], profile=profile, assumptions=Assumptions()
    )
    # 4 layers × 7 GB of weights and optimizer state per stage, half per TP rank, 25 GB/s
    assert propose(state).transition.weight_transfer_s == pytest.approx(14 * GB / 25e9)


def test_measured_checkpoint_load_time_overrides_the_estimate() -> None:
    state = grid_state(spares=1, failed=[1], assumptions=Assumptions(checkpoint_load_s=42))
    assert propose(state).transition.weight_transfer_s == 42


def test_restart_grows_with_cluster_size() -> None:
    small = grid_state(layers=8, pp=4, dp=4, tp=2, spares=8, failed=[0])
    large = grid_state(layers=32, pp=8, dp=64, tp=8, spares=8, failed=[0])
    restarts = [propose(s).transition.restart_s for s in (small, large)]
    assert restarts[0] == CheckpointPolicy().restart_min_s == 60.0
    assert restarts[1] == pytest.approx(0.244 * 4096 - 198)
    # FlashRecovery's in-place restart stays flat over the same range
    flash = [propose(s, "flashrecovery").transition.restart_s for s in (small, large)]
    assert flash[0] == flash[1] < restarts[1]


def test_loses_more_work_than_flashrecovery() -> None:
    state = grid_state(pp=2, dp=2, spares=1, failed=[1])
    lost = propose(state).transition.lost_work_s
    assert lost > propose(state, "flashrecovery").transition.lost_work_s


def test_fault_outside_the_plan_costs_nothing() -> None:
    state = grid_state(spares=1, failed=[4])
    candidate = propose(state)
    assert candidate.plan == state.plan
    assert candidate.transition.total_s == 0


@settings(max_examples=300, deadline=None)
@given(failed_states())
def test_random_failures_keep_invariants(state: ClusterState) -> None:
    candidate = propose(state)
    hit = {(p, s) for p, s, stage in state.plan.stages() if state.failed & set(stage.devices)}
    # brute force: only spare devices can stop a checkpoint restart
    assert candidate.feasible == (len(state.spare_devices()) >= len(hit) * state.plan.tp)
    if candidate.feasible:
        assert_replaced_on_spares(state, candidate)
        assert math.isfinite(candidate.est_step_time_s)
        if hit:
            assert candidate.transition.lost_work_s >= estimate_step_time(
                state.profile, state.cluster, state.plan
            ) * (state.assumptions.checkpoint_interval_steps + 1) / 2 * (1 - 1e-9)
    else:
        assert "spare" in candidate.note
