"""The planning task of a large job, with Python's garbage collector paused as the worker
and the core pause it (``recovery/collector.py``) against running, in the same run.

A node of the job is lost, and its decision is planned, proposed and applied the way
``incidents.plan_recovery`` runs it (``decisions.plan``: the job read, every policy's
candidates, the decision written, one command per node and the plan made the job's), on
PostgreSQL, with no Celery and no agent: the worker's own time, the plan phase and the start of
the transfer phase of ``benchmarks.recovery_scale``. Two identical ``auto`` jobs of ``--nodes``
nodes of 8 devices (``controlplane.demo.scale_scenario``) lose one more node each round; one is
planned with the collector paused and the other with it running, the order alternating. Both
must choose the same policy.

    python -m benchmarks.planning_task [--nodes 2048] [--rounds 3] [--policies rerouting,...]

Needs PostgreSQL on 127.0.0.1:5432 (a fresh database each run, dropped after) and Redis
(``--redis-db``, flushed: the commands are published there, to no one).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import psycopg
import redis

from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
MODES = ("paused", "running")


@contextmanager
def scratch_database(redis_db: int) -> Iterator[None]:
    """This process's Django on a fresh PostgreSQL database, migrated, and a flushed Redis
    database; both emptied afterwards."""
    name = f"pitstop_planning_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    redis_url = f"redis://127.0.0.1:6379/{redis_db}"
    redis.Redis.from_url(redis_url).flushdb()
    os.environ.update(
        DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{name}",
        REDIS_URL=redis_url,
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        LOG_LEVEL=os.environ.get("LOG_LEVEL", "WARNING"),  # not a line per transition
    )
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        yield
    finally:
        from django.db import connections

        connections.close_all()
        redis.Redis.from_url(redis_url).flushdb()
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def collector_running() -> Iterator[None]:
    """The baseline: the collector left running throughout, the core's own pauses undone
    (``collector.paused`` a no-op while the block runs)."""
    from controlplane.recovery import collector

    real = collector.paused
    collector.paused = nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        collector.paused = real


def run(nodes: int, rounds: int, policies: list[str]) -> list[dict[str, Any]]:
    """Each round's row: for each mode the seconds ``decisions.plan`` took, its status and the
    policy it chose."""
    from django.utils import timezone

    from controlplane.demo import scale_scenario
    from controlplane.incidents import decisions
    from controlplane.incidents.models import DecisionStatus, RecoveryDecision
    from controlplane.jobs.models import Node, NodeStatus
    from controlplane.jobs.services import create_job
    from controlplane.recovery import collector

    scenario = scale_scenario(nodes)
    jobs = {}
    for name in ("warm-up", *MODES):
        jobs[name], _ = create_job(f"planning-{name}", scenario, enabled_policies=policies)
        Node.objects.filter(job=jobs[name]).update(status=NodeStatus.HEALTHY)  # all said hello
    import scipy.optimize  # noqa: F401  (a worker loads it when it starts: controlplane.celery)

    def lose(job: Any, index: int, pause: bool) -> tuple[float, str, str | None]:
        """Node ``index`` lost: the seconds its decision took to plan, its status, its policy."""
        node = Node.objects.get(job=job, index=index)
        _, decision = decisions.record_failure(
            job,
            kind="crash",
            devices=range(index * 8, index * 8 + 8),
            source="socket",
            occurred_at=timezone.now(),
            node=node,
        )
        gc.collect()
        started = time.perf_counter()
        with collector.paused() if pause else collector_running():
            status = decisions.plan(decision.pk)
        seconds = time.perf_counter() - started
        answer, chosen = RecoveryDecision.objects.values_list("decision", "chosen").get(
            pk=decision.pk
        )
        # as if every agent trained again: the next loss opens a decision of its own
        RecoveryDecision.objects.filter(pk=decision.pk).update(status=DecisionStatus.RECOVERED)
        return seconds, status, answer["candidates"][chosen]["policy"] if answer else None

    # a process's first decision loads what the later ones reuse (the planner's searches)
    lose(jobs["warm-up"], nodes - 1, pause=True)
    rows = []
    for r in range(rounds):
        row: dict[str, Any] = {"round": r + 1, "nodes_lost": r + 1}
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            seconds, status, policy = lose(jobs[mode], nodes - 1 - r, pause=mode == "paused")
            row.update({f"{mode}_s": round(seconds, 4), f"{mode}_status": status})
            row[f"{mode}_policy"] = policy
        row["ratio"] = round(row["running_s"] / row["paused_s"], 2)
        rows.append(row)
        print(
            f"{row['round']:>5} {row['nodes_lost']:>10} {row['paused_s']:>10.3f} "
            f"{row['running_s']:>11.3f} {row['ratio']:>6.2f}  {row['paused_policy']}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--nodes", type=int, default=2048, help="nodes of 8 devices")
    parser.add_argument("--rounds", type=int, default=3, help="nodes lost, one a round")
    parser.add_argument(
        "--policies", default="rerouting,dynamic,odyssey", help="the jobs' policies (the demo's)"
    )
    parser.add_argument("--redis-db", type=int, default=11, help="this machine's Redis database")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/planning_task.json")
    args = parser.parse_args(argv)
    if not 2 <= args.nodes <= 4096 or not 1 <= args.rounds < args.nodes:
        parser.error("--nodes must be within 2..4096 and --rounds within 1..nodes - 1")
    policies = [p for p in args.policies.split(",") if p]
    print(f"planning a {args.nodes}-node job ({args.nodes * 8} devices), {args.rounds} rounds")
    header = f"{'round':>5} {'nodes lost':>10} {'paused s':>10} {'running s':>11} {'ratio':>6}"
    print(header + "  policy")
    with scratch_database(args.redis_db):
        rows = run(args.nodes, args.rounds, policies)
    for row in rows:
        if row["paused_policy"] != row["running_policy"]:
            raise SystemExit(f"round {row['round']}: the two modes chose different policies")
    paused = statistics.median(row["paused_s"] for row in rows)
    running = statistics.median(row["running_s"] for row in rows)
    print(f"median: paused {paused:.3f} s, running {running:.3f} s, ratio {running / paused:.2f}")
    write_results(
        args.out,
        {
            "nodes": args.nodes,
            "devices": args.nodes * 8,
            "policies": policies,
            "rows": rows,
            "median_paused_s": paused,
            "median_running_s": running,
            "ratio": round(running / paused, 2),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
