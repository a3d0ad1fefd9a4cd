"""Applying a chosen plan: commands reach the connected agents through Redis, their
acknowledgements and their return to training move the decision to recovered, and nothing is
lost or applied twice when a command is missed, refused, or its agent reconnects."""

from __future__ import annotations

import asyncio
import copy
import csv
import datetime as dt
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlplane.asgi import application
from controlplane.incidents import applying
from controlplane.incidents.models import (
    AgentCommand,
    DecisionStatus,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.incidents.phases import phases
from controlplane.jobs import liveness
from controlplane.jobs.models import Device, DeviceState, Job, JobStatus
from controlplane.jobs.services import create_job
from worker_agent import protocol

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("eager_planning"),
]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["devices_per_node"] = 4  # node-0: 0-3, node-1: 4-7, node-2: spares 8-9
NODES = {"node-0": [0, 1, 2, 3], "node-1": [4, 5, 6, 7]}


class Agent:
    """A node's agent reduced to its frames, over Channels' communicator."""

    def __init__(self, job: Job, token: str, node: str) -> None:
        self.job, self.token, self.node, self.devices = job, token, node, NODES[node]
        self.seq = 0

    async def connect(self) -> dict[str, Any]:
        self.socket = WebsocketCommunicator(application, "/ws/agent/")
        connected, _ = await self.socket.connect()
        assert connected
        hello = protocol.Hello(
            job=self.job.name, node=self.node, token=self.token, devices=self.devices
        )
        await self.socket.send_to(protocol.encode(hello))
        return await self.said()

    async def said(self, timeout: float = 10) -> dict[str, Any]:
        frame: dict[str, Any] = json.loads(await self.socket.receive_from(timeout=timeout))
        return frame

    async def send(self, frame: Any) -> None:
        await self.socket.send_to(protocol.encode(frame))

    async def fault(self, *devices: int, step: int | None = None) -> None:
        self.seq += 1
        await self.send(
            protocol.Fault(
                seq=self.seq,
                at=time.time(),
                kind=protocol.FaultKind.CRASH,
                devices=list(devices),
                step=step,
            )
        )

    async def ack(self, command: str, ok: bool = True, error: str | None = None) -> None:
        refusal = None
        if error is not None:
            refusal = protocol.Error(code=protocol.ErrorCode.INVALID, message=error)
        await self.send(protocol.Ack(command=command, ok=ok, at=time.time(), error=refusal))

    async def beat(self, step: int, state: str = "training") -> None:
        self.seq += 1
        reports = [
            protocol.DeviceReport(device=d, state=protocol.DeviceState(state)) for d in self.devices
        ]
        await self.send(
            protocol.Heartbeat(seq=self.seq, at=time.time(), step=step, devices=reports)
        )

    async def quiet(self) -> bool:
        return bool(await self.socket.receive_nothing(timeout=0.3))


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[tuple[Job, dict[str, Agent]]]:
    job, token = await database_sync_to_async(create_job)(
        "llama", copy.deepcopy(SCENARIO), approval_mode="auto", enabled_policies=["dynamic"]
    )
    agents = {name: Agent(job, token, name) for name in NODES}
    for agent in agents.values():
        assert (await agent.connect())["type"] == "welcome"
    yield job, agents
    for agent in agents.values():
        await agent.socket.disconnect()


async def latest(job: Job) -> RecoveryDecision:
    found: RecoveryDecision = await database_sync_to_async(
        lambda: (
            RecoveryDecision.objects.select_related("job", "failure").filter(job=job).latest("pk")
        )
    )()
    return found


async def kinds(decision: RecoveryDecision) -> list[str]:
    found: list[str] = await database_sync_to_async(
        lambda: list(decision.events.values_list("kind", flat=True))
    )()
    return found


async def eventually(check: Any, timeout: float = 10) -> Any:
    """Poll an async check until it returns something true."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.02)


async def commands_after_a_fault(
    job: Job, agents: dict[str, Agent], step: int | None = None
) -> dict[str, dict[str, Any]]:
    """Device 5 crashes (at ``step``); the auto job's plan goes to both connected agents."""
    await agents["node-1"].fault(5, step=step)
    return {name: await agent.said() for name, agent in agents.items()}


