"""Two failure detectors (``manage.py detect_failures``) at once: the one holding the lease
sweeps, the other waits; a silent node is recorded exactly once, also when the active detector
is SIGKILLed and the other takes over, within a few seconds. Real processes: their own Redis, a
SQLite file database and the two detectors."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.e2e.stack import SCENARIO, Stack
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.e2e

# Two jobs, one for each silent node: a failure of a node whose devices are down already is not
# recorded again (``decisions.record_failure``), so each node's failure is the first of its job.
# Also the keys the detectors watch and lease, as the deployment names them.
SETUP = """
import json
from controlplane.jobs import detector, liveness
from controlplane.jobs.services import create_job
jobs = [create_job(f"watched-{{i}}", json.loads({scenario!r}), approval_mode="manual")[0].pk
        for i in range(2)]
print(json.dumps({{"jobs": jobs, "seen": [liveness.seen_key(j) for j in jobs],
                  "watched": liveness.JOBS_KEY, "lease": detector.LEASE_KEY,
                  "ttl_s": detector.LEASE_TTL_S}}))
"""
DETECTOR = [sys.executable, "manage.py", "detect_failures"]


def test_two_detectors_record_a_silent_node_once_and_one_takes_over_from_the_other(
    tmp_path: Path,
) -> None:
    stack = Stack(tmp_path)
    stack.env["PITSTOP_JOIN_DEADLINE_S"] = "600"  # the nodes never join: only silence counts
    database = sqlite3.connect(tmp_path / "drill.sqlite3", timeout=30)
    try:
        stack.start("redis")
        stack.manage("migrate", "--noinput", "-v", "0")
        made = json.loads(stack.manage("shell", "-c", SETUP.format(scenario=json.dumps(SCENARIO))))
        client = redis.Redis(port=stack.redis_port, decode_responses=True)
        pids = {}
        for name in ("detector-a", "detector-b"):
            log = (tmp_path / f"{name}.log").open("ab")
            stack.processes[name] = subprocess.Popen(
                DETECTOR, env=stack.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
            )
            pids[stack.processes[name].pid] = name

        def holder() -> str | None:
            value = client.get(made["lease"])
            return None if value is None else pids.get(int(str(value).rsplit(":", 1)[1]))

        def silent(i: int) -> None:
            """What the server's heartbeat writer leaves of job i's node-0, quiet for 100 s."""
            client.zadd(made["seen"][i], {"node-0": time.time() - 100})
            client.sadd(made["watched"], made["jobs"][i])

        def failures(i: int) -> int:
            return int(
                database.execute(
                    "SELECT COUNT(*) FROM incidents_failure WHERE job_id = ? AND kind = 'hang'",
                    (made["jobs"][i],),
                ).fetchone()[0]
            )

        def reported(i: int) -> int:
            """How many times the detectors together reported job i's node-0 silent."""
            line = f"job={made['jobs'][i]} node=node-0"
            rows = [row for name in pids.values() for row in stack.log(name).splitlines()]
            return sum("detector.silent" in row and line in row for row in rows)

        def settled(i: int) -> bool:
            return failures(i) > 0 and client.zscore(made["seen"][i], "node-0") is None

        # both running: one holds the lease, the node is recorded once, by it alone
        active = stack.wait(holder, "a detector holding the lease", 90)
        standby = next(name for name in pids.values() if name != active)
        silent(0)
        stack.wait(lambda: settled(0), "the first silent node recorded", 30)
        time.sleep(1.0)  # several sweeps of both detectors later
        assert (failures(0), reported(0)) == (1, 1)
        assert "detector.silent" not in stack.log(standby)

        # the active one SIGKILLed: the other takes over and records the next silent node once
        stack.kill(active)
        killed_at = time.monotonic()
        silent(1)
        stack.wait(lambda: holder() == standby, "the standby taking over", 30)
        takeover_s = time.monotonic() - killed_at
        stack.wait(lambda: settled(1), "the second silent node recorded", 30)
        recorded_s = time.monotonic() - killed_at
        time.sleep(1.0)
        assert (failures(0), reported(0), failures(1), reported(1)) == (1, 1, 1, 1)
        print(f"takeover {takeover_s:.2f} s, silent node recorded {recorded_s:.2f} s after kill")
        assert takeover_s < made["ttl_s"] + 1.5, takeover_s
        assert "detector.leading" in stack.log(standby)
    finally:
        database.close()
        stack.stop_all()
