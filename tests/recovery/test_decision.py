"""The one decision function: candidates of every asked policy, the eq. 8 best chosen."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery import policies
from controlplane.recovery.codes import Code
from controlplane.recovery.decision import decide, grow
from controlplane.recovery.errors import Superseded
from controlplane.recovery.model import Candidate, ClusterState, Failure, FailureKind
from controlplane.recovery.policies.base import SteadyCosts
from tests.recovery.builders import examples, grid_state

ALL = policies.names()


@dataclass(frozen=True)
class Fixed(SteadyCosts):
    """A test policy that answers with one made-up candidate of the given objective."""

    objective: float
    feasible: bool = True
    name: ClassVar[str] = "fixed"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        code = Code.OK if self.feasible else Code.NO_SPARE
        return [Candidate(policy=self.name, code=code, note="", objective=self.objective)]


@given(objectives=st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0]), st.booleans()), max_size=6))
def test_the_first_feasible_candidate_of_highest_objective_is_chosen(
    objectives: list[tuple[float, bool]],
) -> None:
    state = grid_state(pp=2, dp=2, failed=[1])
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    asked = [Fixed(objective, feasible) for objective, feasible in objectives]
    decision = decide(state, failure, policies=asked)
    feasible = [i for i, (_, ok) in enumerate(objectives) if ok]
    if not feasible:
        assert decision.chosen is None and decision.best is None
        return
    top = max(objectives[i][0] for i in feasible)
    assert decision.chosen == next(i for i in feasible if objectives[i][0] == top)


@given(
    failed=st.sets(st.integers(0, 7), min_size=1, max_size=3),
    names=st.lists(st.sampled_from(ALL), min_size=1, max_size=4, unique=True),
)
@settings(max_examples=examples(30), deadline=None)
def test_every_asked_policy_answers_in_order(failed: set[int], names: list[str]) -> None:
    state = grid_state(layers=8, pp=2, dp=2, tp=2, spares=2, failed=sorted(failed))
    failure = Failure(kind=FailureKind.CRASH, devices=frozenset(failed))
    decision = decide(state, failure, policies=names)
    asked = list(dict.fromkeys(c.policy for c in decision.candidates))
    assert asked == names, "one answer or more per policy, in the order asked"
    best = decision.best
    for candidate in decision.candidates:
        assert candidate.feasible == (candidate.code is Code.OK)
        if best is not None and candidate.feasible:
            assert candidate.objective <= best.objective
    assert decision.search_s >= 0


def test_options_reach_the_named_policy_and_bad_ones_are_refused() -> None:
    state = grid_state(layers=6, pp=3, dp=2, failed=[0])
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    fast = decide(state, failure, policies=["dynamic"])
    exhaustive = decide(
        state, failure, policies=["dynamic"], options={"dynamic": {"exhaustive": True}}
    )
    assert exhaustive.best is not None and fast.best is not None
    assert exhaustive.best.objective == pytest.approx(fast.best.objective)
    with pytest.raises(policies.InvalidOption, match="not asked"):
        decide(state, failure, policies=["rerouting"], options={"dynamic": {"exhaustive": True}})
    with pytest.raises(policies.InvalidOption, match="takes no option 'exhaustive'"):
        decide(state, failure, policies=["rerouting"], options={"rerouting": {"exhaustive": 1}})


@pytest.mark.parametrize(
    ("name", "options", "accepted"),
    [
        ("oobleck", {"f": 2}, True),
        ("oobleck", {"f": "many"}, False),
        ("oobleck", {"f": 2.5}, False),  # a count is an int
        ("oobleck", {"f": True}, False),  # a bool is no count
        ("oobleck", {"regroup_s": 3}, True),  # an int is a fine float
        ("checkpoint", {"restart_min_s": float("nan")}, False),
        ("dynamic", {"exhaustive": 1}, False),
        ("varuna", {"checkpoint_s": None}, True),
        ("checkfree", {"restart_s": None}, False),
    ],
)
def test_option_values_of_the_wrong_type_are_refused_naming_the_option(
    name: str, options: dict[str, Any], accepted: bool
) -> None:
    if accepted:
        built = policies.get(name, **options)
        assert all(getattr(built, key) == value for key, value in options.items())
        return
    with pytest.raises(policies.InvalidOption) as caught:
        policies.get(name, **options)
    assert caught.value.field == f"options.{name}.{next(iter(options))}"


@dataclass(frozen=True)
class Watching(Fixed):
    """``Fixed``, noting whether Python's garbage collector ran while it was asked."""

    seen: list[bool] = field(default_factory=list)
    fails: bool = False

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        self.seen.append(gc.isenabled())
        if self.fails:
            raise RuntimeError("the policy failed")
        return super().propose(state, failure)

    def grow(self, state: ClusterState) -> list[Candidate]:
        self.seen.append(gc.isenabled())
        return []


