"""The agent against the real control plane (its own Redis and Daphne from tests/e2e/stack.py):
each local fault detector reports its fault, seen on the failures API, and stays quiet on a
healthy run; faults raised while the server is away arrive after it is back; a dropped socket is
connected again; SIGTERM says goodbye and leaves no child; a crash is recovered from end to end,
the plan applied by the ranks. The ranks are the toy trainer, real child processes."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import SCENARIO, Stack
from tests.processes import REPO_ROOT, clean_environment, free_port, process_exists
from tests.worker_agent.helpers import carried_out, children_of, poll, start_agent

pytestmark = pytest.mark.e2e

JOBS = """
import json
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from controlplane.jobs.services import create_job
scenario = json.loads(open({path!r}).read())
made = {{}}
for name, mode in {jobs!r}:
    job, token = create_job(name, scenario, approval_mode=mode, enabled_policies=["dynamic"])
    made[name] = {{"id": job.pk, "token": token}}
root = User.objects.create_superuser("root", password="x")
print(json.dumps({{"jobs": made, "api_token": Token.objects.create(user=root).key}}))
"""
JOBS_MADE = [
    ("quiet", "manual"),
    ("kill", "manual"),
    ("hang", "manual"),
    ("nan", "manual"),
    ("slow", "manual"),
    ("away", "manual"),
    ("drop", "manual"),
    ("recover", "auto"),
    ("orphan", "manual"),
    ("drill", "manual"),
]
# tight detectors for steps of 0.05 s: a hang after 1 s still, a straggler at 2.5 × for 3 steps
DETECTORS = (
    "--hang-floor",
    "1",
    "--hang-factor",
    "4",
    "--straggler-factor",
    "2.5",
    "--straggler-steps",
    "3",
)
# how long after the fault the server must have it (the agent reports at once; a hang after
# the 1 s floor); generous for a busy 2-core machine
BOUND_S = 3.0


@dataclass
class Plane:
    stack: Stack
    jobs: dict[str, dict[str, Any]]
    api_token: str

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.stack.port}"

    def agent(
        self, job: str, *options: str, devices: str = "0,1", trainer: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        tmp = self.stack.tmp / job
        tmp.mkdir(exist_ok=True)
        return start_agent(
            tmp,
            server=self.url,
            job=job,
            token=self.jobs[job]["token"],
            devices=devices,
            options=options,
            trainer=trainer,
        )

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.stack.post(path, self.api_token, body)

    def failures(self, job: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.stack.api(
            f"/api/v1/failures/?job={self.jobs[job]['id']}", self.api_token
        )["results"]
        return found

    def live(self, job: str) -> dict[str, Any]:
        found: dict[str, Any] = self.stack.api(
            f"/api/v1/jobs/{self.jobs[job]['id']}/live/", self.api_token
        )
        return found

    def training(self, job: str, devices: int = 2) -> bool:
        live = self.live(job)
        return bool(live["nodes_connected"] == 1 and (live["step"] or 0) > 5)

    def failure(self, job: str, kind: str, timeout: float = 15) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            return next((f for f in self.failures(job) if f["kind"] == kind), None)

        found: dict[str, Any] = self.stack.wait(seen, f"a {kind} failure of {job}", timeout)
        return found


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("plane")
    stack = Stack(tmp)
    scenario = tmp / "scenario.json"
    scenario.write_text(json.dumps(SCENARIO))
    stack.manage("migrate", "-v", "0")
    made = json.loads(stack.manage("shell", "-c", JOBS.format(path=str(scenario), jobs=JOBS_MADE)))
    try:
        for name in ("redis", "server"):
            stack.start(name)
        yield Plane(stack, made["jobs"], made["api_token"])
    finally:
        stack.stop_all()


def ranks_of(agent: subprocess.Popen[bytes]) -> list[int]:
    """The agent's two toy ranks (its children running the toy trainer); a failure says what
    the agent had started and how its log ends, and comes at once if the agent exited."""
    log = _log_of(agent.pid)

    def ranks() -> list[int] | None:
        if agent.poll() is not None:
            raise AssertionError(f"the agent exited with {agent.returncode}")
        found = [pid for pid in children_of(agent.pid) if b"toy_trainer" in _cmdline(pid)]
        return found if len(found) == 2 else None

    try:
        # two Python processes started on a loaded 2-core machine
        return sorted(poll(ranks, "the agent's two ranks", 60))
    except AssertionError as exc:
        children = {pid: _cmdline(pid)[:120] for pid in children_of(agent.pid)}
        tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else "(no log)"
        raise AssertionError(f"{exc}; its children: {children}; its log ends: {tail}") from None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _log_of(pid: int) -> Path | None:
    """The file a live process writes its output to (``start_agent``'s log)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/fd/1"))
    except OSError:
        return None


def inject(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker_agent", "inject", *args],
        cwd=REPO_ROOT,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def latency(failure: dict[str, Any], since: float) -> float:
    detected = dt.datetime.fromisoformat(failure["detected_at"].replace("Z", "+00:00"))
    return detected.timestamp() - since


def stop(agent: subprocess.Popen[bytes]) -> None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)


def test_a_healthy_run_is_quiet_and_sigterm_says_goodbye_and_leaves_no_child(
    plane: Plane,
) -> None:
    agent = plane.agent("quiet", *DETECTORS)
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("quiet"), "training")
        live = plane.live("quiet")
        time.sleep(2.5)  # as long as a hang takes to be found, and many straggler windows
        assert plane.failures("quiet") == []
        assert plane.live("quiet")["step"] > live["step"]
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
        assert [pid for pid in ranks if process_exists(pid)] == [], "a rank outlived the agent"
        plane.stack.wait(lambda: plane.live("quiet")["nodes_connected"] == 0, "the node gone")
        assert plane.failures("quiet") == [], "a goodbye is no failure"
    finally:
        stop(agent)
    log = (plane.stack.tmp / "quiet" / "agent-node-0.log").read_text()
    assert "fault" not in log, log


