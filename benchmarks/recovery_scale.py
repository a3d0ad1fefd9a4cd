"""A 16,384-device job's recovery through the whole control plane, kill to training again.

It starts the stack ``./dev demo`` runs (Daphne, a Celery worker, the detector; here on
PostgreSQL and this machine's Redis, a fresh database and Redis database each run), creates an
``auto`` job of the 7B model on ``--nodes`` simulated nodes of 8 devices (PP4 × DP(2 × nodes),
``controlplane.demo.scale_scenario``) and plays them with ``python -m worker_agent simulate``:
two processes for the bulk, and one process for each node that will be killed. Once every node
trains it SIGKILLs one node's process (its socket closes without goodbye), waits until the job
trains again, then kills ``--burst`` more nodes 20 ms apart (a rack) and waits again. For each
round it reads the recovery's phases from the REST API (detect, plan, approve, transfer: every
agent acknowledged, restart: every agent training again, first step), the heartbeat ingest lag
from kill to training again (the server's own histogram), and every command's
acknowledgements and sends from the database.

    python -m benchmarks.recovery_scale [--nodes 2048] [--burst 10] [--policies rerouting,...]

It also reports the start: from the first agent launched to every node training.

Goals on this machine: kill → training again ≤ 3 s, ingest p99 < 100 ms throughout, every
command acknowledged once. Bounded: every wait has a deadline; loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import redis

from benchmarks.heartbeat_load import lag_buckets, percentile
from benchmarks.recovery_e2e import PHASES, _time
from benchmarks.results import write_results
from controlplane.demo import (
    POLICIES,
    ControlPlane,
    Processes,
    free_port,
    scale_scenario,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "benchmarks" / "results" / "recovery_scale-logs"
GOAL_S, P99_GOAL_S = 3.0, 0.1
BURST_GAP_S = 0.02
API_PATIENCE_S = 120.0  # how long a read of the API is asked again before the run gives up
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"

# every command of the job's decisions: how many, acknowledged, sent more than once; and when
# (epoch seconds) the first was written, the last sent, half and all of them acknowledged, and
# the last of their nodes trained again
COMMANDS = """
import json, statistics
from django.db.models import Count, Max, Min, Q
from controlplane.incidents.models import AgentCommand
mine = AgentCommand.objects.filter(decision__job_id={job})
out = mine.values("decision_id").annotate(
    commands=Count("pk"), acked=Count("pk", filter=Q(acked_at__isnull=False)),
    resent=Count("pk", filter=Q(sends__gt=1)), most_sends=Max("sends"),
    written=Min("created_at"), sent_last=Max("sent_at"), acked_last=Max("acked_at"),
    resumed_last=Max("resumed_at"))
found = {{}}
for r in out:
    acks = sorted(a.timestamp() for a in mine.filter(decision_id=r["decision_id"],
                  acked_at__isnull=False).values_list("acked_at", flat=True))
    r["acked_half"] = statistics.median(acks) if acks else None
    for k in ("written", "sent_last", "acked_last", "resumed_last"):
        r[k] = r[k].timestamp() if r[k] is not None else None
    found[str(r.pop("decision_id"))] = r
