"""Replicas: every reading they give equals the walk over the plan they replace, bit for bit.

The walks (``replicas.walking()``) are the estimators as they were before replicas, each tested
on its own against the paper's equations in test_estimator.py; here random same-split plans
go through random failures and repairs, rerouted step by step as a simulated job is, and every
reading is compared with ``==`` on floats.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery import replicas
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator import estimate_step_time, peak_memory
from controlplane.recovery.estimator.memory import device_peaks
from controlplane.recovery.estimator.time import gradient_sync_time
from controlplane.recovery.model import (
    Assumptions,
    Cluster,
    ClusterState,
    ExecutionPlan,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
    TransitionCost,
)
from controlplane.recovery.planner import usable_groups
from controlplane.recovery.policies.base import score
from controlplane.recovery.policies.rerouting import reroute
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.traces import TraceSpec, generate
from tests.recovery.builders import examples


@st.composite
def same_split_states(draw: st.DrawFn) -> ClusterState:
    """A plan whose pipelines share one split, on devices numbered at random over the nodes."""
    depth = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 6))
    tp = draw(st.sampled_from([1, 2]))
    layers = depth + draw(st.integers(0, 5))
    cuts = sorted(draw(st.permutations(range(1, layers)))[: depth - 1])
    split = list(itertools.pairwise([0, *cuts, layers]))
    idle = draw(st.integers(0, 5))
    ids = draw(st.permutations(range(dp * depth * tp + idle)))
    uniform = draw(st.booleans())
    micro = (
        [draw(st.integers(1, 4))] * dp
        if uniform
        else draw(st.lists(st.integers(1, 4), min_size=dp, max_size=dp))
    )
    groups = iter(ids[i : i + tp] for i in range(0, dp * depth * tp, tp))
    plan = ExecutionPlan(
        pipelines=tuple(
            Pipeline(
                stages=tuple(Stage(devices=tuple(next(groups)), layers=r) for r in split),
                micro_batches=micro[p],
            )
            for p in range(dp)
        )
    )
    per_layer = st.floats(0.01, 3.0, allow_nan=False, allow_infinity=False)
    profile = ModelProfile(
        name="random",
        fwd_s=tuple(draw(st.lists(per_layer, min_size=layers, max_size=layers))),
        bwd_s=tuple(draw(st.lists(per_layer, min_size=layers, max_size=layers))),
        m_p=(1.0,) * layers,
        m_o=(2.0,) * layers,
        m_g=tuple(draw(st.lists(per_layer, min_size=layers, max_size=layers))),
        m_a=tuple(draw(st.lists(per_layer, min_size=layers, max_size=layers))),
        update_s=tuple(
            draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=layers, max_size=layers))
        ),
    )
    free = draw(st.booleans())
    cluster = Cluster(
        devices=dp * depth * tp + idle,
        devices_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        device_memory_bytes=draw(st.sampled_from([1e9, 30.0])),
        intra_node_gbps=None if free else 100.0,
        inter_node_gbps=None if free else 25.0,
        failure_rate_per_device_hour=0.01,
        spares=draw(st.integers(0, 3)),
    )
    return ClusterState(
        profile=profile,
        cluster=cluster,
        training=Training(global_batch=sum(micro)),
        plan=plan,
        assumptions=Assumptions(),
        interrupted_step_s=0.5,
    )


def readings(state: ClusterState) -> dict[str, Any]:
    """Everything the replicas stand in for, read off a state's plan."""
    plan, cluster = state.plan, state.cluster
    out: dict[str, Any] = {}
    for name, read in {
        "step": lambda: estimate_step_time(state.profile, cluster, plan),
        "sync": lambda: gradient_sync_time(state.profile, cluster, plan),
        "peaks": lambda: dict(device_peaks(state.profile, cluster, plan)),
        "devices": lambda: replicas.devices(plan, cluster),
        "count": lambda: replicas.device_count(plan, cluster),
        "scored": lambda: score("test", state, plan, TransitionCost(restart_s=1.0)),
    }.items():
        try:
            out[name] = read()
        except InfeasiblePlan as exc:
            out[name] = ("raised", str(exc), exc.decline)
    return out


