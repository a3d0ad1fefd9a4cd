"""The ``simulate`` command: options to an experiment, a progress bar, the files it writes."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import ClusterState
from controlplane.recovery.simulator.experiment import Experiment, run_experiment
from controlplane.recovery.simulator.metrics import summarize
from controlplane.recovery.simulator.timeline import Run
from controlplane.recovery.simulator.traces import (
    Distribution,
    RepairDistribution,
    Trace,
    TraceSpec,
    load_csv,
    save_csv,
)


def _number(text: str | None, field: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise InvalidScenario(f"{text!r} is not a number", field=field) from None


def _float(text: str, field: str) -> float:
    value = _number(text, field)
    assert value is not None
    return value


def _integer(text: str | None, field: str) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidScenario(f"{text!r} is not an integer", field=field) from None


def _trace(state: ClusterState, args: argparse.Namespace) -> TraceSpec | Trace:
    kind: str = args.trace
    if kind.startswith("csv:"):
        return load_csv(kind[len("csv:") :], state.cluster)
    if kind not in {d.value for d in Distribution}:
        raise InvalidScenario(f"{kind!r} is not poisson, weibull or csv:PATH", field="--trace")
    rate = _number(args.failure_rate, "--failure-rate")
    return TraceSpec(
        distribution=Distribution(kind),
        failure_rate_per_device_hour=(
            state.cluster.failure_rate_per_device_hour if rate is None else rate
        ),
        weibull_shape=_float(args.weibull_shape, "--weibull-shape"),
        weibull_scale_hours=_number(args.weibull_scale_hours, "--weibull-scale-hours"),
        node_failure_prob=_float(args.node_failure_prob, "--node-failure-prob"),
        node_failure_rate_per_node_hour=_float(args.node_failure_rate, "--node-failure-rate"),
        burst_prob=_float(args.burst_prob, "--burst-prob"),
        burst_size=_integer(args.burst_size, "--burst-size") or 0,
        burst_window_s=_float(args.burst_window_s, "--burst-window-s"),
        repair_hours=_number(args.repair_hours, "--repair-hours"),
        repair_distribution=RepairDistribution(args.repair_distribution),
    )


def experiment_from(state: ClusterState, args: argparse.Namespace) -> Experiment:
    return Experiment(
        hours=_float(args.hours, "--hours"),
        policies=tuple(name.strip() for name in args.policies.split(",") if name.strip()),
        trace=_trace(state, args),
        seeds=_integer(args.seeds, "--seeds") or 0,
        base_seed=_integer(args.seed, "--seed") or 0,
    )


def with_spares(state: ClusterState, text: str | None) -> ClusterState:
    spares = _integer(text, "--spares")
    if spares is None:
        return state
    if spares < 0:
        raise InvalidScenario("must be ≥ 0", field="--spares")
    return replace(state, cluster=replace(state.cluster, spares=spares))


def _write_outputs(
    out: Path,
    runs: dict[str, list[Run]],
    traces: list[Trace],
    summary: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    timeline = {name: [r.to_dict() for r in policy_runs] for name, policy_runs in runs.items()}
    (out / "timeline.json").write_text(json.dumps(timeline) + "\n")
    if args.save_traces:
        (out / "traces").mkdir(exist_ok=True)
        for trace, run in zip(traces, next(iter(runs.values())), strict=True):
            save_csv(trace, out / "traces" / f"seed-{run.seed}.csv")
    if not args.no_report:
        from controlplane.recovery.simulator.report import write_report

        title = f"Pitstop simulation: {Path(args.scenario).name}"
        write_report(out / "report.html", runs, summary, title)


def run(state: ClusterState, args: argparse.Namespace) -> dict[str, Any]:
    """Parse the options, simulate with a progress bar on a terminal, write the files."""
    state = with_spares(state, args.spares)
    experiment = experiment_from(state, args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidScenario(f"{out} exists and is not a directory", field="--out")
    total_h = experiment.hours * experiment.seeds * len(experiment.policies)
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

        runs, traces = run_experiment(state, experiment, progress=progress)
    summary = summarize(runs, {**experiment.parameters(), "scenario": str(args.scenario)})
    _write_outputs(out, runs, traces, summary, args)
    return summary
