"""CheckFree and CheckFree+: a lost stage rebuilt on spares from its neighbours' weights."""

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
from controlplane.recovery.policies.checkfree import CheckFreePlusPolicy, CheckFreePolicy
from tests.recovery.builders import grid_plan, grid_state, uniform_profile
from tests.recovery.policies.checks import assert_replaced_on_spares, failed_states

GB = 1e9
POLICIES = ["checkfree", "checkfree_plus"]


def propose(name: str, state: ClusterState) -> Candidate:
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    [candidate] = get(name).propose(state, failure)
    assert candidate.policy == name
    return candidate


def test_registered_under_their_names() -> None:
    assert isinstance(get("checkfree"), CheckFreePolicy)
    assert isinstance(get("checkfree_plus"), CheckFreePlusPolicy)


@pytest.mark.parametrize("name", POLICIES)
def test_intermediate_stage_is_rebuilt_on_spares(name: str) -> None:
    state = grid_state(layers=12, pp=6, dp=1, tp=2, spares=2, failed=[5])
    candidate = propose(name, state)
    assert candidate.feasible, candidate.note
    assert_replaced_on_spares(state, candidate)
    assert candidate.plan is not None
    assert candidate.plan.pipelines[0].stages[2].devices == (12, 13)


@pytest.mark.parametrize("name", POLICIES)
def test_without_spares_is_infeasible_and_names_the_shortage(name: str) -> None:
    state = grid_state(layers=12, pp=6, dp=1, tp=2, spares=1, failed=[5])
    candidate = propose(name, state)
    assert not candidate.feasible
    assert candidate.code == "no_spare"
    assert "needs 1 spare group of 2 devices, 0 available" in candidate.note


@pytest.mark.parametrize("last", [False, True])
def test_edge_stage_only_recoverable_by_checkfree_plus(last: bool) -> None:
    state = grid_state(layers=12, pp=6, dp=1, spares=1, failed=[5 if last else 0])
    plain = propose("checkfree", state)
    assert not plain.feasible
    assert plain.code == "edge_stage"
    plus = propose("checkfree_plus", state)
    assert plus.feasible, plus.note
    assert_replaced_on_spares(state, plus)


@pytest.mark.parametrize("name", POLICIES)
def test_stage_with_a_live_replica_is_left_to_exact_copy(name: str) -> None:
    state = grid_state(layers=12, pp=6, dp=2, spares=2, failed=[2])
    candidate = propose(name, state)
    assert not candidate.feasible
    assert candidate.code == "stage_has_replica" and candidate.note.startswith("stage 2")


@pytest.mark.parametrize("name", POLICIES)
def test_stage_lost_in_every_pipeline_is_rebuilt_in_every_pipeline(name: str) -> None:
    state = grid_state(layers=12, pp=6, dp=2, spares=2, failed=[2, 8])
    candidate = propose(name, state)
    assert candidate.feasible, candidate.note
    assert_replaced_on_spares(state, candidate)


@pytest.mark.parametrize("name", POLICIES)
def test_adjacent_lost_stages_are_infeasible(name: str) -> None:
    state = grid_state(layers=12, pp=6, dp=1, spares=2, failed=[2, 3])
    candidate = propose(name, state)
    assert candidate.code == "adjacent_stages_lost" and candidate.note.startswith("stages 2 and 3")


def test_checkfree_plus_ring_makes_first_and_last_adjacent() -> None:
    state = grid_state(layers=12, pp=6, dp=1, spares=2, failed=[0, 5])
    assert propose("checkfree_plus", state).code == "adjacent_stages_lost"


def test_checkfree_plus_needs_four_stages() -> None:
    state = grid_state(layers=6, pp=3, dp=1, spares=1, failed=[1])
    assert propose("checkfree_plus", state).code == "too_few_stages"
    assert propose("checkfree", state).feasible


def test_neighbours_with_other_layer_counts_cannot_be_averaged() -> None:
    state = grid_state(layers=7, pp=3, dp=1, spares=1, failed=[1])
    uneven = grid_plan(7, 3, 1, 4, splits=[2, 3, 2])
    candidate = propose("checkfree", state.with_plan(uneven))
    assert candidate.code == "shape_mismatch" and candidate.note.startswith(
        "stage 1 and neighbour 0"
    )


def test_fault_outside_the_plan_costs_nothing() -> None:
    state = grid_state(layers=12, pp=6, dp=1, spares=2, failed=[7])
    for name in POLICIES:
        candidate = propose(name, state)
        assert candidate.plan == state.plan
        assert candidate.transition.total_s == 0


