"""The decision shortcuts the simulator relies on at scale keep Odyssey's decisions exact."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.estimator.time import gradient_sync_floor_s, gradient_sync_time
from controlplane.recovery.model import Assumptions, ClusterState
from controlplane.recovery.planner import usable_groups
from controlplane.recovery.policies.dynamic import plan_dynamic
from controlplane.recovery.policies.odyssey import choose_family
from tests.recovery.builders import grid_state, uniform_profile

GB = 1e9


@st.composite
def failed_states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(2, 6))
    tp = draw(st.sampled_from([1, 2]))
    devices = pp * dp * tp
    failed = draw(st.sets(st.integers(0, devices - 1), min_size=1, max_size=max(1, devices // 3)))
    layers = draw(st.integers(pp, 10))
    return grid_state(
        layers=layers,
        pp=pp,
        dp=dp,
        tp=tp,
        micro_batches=draw(st.integers(1, 6)),
        failed=sorted(failed),
        profile=uniform_profile(
            layers, m_p=1 * GB, m_o=6 * GB, m_g=draw(st.sampled_from([1, 4])) * GB
        ),
        devices_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        failure_rate=draw(st.sampled_from([0.0, 0.1, 10.0])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0), (10.0, 1.0), (1.0, 10.0)])),
        assumptions=Assumptions(restart_s=draw(st.sampled_from([0.0, 2.0, 60.0]))),
    )


@given(state=failed_states())
@settings(max_examples=80, deadline=None)
def test_dominance_cut_never_changes_odyssey_choice(state: ClusterState) -> None:
    cut = choose_family("odyssey", state)
    full = choose_family("odyssey", state, dominance_cut=False)
    assert cut.feasible == full.feasible
    assert cut.objective == full.objective
    assert cut.plan == full.plan


@given(state=failed_states())
@settings(max_examples=80, deadline=None)
def test_gradient_sync_floor_holds_for_every_replan(state: ClusterState) -> None:
    candidate = plan_dynamic("dynamic", state)
    if not candidate.feasible or candidate.plan is None:
        return
    plan = candidate.plan
    floor = gradient_sync_floor_s(
        state.profile,
        state.cluster,
        groups=len(usable_groups(state)),
        dp=plan.dp,
        tp=plan.tp,
    )
    assert floor <= gradient_sync_time(state.profile, state.cluster, plan) * (1 + 1e-12)


def test_dominated_replan_says_so() -> None:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, failed=[1], failure_rate=0.1)
    candidate = plan_dynamic("dynamic", state, beat=math.inf)
    assert not candidate.feasible and candidate.code == "dominated"
    chosen = choose_family("odyssey", state)
    assert chosen.feasible and chosen.note and chosen.option is not None
