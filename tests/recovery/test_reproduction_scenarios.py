"""The reproduction scenarios in examples/ subfolders (examples/oobleck/, …) stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
# Top-level examples/*.json go through the plan CLI in test_cli.py; these are one level down.
SCENARIOS = sorted(p for p in (ROOT / "examples").glob("*/**/*.json"))


def test_reproduction_scenarios_exist() -> None:
    assert any(p.parent.name == "oobleck" for p in SCENARIOS)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_reproduction_scenario_is_valid(path: Path) -> None:
    state = load_scenario(path)
    assert estimate_step_time(state.profile, state.cluster, state.plan) > 0


@pytest.mark.parametrize(
    "name",
    ["gpt3-6.7b-oobleck", "gpt3-6.7b-varuna", "gpt2-oobleck", "gpt2-varuna", "gpt2-bamboo"],
)
def test_oobleck_scenarios_start_with_every_node(name: str) -> None:
    """Oobleck's Table 2 starts with 30 nodes of one GPU and the artifact's f = 3."""
    state = load_scenario(ROOT / "examples" / "oobleck" / f"{name}.json")
    assert state.cluster.devices == 30
    assert state.cluster.devices_per_node == 1
    assert state.assumptions.oobleck_f == 3
