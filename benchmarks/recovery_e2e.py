"""Kill to training again, end to end: the demo's stack, real trainers, one policy at a time.

For each policy and repetition it creates an ``auto`` job of the reference trainer (PP4 × DP2 of
the 8-layer model, ``examples/reference-trainer-pp4-dp2.json``) that enables only that policy,
starts its 8 CPU ranks under 4 agents on the stack ``./dev demo`` runs (Daphne with the
embedded Redis, a Celery worker, the detector; ``controlplane/demo.py``), plus a fifth agent
whose one spare device's rank idles warm (the standby that in-memory restore, ``flashrecovery``,
and checkpoint restart put in the lost device's place); every rank writes a checkpoint of its
layers every 10 steps (checkpoint restart reloads them in place: the ranks stay up, so this
baseline is the warm form of a restart, with no process started). It waits for training,
SIGKILLs the rank of one device, and reads the recovery's timeline phases from the REST API:
detect, plan, approve, transfer, restart, first step. "Resumed" is the end of the restart
phase: every agent's ranks train under the new plan; "step" the end of the first step, every
agent's ranks having made one under it. The transfer phase (command sent → every agent
acknowledged) is cut further at the ranks' own records of the apply: delivered (→ the last rank
began it), its regroup and layer moves, acknowledged (the last rank done → the last ack stored).
The ratio is each policy's median over the median of the last policy named (the baseline;
checkpoint restart where the trainer runs it). A repetition that does not recover within
``--timeout`` counts as failed, with the decision's reason; a survivor stuck in a collective
would show as one.

    python -m benchmarks.recovery_e2e [--policies rerouting,...,checkpoint] [--repeats 3]

Bounded (every wait has a deadline), loopback only; a fresh data directory per run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import sys
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
from worker_agent.trainer import checkpoint

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detect", "plan", "approve", "transfer", "restart", "first_step")
VICTIM = ("node-2", 4)  # pipeline 1's first stage; device 0 holds the same layers
# one spare device on a fifth agent, whose rank idles warm (the trainer's standby): what
# in-memory restore (flashrecovery) and checkpoint restart put in the lost device's place
SPARE_NODE = ("node-4", [8])
CHECKPOINT_EVERY = 10  # steps; every rank writes its layers (checkpoint restart's source)
START_S = 180.0  # for a job to make its warm-up steps
RESTART = "restart"  # not a policy: the job stopped and started again from its checkpoint


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


def apply_timings(job: TrainerJob, decision: int) -> dict[str, Any]:
    """Inside the transfer phase, from the ranks' own records of the apply (``Rank.apply``,
    ``<generation>timing/<device>`` in the job's store): when the first and the last rank began
    it, and the slowest rank's regroup and layer moves; ``done_at``: when the last was done."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", job.store_port, is_master=False, wait_for_workers=False)
    keys = [f"d{decision}/timing/{d}" for devices in job.nodes.values() for d in devices]
    by_device = {k.rsplit("/", 1)[1]: json.loads(store.get(k)) for k in keys if store.check([k])}
    found = list(by_device.values())
    if not found:
        return {}
    return {
        "began_at": {d: t["started_at"] for d, t in by_device.items()},
        "first_began_at": min(t["started_at"] for t in found),
        "last_began_at": max(t["started_at"] for t in found),
        "regroup_s": max(t["regroup_s"] for t in found),
        "moves_s": max(t["transfer_s"] for t in found),
        "done_at": max(t["at"] for t in found),
    }


def transfer_parts(phase: dict[str, Any], ranks: dict[str, Any]) -> dict[str, Any]:
    """The transfer phase (command sent → every agent acknowledged) cut at the ranks' records:
    delivered (sent → the last rank began), applied (→ the last rank done), acknowledged."""
    if not ranks:
        return {}
    start, end = _time(phase["start"]), _time(phase["end"])
    began = {d: round(at - start, 4) for d, at in ranks["began_at"].items()}
    return {
        "began_after_s": began,
        "deliver_s": ranks["last_began_at"] - start,
        "apply_s": ranks["done_at"] - ranks["last_began_at"],
        "regroup_s": ranks["regroup_s"],
        "moves_s": ranks["moves_s"],
        "acknowledge_s": end - ranks["done_at"],
    }


