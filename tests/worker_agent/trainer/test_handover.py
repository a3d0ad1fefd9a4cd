"""Weights and optimizer state handed over between plans train on as if nothing had moved.

One launch of 4 ranks with AdamW (whose moments make a lost optimizer state show):

- phase 0: PP2 × DP2 for steps 0-1, from the initial weights;
- phase 1: the same shape with every device on other layers (each receives its layers from a
  holder), steps 2-3;
- phase 2: one pipeline of 4 stages over the same devices (layers split anew), steps 4-5;
- phase 3: one pipeline of 2 stages on devices 0 and 1 only, steps 6-7: devices 2 and 3 only
  send the layers they held and take no part in the training;
- phases 4-6: the unmoved run, PP2 × DP2 for steps 0-3, then on for steps 4-5 and 6-7.

Phase 1 does the same arithmetic in the same order as phase 4, so its weights are bitwise those
of the unmoved run; phases 2 and 3 sum gradients in other orders, so they match closely.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.worker_agent.trainer.reference import pipeline, plan, stage
from worker_agent.trainer.engine import TrainConfig, TrainPlan
from worker_agent.trainer.handover import NoHolder, transfers
from worker_agent.trainer.launch import Phase, RunResult, run_local

CONFIG = TrainConfig(optimizer="adamw", lr=3e-3)

PP2_DP2 = plan(
    pipeline(2, stage(0, 0, 4), stage(1, 4, 8)), pipeline(2, stage(2, 0, 4), stage(3, 4, 8))
)
SWAPPED = plan(
    pipeline(2, stage(3, 0, 4), stage(2, 4, 8)), pipeline(2, stage(1, 0, 4), stage(0, 4, 8))
)
PP4 = plan(pipeline(4, stage(2, 0, 2), stage(0, 2, 4), stage(3, 4, 6), stage(1, 6, 8)))
PP2_ON_0_1 = plan(pipeline(4, stage(0, 0, 4), stage(1, 4, 8)))


def _model(run: RunResult, phase: int) -> dict[int, dict[str, np.ndarray]]:
    """Every layer's weights after a phase, from the lowest device holding it."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for device in sorted(run.weights[phase]):
        for k, params in run.weights[phase][device].items():
            out.setdefault(k, params)
    return out


@pytest.fixture(scope="module")
def run() -> RunResult:
    phases = [
        Phase(PP2_DP2, 2),
        Phase(SWAPPED, 2, carry=True),
        Phase(PP4, 2, carry=True),
        Phase(PP2_ON_0_1, 2, carry=True),
        Phase(PP2_DP2, 4, first_step=0),
        Phase(PP2_DP2, 2, carry=True),
        Phase(PP2_DP2, 2, carry=True),
    ]
    return run_local(4, phases, CONFIG, collect_weights=True, timeout_s=150)


def test_a_permuted_plan_trains_bitwise_as_the_unmoved_run(run: RunResult) -> None:
    moved, unmoved = _model(run, 1), _model(run, 4)
    assert set(moved) == set(range(8))
    for k in moved:
        for name, value in moved[k].items():
            assert np.array_equal(value, unmoved[k][name]), (k, name)
    steps = {**run.losses(0), **run.losses(1)}
    np.testing.assert_allclose(list(steps.values()), list(run.losses(4).values()), rtol=1e-12)


@pytest.mark.parametrize(("moved", "unmoved"), [(2, 5), (3, 6)], ids=["pp4", "pp2-on-0-1"])
def test_a_reshaped_plan_trains_on_as_the_unmoved_run(
    run: RunResult, moved: int, unmoved: int
) -> None:
    got, want = _model(run, moved), _model(run, unmoved)
    assert set(got) == set(range(8))
    for k in got:
        for name, value in got[k].items():
            # AdamW: a few elements with a gradient near zero move by a fraction of lr on noise
            np.testing.assert_allclose(value, want[k][name], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        list(run.losses(moved).values()), list(run.losses(unmoved).values()), rtol=1e-5
    )


def test_every_device_holds_exactly_its_new_stage(run: RunResult) -> None:
    assert {d: sorted(w) for d, w in run.weights[2].items()} == {
        2: [0, 1],
        0: [2, 3],
        3: [4, 5],
        1: [6, 7],
    }
    # devices 2 and 3 sent layers 0-1 and 4-5, and hold nothing under a plan without them
    assert {d: sorted(w) for d, w in run.weights[3].items()} == {
        0: [0, 1, 2, 3],
        1: [4, 5, 6, 7],
        2: [],
        3: [],
    }
    assert {r.device for r in run.steps[3]} == {0, 1}


def test_the_moved_weights_changed_owner(run: RunResult) -> None:
    """Not vacuous: after the swap device 0 holds layers 4-7, which it never trained itself."""
    assert sorted(run.weights[0][0]) == [0, 1, 2, 3]
    assert sorted(run.weights[1][0]) == [4, 5, 6, 7]


def test_transfers_take_each_missing_layer_from_a_live_holder() -> None:
    old = TrainPlan.parse(SWAPPED, 8).plan  # 3, 1 hold layers 0-3; 2, 0 hold 4-7
    new = TrainPlan.parse(PP4, 8).plan
    moves = transfers(old, new, live={0, 1, 2, 3})
    assert sorted((t.layer, t.dst) for t in moves) == [
        (0, 2),
        (1, 2),
        (2, 0),
        (3, 0),
        (4, 3),
        (5, 3),
        (6, 1),
        (7, 1),
    ]
    for t in moves:
        assert t.src in ({1, 3} if t.layer < 4 else {0, 2})
    # the holders share the sending: each of the four sends two layers
    assert sorted(t.src for t in moves) == [0, 0, 1, 1, 2, 2, 3, 3]
    # a failed holder is never asked
    moves = transfers(old, new, live={0, 1, 3})
    assert {t.src for t in moves if t.layer >= 4} == {0}


def test_a_plan_keeping_every_layer_in_place_moves_nothing() -> None:
    old = TrainPlan.parse(PP2_DP2, 8).plan
    assert transfers(old, TrainPlan.parse(PP4, 8).plan, live={0, 1, 2, 3}) == []


def test_a_layer_without_live_holder_is_refused() -> None:
    old = TrainPlan.parse(SWAPPED, 8).plan
    new = TrainPlan.parse(PP4, 8).plan
    with pytest.raises(NoHolder, match=r"layer [4-7] has no live holder"):
        transfers(old, new, live={1, 3})
