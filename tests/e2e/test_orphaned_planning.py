"""A Celery worker SIGKILLed while it plans a decision: another worker plans it within seconds
(its planning lease lapses, the detector queues it again), not after the broker's visibility
timeout or the 30 s re-queue, and the decision is planned once. Everything is real: its own
Redis, a SQLite file database, two Celery workers and the failure detector."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e.stack import SCENARIO, Stack
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.e2e

WORKER = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool", "solo",
          "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]  # fmt: skip

# A job and a failure whose decision waits, planning, for a worker; prints the decision's id. The
# task itself is sent by ENQUEUE, once the test holds the database.
FAILURE = """
import json
from django.utils import timezone
from controlplane.incidents import decisions
from controlplane.incidents.models import FailureSource
from controlplane.jobs.services import create_job
job, _ = create_job("orphan", json.loads({scenario!r}), approval_mode="manual")
_, decision = decisions.record_failure(job, kind="crash", devices=[5], source=FailureSource.AGENT,
                                       occurred_at=timezone.now(), plan=lambda pk: None)
print(decision.pk)
"""
ENQUEUE = "from controlplane.incidents.tasks import plan_recovery; plan_recovery.delay({id})"


def spawn(stack: Stack, name: str, command: list[str]) -> subprocess.Popen[bytes]:
    log = (stack.tmp / f"{name}.log").open("ab")
    stack.processes[name] = subprocess.Popen(
        command, env=stack.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    return stack.processes[name]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    stack.env["PITSTOP_JOIN_DEADLINE_S"] = "600"  # the job's nodes never join here
    try:
        stack.start("redis")
        stack.manage("migrate", "--noinput", "-v", "0")
        yield stack
    finally:
        stack.stop_all()


def test_planning_lost_with_its_worker_runs_again_within_five_seconds(stack: Stack) -> None:
    workers = {name: spawn(stack, name, WORKER) for name in ("worker-a", "worker-b")}
    stack.start("detector")
    stack.wait(lambda: all("ready." in stack.log(n) for n in workers), "both workers ready", 90)
    decision = int(stack.manage("shell", "-c", FAILURE.format(scenario=json.dumps(SCENARIO))))
    database = sqlite3.connect(stack.tmp / "drill.sqlite3", timeout=30, isolation_level=None)
    client = redis.Redis(port=stack.redis_port, decode_responses=True)

    def status() -> str:
        row = database.execute(
            "SELECT status FROM incidents_recoverydecision WHERE id = ?", (decision,)
        ).fetchone()
        return str(row[0])

    # The database held: the worker that takes the task plans, then waits to store the proposal.
    database.execute("BEGIN IMMEDIATE")
    locked = True
    try:
        stack.manage("shell", "-c", ENQUEUE.format(id=decision))
        planner = stack.wait(
            lambda: next((n for n in workers if "plan_recovery[" in stack.log(n)), None),
            "a worker taking the planning task",
            90,
        )
        # young enough that the 30 s re-queue of requeue_overdue cannot be what plans it again
        age_s = database.execute(
            "SELECT (julianday('now') - julianday(updated_at)) * 86400"
            " FROM incidents_recoverydecision WHERE id = ?",
            (decision,),
        ).fetchone()[0]
        assert age_s < 20, f"the machine is too slow for this test: {age_s:.0f} s"
        stack.kill(planner)
        killed_at = time.monotonic()
        database.execute("ROLLBACK")
        locked = False
        stack.wait(lambda: status() != "planning", "the decision planned again", 60)
        replanned_s = time.monotonic() - killed_at
    finally:
        if locked:
            database.execute("ROLLBACK")
    proposed = database.execute(
        "SELECT COUNT(*) FROM incidents_timelineevent WHERE decision_id = ? AND kind = 'proposed'",
        (decision,),
    ).fetchone()[0]
    print(f"planning re-run {replanned_s:.2f} s after its worker was SIGKILLed")
    assert status() == "proposed" and proposed == 1, stack.log("detector")
    assert replanned_s < 5.0, f"{replanned_s:.1f} s\n{stack.log('detector')}"
    # the second worker lets go of its lease just after it stores the proposal
    stack.wait(lambda: client.keys("*:planning*") == [], "lease let go by the second worker", 10)