def one_recovery(
    plane: ControlPlane, job: TrainerJob, *, warmup_steps: int, timeout: float
) -> dict[str, Any]:
    """Start the job, kill the victim's rank once it trains, and time its recovery."""
    job.start()
    try:
        killed_at = kill_once_trained(plane, job, warmup_steps)
        if killed_at is None:
            return {"status": "timeout", "reason": f"not training within {START_S:g} s"}

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
        parts = transfer_parts(phases["transfer"], apply_timings(job, decision["id"]))
        return {
            "status": "recovered",
            "policy": decision["candidates"][decision["chosen"]]["policy"],
            "kill_to_training_s": _time(first["end"]) - killed_at,
            "kill_to_resumed_s": _time(phases["restart"]["end"]) - killed_at,
            **{f"{name}_s": phases[name]["seconds"] for name in PHASES if name in phases},
            "transfer_parts": parts,
        }
    finally:
        job.stop()


def one_restart(
    plane: ControlPlane, job: TrainerJob, checkpoints: Path, *, warmup_steps: int, timeout: float
) -> dict[str, Any]:
    """Today's recovery, as the baseline: once the victim's rank is killed, every agent and rank
    of the job is stopped and started again at once with ``--resume`` (an ideal scheduler: no
    time to notice, no queue), and the job trains from its newest checkpoint. Timed until every
    training node has reported a step past it."""
    job.start()
    try:
        killed_at = kill_once_trained(plane, job, warmup_steps)
        if killed_at is None:
            return {"status": "timeout", "reason": f"not training within {START_S:g} s"}
        job.stop()
        resumed = checkpoint.latest(checkpoints, scenario_layers(job))
        if resumed is None:
            return {"status": "failed", "reason": f"no complete checkpoint in {checkpoints}"}
        stopped_at = time.time()
        job.trainer_options = (*job.trainer_options, "--resume")
        job.start()

        def trains() -> bool:
            live = plane.api(f"/api/v1/jobs/{job.id}/live/")
            steps = {n["node"]: n["step"] for n in live["nodes"]}
            return all((steps.get(n) or -1) > resumed for n in NODES)

        try:
            wait_for(trains, f"{job.name} training again", timeout, plane.processes)
        except TimeoutError:
            return {"status": "timeout", "reason": f"not training within {timeout:g} s"}
        return {
            "status": "recovered",
            "policy": "restart",
            "kill_to_training_s": time.time() - killed_at,
            "stop_s": stopped_at - killed_at,
            "resumed_from_step": resumed,
        }
    finally:
        job.stop()


def kill_once_trained(plane: ControlPlane, job: TrainerJob, warmup_steps: int) -> float | None:
    """SIGKILL the victim's rank once the job has made ``warmup_steps`` steps; when it was
    killed, or None if the job did not get there within ``START_S``."""
    try:
        wait_for(
            lambda: (plane.api(f"/api/v1/jobs/{job.id}/live/").get("step") or 0) >= warmup_steps,
            f"{job.name} training",
            START_S,
            plane.processes,
        )
    except TimeoutError:
        return None
    node, device = VICTIM
    victim = rank_of(job.agent(node).pid, device)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    return killed_at


def scenario_layers(job: TrainerJob) -> int:
    return int(json.loads(job.scenario.read_text())["model"]["layers"])


