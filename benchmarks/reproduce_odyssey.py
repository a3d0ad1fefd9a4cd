"""Reproduce Odyssey's 32-NPU simulation (000 §V-B) and measure Pitstop's policy beside it.

Every row runs its policies over the same failure traces (seed i of every row is the same
trace when the cluster is the same). Ratios are Odyssey's mean samples over the other's, each
with a 95 % Student-t interval of the per-seed ratio. Assumptions: docs/reproduction/odyssey.md.

    python -m benchmarks.reproduce_odyssey [--seeds 20] [--out benchmarks/results/odyssey.json]
        [--only paper,sensitivity,beyond] [--rows 2,4,6] [--hours 9]

``--rows`` picks rows by number whatever their group; ``--only`` picks whole groups (``paper``
when neither is given); both together run the rows of those groups. A selection that names an
unknown group or row, or matches no row, is an error.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.results import write_results
from controlplane.recovery.model import ClusterState
from controlplane.recovery.scenario import load_scenario
from controlplane.recovery.simulator.experiment import Experiment, run_experiment, run_ideal
from controlplane.recovery.simulator.metrics import mean_ci95, share_of_ideal
from controlplane.recovery.simulator.traces import Distribution, TraceSpec

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "examples" / "llama2-7b-pp4-dp8-tp1.json"
HOURS = 9.0
RATE = 0.1  # 000 §V-B: "NPU failure rate (10% per hour)", read as λ = 0.1 per NPU-hour
PAPER = {"oobleck": 1.229, "rerouting": 1.355}  # 000 §V-B, Figs. 7-8


@dataclass(frozen=True)
class Setting:
    """One row: a variant of the scenario and the policies compared on the same traces."""

    group: str
    name: str
    policies: tuple[str, ...] = ("odyssey", "oobleck", "rerouting")
    devices_per_node: int | None = None
    memory_bytes: float | None = None
    global_batch: int | None = None
    oobleck_f: int | None = None
    oobleck_regroup_s: float | None = None
    spares: int = 0
    repair_hours: float | None = None
    restart_s: float | None = None
    rate: float = RATE
    notes: dict[str, Any] = field(default_factory=dict)


SETTINGS = [
    # The faithful reading (see the doc): an NPU is Oobleck's node, as in Odyssey's planner.
    Setting("paper", "faithful: node = NPU, 64 GB, B = 64", devices_per_node=1),
    Setting("sensitivity", "Oobleck node = 8-NPU host", devices_per_node=8),
    Setting("sensitivity", "node = NPU, unlimited memory", devices_per_node=1,
            memory_bytes=math.inf),
    Setting("sensitivity", "node = NPU, B = 32", devices_per_node=1, global_batch=32),
    Setting("sensitivity", "node = NPU, B = 16", devices_per_node=1, global_batch=16),
    Setting("sensitivity", "node = NPU, Oobleck f = 3", devices_per_node=1, oobleck_f=3),
    Setting("sensitivity", "node = NPU, Oobleck restart 60 s", devices_per_node=1,
            oobleck_regroup_s=60.0),
    Setting("sensitivity", "node = NPU, λ = 0.105/h (P(1 h) = 0.1)", devices_per_node=1,
            rate=-math.log(0.9)),
    Setting("beyond", "paper setting", ("odyssey", "pitstop"), devices_per_node=1),
    # With spares, Odyssey's re-plan may use them too (odyssey_spares): the same devices for all.
    Setting("beyond", "8 spares, repair 2 h", ("odyssey_spares", "pitstop", "flashrecovery"),
            devices_per_node=1, spares=8, repair_hours=2.0),
    Setting("beyond", "no spares, repair 2 h", ("odyssey", "pitstop"), devices_per_node=1,
            repair_hours=2.0),
    Setting("beyond", "8 spares, no repair", ("odyssey_spares", "pitstop", "flashrecovery"),
            devices_per_node=1, spares=8),
    # A re-plan restarting the whole job as at ~2,000 devices (FlashRecovery Table II fit)
    Setting("beyond", "8 spares, repair 2 h, restart 300 s",
            ("odyssey_spares", "pitstop", "flashrecovery"), devices_per_node=1, spares=8,
            repair_hours=2.0, restart_s=300.0),
]  # fmt: skip


def select(parser: argparse.ArgumentParser, only: str | None, rows: str | None) -> list[int]:
    """The indices of SETTINGS chosen by ``--only`` and ``--rows``; errors out on no match.

    Rows named explicitly are run whatever their group (the default group would otherwise hide
    them); ``--only`` alone runs whole groups, and the two together run their intersection.
    """
    known_groups = list(dict.fromkeys(s.group for s in SETTINGS))
    known = f"known groups: {', '.join(known_groups)}; rows 0-{len(SETTINGS) - 1}"
    groups = set(known_groups)
    if only is not None or rows is None:
        groups = {g.strip() for g in (only or "paper").split(",") if g.strip()}
        unknown = sorted(groups - set(known_groups))
        if unknown:
            parser.error(f"unknown group(s) {', '.join(unknown)}; {known}")
    indices = list(range(len(SETTINGS)))
    if rows is not None:
        try:
            indices = sorted({int(r) for r in rows.split(",") if r.strip()})
        except ValueError:
            parser.error(f"--rows takes comma-separated row numbers, not {rows!r}; {known}")
        outside = [r for r in indices if not 0 <= r < len(SETTINGS)]
        if outside:
            parser.error(f"unknown row(s) {', '.join(map(str, outside))}; {known}")
    chosen = [i for i in indices if SETTINGS[i].group in groups]
    if not chosen:
        parser.error(f"the selection matches no row; {known}")
    return chosen


def state_for(base: ClusterState, setting: Setting) -> ClusterState:
    cluster = base.cluster
    if setting.devices_per_node is not None:
        cluster = replace(cluster, devices_per_node=setting.devices_per_node)
    if setting.memory_bytes is not None:
        cluster = replace(cluster, device_memory_bytes=setting.memory_bytes)
    cluster = replace(cluster, spares=setting.spares)
    state = replace(base, cluster=cluster)
    if setting.global_batch is not None:
        state = with_batch(state, setting.global_batch)
    if setting.restart_s is not None:
        state = replace(state, assumptions=replace(state.assumptions, restart_s=setting.restart_s))
    return state


def options_for(setting: Setting) -> dict[str, dict[str, Any]]:
    """The policies' options a setting changes (Oobleck's f and regroup time)."""
    oobleck = {
        key: value
        for key, value in (("f", setting.oobleck_f), ("regroup_s", setting.oobleck_regroup_s))
        if value is not None
    }
    return {"oobleck": oobleck} if oobleck and "oobleck" in setting.policies else {}


def with_batch(state: ClusterState, global_batch: int) -> ClusterState:
    """The same 8 pipelines with the batch shared evenly (micro-batch 1)."""
    plan = state.plan
    share = global_batch // len(plan.pipelines)
    pipelines = tuple(replace(p, micro_batches=share) for p in plan.pipelines)
    return replace(
        state,
        training=replace(state.training, global_batch=global_batch),
        plan=replace(plan, pipelines=pipelines),
    )


def ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95 % Student-t interval (the simulator's own)."""
    return mean_ci95(values)


