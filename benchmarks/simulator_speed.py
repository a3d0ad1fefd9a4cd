"""Simulator speed: a 16,384-device Llama-2-7B job for 7 days at Meta's failure rate, Odyssey.

Meta reports one failure about every 1.8 h on 16k GPUs (Llama 3 training), so each device fails
at 1/(1.8·16384) per hour: about 93 failures in 7 days, every one a decision of the adaptive
policy over the whole cluster. The target is under 60 s on one core. In the same run the
benchmark simulates the same trace with a baseline and reports the ratio; both runs must train
the same samples. The baseline ``walk`` reads every plan by walking it, as the core did before
``controlplane/recovery/replicas.py``; ``no-cut`` turns Odyssey's dominance cut off (every
failure places and scores the best re-plans with Kuhn-Munkres, as before the simulator needed
the cut); ``no-split-floor`` places every re-plan the uniform floor on gradient sync lets
through and searches for the others, as before a shape's own layer splits and the longest
pipeline's sends bounded them (``dynamic.without_split_floors``).

    python -m benchmarks.simulator_speed [--sizes 16384] [--days 7] [--seed 1]
        [--baseline walk|no-cut|no-split-floor] [--no-baseline]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.planner_scaling import failed_state
from benchmarks.results import write_results
from controlplane.recovery import replicas
from controlplane.recovery.model import ClusterState
from controlplane.recovery.planner import forget
from controlplane.recovery.policies.base import Policy
from controlplane.recovery.policies.dynamic import without_split_floors
from controlplane.recovery.policies.odyssey import OdysseyPolicy
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.traces import TraceSpec, generate

META_HOURS_BETWEEN_FAILURES_AT_16K = 1.8
TARGET_S = 60.0


def healthy_state(devices: int, rate: float) -> ClusterState:
    """PP 8 × DP devices/8 Llama-2-7B, every device healthy, planning with the trace's rate."""
    state = failed_state(devices)
    cluster = replace(state.cluster, failure_rate_per_device_hour=rate)
    return replace(state, failed=frozenset(), cluster=cluster)


def timed(
    state: ClusterState,
    policy: Policy,
    spec: TraceSpec,
    days: float,
    seed: int,
    *,
    baseline: str | None = None,
) -> Any:
    horizon = days * 24 * 3600.0
    trace = generate(spec, state.cluster, horizon, seed)
    forget()  # each run starts with nothing remembered, as a fresh simulation would
    wall, cpu = time.perf_counter(), time.process_time()
    if baseline == "walk":
        context: contextlib.AbstractContextManager[None] = replicas.walking()
    elif baseline == "no-split-floor":
        context = without_split_floors()
    else:
        context = contextlib.nullcontext()
    with context:
        run = simulate(state, policy, trace, horizon, seed=seed)
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "failures": len(trace.failures),
        "decisions": len(run.recoveries),
        "samples": run.samples,
        "families": sorted({r.family or "-" for r in run.recoveries}),
    }


def measure(devices: int, days: float, seed: int, baseline: str | None) -> dict[str, Any]:
    rate = 1 / (META_HOURS_BETWEEN_FAILURES_AT_16K * 16384)
    state = healthy_state(devices, rate)
    spec = TraceSpec(failure_rate_per_device_hour=rate)
    row: dict[str, Any] = {
        "devices": devices,
        "days": days,
        "seed": seed,
        "rate_per_device_hour": rate,
        "baseline": baseline,
    }
    row["run"] = timed(state, OdysseyPolicy(), spec, days, seed)
    if baseline is not None:
        policy = OdysseyPolicy(dominance_cut=baseline != "no-cut")
        row["base"] = timed(state, policy, spec, days, seed, baseline=baseline)
        row["ratio_base_over_run"] = row["base"]["cpu_s"] / row["run"]["cpu_s"]
        row["same_samples"] = row["base"]["samples"] == row["run"]["samples"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'devices':>8} {'days':>5} {'decisions':>9} {'wall s':>8} {'cpu s':>8} "
        f"{'s/decision':>10} {'< 60 s':>6} {'baseline':>14} {'base cpu s':>10} {'ratio':>6} "
        f"{'same samples':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        run = r["run"]
        per = run["cpu_s"] / max(run["decisions"], 1)
        base = r.get("base")
        base_s = f"{base['cpu_s']:.1f}" if base else "-"
        ratio = f"{r['ratio_base_over_run']:.1f}x" if base else "-"
        same = str(r["same_samples"]).lower() if base else "-"
        ok = "yes" if run["cpu_s"] < TARGET_S else "no"
        lines.append(
            f"{r['devices']:>8} {r['days']:>5g} {run['decisions']:>9} {run['wall_s']:>8.1f} "
            f"{run['cpu_s']:>8.1f} {per:>10.3f} {ok:>6} {r['baseline'] or '-':>14} {base_s:>10} "
            f"{ratio:>6} {same:>12}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16384", help="comma-separated device counts")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--baseline",
        choices=("walk", "no-cut", "no-split-floor"),
        default="walk",
        help="the same trace walking every plan (as before replicas), without Odyssey's cut, "
        "or placing every re-plan the uniform sync floor lets through (as before split floors)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline run")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes takes comma-separated device counts, not {args.sizes!r}")
    if not sizes or args.days <= 0:
        parser.error("give at least one size and positive days")
    rows = []
    for devices in sizes:
        baseline = None if args.no_baseline else args.baseline
        rows.append(measure(devices, args.days, args.seed, baseline))
        print(table(rows).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    write_results(Path(args.out) / "simulator_speed.json", {"rows": rows})


if __name__ == "__main__":
    main()
