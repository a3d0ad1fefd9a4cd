"""Deployments sharing one Redis server hear nothing of each other: each has a job of the same id
with a node of the same name, and a drill sent to one reaches only its own agent, whose socket
no agent of another deployment replaces. Two on different database numbers need no setting;
two on one database differ by ``PITSTOP_NAMESPACE``."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.e2e.stack import NODES, SCENARIO, Stack, setup
from worker_agent import protocol

pytestmark = pytest.mark.e2e


class Deployment:
    """A control plane (its own SQLite database and ASGI server) on a shared Redis server: a copy
    of ``template``, the database made by ``made``, so that every deployment has the same job,
    ``drill``, with the same id and tokens."""

    def __init__(
        self, tmp: Path, template: Stack, made: dict[str, Any], redis: str, namespace: str | None
    ) -> None:
        tmp.mkdir()
        for path in template.tmp.glob("drill.sqlite3*"):
            shutil.copy(path, tmp / path.name)
        self.made = made
        self.stack = Stack(tmp)
        self.stack.env["REDIS_URL"] = redis
        if namespace is not None:
            self.stack.env["PITSTOP_NAMESPACE"] = namespace
        self.stack.start("server")

    def agent(self, sockets: contextlib.ExitStack) -> ClientConnection:
        """node-0's agent, connected (closed with ``sockets``): its hello answered with a
        welcome."""
        url = f"ws://127.0.0.1:{self.stack.port}/ws/agent/"
        socket = sockets.enter_context(connect(url, open_timeout=10))
        hello = protocol.Hello(
            job="drill", node="node-0", token=self.made["agent_token"], devices=NODES["node-0"]
        )
        socket.send(protocol.encode(hello))
        assert json.loads(socket.recv(timeout=10))["type"] == "welcome"
        beat(socket)
        return socket

    def drill(self) -> str:
        """A drill for node-0's device 0; its id, once sent."""
        status, body = self.stack.post(
            f"/api/v1/jobs/{self.made['job']}/drills/",
            self.made["api_token"],
            {"node": "node-0", "kind": "kill", "device": 0},
        )
        assert status == 202, body
        return str(body["id"])


def beat(socket: ClientConnection, seq: int = 0) -> None:
    frame = protocol.Heartbeat(
        seq=seq,
        at=time.time(),
        step=1,
        devices=[
            protocol.DeviceReport(device=d, state=protocol.DeviceState.TRAINING)
            for d in NODES["node-0"]
        ],
    )
    socket.send(protocol.encode(frame))


def first_command(socket: ClientConnection, timeout_s: float = 15) -> dict[str, Any]:
    """The first command the socket is sent (beating meanwhile, as an agent does); fails the
    test if the server closes the socket first."""
    deadline = time.monotonic() + timeout_s
    seq = 1
    while time.monotonic() < deadline:
        try:
            frame: dict[str, Any] = json.loads(socket.recv(timeout=0.5))
        except TimeoutError:
            beat(socket, seq)
            seq += 1
            continue
        except ConnectionClosed as closed:
            raise AssertionError(f"the server closed the agent's socket: {closed}") from None
        if frame["type"] == "command":
            return frame
    raise AssertionError(f"no command within {timeout_s} s")


@pytest.fixture
def deployments(tmp_path: Path) -> Iterator[list[Deployment]]:
    """Three deployments on one Redis server: two on different databases, unconfigured, and a
    third on the first one's database with a namespace of its own."""
    template = Stack(tmp_path)  # the database the deployments copy, and the Redis server
    template.start("redis")
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps(SCENARIO))
    template.manage("migrate", "-v", "0")
    made = json.loads(template.manage("shell", "-c", setup(scenario)))
    found: list[Deployment] = []
    try:
        for name, db, namespace in (("first", 0, None), ("second", 1, None), ("third", 0, "third")):
            redis = f"redis://127.0.0.1:{template.redis_port}/{db}"
            found.append(Deployment(tmp_path / name, template, made, redis, namespace))
        yield found
    finally:
        for deployment in found:
            deployment.stack.stop_all()
        template.stop_all()


def test_deployments_on_one_redis_server_never_cross_commands_or_sockets(
    deployments: list[Deployment],
) -> None:
    with contextlib.ExitStack() as sockets:
        # Each node-0 says hello after the others': a hello that crossed over would replace (and
        # close) the socket of the same node in another deployment.
        agents = [deployment.agent(sockets) for deployment in deployments]
        # One drill a deployment, in turn: a drill that crossed over would reach another's agent
        # before that agent's own drill, since Redis delivers a channel's messages in order.
        for deployment, agent in zip(deployments, agents, strict=True):
            sent = deployment.drill()
            command = first_command(agent)
            assert command["id"] == sent, deployment.stack.tmp.name
            assert command["action"] == "inject"
