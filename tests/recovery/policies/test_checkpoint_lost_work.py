"""Lost work told by a clock: what ran since the last checkpoint and of the interrupted step.

Without a clock (the planner, the CLI) policies charge the expectation; the simulator tells them
what a fault really threw away through ``ClusterState``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.model import Assumptions, ClusterState, Failure, FailureKind
from controlplane.recovery.policies import get
from tests.recovery.builders import grid_state

# 8 layers at 1 s + 2 s, 2 stages × 2 pipelines of 4 micro-batches: (4 + 2 − 1) × 12 = 60 s
STEP_S = 60.0
DETECTION_S = 5.0


def failed_state(**lost: float | None) -> ClusterState:
    state = grid_state(
        pp=2,
        dp=2,
        spares=2,
        failed=[1],
        assumptions=Assumptions(detection_s=DETECTION_S, checkpoint_interval_steps=101),
    )
    return replace(state, **lost)  # type: ignore[arg-type]


def lost_work_s(name: str, state: ClusterState) -> float:
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    candidate = next(c for c in get(name).propose(state, failure) if c.feasible)
    assert candidate.transition.detection_s == DETECTION_S, "detection is charged on its own"
    return candidate.transition.detection_s + candidate.transition.lost_work_s


def test_without_a_clock_a_whole_step_and_half_an_interval_are_charged() -> None:
    # 0..100 completed steps since the checkpoint with equal odds: 50, plus the whole step
    assert lost_work_s("checkpoint", failed_state()) == pytest.approx(DETECTION_S + 51 * STEP_S)


@given(
    interrupted=st.floats(0, STEP_S),
    completed=st.integers(0, 100).map(lambda n: n * STEP_S),
)
@settings(max_examples=50, deadline=None)
def test_checkpoint_charges_what_ran_since_the_checkpoint(
    interrupted: float, completed: float
) -> None:
    state = failed_state(interrupted_step_s=interrupted, completed_since_checkpoint_s=completed)
    assert lost_work_s("checkpoint", state) == pytest.approx(DETECTION_S + interrupted + completed)


def test_a_failure_100_s_into_the_run_costs_100_s_not_half_an_interval() -> None:
    # one 60 s step done and 40 s of the next: the checkpoint at step 0 is the last one
    state = failed_state(interrupted_step_s=40.0, completed_since_checkpoint_s=60.0)
    assert lost_work_s("checkpoint", state) == pytest.approx(DETECTION_S + 100.0)


@pytest.mark.parametrize(
    "name", ["checkpoint", "flashrecovery", "rerouting", "dynamic", "varuna", "odyssey"]
)
def test_no_step_running_costs_no_interrupted_step(name: str) -> None:
    running = failed_state(interrupted_step_s=30.0, completed_since_checkpoint_s=0.0)
    down = failed_state(interrupted_step_s=0.0, completed_since_checkpoint_s=0.0)
    assert lost_work_s(name, running) - lost_work_s(name, down) == pytest.approx(30.0)


@pytest.mark.parametrize("name", ["checkpoint", "flashrecovery", "rerouting", "dynamic"])
def test_nothing_left_to_lose_costs_only_detection(name: str) -> None:
    # a second failure during a checkpoint restart: the rollback was charged once already
    state = failed_state(interrupted_step_s=0.0, completed_since_checkpoint_s=0.0)
    assert lost_work_s(name, state) == pytest.approx(DETECTION_S)
