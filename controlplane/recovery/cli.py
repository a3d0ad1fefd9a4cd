"""Command line of the recovery core: estimate a plan, compare recovery candidates."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from controlplane.recovery import policies
from controlplane.recovery.codec import decision_to_dict
from controlplane.recovery.codes import Caveat
from controlplane.recovery.decision import decide
from controlplane.recovery.errors import InvalidScenario, RecoveryError
from controlplane.recovery.estimator import estimate_step_time, peak_memory
from controlplane.recovery.model import ClusterState, Failure, FailureKind
from controlplane.recovery.scenario import Scenario, load_scenario

if TYPE_CHECKING:
    from controlplane.recovery.simulator.traces import Distribution

EXIT_BAD_INPUT = 2
T = TypeVar("T")


def estimate(state: ClusterState, *, merge_rerouted: bool = False) -> dict[str, Any]:
    """Step time and per-device peak memory of the scenario's current plan."""
    peaks = peak_memory(state.profile, state.plan)
    step = estimate_step_time(
        state.profile, state.cluster, state.plan, merge_rerouted=merge_rerouted
    )
    return {
        "est_step_time_s": step,
        "peak_memory_bytes": {str(d): b for d, b in sorted(peaks.items())},
    }


def asked_options(scenario: Scenario, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The scenario's options of the policies asked (it may set some for others too)."""
    return {name: dict(scenario.options[name]) for name in names if name in scenario.options}


def plan(scenario: Scenario, names: Sequence[str], *, exhaustive: bool = False) -> dict[str, Any]:
    """Every named policy's candidates for the scenario's failure, and the best one.

    ``exhaustive`` goes to every policy that searches plans (those with that option).
    """
    state = scenario.state
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    options = asked_options(scenario, names)
    for name in names:
        if exhaustive and "exhaustive" in policies.option_defaults(name):
            options.setdefault(name, {})["exhaustive"] = True
    decision = decide(state, failure, policies=names, options=options)
    for candidate in decision.candidates:
        for caveat in candidate.caveats:
            print(f"warning [{caveat}]: {candidate.policy}: {CAVEATS[caveat]}", file=sys.stderr)
    return decision_to_dict(decision)


DEFAULT_POLICIES = "odyssey,oobleck,rerouting"

CAVEATS = {
    Caveat.SEARCH_INCOMPLETE: "a search budget ended the plan search before it proved this "
    "plan the best; --exhaustive searches without budgets",
}


# The simulator's fields and the flags that set them: its errors name the field, the command
# line names the flag.
SIMULATE_FLAGS = {
    "out_dir": "--out",
    "hours": "--hours",
    "policies": "--policies",
    "seeds": "--seeds",
    "trace": "--trace",
    "failure_rate_per_device_hour": "--failure-rate",
    "weibull_shape": "--weibull-shape",
    "weibull_scale_hours": "--weibull-scale-hours",
    "node_failure_prob": "--node-failure-prob",
    "node_failure_rate_per_node_hour": "--node-failure-rate",
    "burst_prob": "--burst-prob",
    "burst_size": "--burst-size",
    "burst_window_s": "--burst-window-s",
    "repair_hours": "--repair-hours",
}


# TraceSpec fields set by a flag of the same meaning; a flag left out keeps TraceSpec's default.
TRACE_OPTIONS = (
    "failure_rate_per_device_hour",
    "weibull_shape",
    "weibull_scale_hours",
    "node_failure_prob",
    "node_failure_rate_per_node_hour",
    "burst_prob",
    "burst_size",
    "burst_window_s",
    "repair_hours",
)


def simulate(scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, write summary.json, timeline.json and report.html; return the summary."""
    from controlplane.recovery import simulator  # simpy and plotly load only here

    state = scenario.state
    if args.spares is not None:
        state = replace(state, cluster=replace(state.cluster, spares=args.spares))
    try:
        trace: simulator.TraceSpec | simulator.Trace
        if isinstance(args.trace, Path):
            trace = simulator.load_csv(args.trace, state.cluster)
        else:
            given = {field: getattr(args, field) for field in TRACE_OPTIONS}
            if given["failure_rate_per_device_hour"] is None:
                given["failure_rate_per_device_hour"] = state.cluster.failure_rate_per_device_hour
            trace = simulator.TraceSpec(
                distribution=args.trace,
                repair_distribution=simulator.RepairDistribution(args.repair_distribution),
                **{field: value for field, value in given.items() if value is not None},
            )
        experiment = simulator.Experiment(
            hours=args.hours,
            policies=args.policies,
            trace=trace,
            seeds=args.seeds,
            base_seed=args.seed,
            options=asked_options(scenario, args.policies),
        )
        with simulator.progress_bar(experiment) as progress:
            return simulator.run(
                state,
                experiment,
                out_dir=args.out,
                report=not args.no_report,
                save_traces=args.save_traces,
                scenario=str(args.scenario),
                progress=progress,
            )
    except InvalidScenario as exc:
        flag = SIMULATE_FLAGS.get(exc.field or "")
        if flag is None:
            raise
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise type(exc)(message, field=flag) from None


# Converters for the simulate flags. argparse turns a ValueError into a usage message, but lets
# other exceptions through, so a bad value is reported as every bad input is: one line naming
# the flag, exit code 2.
def _converter(flag: str, parse: Callable[[str], T], expected: str) -> Callable[[str], T]:
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError:
            raise InvalidScenario(f"{text!r} is not {expected}", field=flag) from None

    return convert


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _policy_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _trace_kind(text: str) -> Path | Distribution:
    """``csv:PATH`` as the path of a trace to replay, else the distribution to draw from."""
    from controlplane.recovery.simulator.traces import Distribution  # only simulate needs it

    if text.startswith("csv:"):
        return Path(text[len("csv:") :])
    try:
        return Distribution(text)
    except ValueError:
        raise InvalidScenario(
            f"{text!r} is not poisson, weibull or csv:PATH", field="--trace"
        ) from None


def _number(flag: str) -> Callable[[str], float]:
    return _converter(flag, float, "a number")


def _integer(flag: str) -> Callable[[str], int]:
    return _converter(flag, int, "an integer")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m controlplane.recovery",
        description="Pitstop's recovery core: estimate plans and compare recovery policies.",
    )
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    est = commands.add_parser("estimate", help="step time and peak memory of a scenario's plan")
    est.add_argument("scenario", help="scenario JSON file (docs/scenario.md)")
    est.add_argument(
        "--merge-rerouted",
        action="store_true",
        help="a whole pipeline rerouted onto whole live ones runs as their extra micro-batches "
        "(the reference trainer's routing) instead of eq. 13's stage-by-stage charge",
    )
    pl = commands.add_parser("plan", help="recovery candidates of every policy, best chosen")
    pl.add_argument("scenario", help="scenario JSON file (docs/scenario.md)")
    pl.add_argument(
        "--policy",
        action="append",
        choices=policies.names(),
        help="policy to ask (repeatable); default: all of them",
    )
    pl.add_argument(
        "--exhaustive",
        action="store_true",
        help="search every partition and layer split, no pruning or budget (reference; small jobs)",
    )
    sim = commands.add_parser(
        "simulate",
        help="every policy over the same failure traces: samples, downtime, report",
        description="Discrete-event simulation of the scenario's job (docs/simulator.md).",
    )
    sim.add_argument("scenario", help="scenario JSON file (its plan is the starting plan)")
    sim.add_argument("--out", required=True, metavar="DIR", help="directory for the results")
    sim.add_argument(
        "--hours",
        type=_number("--hours"),
        default=9.0,
        metavar="H",
        help="simulated hours (default 9)",
    )
    sim.add_argument(
        "--policies",
        type=_policy_list,
        default=_policy_list(DEFAULT_POLICIES),
        metavar="A,B,…",
        help=f"policies to compare; the ratios divide by the first (default {DEFAULT_POLICIES})",
    )
    sim.add_argument(
        "--seeds",
        type=_integer("--seeds"),
        default=10,
        metavar="N",
        help="traces per policy (default 10)",
    )
    sim.add_argument(
        "--seed", type=_integer("--seed"), default=0, metavar="BASE", help="seed of the first trace"
    )
    sim.add_argument(
        "--trace",
        type=_trace_kind,
        default="poisson",
        metavar="poisson|weibull|csv:PATH",
        help="how failures arrive: drawn per device, or replayed from a CSV file",
    )
    sim.add_argument(
        "--failure-rate",
        dest="failure_rate_per_device_hour",
        type=_number("--failure-rate"),
        metavar="R",
        help="failures per device-hour (default: the scenario's cluster failure rate)",
    )
    sim.add_argument(
        "--weibull-shape",
        type=_number("--weibull-shape"),
        metavar="K",
        help="Weibull shape (default 1)",
    )
    sim.add_argument(
        "--weibull-scale-hours",
        type=_number("--weibull-scale-hours"),
        metavar="S",
        help="Weibull scale (default: keeps the mean gap)",
    )
    sim.add_argument(
        "--node-failure-prob",
        type=_number("--node-failure-prob"),
        metavar="P",
        help="share of failures taking a node",
    )
    sim.add_argument(
        "--node-failure-rate",
        dest="node_failure_rate_per_node_hour",
        type=_number("--node-failure-rate"),
        metavar="R",
        help="whole-node failures per node-hour",
    )
    sim.add_argument(
        "--burst-prob", type=_number("--burst-prob"), metavar="P", help="chance of a burst"
    )
    sim.add_argument(
        "--burst-size", type=_integer("--burst-size"), metavar="K", help="failures in a burst"
    )
    sim.add_argument(
        "--burst-window-s",
        type=_number("--burst-window-s"),
        metavar="S",
        help="a burst's spread (default 60 s)",
    )
    sim.add_argument(
        "--repair-hours",
        type=_number("--repair-hours"),
        metavar="H",
        help="repair time (default: never)",
    )
    sim.add_argument(
        "--repair-distribution",
        default="fixed",
        choices=["fixed", "exponential"],
        help="repair time: exactly H, or exponential with mean H",
    )
    sim.add_argument(
        "--spares",
        type=_converter("--spares", _count, "a count ≥ 0"),
        metavar="N",
        help="spare devices (default: cluster.spares)",
    )
    sim.add_argument("--save-traces", action="store_true", help="write each seed's trace as CSV")
    sim.add_argument("--no-report", action="store_true", help="skip report.html")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        scenario = load_scenario(args.scenario)
        if args.command == "estimate":
            result = estimate(scenario.state, merge_rerouted=args.merge_rerouted)
        elif args.command == "simulate":
            result = simulate(scenario, args)
        else:
            result = plan(
                scenario, args.policy or policies.default_names(), exhaustive=args.exhaustive
            )
    except RecoveryError as exc:
        print(f"error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