def run_setting(
    base: ClusterState, setting: Setting, seeds: int, hours: float = HOURS
) -> dict[str, Any]:
    state = state_for(base, setting)
    trace = TraceSpec(
        distribution=Distribution.POISSON,
        failure_rate_per_device_hour=setting.rate,
        repair_hours=setting.repair_hours,
    )
    experiment = Experiment(
        hours=hours,
        policies=setting.policies,
        trace=trace,
        seeds=seeds,
        options=options_for(setting),
    )
    started = time.perf_counter()
    runs, traces = run_experiment(state, experiment)
    ref = setting.policies[0]
    samples = {name: [r.samples for r in policy_runs] for name, policy_runs in runs.items()}
    result: dict[str, Any] = {
        "group": setting.group,
        "name": setting.name,
        "policies": {},
        "failures_mean": sum(len(t.failures) for t in traces) / len(traces),
        "wall_s": round(time.perf_counter() - started, 1),
        "setting": {k: v for k, v in setting.__dict__.items() if k not in {"group", "name"}},
    }
    for name, policy_runs in runs.items():
        throughput = [s / experiment.horizon_s for s in samples[name]]
        pairs = list(zip(samples[ref], samples[name], strict=True))
        per_seed = [a / b if b > 0 else math.inf for a, b in pairs]
        finite = [r for r in per_seed if math.isfinite(r)]
        mean_ref = sum(samples[ref]) / len(samples[ref])
        mean = sum(samples[name]) / len(samples[name])
        gain = [b / a if a > 0 else math.inf for a, b in pairs]
        finite_gain = [g for g in gain if math.isfinite(g)]
        result["policies"][name] = {
            "gain_over_first_per_seed_ci95": ci95(finite_gain) if finite_gain else None,
            "throughput_mean": ci95(throughput)[0],
            "throughput_ci95": ci95(throughput)[1:],
            "ratio_of_means": mean_ref / mean if mean > 0 else None,
            "ratio_per_seed_ci95": ci95(finite) if finite else None,
            "downtime_s_mean": sum(r.downtime_s for r in policy_runs) / len(policy_runs),
            "recoveries_mean": sum(r.recovery_count for r in policy_runs) / len(policy_runs),
            "infeasible_mean": sum(r.infeasible_count for r in policy_runs) / len(policy_runs),
        }
    # the bound: every recovery free and instant, the fastest plan on the healthy devices
    ideal = run_ideal(state, experiment, traces)
    result["ideal_throughput_mean"] = ci95([r.throughput for r in ideal])[0]
    for name, policy_runs in runs.items():
        result["policies"][name]["share_of_ideal"] = share_of_ideal(policy_runs, ideal)
    return result


