"""CheckFree+'s standing convergence inflation, charged by the simulator while it runs."""

from __future__ import annotations

import pytest

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.policies.checkfree import CheckFreePlusPolicy
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.traces import Trace
from tests.recovery.builders import grid_state

HOUR = 3600.0


def test_swap_inflation_is_one_plus_s() -> None:
    state = grid_state(layers=12, pp=6, dp=1)
    assert CheckFreePlusPolicy().convergence_factor(state) == pytest.approx(1.23)
    assert CheckFreePlusPolicy(step_inflation=0.0).convergence_factor(state) == 1.0


@pytest.mark.parametrize("s", [0.0, 0.23, 0.5])
def test_checkfree_plus_pays_its_swap_schedule_without_failures(s: float) -> None:
    state = grid_state(
        layers=12,
        pp=6,
        dp=1,
        micro_batches=8,
    )
    step_s = estimate_step_time(state.profile, state.cluster, state.plan)
    plus = simulate(state, CheckFreePlusPolicy(step_inflation=s), Trace(()), HOUR)
    plain = simulate(state, "checkfree", Trace(()), HOUR)
    assert plain.samples == pytest.approx(8 * HOUR / step_s)
    assert plus.samples == pytest.approx(plain.samples / (1 + s))