def test_ranks_die_with_an_agent_killed_by_sigkill(plane: Plane) -> None:
    agent = plane.agent("orphan", trainer=("--outlive-agent",))
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("orphan"), "training")
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=20)
        poll(lambda: not any(process_exists(pid) for pid in ranks), "the ranks gone")
    finally:
        stop(agent)
    failure = plane.failure("orphan", "node_lost")  # the agent's socket closed: its node failed
    assert {0, 1} <= set(failure["devices"]), failure


def test_an_agent_the_server_refuses_exits_and_leaves_no_child(plane: Plane) -> None:
    tmp = plane.stack.tmp / "refused"
    tmp.mkdir()
    agent = start_agent(tmp, server=plane.url, job="quiet", token="wrong")
    try:
        assert agent.wait(timeout=20) == 1
    finally:
        stop(agent)
    log = (tmp / "agent-node-0.log").read_text()
    assert "unauthorised" in log and log.count("rank started") == 2, log
    pids = [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "rank started" in line]
    assert not [pid for pid in pids if process_exists(pid)]


def test_a_killed_rank_is_a_crash_within_a_bound_and_aborts_the_generation(plane: Plane) -> None:
    port = free_port()
    store = ("--store", f"127.0.0.1:{port}", "--serve-store")
    agent = plane.agent("kill", *DETECTORS, *store)
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("kill"), "training")
        since = time.time()
        os.kill(ranks[0], signal.SIGKILL)
        failure = plane.failure("kill", "crash")
        assert failure["devices"] == [0] and failure["source"] == "agent", failure
        assert "signal 9" in failure["message"], failure
        took = latency(failure, since)
        print(f"kill -9 -> crash on the failures API: {took:.3f} s")
        assert took < BOUND_S
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=5))
        abort = json.loads(client.get("d0/abort"))
        assert abort["device"] == 0 and abort["kind"] == "crash", abort
        time.sleep(1.2)  # the other rank trains on: nothing more to report
        assert [f["kind"] for f in plane.failures("kill")] == ["crash"]
    finally:
        stop(agent)


def test_a_stopped_rank_is_a_hang_and_is_killed(plane: Plane) -> None:
    # device 0 steps in lockstep with device 1, so it stalls with it, as a rank waiting in a
    # collective does; but its link's pulses go on, and only the stopped rank is to blame
    agent = plane.agent("hang", *DETECTORS, trainer=("--follow", "1"))
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("hang"), "training")
        since = time.time()
        inject("hang", "--pid", str(ranks[1]))
        failure = plane.failure("hang", "hang")
        assert failure["devices"] == [1], failure
        took = latency(failure, since)
        print(f"SIGSTOP -> hang on the failures API: {took:.3f} s (floor 1 s)")
        assert 1.0 <= took < 1.0 + BOUND_S
        poll(
            lambda: not process_exists(ranks[1]) or ranks[1] not in children_of(agent.pid),
            "the hung rank killed",
            5,
        )
        time.sleep(0.5)
        assert [f["kind"] for f in plane.failures("hang")] == ["hang"], "its death is no crash"
    finally:
        stop(agent)


def test_a_nan_loss_is_a_nan_fault(plane: Plane) -> None:
    agent = plane.agent("nan", *DETECTORS)
    try:
        ranks_of(agent)
        plane.stack.wait(lambda: plane.training("nan"), "training")
        since = time.time()
        inject("nan", "--agent", str(agent.pid), "--device", "0")
        failure = plane.failure("nan", "nan")
        assert failure["devices"] == [0] and "nan" in failure["message"], failure
        print(f"nan injected -> nan on the failures API: {latency(failure, since):.3f} s")
        assert latency(failure, since) < BOUND_S
        time.sleep(0.5)  # the losses are finite again: one fault, the rank trains on
        assert [f["kind"] for f in plane.failures("nan")] == ["nan"]
    finally:
        stop(agent)