def print_row(result: dict[str, Any]) -> None:
    ref = next(iter(result["policies"]))
    cells = []
    for name, p in result["policies"].items():
        t_low, t_high = p["throughput_ci95"]
        text = f"{name} {p['throughput_mean']:.2f} [{t_low:.2f}, {t_high:.2f}] sps"
        if name != ref and result["group"] == "beyond":
            g, g_low, g_high = p["gain_over_first_per_seed_ci95"]
            text += f" (x{g:.3f} of {ref}, CI [{g_low:.3f}, {g_high:.3f}])"
        elif name != ref and p["ratio_of_means"] is not None:
            _, r_low, r_high = p["ratio_per_seed_ci95"]
            text += f" (x{p['ratio_of_means']:.3f}, per-seed CI [{r_low:.3f}, {r_high:.3f}])"
        if p["share_of_ideal"] is not None:
            share, (s_low, s_high) = p["share_of_ideal"]["mean"], p["share_of_ideal"]["ci95"]
            text += f" {share:.3f} [{s_low:.3f}, {s_high:.3f}] of ideal"
        cells.append(text)
    ideal = f"; ideal {result['ideal_throughput_mean']:.2f} sps"
    print(f"{result['group']:<11} {result['name']:<40} " + "; ".join(cells) + ideal, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "odyssey.json"))
    parser.add_argument("--only", help="groups: paper (the default, ~2 min), sensitivity, beyond")
    parser.add_argument("--rows", help="comma-separated row numbers, whatever their group")
    parser.add_argument("--hours", type=float, default=HOURS, help="simulated hours per trace")
    parser.add_argument("--scenario", default=str(SCENARIO))
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.hours <= 0:
        parser.error("--seeds must be at least 1 and --hours positive")
    chosen = select(parser, args.only, args.rows)
    base = load_scenario(args.scenario).state
    print(
        f"Odyssey 000 §V-B: 32 NPUs, {args.hours:g} h, Poisson failures; paper: Odyssey "
        f"x{PAPER['oobleck']} Oobleck, x{PAPER['rerouting']} ReCycle; {args.seeds} seeds"
    )
    print("throughput = samples/s over the horizon (mean [CI95]); xR = Odyssey's (or the first's)")
    results = []
    for index in chosen:
        result = run_setting(base, SETTINGS[index], args.seeds, args.hours)
        print_row(result)
        results.append(result)
    payload = {
        "paper": PAPER,
        "scenario": str(Path(args.scenario).relative_to(ROOT))
        if Path(args.scenario).is_relative_to(ROOT)
        else args.scenario,
        "hours": args.hours,
        "seeds": args.seeds,
        "results": results,
    }
    write_results(Path(args.out), payload)


if __name__ == "__main__":
    main()