async def test_an_auto_plan_reaches_every_agent_and_recovers_when_they_train_again(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    decision = await latest(job)
    assert decision.status == DecisionStatus.APPLYING
    for frame in sent.values():
        assert (frame["type"], frame["action"]) == ("command", "apply_plan")
        # the plan travels deflated, once on the decision, not in each command's row
        assert protocol.unpack_plan(frame["plan"]) == decision.plan
        assert frame["decision"] == decision.pk
    assert sent["node-0"]["id"] != sent["node-1"]["id"]
    job_now = await database_sync_to_async(Job.objects.get)(pk=job.pk)
    assert job_now.plan == decision.plan  # the job runs the plan being applied
    assert await database_sync_to_async(
        Device.objects.filter(job=job, index=5, state=DeviceState.FAILED).exists
    )()

    for name, agent in agents.items():
        await agent.ack(sent[name]["id"])
    for agent in agents.values():
        await agent.beat(100)  # training again, at the step they resumed from
    await eventually(lambda: _has(decision, "resumed"))
    assert (await latest(job)).status == DecisionStatus.APPLYING  # no step done yet
    await agents["node-0"].beat(101)
    await agents["node-0"].beat(102)
    assert (await latest(job)).status == DecisionStatus.APPLYING  # node-1 has not stepped
    await agents["node-1"].beat(101)
    done = await eventually(lambda: _status_is(job, DecisionStatus.RECOVERED))
    assert done, await kinds(decision)
    assert (await kinds(decision))[-5:] == [
        "command_acked",
        "command_acked",
        "resumed",
        "first_step",
        "recovered",
    ]
    job_now = await database_sync_to_async(Job.objects.get)(pk=job.pk)
    assert (job_now.status, job_now.step) == (JobStatus.RUNNING, 101)
    assert (await latest(job)).resumed_step == 100  # the step before the first one, 101
    events = await database_sync_to_async(lambda: list(decision.events.all()))()
    breakdown = {p["phase"]: p["seconds"] for p in phases(await latest(job), events)}
    assert all(seconds is not None and seconds >= 0 for seconds in breakdown.values()), breakdown
    # /metrics: the recovery's duration, under the policy whose plan was applied
    scraped = await database_sync_to_async(lambda: Client().get("/metrics").content.decode())()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
    }
    policy = (("policy", "dynamic"),)
    assert samples[("pitstop_recovery_seconds_count", policy)] == 1
    assert 0 < samples[("pitstop_recovery_seconds_sum", policy)] < 30


async def test_the_api_gives_the_step_at_the_failure_and_the_step_training_resumed_from(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    """Training resumes from the step before the lowest first step an agent reported: one
    agent whose beats showed its return only a step late (its first counted beat already past
    its first step) does not move it."""
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents, step=100)
    for name, agent in agents.items():
        await agent.ack(sent[name]["id"])
    # each beat handled before the next is sent (two sockets are two queues)
    await agents["node-0"].beat(100)  # training again, before its first step
    assert await eventually(lambda: _command_at(sent["node-0"]["id"], resumed=100))
    await agents["node-1"].beat(102)  # ... first heard of past steps 101 and 102
    assert await eventually(lambda: _command_at(sent["node-1"]["id"], resumed=102))
    await agents["node-0"].beat(101)
    assert await eventually(lambda: _command_at(sent["node-0"]["id"], stepped=101))
    await agents["node-1"].beat(103)
    assert await eventually(lambda: _status_is(job, DecisionStatus.RECOVERED))
    decision = await latest(job)
    assert (decision.failure.step, decision.resumed_step) == (100, 100)

    def read() -> tuple[Any, Any, Any]:
        client = Client()
        client.force_login(User.objects.create_superuser("root", password="x"))
        url = f"/api/v1/recoveries/{decision.pk}/"
        timeline = client.get(f"{url}timeline/")
        exported = client.get(f"{url}timeline/", {"format": "csv"}).content.decode()
        return client.get(url).json(), timeline.json(), exported

    shown, timeline, exported = await database_sync_to_async(read)()
    assert (shown["failure"]["step"], shown["resumed_step"]) == (100, 100)
    assert (timeline["step_at_failure"], timeline["resumed_step"]) == (100, 100)
    steps = {e["kind"]: e["step"] for e in timeline["results"] if e["step"] is not None}
    assert steps == {"failure_detected": 100, "resumed": 102, "first_step": 103, "recovered": 103}
    rows = list(csv.DictReader(io.StringIO(exported)))
    assert [(r["kind"], int(r["step"])) for r in rows if r["step"]] == list(steps.items())
    assert json.loads(rows[-1]["payload"])["resumed_step"] == 100