def summarise(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if r["status"] == "recovered"]
    row: dict[str, Any] = {
        "policy": policy,
        "recovered": len(done),
        "runs": len(runs),
        "failures": [r["reason"] for r in runs if r["status"] != "recovered"],
    }
    for key in ("kill_to_training_s", "kill_to_resumed_s", *(f"{p}_s" for p in PHASES)):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            row[key] = statistics.median(values)
            row[f"{key}_range"] = [min(values), max(values)]
    parts = [r["transfer_parts"] for r in done if r.get("transfer_parts")]
    if parts:
        row["transfer_parts"] = {
            k: statistics.median(p[k] for p in parts) for k in parts[0] if k != "began_after_s"
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--policies",
        default=f"rerouting,dynamic,odyssey,flashrecovery,checkpoint,{RESTART}",
        help=f"policies to time, the last one the baseline of the ratio; {RESTART!r}: the job "
        "stopped and started again from its newest checkpoint, outside the control plane",
    )
    parser.add_argument("--repeats", type=int, default=3, help="recoveries per policy")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps before the kill")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to recover")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/recovery_e2e.json")
    parser.add_argument(
        "--logs", type=Path, metavar="DIR", help="keep the processes' logs here (default: dropped)"
    )
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if not policies or args.repeats < 1 or args.warmup_steps < 1 or not args.timeout > 0:
        parser.error("--policies, --repeats, --warmup-steps and --timeout must be given, ≥ 1")
    scenario = reference_scenario()
    scenario["cluster"]["spares"] = len(SPARE_NODE[1])
    nodes = {**NODES, SPARE_NODE[0]: SPARE_NODE[1]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pitstop-recovery-e2e-") as tmp:
        data = Path(tmp)
        scenario_file = data / SCENARIO.name
        scenario_file.write_text(json.dumps(scenario))
        logs = args.logs or data / "logs"
        logs.mkdir(parents=True, exist_ok=True)
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
                {
                    "name": f"{p}-{i}",
                    "scenario": scenario,
                    # the baseline restarts the job itself: its proposals wait, unapplied
                    "mode": "manual" if p == RESTART else "auto",
                    "policies": ["checkpoint"] if p == RESTART else [p],
                }
                for p in policies
                for i in range(args.repeats)
            ]
            made = plane.setup("bench", "bench", jobs)["jobs"]
            progress = tqdm(total=len(jobs), desc="recoveries", unit="run")
            for policy in policies:
                runs = []
                for i in range(args.repeats):
                    name = f"{policy}-{i}"
                    checkpoints = data / "checkpoints" / name
                    job = TrainerJob(
                        name,
                        made[name]["id"],
                        made[name]["token"],
                        scenario_file,
                        nodes,
                        plane,
                        trainer_options=(
                            *("--checkpoint-dir", str(checkpoints)),
                            *("--checkpoint-every", str(CHECKPOINT_EVERY)),
                        ),
                    )
                    if policy == RESTART:
                        run = one_restart(
                            plane,
                            job,
                            checkpoints,
                            warmup_steps=args.warmup_steps,
                            timeout=args.timeout,
                        )
                    else:
                        run = one_recovery(
                            plane, job, warmup_steps=args.warmup_steps, timeout=args.timeout
                        )
                    runs.append(run)
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
        f"\n8 CPU ranks over 4 agents and a warm spare, {SCENARIO.name}, auto mode, checkpoints "
        f"every {CHECKPOINT_EVERY} steps, rank of device {VICTIM[1]} SIGKILLed; medians of "
        f"{args.repeats}; seconds"
    )
    head = f"{'policy':<12} {'ok':>5} {'kill→resumed':>12} {'kill→step':>10} " + " ".join(
        f"{p:>9}" for p in PHASES
    )
    print(head + f" {'÷ ' + policies[-1]:>12}")
    for row in rows:
        cells = " ".join(
            f"{row[f'{p}_s']:>9.3f}" if f"{p}_s" in row else f"{'—':>9}" for p in PHASES
        )
        total, resumed = row.get("kill_to_training_s"), row.get("kill_to_resumed_s")
        ratio = row["ratio_to_baseline"]
        print(
            f"{row['policy']:<12} {row['recovered']:>2}/{row['runs']:<2} "
            f"{(f'{resumed:.3f}' if resumed else '—'):>12} "
            f"{(f'{total:.3f}' if total else '—'):>10} {cells} "
            f"{(f'{ratio:.2f}×' if ratio else '—'):>12}"
        )
        if row.get("transfer_parts"):
            print(
                "  transfer: "
                + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in row["transfer_parts"].items())
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
            "spare": {"node": SPARE_NODE[0], "devices": SPARE_NODE[1]},
            "checkpoint_every": CHECKPOINT_EVERY,
            "repeats": args.repeats,
            "baseline": policies[-1],
            "rows": rows,
        },
    )
    return 0 if all(r["recovered"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the stack and the jobs' agents are stopped (``finally``)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
