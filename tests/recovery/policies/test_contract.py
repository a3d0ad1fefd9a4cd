"""One contract over every registered policy: the promises the control plane relies on."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.recovery import policies
from controlplane.recovery.codec import candidate_to_dict
from controlplane.recovery.codes import Code
from controlplane.recovery.errors import UnknownPolicy
from controlplane.recovery.model import ClusterState, Failure, FailureKind
from tests.recovery.builders import grid_state, uniform_profile

GB = 1e9


@st.composite
def states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 4))
    tp = draw(st.sampled_from([1, 2]))
    devices = pp * dp * tp
    spares = draw(st.sampled_from([0, tp, 2 * tp]))
    failed = draw(st.sets(st.integers(0, devices + spares - 1), min_size=1, max_size=3))
    return grid_state(
        layers=draw(st.integers(pp, 12)),
        pp=pp,
        dp=dp,
        tp=tp,
        micro_batches=draw(st.integers(1, 6)),
        failed=sorted(failed),
        spares=spares,
        devices_per_node=draw(st.sampled_from([2, 4, 8])),
        profile=None,
        memory_bytes=draw(st.sampled_from([math.inf, 200 * GB])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0)])),
    )


def with_memory(state: ClusterState) -> ClusterState:
    profile = uniform_profile(state.profile.layers, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB, m_a=2 * GB)
    return ClusterState(
        profile=profile,
        cluster=state.cluster,
        training=state.training,
        plan=state.plan,
        failed=state.failed,
        assumptions=state.assumptions,
    )


@pytest.mark.parametrize("name", policies.names())
@given(state=states())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_policy_contract(name: str, state: ClusterState) -> None:
    state = with_memory(state)
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    policy = policies.get(name)
    candidates = policy.propose(state, failure)
    assert candidates, "a policy always answers, if only to decline"
    again = policies.get(name).propose(state, failure)
    assert [candidate_to_dict(c) for c in candidates] == [candidate_to_dict(c) for c in again], (
        "deterministic"
    )
    for candidate in candidates:
        assert candidate.policy == name
        if not candidate.feasible:
            assert candidate.code in set(Code) - {Code.OK}, "a declining policy says why, coded"
            assert candidate.note, "and in words"
            continue
        plan = candidate.plan
        assert plan is not None
        if getattr(policy, "restarts_in_place", False):
            # a process's fault: its device runs the restarted process; no other failed device
            assert plan.devices() & state.failed <= failure.devices, "in place, nothing else"
        else:
            assert not plan.devices() & state.failed, "never uses a failed device"
        assert plan.micro_batches == state.training.micro_batches, "keeps the global batch"
        for pipeline in plan.pipelines:
            assert pipeline.stages[0].layers[0] == 0
            assert pipeline.stages[-1].layers[1] == state.profile.layers
        assert max(candidate.peak_memory_bytes.values()) <= state.cluster.device_memory_bytes
        t = candidate.transition
        parts = (t.detection_s, t.search_s, t.weight_transfer_s, t.restart_s, t.lost_work_s)
        assert min(parts) >= 0
        assert t.total_s == pytest.approx(sum(parts))
        assert candidate.est_step_time_s > 0 and candidate.objective >= 0


def test_registry_names_match_the_cli_contract() -> None:
    assert policies.names() == [
        "odyssey",
        "rerouting",
        "dynamic",
        "oobleck",
        "checkfree",
        "checkfree_plus",
        "flashrecovery",
        "checkpoint",
        "bamboo",
        "varuna",
        "odyssey_spares",
        "pitstop",
        "restart",
        "restart_shrink",
    ]
    assert policies.default_names() == policies.names()[:-2]  # the launcher's: by name only


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(UnknownPolicy, match="known: odyssey, rerouting"):
        policies.get("nope")


def test_unknown_options_are_refused_with_the_known_ones() -> None:
    with pytest.raises(policies.InvalidOption, match="takes: exhaustive"):
        policies.get("dynamic", exhastive=True)
    with pytest.raises(policies.InvalidOption, match="takes: none"):
        policies.get("rerouting", exhaustive=True)
    # a name's preset options are not the caller's to change
    with pytest.raises(policies.InvalidOption, match="use_spares"):
        policies.get("odyssey_spares", use_spares=False)


@pytest.mark.parametrize("name", policies.names())
def test_every_policy_describes_itself(name: str) -> None:
    info = policies.describe(name)
    assert info.name == name and info.summary and not info.summary.endswith(":")
    built = policies.get(name, **info.options)  # every listed option is taken, defaults included
    assert built.name == name


def test_registering_a_name_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="already registered"):
        policies.register("odyssey", "controlplane.recovery.policies.odyssey:OdysseyPolicy")
