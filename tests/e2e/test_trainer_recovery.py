"""Failure drills with real trainers: the reference trainer's ranks (4 CPU ranks over 2 agents,
PP2 x DP2 of the 8-layer model) under the whole control plane in processes (Redis, Daphne, a
Celery worker, the detector; tests/e2e/stack.py). A killed rank is recovered from automatically
and training goes on at the step it stopped at: the step the API says it resumed from is the one
the ranks themselves went on from, and the step the failure was recorded at; a manual decision
is approved, another overridden with another candidate, through the REST API; the timeline
exported as CSV is what happened; the server, the worker and Redis restart in the middle of a
recovery and it still completes, once."""

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
import torch

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
        self.dumps = stack.tmp / "dumps"

    def start_job(self, job: str) -> None:
        port = free_port()
        for node in TRAINER_NODES:
            self.stack.start_agent(node, job, self.jobs[job]["token"], port, self.dumps / job)

    def stop_job(self) -> None:
        for name in [n for n in self.stack.processes if n.startswith("agent-")]:
            self.stack.kill(name)  # the ranks die with their agent

    def api(self, path: str, body: dict[str, Any] | None = None) -> Any:
        if body is None:
            return self.stack.api(path, self.token)
        status, answer = self.stack.post(path, self.token, body)
        assert status < 400, answer
        return answer

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


def trainer_resumed_from(drill: Drill, job: str, decision: dict[str, Any]) -> int:
    """The step the ranks themselves went on from under ``decision``'s plan: each dumped its
    state once the plan was applied (``--dump``, ``{device}-{command id}.pt``) with the step it
    trains next; the last step completed is the one before."""
    events = drill.timeline(decision["id"])["results"]
    commands = {e["payload"]["command"] for e in events if e["kind"] == "command_sent"}
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    steps = {}
    for path in (drill.dumps / job).glob("*.pt"):
        device, tag = path.stem.split("-", 1)
        if tag in commands and int(device) in used:
            steps[int(device)] = int(torch.load(path)["step"])
    assert set(steps) == used and len(set(steps.values())) == 1, (steps, used)
    return steps.popitem()[1] - 1


def assert_resumed_where_it_failed(drill: Drill, job: str, decision: dict[str, Any]) -> int:
    """The ranks went on from the step the failure was recorded at (the killed rank's last):
    in memory, only the step in progress is lost. Or from the one after it, when the killed
    rank had done its share of the step in progress (its gradients in its peers' all-reduce)
    before it died unheard: its peers then completed that step, and nothing is redone.

    The recovery's ``resumed_step`` is read from the agents' heartbeats (the step before the
    first one each reports under the new plan), so it is that step when the beats are prompt,
    as they mostly are, and a later one when a beat is late (a loaded machine: 7 steps late in
    one CI run); never an earlier one. Returns the step the ranks went on from."""
    failed, resumed = decision["failure"]["step"], decision["resumed_step"]
    assert isinstance(failed, int) and isinstance(resumed, int), decision
    went_on_from = trainer_resumed_from(drill, job, decision)
    assert went_on_from - failed in (0, 1), (failed, went_on_from)
    assert resumed >= went_on_from, (resumed, went_on_from, decision)
    if resumed != went_on_from:
        print(f"resumed_step {resumed} reported for {went_on_from}: a late heartbeat")
    timeline = drill.timeline(decision["id"])
    assert (timeline["step_at_failure"], timeline["resumed_step"]) == (failed, resumed)
    return resumed


def test_a_killed_rank_is_recovered_automatically_and_the_timeline_csv_says_so(
    drill: Drill,
) -> None:
    drill.start_job("auto")
    try:
        drill.stack.wait(lambda: drill.training("auto", 3), "training", 120)
        since = time.time()
        drill.kill("node-1", 3)
        decision = drill.decision("auto", "recovered", timeout=60)
        print(f"kill -> recovered seen: {time.time() - since:.2f} s")
        resumed = assert_resumed_where_it_failed(drill, "auto", decision)
        timeline = drill.timeline(decision["id"])
        rows = drill.csv(decision["id"])
        steps = {row["kind"]: row["step"] for row in rows if row["step"]}
        assert steps["failure_detected"] == str(decision["failure"]["step"]), rows
        recovered = json.loads(rows[-1]["payload"])
        assert (rows[-1]["kind"], recovered["resumed_step"]) == ("recovered", resumed), rows
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
        drill.kill("node-1", 3)
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
        assert_resumed_where_it_failed(drill, "manual", overridden)
        kinds = [e["kind"] for e in drill.timeline(overridden["id"])["results"]]
        assert kinds.index("proposed") < kinds.index("overridden") < kinds.index("applying")
        assert "approved" not in kinds, kinds
        # a second failure: the operator approves the proposal as it is
        drill.stack.wait(lambda: drill.training("manual"), "training again", 60)
        drill.kill("node-0", 0)
        second = drill.decision("manual", "proposed", count=2)
        drill.api(f"/api/v1/recoveries/{second['id']}/approve/", {"reason": "drill"})
        approved = drill.decision("manual", "recovered", count=2, timeout=60)
        assert approved["plan"] == second["plan"] and approved["chosen_by"] == "root"
        assert_resumed_where_it_failed(drill, "manual", approved)
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
        drill.kill("node-1", 3)
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
        assert_resumed_where_it_failed(drill, "drill", decision)
        kinds = [e["kind"] for e in drill.timeline(decision["id"])["results"]]
        assert kinds.count("applying") == 1 and kinds.count("command_acked") == 2, kinds
        assert kinds.count("failure_detected") == 1 and kinds[-1] == "recovered", kinds
        assert len(drill.decisions("drill")) == 1, "none lost, none made up"
        stack.wait(lambda: drill.training("drill"), "training on", 60)
    finally:
        drill.stop_job()
