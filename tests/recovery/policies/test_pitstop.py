"""Pitstop's policy: eq. 8 over rerouting, re-planning with and without spares, and swapping."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.model import Failure, FailureKind
from controlplane.recovery.policies.odyssey import choose_family
from controlplane.recovery.policies.pitstop import PitstopPolicy, choose_any_family
from tests.recovery.builders import grid_state
from tests.recovery.policies.checks import assert_valid_plan


def crash(*devices: int) -> Failure:
    return Failure(kind=FailureKind.CRASH, devices=frozenset(devices))


def test_without_spares_it_chooses_what_odyssey_chooses() -> None:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, failed=[1])
    ours = choose_any_family("pitstop", state, crash(1))
    theirs = choose_family("odyssey", state)
    assert ours.feasible and theirs.feasible
    assert ours.objective == theirs.objective
    assert ours.plan == theirs.plan


def test_with_spares_it_uses_them_where_odyssey_leaves_them_idle() -> None:
    state = grid_state(layers=8, pp=2, dp=2, micro_batches=4, failed=[1], spares=2)
    ours = choose_any_family("pitstop", state, crash(1))
    theirs = choose_family("odyssey", state)
    assert ours.feasible and ours.plan is not None
    assert ours.plan.devices() & set(state.cluster.spare_ids), ours.reason
    assert ours.objective > theirs.objective
    assert_valid_plan(ours.plan, state)


def test_declines_with_every_reason_when_nothing_is_feasible() -> None:
    state = grid_state(layers=2, pp=2, dp=1, micro_batches=2, failed=[0, 1])
    candidate = choose_any_family("pitstop", state, crash(0, 1))
    assert not candidate.feasible
    assert "replica" in candidate.reason


@given(
    dp=st.integers(2, 4),
    failed=st.sets(st.integers(0, 7), min_size=1, max_size=2),
    spares=st.sampled_from([0, 2]),
)
@settings(max_examples=20, deadline=None)
def test_never_worse_than_odyssey_by_eq_8(dp: int, failed: set[int], spares: int) -> None:
    state = grid_state(layers=8, pp=2, dp=dp, micro_batches=4, spares=spares)
    failed = {d % (2 * dp) for d in failed}
    state = state.with_failure(crash(*failed))
    ours = PitstopPolicy().propose(state, crash(*failed))[0]
    theirs = choose_family("odyssey", state)
    if theirs.feasible:
        assert ours.feasible
        assert ours.objective >= theirs.objective * (1 - 1e-12)
