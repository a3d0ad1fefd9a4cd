"""The agent's socket against a server that answers its hello with an error: a hello the server
read too late (``timeout``) is said again on a new socket; a refusal (``unauthorised``) ends it,
saying why. Each test runs a websocket server of its own on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import websockets

from worker_agent import protocol
from worker_agent.connection import Uplink

pytestmark = pytest.mark.asyncio


def error(code: str, message: str) -> str:
    return json.dumps({"type": "error", "code": code, "message": message})


def welcome(hello: dict[str, Any]) -> str:
    return json.dumps({"type": "welcome", "job": hello["job"], "node": hello["node"],
                       "heartbeat_interval_s": 0.2, "missed_beats": 3,
                       "server_time": time.time()})  # fmt: skip


async def talk(answers: list[str | None]) -> tuple[Uplink, list[dict[str, Any]]]:
    """An uplink run against a server that answers each hello with the next of ``answers``
    (None: a welcome) and closes a socket it answered with an error; stopped once it has beaten
    after a welcome, or when it returns. What the server read, in order."""
    read: list[dict[str, Any]] = []
    stop = asyncio.Event()

    async def converse(ws: Any) -> None:
        hello = json.loads(await ws.recv())
        read.append(hello)
        answer = answers.pop(0) if answers else None
        if answer is not None:
            await ws.send(answer)
            await ws.close(4002)
            return
        await ws.send(welcome(hello))
        async for text in ws:
            read.append(json.loads(text))
            stop.set()

    def beat(seq: int) -> protocol.Heartbeat:
        report = protocol.DeviceReport(device=0, state=protocol.DeviceState.TRAINING)
        return protocol.Heartbeat(seq=seq, at=time.time(), step=1, devices=[report])

    async def nothing(_: protocol.Command) -> None:
        return None

    async with websockets.serve(converse, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        uplink = Uplink(f"ws://127.0.0.1:{port}/", job="j", node="node-0", token="t",
                        devices=[0], agent="test", heartbeat=beat, on_command=nothing)  # fmt: skip
        await asyncio.wait_for(uplink.run(stop), timeout=20)
    return uplink, read


async def test_a_hello_the_server_read_too_late_is_said_again_on_a_new_socket() -> None:
    uplink, read = await talk([error("timeout", "no hello in 5.0 s")] * 2)
    kinds = [frame["type"] for frame in read]
    assert kinds[:3] == ["hello", "hello", "hello"] and "heartbeat" in kinds[3:]
    assert uplink.refused is None and uplink.connections == 1


async def test_a_refused_hello_ends_the_uplink_saying_why() -> None:
    uplink, read = await talk([error("unauthorised", "no such token for this job")])
    assert [frame["type"] for frame in read] == ["hello"]
    assert uplink.refused is not None and uplink.refused.code is protocol.ErrorCode.UNAUTHORISED
    assert uplink.connections == 0
