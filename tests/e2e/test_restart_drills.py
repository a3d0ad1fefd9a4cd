"""Restart drills: in the middle of one recovery the Celery worker, the ASGI server and Redis
each go away and come back, and the recovery still completes: no decision lost, none applied
twice, no failure made up. Everything is real: its own Redis, a SQLite file database, Daphne,
a Celery worker, the failure detector, and agents speaking the protocol over sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.e2e.stack import NODES, SCENARIO, Stack, setup

pytestmark = pytest.mark.e2e


class Agent:
    """A node's agent reduced to the protocol: reconnects, beats, carries out each command id
    once and acknowledges it (every time it is sent, while ``acking``; once ``acking``, the
    ones it holds unacknowledged, as an agent does when its apply is done)."""

    def __init__(self, url: str, job: str, token: str, node: str) -> None:
        self.url, self.job, self.token, self.node = url, job, token, node
        self.devices = NODES[node]
        self.acking = False
        self.applied: list[str] = []  # command ids carried out, in order
        self.received: list[str] = []  # every command frame's id, repeats included
        self.holding: set[str] = set()  # received while not acking
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
                while self.acking and self.holding:
                    await self.ack(ws, self.holding.pop())
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
            else:
                self.holding.add(frame["id"])

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
    made = json.loads(stack.manage("shell", "-c", setup(scenario)))
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
        # 3. Redis restarts, empty: beats, the hub's subscription and the queues come back, and
        # the detector publishes what is still unacknowledged once more (the record that it
        # reached the agents is lost with Redis); a socket that has it is not sent it twice,
        # and the agents acknowledge it when their apply is done
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
        # sent at the plan and at the reconnection to the new server, not twice on a socket
        assert agent.received.count(agent.applied[0]) == 2, f"{node} got {agent.received}"
        assert agent.connections == 2, f"{node} connected {agent.connections} times"
    events = stack.api(f"/api/v1/recoveries/{done[0]['id']}/timeline/", token)
    kinds = [e["kind"] for e in events["results"]]
    assert kinds.count("command_acked") == 2, kinds  # each node's, once
    assert kinds.count("failure_detected") == 1 and kinds[-1] == "recovered", kinds
    phases = {p["phase"]: p["seconds"] for p in events["phases"]}
    assert all(s is not None for s in phases.values()), phases
