"""The time and memory estimators against the papers' formulas and worked vectors."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codec import state_from_dict, state_to_dict
from controlplane.recovery.errors import InfeasiblePlan, InvalidScenario
from controlplane.recovery.estimator import (
    estimate_step_time,
    peak_memory,
    pipeline_time,
    rerouting_step_time,
    stage_peak_bytes,
    symmetric_step_time,
)
from controlplane.recovery.estimator.time import one_f_one_b_order
from controlplane.recovery.model import Cluster
from controlplane.recovery.policies.rerouting import reroute
from tests.recovery.builders import grid_plan, uniform_profile

FREE = Cluster(devices=64)
GB = 1e9


def test_eq9_symmetric_vector() -> None:
    assert symmetric_step_time(4, 8, 1.0, 2.0) == 33.0


@pytest.mark.parametrize(
    ("t_f", "t_b", "m", "expected"),
    [
        ([1, 2], [2, 4], 3, 21),
        ([1, 1, 2], [2, 2, 4], 4, 30),
        ([2, 1, 1], [4, 2, 2], 4, 26),
    ],
)
def test_eq11_vectors(t_f: list[float], t_b: list[float], m: int, expected: float) -> None:
    assert pipeline_time(t_f, t_b, m) == expected


@pytest.mark.parametrize(
    ("split", "expected"), [([11, 11, 10], 291), ([11, 10, 11], 294), ([10, 11, 11], 294)]
)
def test_eq11_prefers_extra_layers_early(split: list[int], expected: float) -> None:
    assert pipeline_time([n * 1.0 for n in split], [n * 2.0 for n in split], 7) == expected


@given(
    stages=st.integers(1, 8),
    m=st.integers(1, 24),
    t_f=st.floats(0.1, 10),
    t_b=st.floats(0.1, 10),
)
def test_eq11_equals_eq9_for_uniform_stages(stages: int, m: int, t_f: float, t_b: float) -> None:
    assert pipeline_time([t_f] * stages, [t_b] * stages, m) == pytest.approx(
        symmetric_step_time(stages, m, t_f, t_b)
    )


stage_times = st.lists(st.floats(0.01, 5), min_size=1, max_size=6)


@given(data=st.data(), t_f=stage_times, m=st.integers(1, 12))
def test_eq11_is_monotone_and_above_lower_bound(
    data: st.DataObject, t_f: list[float], m: int
) -> None:
    t_b = data.draw(st.lists(st.floats(0.01, 5), min_size=len(t_f), max_size=len(t_f)))
    base = pipeline_time(t_f, t_b, m)
    # the bound of StageTable (planner.py): stage b waits for micro-batch 0, runs m passes, sends
    # the gradient back
    lower = max(sum(t_f[:b]) + m * (t_f[b] + t_b[b]) + sum(t_b[:b]) for b in range(len(t_f)))
    assert base >= lower - 1e-9
    assert pipeline_time(t_f, t_b, m + 1) >= base
    s = data.draw(st.integers(0, len(t_f) - 1))
    slower = list(t_f)
    slower[s] += 1.0
    assert pipeline_time(slower, t_b, m) >= base


@given(stages=st.integers(1, 6), m=st.integers(1, 10))
def test_1f1b_order_runs_every_pass_once(stages: int, m: int) -> None:
    for s in range(stages):
        order = one_f_one_b_order(s, stages, m)
        assert sorted(order) == sorted(
            [(True, j) for j in range(m)] + [(False, j) for j in range(m)]
        )
        # a backward never precedes its own forward
        assert all(order.index((True, j)) < order.index((False, j)) for j in range(m))


def test_eq12_one_failure_vector() -> None:
    assert rerouting_step_time(4, 8, 5, 1.0, 2.0, [1, 0, 0, 0]) == 39.0


def test_eq13_several_failures_vector() -> None:
    assert rerouting_step_time(4, 8, 5, 1.0, 2.0, [1, 0, 2, 0]) == pytest.approx(55.0)


def test_rerouting_infeasible_when_stage_loses_all_replicas() -> None:
    with pytest.raises(InfeasiblePlan, match="stage 1"):
        rerouting_step_time(4, 8, 5, 1.0, 2.0, [0, 5, 0, 0])


@given(
    pp=st.integers(1, 5),
    dp=st.integers(2, 5),
    m=st.integers(1, 12),
    data=st.data(),
)
@settings(max_examples=60)
def test_plan_estimate_of_rerouted_grid_equals_eq13(
    pp: int, dp: int, m: int, data: st.DataObject
) -> None:
    layers = pp * 2
    plan = grid_plan(layers, pp, dp, m)
    failed = data.draw(st.frozensets(st.integers(0, pp * dp - 1), max_size=pp * dp))
    per_stage = [sum(1 for p in range(dp) if p * pp + s in failed) for s in range(pp)]
    profile = uniform_profile(layers, 0.5, 1.0)
    rerouted = reroute(plan, failed)
    if any(f >= dp for f in per_stage):
        assert isinstance(rerouted, str)
        return
    assert not isinstance(rerouted, str)
    expected = rerouting_step_time(pp, m, dp, 1.0, 2.0, per_stage)
    assert estimate_step_time(profile, FREE, rerouted) == pytest.approx(expected)
    assert not rerouted.devices() & failed


def test_eq14_vector() -> None:
    profile = uniform_profile(32, m_p=0.4 * GB, m_o=2.4 * GB, m_g=0.4 * GB, m_a=0.5 * GB)
    assert stage_peak_bytes(profile, (0, 8), 0, 4, 8) == pytest.approx(41.6 * GB)
    assert stage_peak_bytes(profile, (24, 32), 3, 4, 8) == pytest.approx(29.6 * GB)


def test_eq14_capacity_keeps_only_late_heavy_split() -> None:
    profile = uniform_profile(32, m_p=0.4 * GB, m_o=2.4 * GB, m_g=0.4 * GB, m_a=0.5 * GB)
    peaks = {}
    for split in ([10, 11, 11], [11, 11, 10], [11, 10, 11]):
        plan = grid_plan(32, 3, 1, 8, splits=split)
        peaks[tuple(split)] = max(peak_memory(profile, plan).values())
    assert peaks[(10, 11, 11)] == pytest.approx(47.0 * GB)
    assert [s for s, p in peaks.items() if p <= 50 * GB] == [(10, 11, 11)]


@given(layers=st.integers(1, 16), stages=st.integers(1, 6), m=st.integers(1, 12))
def test_eq14_non_increasing_along_pipeline(layers: int, stages: int, m: int) -> None:
    profile = uniform_profile(64, m_p=1.0, m_o=6.0, m_g=1.0, m_a=3.0)
    peaks = [stage_peak_bytes(profile, (0, layers), i, stages, m) for i in range(stages)]
    assert peaks == sorted(peaks, reverse=True)
    double = stage_peak_bytes(profile, (0, 2 * layers), 0, stages, m)
    assert double == pytest.approx(2 * peaks[0])  # linear in N_l


def test_communication_adds_time_only_with_bandwidths() -> None:
    profile = uniform_profile(8, 1.0, 2.0, m_g=1e9, m_a=1e9)
    plan = grid_plan(8, 2, 2, 4)
    free = estimate_step_time(profile, Cluster(devices=4), plan)
    assert free == symmetric_step_time(2, 4, 4.0, 8.0)
    linked = Cluster(devices=4, devices_per_node=2, intra_node_gbps=100, inter_node_gbps=10)
    slow = estimate_step_time(profile, linked, plan)
    # each stage's 4 GB of gradients cross nodes in a ring of 2: 2·(1/2)·4e9 B / 1.25e9 B/s
    grads = 2 * (2 - 1) / 2 * 4e9 / (10e9 / 8)
    assert slow > free + grads - 1e-9
    assert not math.isinf(slow)


@given(
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    m=st.integers(1, 8),
    data=st.data(),
)
@settings(max_examples=60)
def test_optimizer_update_adds_the_slowest_devices_update(
    pp: int, dp: int, m: int, data: st.DataObject
) -> None:
    """The update term, against a count written here: per device, the updates of the layers it
    holds (once, rerouted stages included), the largest of those added to the step."""
    layers = pp * 2
    updates = data.draw(st.lists(st.floats(0.0, 1.0), min_size=layers, max_size=layers))
    plan = grid_plan(layers, pp, dp, m)
    if dp > 1 and data.draw(st.booleans()):
        rerouted = reroute(plan, frozenset({dp * pp - 1}))
        assert not isinstance(rerouted, str)
        plan = rerouted
    base = uniform_profile(layers, 0.5, 1.0)
    with_update = dataclasses.replace(base, update_s=tuple(updates))
    held: dict[int, set[int]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            for device in stage.devices:
                held.setdefault(device, set()).update(range(*stage.layers))
    slowest = max(sum(updates[k] for k in ks) for ks in held.values())
    assert estimate_step_time(with_update, FREE, plan) == pytest.approx(
        estimate_step_time(base, FREE, plan) + slowest
    )


def test_an_update_term_round_trips_and_defaults_to_nothing() -> None:
    profile = uniform_profile(4)
    assert profile.update_s == (0.0,) * 4 and not profile.has_update
    state = state_from_dict(
        {
            "model": {"layers": 4, "fwd_s": 1.0, "bwd_s": 2.0, "update_s": [0.1, 0.2, 0.3, 0.4]},
            "cluster": {"devices": 2},
            "training": {"global_batch": 2},
            "plan": {
                "pipelines": [
                    {
                        "stages": [
                            {"devices": [0], "layers": [0, 2]},
                            {"devices": [1], "layers": [2, 4]},
                        ],
                        "micro_batches": 2,
                    }
                ]
            },
        }
    )
    assert state.profile.update(0, 2) == pytest.approx(0.3)
    assert state_to_dict(state)["model"]["update_s"] == [0.1, 0.2, 0.3, 0.4]
    assert "update_s" not in state_to_dict(dataclasses.replace(state, profile=profile))["model"]
    with pytest.raises(InvalidScenario, match="3 values for 4 layers"):
        state_from_dict(
            {
                **state_to_dict(state),
                "model": {"layers": 4, "fwd_s": 1.0, "bwd_s": 1.0, "update_s": [0.1, 0.2, 0.3]},
            }
        )


@given(
    pp=st.integers(1, 4),
    dp=st.integers(2, 5),
    m=st.integers(1, 9),
    data=st.data(),
)
@settings(max_examples=80)
def test_merged_rerouting_runs_lost_pipelines_micro_batches_through_the_survivors(
    pp: int, dp: int, m: int, data: st.DataObject
) -> None:
    """Whole pipelines lost: survivor j of r takes the lost micro-batches m with m mod r == j, so
    the step is eq. 9 with the busiest survivor's count. Any other loss is eq. 13 either way."""
    layers = 2 * pp
    plan = grid_plan(layers, pp, dp, m)
    profile = uniform_profile(layers, 0.5, 1.0)
    lost = sorted(data.draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp - 1)))
    failed = frozenset(p * pp + s for p in lost for s in range(pp))
    rerouted = reroute(plan, failed)
    assert not isinstance(rerouted, str)
    survivors = dp - len(lost)
    busiest = m + len(lost) * -(-m // survivors)
    assert estimate_step_time(profile, FREE, rerouted, merge_rerouted=True) == pytest.approx(
        symmetric_step_time(pp, busiest, 1.0, 2.0)
    )
    # one more device lost in a surviving pipeline: some stage keeps fewer replicas and the
    # lost pipelines no longer map onto whole survivors, so eq. 13 charges everything
    if survivors > 1 and pp > 1:
        extra = failed | {(dp - 1 if dp - 1 not in lost else min(set(range(dp)) - set(lost))) * pp}
        partial = reroute(plan, extra)
        assert not isinstance(partial, str)
        assert estimate_step_time(profile, FREE, partial, merge_rerouted=True) == pytest.approx(
            estimate_step_time(profile, FREE, partial)
        )
