"""An experiment end to end: the policies and the ideal over its traces, and the files written."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import ClusterState
from controlplane.recovery.simulator.experiment import (
    Experiment,
    Progress,
    run_experiment,
    run_ideal,
)
from controlplane.recovery.simulator.ideal import IDEAL
from controlplane.recovery.simulator.metrics import summarize
from controlplane.recovery.simulator.timeline import Run
from controlplane.recovery.simulator.traces import Trace, save_csv


def run(
    state: ClusterState,
    experiment: Experiment,
    *,
    out_dir: str | Path,
    report: bool = True,
    save_traces: bool = False,
    scenario: str = "",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Simulate ``experiment`` from ``state`` (its plan is the starting plan, its failed devices
    are ignored) and write summary.json, timeline.json, report.html unless ``report`` is False,
    and each seed's trace as CSV with ``save_traces``; return the summary.

    ``scenario`` names where ``state`` came from, for the summary and the report's title.
    Errors are InvalidScenario naming the argument (``out_dir``) or the experiment's field.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidScenario(f"{out} exists and is not a directory", field="out_dir")
    runs, traces = run_experiment(state, experiment, progress=progress)
    ideal = run_ideal(state, experiment, traces, progress=progress)
    parameters = {**experiment.parameters(), "scenario": scenario}
    summary = summarize(runs, parameters, ideal=ideal)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    timeline = {name: [r.to_dict() for r in policy_runs] for name, policy_runs in runs.items()}
    timeline[IDEAL] = [r.to_dict() for r in ideal]
    (out / "timeline.json").write_text(json.dumps(timeline) + "\n")
    if save_traces:
        _save_traces(out / "traces", traces, ideal)
    if report:
        from controlplane.recovery.simulator.report import write_report  # plotly loads here

        title = f"Pitstop simulation: {Path(scenario).name}" if scenario else "Pitstop simulation"
        write_report(out / "report.html", runs, summary, title, ideal=ideal)
    return summary


def _save_traces(folder: Path, traces: list[Trace], runs: list[Run]) -> None:
    folder.mkdir(exist_ok=True)
    for trace, run in zip(traces, runs, strict=True):
        save_csv(trace, folder / f"seed-{run.seed}.csv")


@contextmanager
def progress_bar(experiment: Experiment) -> Iterator[Progress]:
    """A progress bar in simulated hours on stderr, drawn only when stderr is a terminal."""
    total_h = experiment.hours * experiment.seeds * (len(experiment.policies) + 1)  # + the ideal
    done: dict[tuple[str, int], float] = {}
    with tqdm(
        total=round(total_h, 3),
        unit="sim h",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} sim h [{elapsed}<{remaining}{postfix}]",
    ) as bar:

        def progress(policy: str, seed: int, now_s: float) -> None:
            hours = now_s / 3600
            step = hours - done.get((policy, seed), 0.0)
            if step > 0:
                done[(policy, seed)] = hours
                bar.set_postfix_str(f"{policy} seed {seed}", refresh=False)
                bar.update(step)

        yield progress
