"""Kill to training again, end to end: the demo's stack, real trainers, one policy at a time.

For each policy and repetition it creates an ``auto`` job of the reference trainer (PP4 × DP2 of
the 8-layer model, ``examples/reference-trainer-pp4-dp2.json``) that enables only that policy,
starts its 8 CPU ranks under 4 agents on the stack ``./dev demo`` runs (Daphne with the
embedded Redis, a Celery worker, the detector; ``controlplane/demo.py``), waits for training,
SIGKILLs the rank of one device, and reads the recovery's timeline phases from the REST API:
detect, plan, approve, transfer, restart, first step. "Training again" is the end of the first
step: every agent's ranks have made a step under the new plan. The ratio is each policy's
median over the median of the last policy named (the baseline; checkpoint restart where the
trainer runs it). A repetition that does not recover within ``--timeout`` counts as failed,
with the decision's reason; a survivor stuck in a collective would show as one.

    python -m benchmarks.recovery_e2e [--policies rerouting,dynamic,odyssey] [--repeats 3]

Bounded (every wait has a deadline), loopback only; a fresh data directory per run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.results import write_results
from controlplane.demo import (
    NODES,
    SCENARIO,
    ControlPlane,
    Processes,
    TrainerJob,
    children_of,
    free_port,
    reference_scenario,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detect", "plan", "approve", "transfer", "restart", "first_step")
VICTIM = ("node-2", 4)  # pipeline 1's first stage; device 0 holds the same layers


def _time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rank_of(agent: int, device: int) -> int:
    """The pid of the agent's rank for ``device`` (its environment names the device)."""
    for pid in children_of(agent):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"PITSTOP_DEVICE={device}".encode() in environ:
                return pid
    raise RuntimeError(f"no rank of device {device} under agent {agent}")


def one_recovery(
    plane: ControlPlane, job: TrainerJob, *, warmup_steps: int, timeout: float
) -> dict[str, Any]:
    """Start the job, kill the victim's rank once it trains, and time its recovery."""
    job.start()
    try:
        wait_for(
            lambda: (plane.api(f"/api/v1/jobs/{job.id}/live/").get("step") or 0) >= warmup_steps,
            f"{job.name} training",
            180,
            plane.processes,
        )
        node, device = VICTIM
        victim = rank_of(job.agent(node).pid, device)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)

        def settled() -> dict[str, Any] | None:
            found = plane.api(f"/api/v1/recoveries/?job={job.id}")["results"]
            done = [d for d in found if d["status"] in ("recovered", "failed")]
            return done[0] if done else None

        try:
            decision = wait_for(settled, f"{job.name}'s recovery", timeout, plane.processes)
        except TimeoutError:
            return {"status": "timeout", "reason": f"not recovered within {timeout:g} s"}
        if decision["status"] != "recovered":
            return {"status": decision["status"], "reason": decision.get("reason") or ""}
        timeline = plane.api(f"/api/v1/recoveries/{decision['id']}/timeline/")
        phases = {p["phase"]: p for p in timeline["phases"]}
        first = phases["first_step"]
        return {
            "status": "recovered",
            "policy": decision["candidates"][decision["chosen"]]["policy"],
            "kill_to_training_s": _time(first["end"]) - killed_at,
            **{f"{name}_s": phases[name]["seconds"] for name in PHASES if name in phases},
        }
    finally:
        job.stop()


def summarise(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if r["status"] == "recovered"]
    row: dict[str, Any] = {
        "policy": policy,
        "recovered": len(done),
        "runs": len(runs),
        "failures": [r["reason"] for r in runs if r["status"] != "recovered"],
    }
    for key in ("kill_to_training_s", *(f"{p}_s" for p in PHASES)):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            row[key] = statistics.median(values)
            row[f"{key}_range"] = [min(values), max(values)]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--policies",
        default="rerouting,dynamic,odyssey",
        help="policies to time, the last one the baseline of the ratio",
    )
    parser.add_argument("--repeats", type=int, default=3, help="recoveries per policy")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps before the kill")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to recover")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/recovery_e2e.json")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if not policies or args.repeats < 1 or args.warmup_steps < 1 or not args.timeout > 0:
        parser.error("--policies, --repeats, --warmup-steps and --timeout must be given, ≥ 1")
    scenario = reference_scenario()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pitstop-recovery-e2e-") as tmp:
        data = Path(tmp)
        logs = data / "logs"
        logs.mkdir()
        env = {
            k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")
        }  # the embedded defaults, as the demo runs them
        env.update(
            PITSTOP_DATA_DIR=str(data),
            OMP_NUM_THREADS="1",
            PITSTOP_HEARTBEAT_INTERVAL_S="0.5",
            DJANGO_SETTINGS_MODULE="controlplane.settings",
        )
        processes = Processes(logs, env)
        plane = ControlPlane(data, free_port(), processes)
        try:
            plane.start()
            jobs = [
                {"name": f"{p}-{i}", "scenario": scenario, "mode": "auto", "policies": [p]}
                for p in policies
                for i in range(args.repeats)
            ]
            made = plane.setup("bench", "bench", jobs)["jobs"]
            progress = tqdm(total=len(jobs), desc="recoveries", unit="run")
            for policy in policies:
                runs = []
                for i in range(args.repeats):
                    name = f"{policy}-{i}"
                    job = TrainerJob(
                        name, made[name]["id"], made[name]["token"], SCENARIO, NODES, plane
                    )
                    runs.append(
                        one_recovery(
                            plane, job, warmup_steps=args.warmup_steps, timeout=args.timeout
                        )
                    )
                    progress.update()
                rows.append(summarise(policy, runs) | {"raw": runs})
            progress.close()
        finally:
            with contextlib.suppress(Exception):
                processes.stop_all(last=["server"])
    baseline = rows[-1].get("kill_to_training_s")
    for row in rows:
        value = row.get("kill_to_training_s")
        row["ratio_to_baseline"] = value / baseline if value and baseline else None
    print(
        f"\n8 CPU ranks over 4 agents, {SCENARIO.name}, auto mode, rank of device {VICTIM[1]} "
        f"SIGKILLed; medians of {args.repeats}; seconds"
    )
    head = f"{'policy':<12} {'ok':>5} {'kill→train':>11} " + " ".join(f"{p:>9}" for p in PHASES)
    print(head + f" {'÷ ' + policies[-1]:>12}")
    for row in rows:
        cells = " ".join(
            f"{row[f'{p}_s']:>9.3f}" if f"{p}_s" in row else f"{'—':>9}" for p in PHASES
        )
        total = row.get("kill_to_training_s")
        ratio = row["ratio_to_baseline"]
        print(
            f"{row['policy']:<12} {row['recovered']:>2}/{row['runs']:<2} "
            f"{(f'{total:.3f}' if total else '—'):>11} {cells} "
            f"{(f'{ratio:.2f}×' if ratio else '—'):>12}"
        )
        for reason in row["failures"]:
            print(f"  not recovered: {reason}")
    write_results(
        args.out,
        {
            "benchmark": "recovery_e2e",
            "cpus": os.cpu_count(),
            "scenario": SCENARIO.name,
            "victim": {"node": VICTIM[0], "device": VICTIM[1]},
            "repeats": args.repeats,
            "baseline": policies[-1],
            "rows": rows,
        },
    )
    return 0 if all(r["recovered"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