def test_a_slowed_rank_is_a_straggler(plane: Plane) -> None:
    agent = plane.agent("slow", *DETECTORS)
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("slow"), "training")
        since = time.time()
        inject("slow", "--pid", str(ranks[1]), "--seconds", "3", "--stopped-fraction", "0.8")
        failure = plane.failure("slow", "straggler")
        assert failure["devices"] == [1], failure
        print(f"slowed -> straggler on the failures API: {latency(failure, since):.3f} s")
        assert latency(failure, since) < BOUND_S
        assert [f["kind"] for f in plane.failures("slow")] == ["straggler"], "not a hang"
    finally:
        stop(agent)


def connections(plane: Plane, job: str) -> int:
    return (plane.stack.tmp / job / "agent-node-0.log").read_text().count("connected to")


def test_faults_raised_while_the_server_is_away_arrive_after_it_is_back(plane: Plane) -> None:
    agent = plane.agent("away", *DETECTORS)
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("away"), "training")
        plane.stack.kill("server")
        inject("kill", "--pid", str(ranks[0]))  # seen while nobody listens
        time.sleep(0.5)
        plane.stack.start("server")
        failure = plane.failure("away", "crash", timeout=30)
        assert failure["devices"] == [0] and "signal 9" in failure["message"], failure
        assert connections(plane, "away") == 2
        assert [f["kind"] for f in plane.failures("away")] == ["crash"]
    finally:
        stop(agent)


def test_a_dropped_socket_is_a_lost_node_and_is_connected_again(plane: Plane) -> None:
    agent = plane.agent("drop", *DETECTORS)
    try:
        ranks_of(agent)
        plane.stack.wait(lambda: plane.training("drop"), "training")
        inject("drop", "--pid", str(agent.pid))
        failure = plane.failure("drop", "node_lost")
        assert failure["source"] == "socket", failure
        plane.stack.wait(lambda: connections(plane, "drop") == 2, "connected again")
    finally:
        stop(agent)


def test_a_drill_sent_through_the_api_kills_the_rank_and_is_acknowledged(plane: Plane) -> None:
    agent = plane.agent("drill", *DETECTORS)
    drills = f"/api/v1/jobs/{plane.jobs['drill']['id']}/drills/"

    def acked(drill: dict[str, Any]) -> dict[str, Any] | None:
        found = plane.stack.api(drills, plane.api_token)["results"]
        return next((d for d in found if d["id"] == drill["id"] and d["acked_at"]), None)

    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("drill"), "training")
        since = time.time()
        code, drill = plane.post(drills, {"node": "node-0", "kind": "kill", "device": 1})
        assert code == 202, drill
        failure = plane.failure("drill", "crash")
        assert failure["devices"] == [1] and "signal 9" in failure["message"], failure
        print(f"kill drill over REST -> crash on the failures API: {latency(failure, since):.3f} s")
        assert latency(failure, since) < BOUND_S
        assert plane.stack.wait(lambda: acked(drill), "the drill's ack")["ok"] is True
        assert not process_exists(ranks[1]) or ranks[1] not in children_of(agent.pid)
        # the same rank again: the agent has no such rank now, and says so on the drill
        code, again = plane.post(drills, {"node": "node-0", "kind": "kill", "device": 1})
        assert code == 202, again
        refused = plane.stack.wait(lambda: acked(again), "the second drill's ack")
        assert refused["ok"] is False and "no such rank running here" in refused["error"]
        assert [f["kind"] for f in plane.failures("drill")] == ["crash"], "one fault, once"
    finally:
        stop(agent)


def test_a_crash_is_recovered_from_with_the_plan_applied_by_the_ranks(plane: Plane) -> None:
    plane.stack.start("worker")
    agent = plane.agent("recover", *DETECTORS)
    job = plane.jobs["recover"]["id"]
    try:
        ranks = ranks_of(agent)
        plane.stack.wait(lambda: plane.training("recover"), "training")
        os.kill(ranks[0], signal.SIGKILL)

        def recovered() -> list[dict[str, Any]]:
            found = plane.stack.api(f"/api/v1/recoveries/?job={job}", plane.api_token)["results"]
            return found if found and found[0]["status"] in ("recovered", "failed") else []

        decision = plane.stack.wait(recovered, "the recovery", 60)[0]
        assert decision["status"] == "recovered", decision
        used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
        assert 0 not in used and 1 in used
        applied = carried_out(plane.stack.tmp / "recover")
        assert applied == [["1", applied[0][1], "apply_plan", f"d{decision['id']}/"]], applied
    finally:
        stop(agent)
        plane.stack.kill("worker")