def test_convergence_penalty_is_charged_once_per_rebuilt_layer_range() -> None:
    assumptions = Assumptions(detection_s=3)
    state = grid_state(layers=12, pp=6, dp=2, spares=2, failed=[2, 8], assumptions=assumptions)
    candidate = propose("checkfree", state)
    assert candidate.plan is not None
    step = estimate_step_time(state.profile, state.cluster, state.plan)
    new_step = estimate_step_time(state.profile, state.cluster, candidate.plan)
    expected = step + CheckFreePolicy().penalty_steps * new_step * 1
    assert candidate.transition.detection_s == 3
    assert candidate.transition.lost_work_s == pytest.approx(expected)
    assert candidate.transition.restart_s == CheckFreePolicy().restart_s == 30.0


def test_checkfree_plus_pays_a_smaller_convergence_penalty() -> None:
    state = grid_state(layers=12, pp=6, dp=1, spares=1, failed=[2])
    plain, plus = propose("checkfree", state), propose("checkfree_plus", state)
    assert plus.transition.lost_work_s < plain.transition.lost_work_s


def test_checkfree_plus_charges_the_embedding_replica_memory() -> None:
    profile = uniform_profile(12, m_p=1 * GB, m_o=1 * GB, m_g=1 * GB)
    state = grid_state(
        layers=12,
        pp=6,
        dp=1,
        spares=1,
        failed=[2],
        profile=profile,
        memory_bytes=7 * GB,
    )
    # stage 0 peaks at 2 layers × 3 GB static + 0 activations = 6 GB; +2 GB replica > 7 GB
    assert propose("checkfree", state).feasible
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    [plus] = CheckFreePlusPolicy(embedding_bytes=2 * GB).propose(state, failure)
    assert not plus.feasible
    assert plus.code == "out_of_memory" and plus.note.startswith("out of memory")


def test_rebuild_pulls_both_neighbours_weights_through_the_spare_link() -> None:
    profile = uniform_profile(12, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB)
    state = grid_state(
        layers=12,
        pp=6,
        dp=1,
        spares=1,
        devices_per_node=6,
        failed=[2],
        profile=profile,
        bandwidth_gbps=(800, 100),
    )
    candidate = propose("checkfree", state)
    assert candidate.feasible, candidate.note
    # weights only (2 layers × 1 GB) from each neighbour; two copies share the spare's link
    assert candidate.transition.weight_transfer_s == pytest.approx(2 * 2 * GB / 12.5e9)


def test_checkfree_plus_copies_an_edge_stage_from_its_partner_alone() -> None:
    profile = uniform_profile(12, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB)
    state = grid_state(
        layers=12,
        pp=6,
        dp=1,
        spares=1,
        devices_per_node=6,
        failed=[0],
        profile=profile,
        bandwidth_gbps=(800, 100),
    )
    candidate = propose("checkfree_plus", state)
    assert candidate.feasible, candidate.note
    assert candidate.transition.weight_transfer_s == pytest.approx(2 * GB / 12.5e9)


def reference_feasible(state: ClusterState, *, plus: bool) -> bool:
    """Brute force over stage positions of a symmetric plan (CheckFree §6.2)."""
    plan, failed = state.plan, state.failed
    pp, tp = plan.pipelines[0].depth, plan.tp
    hit = {(p, s) for p, s, stage in plan.stages() if failed & set(stage.devices)}
    if not hit:
        return True
    lost = {
        s
        for s in range(pp)
        if any(all(pl.stages[s].devices[k] in failed for pl in plan.pipelines) for k in range(tp))
    }
    if any(s not in lost for _, s in hit):
        return False
    ring = plus and pp > 2
    if any((s + 1) in lost or (ring and s == pp - 1 and 0 in lost) for s in lost):
        return False
    if plus and pp < 4:
        return False
    if not plus and lost & {0, pp - 1}:
        return False
    return len(state.spare_devices()) >= len(hit) * tp


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=300, deadline=None)
@given(state=failed_states())
def test_random_failures_keep_invariants(name: str, state: ClusterState) -> None:
    candidate = propose(name, state)
    expected = reference_feasible(state, plus=name == "checkfree_plus")
    assert candidate.feasible == expected, candidate.note
    if candidate.feasible:
        assert_replaced_on_spares(state, candidate)
        assert math.isfinite(candidate.est_step_time_s)
    else:
        assert candidate.note
