"""Failure drills with real trainers: the reference trainer's ranks (4 CPU ranks over 2 agents,
PP2 x DP2 of the 8-layer model) under the whole control plane in processes (Redis, Daphne, a
Celery worker, the detector; tests/e2e/stack.py). A killed rank is recovered from automatically
and training goes on at the step it stopped at; a manual decision is approved, another
overridden with another candidate, through the REST API; the timeline exported as CSV is what
happened; the server, the worker and Redis restart in the middle of a recovery and it still
completes, once."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.stack import TRAINER_NODES, TRAINER_POLICIES, TRAINER_SCENARIO, Stack
from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import children_of

pytestmark = pytest.mark.e2e

JOBS = """
import json
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from controlplane.jobs.services import create_job
scenario = json.loads(open({path!r}).read())
made = {{}}
for name, mode in (("auto", "auto"), ("manual", "manual"), ("drill", "auto")):
    job, token = create_job(name, scenario, approval_mode=mode, enabled_policies={policies!r})
    made[name] = {{"id": job.pk, "token": token}}
root = User.objects.create_superuser("root", password="x")
print(json.dumps({{"jobs": made, "api_token": Token.objects.create(user=root).key}}))
"""
# The order a recovery's events come in, each kind's first appearance (the acks and command
# sends repeat per agent): failure, plan, decision, applying, acks, resumed, first step, done.
ORDER = [
    "failure_detected",
    "planning_started",
    "proposed",
    "applying",
    "command_sent",
    "command_acked",
    "resumed",
    "first_step",
    "recovered",
]


class Drill:
    def __init__(self, stack: Stack, made: dict[str, Any]) -> None:
        self.stack, self.jobs, self.token = stack, made["jobs"], made["api_token"]

    def start_job(self, job: str) -> None:
        port = free_port()
        for node in TRAINER_NODES:
            self.stack.start_agent(node, job, self.jobs[job]["token"], port)

    def stop_job(self) -> None:
        for name in [n for n in self.stack.processes if n.startswith("agent-")]:
            self.stack.kill(name)  # the ranks die with their agent

    def api(self, path: str, body: dict[str, Any] | None = None) -> Any:
        if body is None:
            return self.stack.api(path, self.token)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.stack.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def live(self, job: str) -> dict[str, Any]:
        found: dict[str, Any] = self.api(f"/api/v1/jobs/{self.jobs[job]['id']}/live/")
        return found

    def training(self, job: str, past: int = 0) -> int:
        live = self.live(job)
        step = live["step"] or 0
        return step if live["nodes_connected"] == len(TRAINER_NODES) and step > past else 0

    def decisions(self, job: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.api(f"/api/v1/recoveries/?job={self.jobs[job]['id']}")[
            "results"
        ]
        return found

    def decision(self, job: str, status: str, count: int = 1, timeout: float = 60) -> Any:
        def found() -> Any:
            got = self.decisions(job)
            return len(got) == count and got[0]["status"] == status and got[0]

        return self.stack.wait(found, f"decision {count} of {job} {status}", timeout)

    def kill(self, node: str, device: int) -> None:
        """SIGKILL the rank of ``device`` (``python -m worker_agent inject kill``)."""
        agent = self.stack.processes[f"agent-{node}"].pid
        self.stack.wait(lambda: children_of(agent), f"{node}'s ranks")
        done = subprocess.run(
            [sys.executable, "-m", "worker_agent", "inject", "kill", "--agent", str(agent),
             "--device", str(device)],
            cwd=REPO_ROOT, env=clean_environment(), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    def timeline(self, decision: int) -> dict[str, Any]:
        found: dict[str, Any] = self.api(f"/api/v1/recoveries/{decision}/timeline/")
        return found

    def csv(self, decision: int) -> list[dict[str, str]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.stack.port}/api/v1/recoveries/{decision}/timeline/?format=csv",
            headers={"Authorization": f"Token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return list(csv.DictReader(io.StringIO(response.read().decode())))


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    stack = Stack(tmp_path_factory.mktemp("trainers"))
    stack.manage("migrate", "-v", "0")
    made = json.loads(
        stack.manage(
            "shell", "-c", JOBS.format(path=str(TRAINER_SCENARIO), policies=TRAINER_POLICIES)
        )
    )
    try:
        for name in ("redis", "server", "worker", "detector"):
            stack.start(name)
        yield Drill(stack, made)
    finally:
        stack.stop_all()


def resumed_step(drill: Drill, decision: int) -> int:
    events = drill.timeline(decision)["results"]
    return int(next(e for e in events if e["kind"] == "resumed")["payload"]["step"])


def kill_and_bound(drill: Drill, job: str, node: str, device: int) -> tuple[int, int]:
    """Kill ``device``'s rank right after reading the job's live step; the range the step the
    job resumes at must fall in. The live picture is up to half a second old and the step
    reported as resumed is the first heartbeat's after the ranks trained again (0.5 s apart),
    so the range is that step, less the one lost, to the steps that fit in those two ages; a
    job that started over, or skipped ahead, falls outside it."""
    live = drill.live(job)
    drill.kill(node, device)
    age = time.time() - float(live["at"]) + 0.5
    ahead = int(age / max(float(live["step_time_s"] or 0.05), 0.05)) + 2
    return int(live["step"]) - 1, int(live["step"]) + ahead


def test_a_killed_rank_is_recovered_automatically_and_the_timeline_csv_says_so(
    drill: Drill,
) -> None:
    drill.start_job("auto")
    try:
        drill.stack.wait(lambda: drill.training("auto", 3), "training", 120)
        since = time.time()
        low, high = kill_and_bound(drill, "auto", "node-1", 3)
        decision = drill.decision("auto", "recovered", timeout=60)
        print(f"kill -> recovered seen: {time.time() - since:.2f} s")
        timeline = drill.timeline(decision["id"])
        assert low <= resumed_step(drill, decision["id"]) <= high, (low, high, timeline)
        rows = drill.csv(decision["id"])
        kinds = [row["kind"] for row in rows]
        firsts = [k for k in dict.fromkeys(kinds) if k in ORDER]
        assert firsts == [k for k in ORDER if k != "proposed" or "proposed" in kinds], kinds
        assert "auto_applied" in kinds and kinds.count("command_acked") == 2, kinds
        assert kinds == [e["kind"] for e in timeline["results"]], "the CSV is the timeline"
        used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
        assert 3 not in used, decision["plan"]
        before = drill.training("auto")
        drill.stack.wait(lambda: drill.training("auto", before + 2), "training on", 60)
    finally:
        drill.stop_job()


def test_manual_decisions_are_overridden_and_approved_through_the_api(drill: Drill) -> None:
    drill.start_job("manual")
    try:
        drill.stack.wait(lambda: drill.training("manual", 3), "training", 120)
        low, high = kill_and_bound(drill, "manual", "node-1", 3)
        first = drill.decision("manual", "proposed")
        time.sleep(1)
        assert drill.decisions("manual")[0]["status"] == "proposed", "waits for an operator"
        other = next(
            i
            for i, c in enumerate(first["candidates"])
            if i != first["chosen"] and c.get("plan") and c.get("code", "ok") == "ok"
        )
        drill.api(f"/api/v1/recoveries/{first['id']}/override/", {"candidate": other})
        overridden = drill.decision("manual", "recovered", timeout=60)
        assert overridden["chosen"] == other and overridden["chosen_by"] == "root", overridden
        assert overridden["plan"] == first["candidates"][other]["plan"]
        assert low <= resumed_step(drill, overridden["id"]) <= high
        kinds = [e["kind"] for e in drill.timeline(overridden["id"])["results"]]
        assert kinds.index("proposed") < kinds.index("overridden") < kinds.index("applying")
        assert "approved" not in kinds, kinds
        # a second failure: the operator approves the proposal as it is
        drill.stack.wait(lambda: drill.training("manual"), "training again", 60)
        low, high = kill_and_bound(drill, "manual", "node-0", 0)
        second = drill.decision("manual", "proposed", count=2)
        drill.api(f"/api/v1/recoveries/{second['id']}/approve/", {"reason": "drill"})
        approved = drill.decision("manual", "recovered", count=2, timeout=60)
        assert approved["plan"] == second["plan"] and approved["chosen_by"] == "root"
        kinds = [e["kind"] for e in drill.timeline(approved["id"])["results"]]
        assert kinds.index("proposed") < kinds.index("approved") < kinds.index("applying")
        drill.stack.wait(lambda: drill.training("manual"), "training on", 60)
    finally:
        drill.stop_job()


def test_a_recovery_survives_the_server_redis_and_worker_restarting(drill: Drill) -> None:
    stack = drill.stack
    drill.start_job("drill")
    try:
        stack.wait(lambda: drill.training("drill", 3), "training", 120)
        stack.kill("worker")  # the planning task waits in the broker
        low, high = kill_and_bound(drill, "drill", "node-1", 3)
        # the failure may not be recorded yet when the kill returns: no decision at first
        stack.wait(
            lambda: [d["status"] for d in drill.decisions("drill")][:1] == ["planning"],
            "planning",
        )
        stack.kill("server")  # the agents connect again to a new one
        stack.start("server")
        stack.kill("redis")  # the queued task is lost with it: the detector queues it again
        time.sleep(1)
        stack.start("redis")
        stack.start("worker")
        decision = drill.decision("drill", "recovered", timeout=90)
        assert low <= resumed_step(drill, decision["id"]) <= high
        kinds = [e["kind"] for e in drill.timeline(decision["id"])["results"]]
        assert kinds.count("applying") == 1 and kinds.count("command_acked") == 2, kinds
        assert kinds.count("failure_detected") == 1 and kinds[-1] == "recovered", kinds
        assert len(drill.decisions("drill")) == 1, "none lost, none made up"
        stack.wait(lambda: drill.training("drill"), "training on", 60)
    finally:
        drill.stop_job()
