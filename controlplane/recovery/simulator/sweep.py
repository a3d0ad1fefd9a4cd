"""An experiment cut into pieces that run anywhere and merge into ``run``'s summary.

A piece is one policy (or the ideal) over one seed's trace: it needs only the scenario, the
experiment and its own two names, so many processes on many hosts can run a sweep's pieces at
once. ``merge`` puts their runs back in the experiment's order and summarises them exactly as
``command.run`` does in one process, adding the mean curves a report plots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import ClusterState
from controlplane.recovery.policies import names
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.experiment import Experiment, planning_rate
from controlplane.recovery.simulator.ideal import IDEAL, ideal_run
from controlplane.recovery.simulator.metrics import (
    mean_cumulative_samples,
    mean_throughput,
    summarize,
    time_grid,
)
from controlplane.recovery.simulator.timeline import Run
from controlplane.recovery.simulator.traces import (
    Distribution,
    RepairDistribution,
    Trace,
    TraceSpec,
    parse_csv,
)


@dataclass(frozen=True, slots=True)
class Piece:
    """One policy's run (or the ideal's) over the trace of one seed."""

    seed: int
    policy: str


def pieces(experiment: Experiment) -> list[Piece]:
    """Every piece of ``experiment``: each seed's policies, then its ideal."""
    seeds = range(experiment.base_seed, experiment.base_seed + experiment.seeds)
    return [Piece(seed, name) for seed in seeds for name in (*experiment.policies, IDEAL)]


def run_piece(state: ClusterState, experiment: Experiment, piece: Piece) -> Run:
    """The run ``command.run`` computes for ``piece``, alone."""
    planned = planning_rate(state, experiment)
    trace = experiment.trace_for(planned, piece.seed)
    if piece.policy == IDEAL:
        return ideal_run(state, trace, experiment.horizon_s, seed=piece.seed)
    if piece.policy not in experiment.policies:
        raise InvalidScenario(f"{piece.policy!r} is not in the experiment", field="policy")
    policy = experiment.build_policies()[experiment.policies.index(piece.policy)]
    return simulate(planned, policy, trace, experiment.horizon_s, seed=piece.seed)


def merge(experiment: Experiment, runs: Iterable[Run], *, scenario: str = "") -> dict[str, Any]:
    """``summary.json`` of the pieces' runs, as ``command.run`` writes it, with ``curves``: the
    time grid (hours) and each policy's (and the ideal's) mean cumulative samples and mean
    throughput on it."""
    by_piece = {(run.seed, run.policy): run for run in runs}
    missing = [p for p in pieces(experiment) if (p.seed, p.policy) not in by_piece]
    if missing:
        raise InvalidScenario(
            f"{len(missing)} pieces have no run, first {missing[0]}", field="runs"
        )
    seeds = range(experiment.base_seed, experiment.base_seed + experiment.seeds)
    ordered = {name: [by_piece[(s, name)] for s in seeds] for name in experiment.policies}
    ideal = [by_piece[(s, IDEAL)] for s in seeds]
    summary = summarize(ordered, {**experiment.parameters(), "scenario": scenario}, ideal=ideal)
    times = time_grid(experiment.horizon_s, points=100)
    summary["curves"] = {
        "hours": [t / 3600 for t in times],
        "samples": {
            name: mean_cumulative_samples(group, times)
            for name, group in {**ordered, IDEAL: ideal}.items()
        },
        "throughput": {
            name: mean_throughput(group, times) for name, group in {**ordered, IDEAL: ideal}.items()
        },
    }
    return summary


TRACE_FIELDS = {f.name for f in dataclasses.fields(TraceSpec)}
EXPERIMENT_FIELDS = {"hours", "policies", "seeds", "base_seed", "trace", "trace_csv", "options"}


def experiment_from_dict(data: Mapping[str, Any], state: ClusterState) -> Experiment:
    """An experiment from JSON: ``hours``, ``policies``, ``seeds``, ``base_seed``, ``options``
    (per policy), and either ``trace`` (``TraceSpec``'s fields; the failure rate defaults to the
    scenario's) or ``trace_csv``, a trace to replay in the documented CSV format
    (docs/simulator.md), the same for every seed. ``InvalidScenario`` names the field at fault."""
    if not isinstance(data, Mapping):
        raise InvalidScenario("must be an object", field="experiment")
    unknown = sorted(set(data) - EXPERIMENT_FIELDS)
    if unknown:
        raise InvalidScenario(
            f"unknown fields {unknown}; known: {sorted(EXPERIMENT_FIELDS)}", field=unknown[0]
        )
    replay = data.get("trace_csv")
    if replay is not None:
        if not isinstance(replay, str):
            raise InvalidScenario("must be the CSV text of a trace", field="trace_csv")
        if data.get("trace"):
            raise InvalidScenario("give a trace to replay or trace fields, not both", field="trace")
        return _experiment(data, parse_csv(replay, state.cluster, source="trace_csv"))
    trace = dict(data.get("trace") or {})
    bad = sorted(set(trace) - TRACE_FIELDS)
    if bad:
        raise InvalidScenario(f"unknown; known: {sorted(TRACE_FIELDS)}", field=f"trace.{bad[0]}")
    trace.setdefault("failure_rate_per_device_hour", state.cluster.failure_rate_per_device_hour)
    try:
        if "distribution" in trace:
            trace["distribution"] = Distribution(trace["distribution"])
        if "repair_distribution" in trace:
            trace["repair_distribution"] = RepairDistribution(trace["repair_distribution"])
        spec = TraceSpec(**trace)
    except ValueError as exc:
        raise InvalidScenario(str(exc), field="trace") from None
    except InvalidScenario as exc:
        raise InvalidScenario(
            str(exc).removeprefix(f"{exc.field}: "), field=f"trace.{exc.field}"
        ) from None
    except TypeError as exc:
        raise InvalidScenario(str(exc), field="trace") from None
    return _experiment(data, spec)


def _experiment(data: Mapping[str, Any], trace: TraceSpec | Trace) -> Experiment:
    policies = data.get("policies")
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        raise InvalidScenario("must be a list of policy names", field="policies")
    known = names()
    for i, name in enumerate(policies):
        if name not in known:
            raise InvalidScenario(
                f"unknown policy {name!r}; known: {', '.join(known)}", field=f"policies[{i}]"
            )
    try:
        return Experiment(
            hours=float(data.get("hours", 9.0)),
            policies=tuple(policies),
            trace=trace,
            seeds=int(data.get("seeds", 1)),
            base_seed=int(data.get("base_seed", 0)),
            options={k: dict(v) for k, v in (data.get("options") or {}).items()},
        )
    except (TypeError, ValueError) as exc:
        raise InvalidScenario(str(exc), field="experiment") from None
