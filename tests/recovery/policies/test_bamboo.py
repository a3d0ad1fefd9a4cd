"""Bamboo: redundant computation's overheads, takeover, rebalance, adjacent failures."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.estimator import estimate_step_time, peak_memory
from controlplane.recovery.model import (
    Candidate,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.policies.bamboo import (
    BambooPolicy,
    redundancy_step_factor,
    shadow_memory,
    take_over,
)


def grid_plan(layers_per_stage: Sequence[int], dp: int, micro_batches: int = 4) -> ExecutionPlan:
    """dp pipelines of the same split; device ids row by row, one device per stage."""
    pp = len(layers_per_stage)
    pipelines = []
    for p in range(dp):
        stages, first = [], 0
        for s, count in enumerate(layers_per_stage):
            stages.append(Stage(devices=(p * pp + s,), layers=(first, first + count)))
            first += count
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines))


def grid_state(
    layers_per_stage: Sequence[int],
    dp: int,
    *,
    static: float = 0.0,
    act: float = 0.0,
    memory: float = math.inf,
    bandwidth_gbps: float | None = None,
    spares: int = 0,
) -> ClusterState:
    plan = grid_plan(layers_per_stage, dp)
    profile = ModelProfile.uniform(
        name="bamboo-test",
        layers=sum(layers_per_stage),
        fwd_s=1.0,
        bwd_s=2.0,
        m_p=static,
        m_a=act,
    )
    return ClusterState(
        profile=profile,
        cluster=Cluster(
            devices=len(layers_per_stage) * dp,
            devices_per_node=1,
            device_memory_bytes=memory,
            intra_node_gbps=bandwidth_gbps,
            inter_node_gbps=bandwidth_gbps,
            spares=spares,
        ),
        training=Training(global_batch=4 * dp),
        plan=plan,
    )


def propose(state: ClusterState, failed: Sequence[int]) -> Candidate:
    devices = frozenset(failed)
    state = state.with_failure(Failure(kind=FailureKind.CRASH, devices=devices))
    (candidate,) = BambooPolicy().propose(state, Failure(kind=FailureKind.CRASH, devices=devices))
    return candidate


# --- failure-free overheads ---------------------------------------------------------------


def test_redundant_forward_costs_a_third_when_backward_is_twice_forward() -> None:
    # forward RC: (F + B + F)/(F + B) = 4/3 with B = 2F
    state = grid_state([2, 2, 2, 2], dp=2)
    assert redundancy_step_factor(state.profile, state.plan) == pytest.approx(4 / 3)


def test_redundancy_factor_is_the_new_bottleneck_over_the_old() -> None:
    # stages of 3, 1, 2 layers: F+B = 9, 3, 6; with the successor's forward 10, 5, 9
    state = grid_state([3, 1, 2], dp=1)
    assert redundancy_step_factor(state.profile, state.plan) == pytest.approx(10 / 9)


def test_one_stage_pipelines_have_nothing_to_shadow() -> None:
    state = grid_state([4], dp=3)
    assert redundancy_step_factor(state.profile, state.plan) == 1.0


def test_failure_off_the_plan_still_pays_redundancy() -> None:
    state = grid_state([2, 2, 2, 2], dp=2, spares=1)
    candidate = propose(state, [8])
    assert candidate.feasible
    assert candidate.plan == state.plan
    assert candidate.est_step_time_s == pytest.approx(
        estimate_step_time(state.profile, state.cluster, state.plan) * 4 / 3
    )
    assert candidate.transition.total_s == 0.0


def test_shadow_adds_the_successor_stage_state_to_eq_14() -> None:
    state = grid_state([1, 2, 3], dp=1, static=10.0, act=1.0)
    plain = peak_memory(state.profile, state.plan)
    shadowed = shadow_memory(state.profile, state.plan)
    # each stage also holds the next stage's m_p + m_o + m_g; the last holds the first's
    assert shadowed[0] - plain[0] == pytest.approx(20.0)
    assert shadowed[1] - plain[1] == pytest.approx(30.0)
    assert shadowed[2] - plain[2] == pytest.approx(10.0)


def test_shadow_over_device_memory_is_bamboo_oom() -> None:
    # stage 0: eq. 14 = 2·10 + 4·2·1 = 28 fits 40; with the successor's 20 bytes it does not
    state = grid_state([2, 2, 2, 2], dp=1, static=10.0, act=1.0, memory=40.0, spares=1)
    assert max(peak_memory(state.profile, state.plan).values()) <= 40.0
    candidate = propose(state, [4])
    assert not candidate.feasible
    assert candidate.code == "out_of_memory" and candidate.note.startswith(
        "stages 0,1 of pipeline 0 exceed device memory"
    )


# --- failures -----------------------------------------------------------------------------


def test_two_adjacent_stages_lost_force_a_checkpoint_restart() -> None:
    candidate = propose(grid_state([2, 2, 2, 2], dp=2), [5, 6])
    assert not candidate.feasible
    assert candidate.code == "adjacent_stages_lost"
    assert candidate.note == "stages 1,2 of pipeline 1 lost; restart from checkpoint"


def test_last_and_first_stages_are_adjacent() -> None:
    candidate = propose(grid_state([2, 2, 2, 2], dp=1), [0, 3])
    assert not candidate.feasible
    assert candidate.code == "adjacent_stages_lost" and candidate.note.startswith(
        "stages 3,0 of pipeline 0 lost"
    )


def test_a_one_stage_pipeline_has_no_shadow() -> None:
    candidate = propose(grid_state([4], dp=2), [1])
    assert not candidate.feasible
    assert candidate.code == "adjacent_stages_lost"


def test_predecessor_runs_the_lost_stage_without_a_copy() -> None:
    state = grid_state([2, 2, 2, 2], dp=2, bandwidth_gbps=100.0)
    plan, copies = take_over(state.plan, {(1, 2)})
    assert [(s.devices, s.layers) for s in plan.pipelines[1].stages] == [
        ((4,), (0, 2)),
        ((5,), (2, 6)),
        ((7,), (6, 8)),
    ]
    assert plan.pipelines[0] == state.plan.pipelines[0]
    assert copies == []
    candidate = propose(state, [6])
    assert candidate.feasible, candidate.note
    assert candidate.transition.weight_transfer_s == 0.0


def test_first_stage_moves_to_stage_one_after_a_copy_from_the_last() -> None:
    state = grid_state([2, 2, 2, 2], dp=1, static=1e9, bandwidth_gbps=8.0)
    plan, copies = take_over(state.plan, {(0, 0)})
    assert [(s.devices, s.layers) for s in plan.pipelines[0].stages] == [
        ((1,), (0, 4)),
        ((2,), (4, 6)),
        ((3,), (6, 8)),
    ]
    assert copies == [0]
    candidate = propose(state, [0])
    assert candidate.feasible, candidate.note
    # stage 0's 2 GB of state over 1 GB/s, from its shadow on the last stage
    assert candidate.transition.weight_transfer_s == pytest.approx(2.0)


def test_after_the_pause_the_pipeline_runs_rebalanced() -> None:
    # 12 layers of F = 1, B = 2 on 4 stages, 4 micro-batches; stage 2 is lost.
    state = grid_state([3, 3, 3, 3], dp=1)
    candidate = propose(state, [2])
    assert candidate.feasible, candidate.note
    assert candidate.plan is not None
    # the 12 layers spread again over the 3 surviving stages, on the same devices
    assert [(s.devices, s.layers) for s in candidate.plan.pipelines[0].stages] == [
        ((0,), (0, 4)),
        ((1,), (4, 8)),
        ((3,), (8, 12)),
    ]
    # three equal stages of F + B = 12: 1F1B takes (m + S - 1)(F + B) = 6 * 12 = 72 s, and the
    # redundant forward of the next stage adds 4/12: 96 s. The takeover layout 3, 6, 3 would
    # run 3 (first forward) + 4 * 18 (the middle stage's work) + 3 (it waits for the last
    # stage's F + B of the first micro-batch) + 6 (last backward) = 84 s, times (18 + 3) / 18.
    assert candidate.est_step_time_s == pytest.approx(96.0)
    takeover, _ = take_over(state.plan, {(0, 2)})
    assert estimate_step_time(state.profile, state.cluster, takeover) == pytest.approx(84.0)


def test_rebalance_keeps_the_takeover_when_no_even_split_fits_memory() -> None:
    # stages of 1, 2, 3 layers of 10 bytes of state (activations free), 60 bytes per device:
    # after stage 1 is lost, stage 0 holds 3 layers and shadows stage 2's 3: 60 bytes, fits;
    # the even split 3, 3 is the same layout, so it is kept as the takeover's.
    state = grid_state([1, 2, 3], dp=1, static=10.0, memory=60.0, spares=1)
    candidate = propose(state, [1])
    assert candidate.feasible, candidate.note
    assert candidate.plan is not None
    assert [s.layers for s in candidate.plan.pipelines[0].stages] == [(0, 3), (3, 6)]


def test_takeover_pauses_to_rebalance_and_slows_the_failed_step() -> None:
    state = grid_state([2, 2, 2, 2], dp=2)
    candidate = propose(state, [2])
    old_step = estimate_step_time(state.profile, state.cluster, state.plan)
    assert candidate.transition.restart_s == BambooPolicy.rebalance_s == 76.0
    assert candidate.transition.lost_work_s == pytest.approx(0.5 * old_step)
    assert candidate.plan is not None
    assert candidate.est_step_time_s == pytest.approx(
        estimate_step_time(state.profile, state.cluster, candidate.plan)
        * redundancy_step_factor(state.profile, candidate.plan)
    )


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.data())
def test_feasible_unless_adjacent_stages_of_one_pipeline_are_lost(
    pp: int, dp: int, data: st.DataObject
) -> None:
    state = grid_state([2] * pp, dp=dp)
    failed = data.draw(st.sets(st.integers(0, pp * dp - 1), min_size=1))
    lost = {(d // pp, d % pp) for d in failed}
    adjacent = any((p, (s + 1) % pp) in lost for p, s in lost)
    candidate = propose(state, sorted(failed))
    assert candidate.feasible == (not adjacent), candidate.note
    if not candidate.feasible:
        assert candidate.code == "adjacent_stages_lost"
        return
    assert candidate.plan is not None
    assert not candidate.plan.devices() & failed
    assert candidate.plan.micro_batches == state.training.micro_batches
    for pipeline in candidate.plan.pipelines:
        assert pipeline.stages[0].layers[0] == 0
        assert pipeline.stages[-1].layers[1] == state.profile.layers
        assert all(a.layers[1] == b.layers[0] for a, b in itertools.pairwise(pipeline.stages))


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 6), st.integers(1, 3), st.integers(0, 35))
def test_rebalanced_pipeline_is_never_slower_than_the_takeover(
    pp: int, layers_extra: int, device: int
) -> None:
    # the takeover layout is always an option, so the rebalance can only gain
    state = grid_state([1 + layers_extra] * pp, dp=1)
    failed = device % pp
    candidate = propose(state, [failed])
    assert candidate.feasible, candidate.note
    takeover, _ = take_over(state.plan, {(0, failed)})
    slowest = estimate_step_time(state.profile, state.cluster, takeover)
    assert candidate.est_step_time_s <= slowest * redundancy_step_factor(
        state.profile, takeover
    ) * (1 + 1e-12)
