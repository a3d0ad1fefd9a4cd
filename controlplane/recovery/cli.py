"""Command line of the recovery core: estimate a plan, compare recovery candidates."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from controlplane.recovery import policies
from controlplane.recovery.codes import Caveat
from controlplane.recovery.errors import RecoveryError
from controlplane.recovery.estimator import estimate_step_time, peak_memory
from controlplane.recovery.model import Candidate, ClusterState, Failure, FailureKind
from controlplane.recovery.objective import best_index
from controlplane.recovery.scenario import load_scenario

EXIT_BAD_INPUT = 2


def estimate(state: ClusterState) -> dict[str, Any]:
    """Step time and per-device peak memory of the scenario's current plan."""
    peaks = peak_memory(state.profile, state.plan)
    return {
        "est_step_time_s": estimate_step_time(state.profile, state.cluster, state.plan),
        "peak_memory_bytes": {str(d): b for d, b in sorted(peaks.items())},
    }


def plan(state: ClusterState, names: Sequence[str], *, exhaustive: bool = False) -> dict[str, Any]:
    """Every named policy's candidates for the scenario's failure, and the best one."""
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    chosen_policies = [policies.get(name, exhaustive=exhaustive) for name in names]
    started = time.perf_counter()
    candidates: list[Candidate] = []
    for policy in chosen_policies:
        candidates.extend(policy.propose(state, failure))
    for candidate in candidates:
        for caveat in candidate.caveats:
            print(f"warning [{caveat}]: {candidate.policy}: {CAVEATS[caveat]}", file=sys.stderr)
    return {
        "search_time_s": time.perf_counter() - started,
        "chosen": best_index(candidates),
        "candidates": [c.to_dict() for c in candidates],
    }


DEFAULT_POLICIES = "odyssey,oobleck,rerouting"

CAVEATS = {
    Caveat.SEARCH_INCOMPLETE: "a search budget ended the plan search before it proved this "
    "plan the best; --exhaustive searches without budgets",
}


def simulate(state: ClusterState, args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, write summary.json, timeline.json and report.html; return the summary."""
    from controlplane.recovery.simulator import command  # simpy and plotly load only here

    return command.run(state, args)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m controlplane.recovery",
        description="Pitstop's recovery core: estimate plans and compare recovery policies.",
    )
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    est = commands.add_parser("estimate", help="step time and peak memory of a scenario's plan")
    est.add_argument("scenario", help="scenario JSON file (docs/scenario.md)")
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
    sim.add_argument("--hours", default="9", metavar="H", help="simulated hours (default 9)")
    sim.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="A,B,…",
        help=f"policies to compare; the ratios divide by the first (default {DEFAULT_POLICIES})",
    )
    sim.add_argument("--seeds", default="10", metavar="N", help="traces per policy (default 10)")
    sim.add_argument("--seed", default="0", metavar="BASE", help="seed of the first trace")
    sim.add_argument(
        "--trace",
        default="poisson",
        metavar="poisson|weibull|csv:PATH",
        help="how failures arrive: drawn per device, or replayed from a CSV file",
    )
    sim.add_argument(
        "--failure-rate",
        metavar="R",
        help="failures per device-hour (default: the scenario's cluster failure rate)",
    )
    sim.add_argument("--weibull-shape", default="1", metavar="K", help="Weibull shape (default 1)")
    sim.add_argument(
        "--weibull-scale-hours", metavar="S", help="Weibull scale (default: keeps the mean gap)"
    )
    sim.add_argument(
        "--node-failure-prob", default="0", metavar="P", help="share of failures taking a node"
    )
    sim.add_argument(
        "--node-failure-rate", default="0", metavar="R", help="whole-node failures per node-hour"
    )
    sim.add_argument("--burst-prob", default="0", metavar="P", help="chance of a burst")
    sim.add_argument("--burst-size", default="0", metavar="K", help="failures in a burst")
    sim.add_argument(
        "--burst-window-s", default="60", metavar="S", help="a burst's spread (default 60 s)"
    )
    sim.add_argument("--repair-hours", metavar="H", help="repair time (default: never)")
    sim.add_argument(
        "--repair-distribution",
        default="fixed",
        choices=["fixed", "exponential"],
        help="repair time: exactly H, or exponential with mean H",
    )
    sim.add_argument("--spares", metavar="N", help="spare devices (default: cluster.spares)")
    sim.add_argument("--save-traces", action="store_true", help="write each seed's trace as CSV")
    sim.add_argument("--no-report", action="store_true", help="skip report.html")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        state = load_scenario(args.scenario)
        if args.command == "estimate":
            result = estimate(state)
        elif args.command == "simulate":
            result = simulate(state, args)
        else:
            result = plan(state, args.policy or policies.names(), exhaustive=args.exhaustive)
    except RecoveryError as exc:
        print(f"error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
