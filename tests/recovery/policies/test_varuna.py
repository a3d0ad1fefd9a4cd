"""Varuna: restart on the best symmetric grid, roll back to the last checkpoint."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Assumptions,
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
from controlplane.recovery.policies.varuna import (
    VarunaPolicy,
    checkpoint_bytes,
    checkpoint_overhead,
    checkpoint_write_s,
    restart_s,
)

GB = 1e9


def grid_state(
    *,
    pp: int = 4,
    dp: int = 2,
    layers: int = 8,
    micro_batches: int = 8,
    static: float = 0.0,
    memory: float = math.inf,
    assumptions: Assumptions | None = None,
) -> ClusterState:
    per_stage = layers // pp
    plan = ExecutionPlan(
        pipelines=tuple(
            Pipeline(
                stages=tuple(
                    Stage(devices=(p * pp + s,), layers=(s * per_stage, (s + 1) * per_stage))
                    for s in range(pp)
                ),
                micro_batches=micro_batches // dp,
            )
            for p in range(dp)
        )
    )
    return ClusterState(
        profile=ModelProfile.uniform(
            name="varuna-test", layers=layers, fwd_s=1.0, bwd_s=2.0, m_p=static, m_o=2 * static
        ),
        cluster=Cluster(devices=pp * dp, devices_per_node=1, device_memory_bytes=memory),
        training=Training(global_batch=micro_batches),
        plan=plan,
        assumptions=assumptions or Assumptions(),
    )


def propose(
    state: ClusterState, failed: Sequence[int], policy: VarunaPolicy | None = None
) -> Candidate:
    devices = frozenset(failed)
    state = state.with_failure(Failure(kind=FailureKind.CRASH, devices=devices))
    (candidate,) = (policy or VarunaPolicy()).propose(
        state, Failure(kind=FailureKind.CRASH, devices=devices)
    )
    return candidate


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 3), st.sampled_from([1, 2, 3, 4, 6, 12]), st.data())
def test_new_plan_is_a_symmetric_grid_of_survivors_keeping_the_batch(
    pp: int, dp: int, per_stage: int, data: st.DataObject
) -> None:
    state = grid_state(pp=pp, dp=dp, layers=pp * per_stage, micro_batches=12)
    failed = data.draw(st.sets(st.integers(0, pp * dp - 1), min_size=1, max_size=pp * dp - 1))
    candidate = propose(state, sorted(failed))
    assert candidate.feasible, candidate.note
    assert candidate.plan is not None
    assert candidate.plan.is_symmetric
    assert not candidate.plan.devices() & failed
    assert candidate.plan.micro_batches == state.training.micro_batches


def test_leftover_groups_sit_idle() -> None:
    # 7 survivors, 8 micro-batches: the grid's width divides 8, so a device stays idle
    state = grid_state(pp=4, dp=2, layers=8, micro_batches=8)
    candidate = propose(state, [3])
    assert candidate.plan is not None
    assert len(candidate.plan.devices()) < 7
    assert 8 % candidate.plan.dp == 0


def test_lost_work_grows_with_the_checkpoint_interval() -> None:
    lost = []
    for interval in (1, 2, 10, 50):
        state = grid_state()
        policy = VarunaPolicy(checkpoint_interval_steps=interval)
        lost.append(propose(state, [1], policy).transition.lost_work_s)
    assert lost == sorted(lost) and len(set(lost)) == len(lost)
    step = estimate_step_time(state.profile, state.cluster, state.plan)
    # the interrupted step plus (k − 1)/2 completed ones: (k + 1)/2 steps, about half the interval
    assert lost[2] == pytest.approx(5.5 * step)


def test_restart_loads_the_checkpoint_after_init() -> None:
    state = grid_state(static=1 * GB)
    candidate = propose(state, [1])
    # 8 layers × 3 GB of parameters and optimizer state over 200 Gb/s
    assert checkpoint_bytes(state.profile) == pytest.approx(24 * GB)
    assert restart_s(state.profile, state.assumptions, 55.5) == pytest.approx(55.5 + 24 / 25)
    assert candidate.transition.restart_s == pytest.approx(55.5 + 24 / 25)
    assert candidate.transition.weight_transfer_s == 0.0


def test_measured_checkpoint_load_overrides_the_bandwidth_estimate() -> None:
    state = grid_state(static=1 * GB, assumptions=Assumptions(checkpoint_load_s=7.0))
    assert restart_s(state.profile, state.assumptions, 55.5) == pytest.approx(55.5 + 7.0)


def test_steady_overhead_is_checkpoint_over_interval_plus_checkpoint() -> None:
    # Oobleck's artifact simulator: c / (k·t_step + c)
    assert checkpoint_overhead(2.0, 5.0, 10) == pytest.approx(5.0 / 25.0)
    state = grid_state(static=1 * GB)
    assert checkpoint_write_s(state.profile, state.assumptions, 15.8) == 15.8
    assert checkpoint_write_s(state.profile, Assumptions()) == pytest.approx(24 / 25)


def test_no_grid_fits_memory_is_varuna_no_grid() -> None:
    # a layer's state is 3 bytes, so a 5-byte device holds one layer: 8 stages, 7 survivors
    state = grid_state(pp=4, dp=2, layers=8, static=1.0, memory=5.0)
    candidate = propose(state, [0])
    assert not candidate.feasible
    assert candidate.code == "no_fitting_plan"
    assert candidate.note.startswith("no PP × DP grid of the 7 surviving")


def test_failure_off_the_plan_keeps_training() -> None:
    state = grid_state()
    state = ClusterState(
        profile=state.profile,
        cluster=Cluster(devices=8, devices_per_node=1, spares=1),
        training=state.training,
        plan=state.plan,
    )
    candidate = propose(state, [8])
    assert candidate.feasible and candidate.plan == state.plan
    assert candidate.transition.total_s == 0.0
