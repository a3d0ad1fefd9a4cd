"""What importing the core costs: a training node imports the estimator and the registry."""

from __future__ import annotations

import json
import os

import pytest

from tests.processes import python_in_repo

HEAVY = ("scipy", "networkx", "simpy", "plotly")


@pytest.mark.parametrize(
    "module",
    [
        "controlplane.recovery.policies",
        "controlplane.recovery.estimator",
        "controlplane.recovery.planner",
        "controlplane.recovery.model",
        "controlplane.recovery.causes",
    ],
)
def test_importing_the_core_loads_no_heavy_library(module: str) -> None:
    """The registry promises lazy loading: scipy and networkx come only with a placement."""
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    assert json.loads(python_in_repo("-c", code, env=os.environ)) == []


def test_placing_a_plan_still_finds_its_solvers() -> None:
    """The solvers load where they are used; a placement works from a fresh interpreter."""
    code = (
        "from tests.recovery.builders import grid_state\n"
        "from controlplane.recovery.policies.dynamic import plan_dynamic\n"
        "import sys\n"
        "c = plan_dynamic('dynamic', grid_state(pp=2, dp=3, failed=[1]))\n"
        "print(c.feasible, 'scipy' in sys.modules)\n"
    )
    assert python_in_repo("-c", code, env=os.environ).split() == ["True", "True"]
