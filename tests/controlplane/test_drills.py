"""Drills through the control plane: ``POST /api/v1/jobs/{id}/drills/`` sends a connected
node's agent one ``inject`` command, whose acknowledgement lands on the drill and the timeline;
every refusal is coded, names its field and writes nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from controlplane.incidents.models import Drill, EventKind, TimelineEvent
from controlplane.jobs.models import Job
from controlplane.jobs.services import issue_agent_token
from tests.controlplane.test_agent_socket import connect, hello, new_job, said
from tests.controlplane.test_api import client_as
from worker_agent import protocol

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


@pytest_asyncio.fixture
async def agent() -> AsyncIterator[tuple[Job, WebsocketCommunicator]]:
    job, token = await new_job("drilled")
    socket = await connect()
    await socket.send_to(hello(job, token))
    assert (await said(socket))["type"] == "welcome"
    yield job, socket
    await socket.disconnect()


@database_sync_to_async
def post(client: Client, job: Job, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = client.post(
        f"/api/v1/jobs/{job.pk}/drills/", json.dumps(data), content_type="application/json"
    )
    return response.status_code, response.json()


@database_sync_to_async
def operator() -> Client:
    return client_as("operator")


@database_sync_to_async
def events(job: Job) -> list[tuple[str, dict[str, Any]]]:
    return [(e.kind, e.payload) for e in TimelineEvent.objects.filter(job=job).order_by("pk")]


async def test_a_drill_reaches_the_agent_once_and_its_ack_lands_on_the_drill(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    code, drill = await post(await operator(), job, {"node": "node-0", "kind": "kill", "device": 2})
    assert code == 202, drill
    assert drill["node"] == "node-0" and drill["kind"] == "kill" and drill["device"] == 2
    assert drill["sent_at"] and drill["acked_at"] is None and drill["ok"] is None

    frame = protocol.parse_server_frame(await socket.receive_from(timeout=10))
    assert isinstance(frame, protocol.Command) and frame.action is protocol.Action.INJECT
    assert frame.id == drill["id"] and frame.inject is not None
    assert (frame.inject.kind, frame.inject.device) == (protocol.InjectKind.KILL, 2)

    ack = protocol.Ack(command=frame.id, ok=True, at=1.0)
    await socket.send_to(protocol.encode(ack))
    await socket.send_to(protocol.encode(ack))  # sent twice: counted once, not refused
    assert await socket.receive_nothing(timeout=0.5)
    row = await database_sync_to_async(Drill.objects.get)(pk=drill["id"])
    assert row.ok is True and row.acked_at is not None and row.requested_by.startswith("user:")
    kinds = [kind for kind, _ in await events(job)]
    assert kinds.count(EventKind.DRILL_SENT) == 1 and kinds.count(EventKind.DRILL_ACKED) == 1
    sent = next(p for k, p in await events(job) if k == EventKind.DRILL_SENT)
    assert sent == {"drill": drill["id"], "node": "node-0", "inject": "kill", "device": 2,
                    "seconds": None}  # fmt: skip

    listed = await database_sync_to_async(lambda: client_as("viewer").get(
        f"/api/v1/jobs/{job.pk}/drills/").json())()  # fmt: skip
    assert [d["id"] for d in listed["results"]] == [drill["id"]] and listed["results"][0]["ok"]


async def test_a_refused_injection_is_recorded_with_the_agents_reason(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    code, drill = await post(await operator(), job, {"node": "node-0", "kind": "drop"})
    assert code == 202, drill and drill["device"] is None
    frame = protocol.parse_server_frame(await socket.receive_from(timeout=10))
    assert isinstance(frame, protocol.Command) and frame.inject is not None
    error = protocol.Error(code=protocol.ErrorCode.INVALID, message="no socket to drop")
    await socket.send_to(protocol.encode(protocol.Ack(command=frame.id, ok=False, at=1.0,
                                                      error=error)))  # fmt: skip
    assert await socket.receive_nothing(timeout=0.5)
    row = await database_sync_to_async(Drill.objects.get)(pk=drill["id"])
    assert row.ok is False and row.error == "[invalid] no socket to drop"


@pytest.mark.parametrize(
    ("data", "status", "code", "field"),
    [
        ({"node": "node-9", "kind": "kill", "device": 0}, 400, "unknown_node", "node"),
        ({"node": "node-0", "kind": "kill", "device": 5}, 400, "wrong_devices", "device"),
        ({"node": "node-0", "kind": "kill"}, 400, "invalid", "device"),
        ({"node": "node-0", "kind": "melt", "device": 0}, 400, "invalid_choice", "kind"),
        (
            {"node": "node-0", "kind": "hang", "device": 0, "seconds": 601},
            400,
            "max_value",
            "seconds",
        ),
        ({"node": "node-1", "kind": "kill", "device": 4}, 409, "node_not_connected", "node"),
    ],
)
async def test_bad_drills_are_refused_naming_the_field_and_nothing_is_sent(
    agent: tuple[Job, WebsocketCommunicator], data: dict[str, Any], status: int, code: str,
    field: str,
) -> None:  # fmt: skip
    job, socket = agent
    answer = await post(await operator(), job, data)
    assert answer == (status, {"code": code, "message": answer[1]["message"], "field": field})
    assert await socket.receive_nothing(timeout=0.3)
    assert not await database_sync_to_async(Drill.objects.exists)()
    assert not [k for k, _ in await events(job) if k == EventKind.DRILL_SENT]


@pytest.mark.parametrize(("role", "status"), [(None, 403), ("viewer", 403)])
async def test_only_operators_inject(
    agent: tuple[Job, WebsocketCommunicator], role: str | None, status: int
) -> None:
    job, socket = agent
    client = await database_sync_to_async(client_as)(role)
    code, _ = await post(client, job, {"node": "node-0", "kind": "kill", "device": 0})
    assert code == status
    assert await socket.receive_nothing(timeout=0.3)
    assert not await database_sync_to_async(Drill.objects.exists)()


async def test_an_ack_for_another_nodes_drill_is_unknown(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    code, drill = await post(await operator(), job, {"node": "node-0", "kind": "nan", "device": 1})
    assert code == 202
    await socket.receive_from(timeout=10)
    # the same drill id acknowledged by another node's connection: not its drill
    other = await connect()
    node_token = await database_sync_to_async(issue_agent_token)(job)
    await other.send_to(hello(job, node_token, node="node-1", devices=[4, 5, 6, 7]))
    assert (await said(other))["type"] == "welcome"
    await other.send_to(protocol.encode(protocol.Ack(command=drill["id"], ok=True, at=1.0)))
    refused = await said(other)
    assert refused["type"] == "error" and refused["code"] == "unknown_command"
    await other.disconnect()
    row = await database_sync_to_async(Drill.objects.get)(pk=drill["id"])
    assert row.acked_at is None