async def _command_at(
    command_id: str, *, resumed: int | None = None, stepped: int | None = None
) -> bool:
    """Whether the command's node is recorded as resumed at, or stepped to, that step."""
    found = AgentCommand.objects.filter(pk=command_id)
    if resumed is not None:
        found = found.filter(resumed_step=resumed)
    if stepped is not None:
        found = found.filter(stepped_step=stepped)
    return bool(await database_sync_to_async(found.exists)())


async def _has(decision: RecoveryDecision, kind: str) -> bool:
    return kind in await kinds(decision)


async def _status_is(job: Job, status: str) -> bool:
    return (await latest(job)).status == status


async def test_an_agent_that_refuses_the_plan_fails_the_decision_with_its_reason(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    await agents["node-0"].ack(sent["node-0"]["id"], ok=False, error="stage 2 does not fit")
    decision = await eventually(lambda: _status_is(job, DecisionStatus.FAILED))
    assert decision
    failed = await latest(job)
    assert failed.reason == "node-0 refused the plan: [invalid] stage 2 does not fit"
    assert (await database_sync_to_async(Job.objects.get)(pk=job.pk)).status == JobStatus.FAILED
    # node-1's acknowledgement still lands on the timeline, and changes nothing
    await agents["node-1"].ack(sent["node-1"]["id"])
    await eventually(lambda: _count(failed, "command_acked", 2))
    assert (await latest(job)).status == DecisionStatus.FAILED


async def test_refusals_that_come_together_fail_the_decision_once_and_close_no_socket(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    """Both agents refuse in one batch: the first refusal fails the decision, the second
    finds it failed and leaves it so (failing it again raised, which closed the refusing
    agents' sockets, and their nodes were taken for lost); both are on the timeline."""
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    decision = await latest(job)
    nodes = await database_sync_to_async(lambda: dict(job.nodes.values_list("name", "pk")))()
    refusals = [
        (nodes[name], protocol.Ack(command=sent[name]["id"], ok=False, at=time.time(),
                                   error=protocol.Error(code=protocol.ErrorCode.INVALID,
                                                        message=f"{name} says no")))
        for name in ("node-1", "node-0")
    ]  # fmt: skip
    recorded = await database_sync_to_async(applying.acked_each)(refusals)
    assert [str(c.pk) for c in recorded if c is not None] == [
        sent["node-1"]["id"],
        sent["node-0"]["id"],
    ]
    failed = await latest(job)
    assert failed.status == DecisionStatus.FAILED
    assert failed.reason == "node-1 refused the plan: [invalid] node-1 says no"
    assert await _count(decision, "command_acked", 2)
    again = await database_sync_to_async(applying.acked_each)(refusals)  # sent again: once
    assert [c is not None for c in again] == [True, True]
    assert await _count(decision, "command_acked", 2)
    for agent in agents.values():
        await agent.beat(3, "paused")
        assert await agent.quiet()  # no error frame, no close


async def _count(decision: RecoveryDecision, kind: str, n: int) -> bool:
    return (await kinds(decision)).count(kind) == n


async def test_acknowledgements_count_once_and_must_name_a_command_sent_to_the_node(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    for command in ("not-a-uuid", sent["node-1"]["id"]):  # junk, and another node's command
        await agents["node-0"].ack(command)
        error = await agents["node-0"].said()
        assert (error["code"], error["field"]) == ("unknown_command", "command")
    await agents["node-0"].ack(sent["node-0"]["id"])
    await agents["node-0"].ack(sent["node-0"]["id"])  # resent after a reconnect, say
    decision = await latest(job)
    await eventually(lambda: _count(decision, "command_acked", 1))
    assert await agents["node-0"].quiet()  # a repeated ack is no error
    assert (await kinds(decision)).count("command_acked") == 1


async def test_a_reconnecting_agent_is_sent_again_what_it_had_not_acknowledged(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    old = agents["node-0"]
    new = Agent(job, old.token, "node-0")
    welcome = await new.connect()
    assert welcome["type"] == "welcome"
    again = await new.said()
    assert again == sent["node-0"]  # the same command, by the same id
    assert (await old.said())["code"] == "replaced"
    await old.socket.disconnect()
    agents["node-0"] = new
    await new.ack(again["id"])
    decision = await latest(job)
    await eventually(lambda: _count(decision, "command_acked", 1))
    assert decision.status == DecisionStatus.APPLYING and decision.failure.devices == [5]


async def test_unacknowledged_commands_are_published_again_and_silence_fails_the_decision(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    sent = await commands_after_a_fault(job, agents)
    await agents["node-1"].ack(sent["node-1"]["id"])
    decision = await latest(job)
    await eventually(lambda: _count(decision, "command_acked", 1))
    assert await database_sync_to_async(applying.resend)() == 0  # too recent
    await database_sync_to_async(
        lambda: AgentCommand.objects.update(sent_at=timezone.now() - dt.timedelta(seconds=10))
    )()

    # node-0's went to its socket: published again, it would only cost (2,048 nodes slow to
    # acknowledge got every command twice); its agent, back after a close, is sent it at hello
    async def handed() -> set[str]:
        return liveness.handed_of([sent["node-0"]["id"]])

    assert await eventually(handed) == {sent["node-0"]["id"]}
    assert await database_sync_to_async(applying.resend)() == 0
    assert await agents["node-0"].quiet()
    # a Redis restart loses that record (and perhaps messages on their way): published again,
    # but not sent twice on the socket that had it (60 kB a node, for nothing)
    liveness.sync_client().delete(liveness.DELIVERED_KEY)
    assert await database_sync_to_async(applying.resend)() == 1  # node-1 acknowledged
    assert await agents["node-0"].quiet()
    assert await agents["node-1"].quiet()
    assert await database_sync_to_async(applying.expire)(timeout_s=60) == []
    await database_sync_to_async(
        lambda: RecoveryDecision.objects.filter(pk=decision.pk).update(
            updated_at=timezone.now() - dt.timedelta(seconds=61)
        )
    )()
    assert await database_sync_to_async(applying.expire)(timeout_s=60) == [decision.pk]
    failed = await latest(job)
    assert failed.status == DecisionStatus.FAILED
    assert failed.reason == "no step from node-0, node-1 within 60 s"


async def test_a_failure_while_applying_supersedes_the_decision_and_sends_a_new_plan(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    first = await commands_after_a_fault(job, agents)
    await agents["node-0"].fault(1)
    second = {name: await agent.said() for name, agent in agents.items()}
    assert {f["id"] for f in second.values()}.isdisjoint(f["id"] for f in first.values())
    decisions = await database_sync_to_async(
        lambda: list(
            RecoveryDecision.objects.select_related("failure").filter(job=job).order_by("pk")
        )
    )()
    assert [d.status for d in decisions] == [DecisionStatus.SUPERSEDED, DecisionStatus.APPLYING]
    assert decisions[1].failure.devices == [1]
    assert protocol.unpack_plan(second["node-0"]["plan"]) == decisions[1].plan
    used = {d for p in decisions[1].plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used.isdisjoint({1, 5})
    # the superseded decision's acknowledgement is recorded, and moves nothing
    await agents["node-0"].ack(first["node-0"]["id"])
    for name, agent in agents.items():
        await agent.ack(second[name]["id"])
        await agent.beat(7)
        await agent.beat(8)
    assert await eventually(lambda: _status_is(job, DecisionStatus.RECOVERED))
    superseded = await database_sync_to_async(RecoveryDecision.objects.get)(pk=decisions[0].pk)
    assert superseded.status == DecisionStatus.SUPERSEDED
    assert await database_sync_to_async(
        TimelineEvent.objects.filter(decision=superseded, kind="command_acked").exists
    )()
