"""Simulation sweeps for Celery: an experiment from JSON, its pieces, a piece's run, the merge.

Each function takes the scenario and the experiment as JSON, so a task needs nothing but its
arguments: a piece (one policy or the ideal over one seed) runs on any worker of any host.
"""

from __future__ import annotations

from typing import Any

from controlplane.recovery.codec import Scenario, scenario_from_dict
from controlplane.recovery.simulator import Experiment
from controlplane.recovery.simulator import sweep as core
from controlplane.recovery.simulator.timeline import Run


def _experiment(scenario: Scenario, given: Any) -> Experiment:
    """The experiment, the scenario's policy options under the ones ``given`` names."""
    if isinstance(given, dict) and isinstance(given.get("policies"), list):
        options = {
            name: {**scenario.options.get(name, {}), **(given.get("options") or {}).get(name, {})}
            for name in given["policies"]
            if isinstance(name, str)
        }
        given = {**given, "options": {k: v for k, v in options.items() if v}}
    return core.experiment_from_dict(given, scenario.state)


def pieces(scenario: Any, experiment: Any) -> list[tuple[int, str]]:
    """Check the scenario and the experiment (``InvalidScenario`` names the field at fault);
    every (seed, policy) piece to run, the ideal's included."""
    parsed = scenario_from_dict(scenario)
    return [(p.seed, p.policy) for p in core.pieces(_experiment(parsed, experiment))]


def run_piece(scenario: Any, experiment: Any, seed: int, policy: str) -> dict[str, Any]:
    """One piece's run, as JSON."""
    parsed = scenario_from_dict(scenario)
    piece = core.Piece(seed, policy)
    return core.run_piece(parsed.state, _experiment(parsed, experiment), piece).to_dict()


def merge(scenario: Any, experiment: Any, runs: list[dict[str, Any]], *, name: str = "") -> Any:
    """The sweep's summary (the simulator's summary.json, with mean curves) from its pieces."""
    parsed = scenario_from_dict(scenario)
    batch = parsed.state.training.global_batch
    return core.merge(
        _experiment(parsed, experiment), [Run.from_dict(r, batch) for r in runs], scenario=name
    )