def test_policies_decide_with_the_garbage_collector_paused_and_it_runs_again_after() -> None:
    """A decision at 131,072 devices makes millions of objects the collector walked again and
    again (recovery/collector.py); paused while the policies answer, on again after them, also
    when one raises, and left off where it was off."""
    state = grid_state(pp=2, dp=2, failed=[1])
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    policy = Watching(1.0)
    assert gc.isenabled()
    decide(state, failure, policies=[policy, policy])
    grow(state, failure, policies=[policy])
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        decide(state, failure, policies=[Watching(1.0, seen=policy.seen, fails=True)])
    assert gc.isenabled()
    gc.disable()
    try:
        decide(state, failure, policies=[policy])
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert policy.seen == [False] * 5


@given(
    objectives=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=1, max_size=5),
    changed_after=st.integers(1, 6),
)
def test_a_failure_that_changed_stops_the_decision_before_the_next_policy(
    objectives: list[float], changed_after: int
) -> None:
    """``stale`` is asked before each policy but the first; once it says the failure changed,
    no policy runs again and ``Superseded`` is raised. Never changed, the answer is the same."""
    state = grid_state(pp=2, dp=2, failed=[1])
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    ran: list[int] = []

    @dataclass(frozen=True)
    class Counted(Fixed):
        index: int = 0

        def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
            ran.append(self.index)
            return super().propose(state, failure)

    asked = [Counted(objective, index=i) for i, objective in enumerate(objectives)]
    calls: list[int] = []

    def stale() -> bool:
        calls.append(len(ran))
        return len(ran) >= changed_after

    if changed_after < len(objectives):
        with pytest.raises(Superseded):
            decide(state, failure, policies=asked, stale=stale)
        assert ran == list(range(changed_after))
    else:
        decision = decide(state, failure, policies=asked, stale=stale)
        assert ran == list(range(len(objectives)))
        top = max(objectives)
        assert decision.chosen == objectives.index(top)
    # asked before policies 1, 2, ... (after as many had run), up to the one that said so
    assert calls == list(range(1, min(changed_after, len(objectives) - 1) + 1))


@given(
    failed=st.sets(st.integers(0, 7), min_size=1, max_size=2),
    yes_at=st.integers(1, 5),
)
@settings(max_examples=examples(20), deadline=None)
def test_the_re_plan_stops_at_its_own_checkpoints_once_the_failure_changed(
    failed: set[int], yes_at: int
) -> None:
    """``dynamic`` alone: no policy comes after it, so only its own checkpoints ask. The first
    yes raises ``Superseded`` there; with none, the answer is the one made without asking."""
    state = grid_state(layers=8, pp=2, dp=2, tp=2, spares=2, failed=sorted(failed))
    failure = Failure(kind=FailureKind.CRASH, devices=frozenset(failed))
    plain = decide(state, failure, policies=["dynamic"])
    asked: list[int] = []

    def stale() -> bool:
        asked.append(1)
        return len(asked) >= yes_at

    try:
        decision = decide(state, failure, policies=["dynamic"], stale=stale)
    except Superseded:
        assert len(asked) == yes_at
    else:
        assert len(asked) < yes_at
        assert decision.candidates == plain.candidates and decision.chosen == plain.chosen


def test_a_re_plan_asks_before_its_first_search() -> None:
    state = grid_state(layers=8, pp=2, dp=2, failed=[1])
    failure = Failure(kind=FailureKind.CRASH, devices=frozenset({1}))
    with pytest.raises(Superseded, match="before the re-plan's first search"):
        decide(state, failure, policies=["dynamic"], stale=lambda: True)