print(json.dumps(found))
"""
# the moments of a decision's commands, reported from the kill
MOMENTS = ("written", "sent_last", "acked_half", "acked_last", "resumed_last")


class Stack:
    """The control plane on a fresh PostgreSQL database and Redis database, and the job."""

    def __init__(self, data: Path, nodes: int, policies: list[str]) -> None:
        self.data, self.nodes = data, nodes
        self.database = f"pitstop_scale_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.database}"')
        self.redis_url = os.environ["REDIS_URL"]
        self.redis = redis.Redis.from_url(self.redis_url)
        self.redis.flushdb()
        logs = data / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.database_url = f"postgresql://postgres@127.0.0.1:5432/{self.database}"
        self.db: psycopg.Connection[Any] | None = None  # the benchmark's own reads
        env = dict(os.environ, PITSTOP_DATA_DIR=str(data), OMP_NUM_THREADS="1",
                   DATABASE_URL=self.database_url,
                   REDIS_URL=self.redis_url,
                   DJANGO_SETTINGS_MODULE="controlplane.settings")  # fmt: skip
        self.processes = Processes(logs, env)
        self.plane = ControlPlane(data, free_port(), self.processes)
        self.policies = policies

    def start(self) -> None:
        self.plane.start()
        scenario = scale_scenario(self.nodes)
        self.scenario = self.data / "scale.json"
        self.scenario.write_text(json.dumps(scenario))
        spec = {"name": "scale", "scenario": scenario, "mode": "auto", "policies": self.policies}
        made = self.plane.setup("bench", secrets.token_urlsafe(16), [spec])["jobs"]["scale"]
        self.job, self.token = made["id"], made["token"]

    def simulate(self, name: str, first: int, count: int, step_s: float, ramp_s: float) -> None:
        self.processes.start(
            name,
            [sys.executable, "-m", "worker_agent", "simulate",
             "--server", f"ws://127.0.0.1:{self.plane.port}", "--job", "scale",
             "--nodes", str(count), "--first-node", str(first), "--devices-per-node", "8",
             "--step-time", str(step_s), "--ramp", str(ramp_s)],
            {"PITSTOP_AGENT_TOKEN": self.token},
        )  # fmt: skip

    def live(self) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.api(f"/api/v1/jobs/{self.job}/live/")
        return found

    def training(self) -> bool:
        """Every node left connected, and each of its devices training or idle (a spare)."""
        live = self.live()
        states = live.get("device_states", {})
        return bool(
            live.get("nodes_connected") == self.nodes - self.lost
            and states.get("training", 0) > 0
            and set(states) <= {"training", "idle"}
        )

    lost = 0  # nodes killed so far

    def read(self, path: str) -> Any:
        """``path`` of the API, asked again while the server, busy with a recovery, answers
        later than the client waits (``wait_for``)."""
        return wait_for(
            lambda: self.plane.api(path), f"an answer to {path}", API_PATIENCE_S, self.processes
        )

    def statuses(self) -> dict[int, str]:
        """Each decision of the job and its status, read from the database. Asked every 0.1 s
        through the API, it was a third of the server's CPU during a recovery (each answer
        decodes and encodes again every decision's candidates with their plans), a load the
        measurement put on what it measures."""
        if self.db is None:
            self.db = psycopg.connect(self.database_url, autocommit=True)
        rows = self.db.execute(
            "SELECT id, status FROM incidents_recoverydecision WHERE job_id = %s", (self.job,)
        ).fetchall()
        return dict(rows)

    def decision(self, decision_id: int) -> dict[str, Any]:
        found: dict[str, Any] = self.read(f"/api/v1/recoveries/{decision_id}/")
        return found

    def commands(self) -> dict[str, Any]:
        out = self.plane.manage("shell", "-c", COMMANDS.format(job=self.job))
        found: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return found

    def close(self) -> None:
        self.processes.stop_all(last=["server"])
        kept = LOGS / str(self.nodes)  # the processes' logs, for what went wrong
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(self.processes.logs, kept)
        self.redis.flushdb()
        self.redis.close()
        if self.db is not None:
            self.db.close()
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


def one_round(stack: Stack, victims: list[str], timeout: float) -> dict[str, Any]:
    """Kill ``victims`` (process names) 20 ms apart; the recovery of the decision that ends it."""
    before = set(stack.statuses())
    lag0 = lag_buckets(stack.redis)
    killed_at = time.time()
    for k, victim in enumerate(victims):
        if k:
            time.sleep(max(killed_at + k * BURST_GAP_S - time.time(), 0))
        stack.processes.stop(victim, signal.SIGKILL)
    stack.lost += len(victims)

    def settled() -> int | None:
        new = {i: status for i, status in stack.statuses().items() if i not in before}
        if not new or any(s not in ("recovered", "failed", "superseded") for s in new.values()):
            return None
        return max(new)

    try:
        last = wait_for(settled, "the recovery", timeout, stack.processes, interval=0.1)
        decision = stack.decision(last)
    except TimeoutError:  # where it stands, to say what did not scale
        ids = [i for i in stack.statuses() if i not in before]
        decision = stack.decision(max(ids)) if ids else {"status": "no decision", "id": None}
        decision = {**decision, "status": f"timeout ({decision['status']})"}
    lag1 = lag_buckets(stack.redis)
    window = [(b, c - c0) for (b, c), (_, c0) in zip(lag1[0], lag0[0], strict=True)]
    new = [stack.decision(i) for i in sorted(stack.statuses()) if i not in before]
    row: dict[str, Any] = {
        "killed": len(victims),
        "decisions": len(new),
        "status": decision["status"],
        "reason": decision.get("reason") or "",
        "ingest_p50_ms": _ms(percentile(window, 0.5)),
        "ingest_p99_ms": _ms(percentile(window, 0.99)),
        "beats": window[-1][1],
    }
    if decision["id"] is None:
        return row
    timeline = stack.read(f"/api/v1/recoveries/{decision['id']}/timeline/")
    phases = {p["phase"]: p for p in timeline["phases"]}
    if decision.get("chosen") is not None:
        row["policy"] = decision["candidates"][decision["chosen"]]["policy"]
    row.update({f"{name}_s": phases[name]["seconds"] for name in PHASES if name in phases})
    detected = [d["failure"]["detected_at"] for d in new if d.get("failure")]
    row["kill_to_detected_s"] = min(_time(t) for t in detected) - killed_at
    for name, phase in (("training", "restart"), ("step", "first_step")):
        end = phases.get(phase, {}).get("end")
        row[f"kill_to_{name}_s"] = None if end is None else _time(end) - killed_at
    commands = stack.commands().get(str(decision["id"]), {})
    row.update({f"commands_{k}": v for k, v in commands.items() if k not in MOMENTS})
    for moment in MOMENTS:  # where the transfer phase's time goes
        at = commands.get(moment)
        row[f"kill_to_{moment}_s"] = None if at is None else round(at - killed_at, 3)
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def run(args: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    """The start (seconds from the first agent launched to every node training) and each
    round's row."""
    with tempfile.TemporaryDirectory(prefix="pitstop-scale-") as tmp:
        stack = Stack(Path(tmp), args.nodes, args.policies)
        try:
            stack.start()
            launched = time.monotonic()
            spared = 1 + args.burst  # the last nodes, one process each
            bulk = args.nodes - spared
            ramp = min(10.0, args.nodes / 200)  # as heartbeat_load opens them
            stack.simulate("sim-a", 0, bulk // 2, args.step_time, ramp)
            stack.simulate("sim-b", bulk // 2, bulk - bulk // 2, args.step_time, ramp)
            victims = []
            for i in range(bulk, args.nodes):
                stack.simulate(f"victim-{i}", i, 1, args.step_time, 0)
                victims.append(f"victim-{i}")
            print(f"{args.nodes} nodes connecting …", flush=True)
            wait_for(stack.training, "every node training", args.timeout, stack.processes)
            start_s = time.monotonic() - launched
            print(f"every node training {start_s:.1f} s after the first agent started", flush=True)
            time.sleep(args.settle)
            rows = []
            for name, killed in (("one", victims[:1]), (f"burst of {args.burst}", victims[1:])):
                if not killed:
                    continue
                print(f"killing {name} …", flush=True)
                row = {"round": name, **one_round(stack, killed, args.timeout)}
                print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
                rows.append(row)
                if row["status"] != "recovered":
                    break
                wait_for(stack.training, "training again", args.timeout, stack.processes)
                time.sleep(args.settle)
            return start_s, rows
        finally:
            stack.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048, help="simulated nodes of 8 devices")
    parser.add_argument("--burst", type=int, default=10, help="nodes killed in the second round")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="the job's policies (default: the demo's)")  # fmt: skip
    parser.add_argument("--step-time", type=float, default=0.5, help="a simulated step, seconds")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before each kill")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for each wait")
    parser.add_argument("--redis-db", type=int, default=13, help="this machine's Redis database")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/recovery_scale.json")
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    if not 2 + args.burst <= args.nodes <= 4096 or args.burst < 0:
        parser.error("--nodes must be within 2 + --burst .. 4096, --burst ≥ 0")
    # ours too: the server's keys are read here, under the prefix its database number gives
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:6379/{args.redis_db}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    start_s, rows = run(args)
    write_results(
        args.out,
        {"nodes": args.nodes, "devices": args.nodes * 8, "start_s": start_s, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
