"""Assertions shared by the policy tests: what a valid recovery candidate looks like."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st

from controlplane.recovery.model import Candidate, ClusterState, ExecutionPlan, Family
from tests.recovery.builders import grid_state


def assert_valid_plan(plan: ExecutionPlan, state: ClusterState) -> None:
    """Invariants every recovery plan keeps (issue 4's property list)."""
    assert plan.micro_batches == state.training.micro_batches
    assert not plan.devices() & state.failed
    owners: dict[int, int] = {}
    for p, pipeline in enumerate(plan.pipelines):
        assert pipeline.stages[0].layers[0] == 0
        assert pipeline.stages[-1].layers[1] == state.profile.layers
        for a, b in itertools.pairwise(pipeline.stages):
            assert a.layers[1] == b.layers[0]
        seen: set[int] = set()
        for stage in pipeline.stages:
            assert not seen & set(stage.devices), "a device in two stages of one pipeline"
            seen |= set(stage.devices)
            if stage.rerouted:
                continue
            for d in stage.devices:
                assert owners.setdefault(d, p) == p, "a device in two pipelines"


def assert_transition_adds_up(candidate: Candidate) -> None:
    t = candidate.transition
    parts = (t.search_s, t.weight_transfer_s, t.restart_s, t.lost_work_s)
    assert all(x >= 0 for x in parts)
    assert t.total_s == pytest.approx(sum(parts))


def assert_replaced_on_spares(state: ClusterState, candidate: Candidate) -> None:
    """Same shape, layers and batch; broken stages and only they moved onto spare groups."""
    plan = candidate.plan
    assert plan is not None and plan.family is Family.DYNAMIC
    assert_valid_plan(plan, state)
    spares = set(state.spare_devices())
    moved: list[int] = []
    for old, new in zip(state.plan.pipelines, plan.pipelines, strict=True):
        assert new.micro_batches == old.micro_batches
        for old_stage, new_stage in zip(old.stages, new.stages, strict=True):
            assert new_stage.layers == old_stage.layers
            assert len(new_stage.devices) == len(old_stage.devices)
            if state.failed & set(old_stage.devices):
                assert set(new_stage.devices) <= spares
                moved.extend(new_stage.devices)
            else:
                assert new_stage == old_stage
    assert len(moved) == len(set(moved))
    assert_transition_adds_up(candidate)


@st.composite
def failed_states(draw: st.DrawFn) -> ClusterState:
    """Symmetric plans with spares and up to five failed devices, spares included."""
    pp, dp, tp = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    spares = draw(st.integers(0, 12))
    devices = pp * dp * tp + spares
    failed = draw(st.sets(st.integers(0, devices - 1), max_size=5))
    return grid_state(
        layers=pp * draw(st.integers(1, 3)),
        pp=pp,
        dp=dp,
        tp=tp,
        spares=spares,
        devices_per_node=draw(st.sampled_from([2, 4, 8])),
        failed=sorted(failed),
    )