def walked(state: ClusterState) -> dict[str, Any]:
    with replicas.walking():
        out = readings(state)
    assert out["peaks"] == peak_memory(state.profile, state.plan)
    assert out["devices"] == state.plan.devices()
    return out


@settings(max_examples=examples(150), deadline=None)
@given(state=same_split_states(), data=st.data())
def test_a_job_rerouted_failure_by_failure_reads_the_same_with_replicas(
    state: ClusterState, data: st.DataObject
) -> None:
    assert replicas.of(state.plan, state.cluster) is not None
    devices = range(state.cluster.total_devices)
    for _ in range(data.draw(st.integers(1, 6))):
        # a failure of one to three devices, or a repair of some failed ones
        repair: bool = data.draw(st.booleans())
        if state.failed and repair:
            back = data.draw(st.sets(st.sampled_from(sorted(state.failed)), min_size=1))
            state = replace(state, failed=state.failed - back)
        else:
            down = data.draw(st.sets(st.sampled_from(devices), min_size=1, max_size=3))
            state = replace(state, failed=state.failed | down)
        for spares in (False, True):
            counted = replicas.usable_group_count(
                state.plan, state.cluster, state.failed, include_spares=spares
            )
            assert counted == len(usable_groups(state, include_spares=spares))
        fast = reroute(state.plan, state.failed, state.cluster)
        with replicas.walking():
            slow = reroute(state.plan, state.failed)
        assert fast == slow
        if isinstance(fast, str):
            return
        state = replace(state, plan=fast)
        assert readings(state) == walked(state)


@pytest.mark.parametrize("spec", [{}, {"repair_hours": 1.0}, {"node_failure_prob": 0.3}])
def test_a_simulated_job_trains_the_same_samples_with_replicas(spec: dict[str, Any]) -> None:
    from benchmarks.simulator_speed import healthy_state

    rate = 1 / (0.1 * 256)  # ten failures an hour over 256 devices
    state = healthy_state(256, rate)
    horizon = 3 * 3600.0
    trace = generate(
        TraceSpec(failure_rate_per_device_hour=rate, **spec), state.cluster, horizon, 3
    )
    assert len(trace.failures) >= 15
    for policy in ("odyssey", "rerouting", "dynamic"):
        fast = simulate(state, policy, trace, horizon, seed=3)
        with replicas.walking():
            slow = simulate(state, policy, trace, horizon, seed=3)
        assert fast == slow
        assert fast.recoveries


def test_a_plan_whose_pipelines_differ_has_no_replicas() -> None:
    plan = ExecutionPlan(
        pipelines=(
            Pipeline(
                stages=(Stage(devices=(0,), layers=(0, 2)), Stage(devices=(1,), layers=(2, 4))),
                micro_batches=2,
            ),
            Pipeline(
                stages=(Stage(devices=(2,), layers=(0, 1)), Stage(devices=(3,), layers=(1, 4))),
                micro_batches=2,
            ),
        )
    )
    assert replicas.of(plan, Cluster(devices=4)) is None
    # a device on two stages, and a rerouted stage that does not list the live replicas
    twice = replace(plan, pipelines=(plan.pipelines[0], plan.pipelines[0]))
    assert replicas.of(twice, Cluster(devices=4)) is None
    odd = Pipeline(
        stages=(
            Stage(devices=(7,), layers=(0, 2), rerouted=True),
            Stage(devices=(3,), layers=(2, 4)),
        ),
        micro_batches=2,
    )
    assert (
        replicas.of(replace(plan, pipelines=(plan.pipelines[0], odd)), Cluster(devices=8)) is None
    )
