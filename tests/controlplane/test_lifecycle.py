"""Nodes' and jobs' lifecycles through the real agent socket, Redis and the detector's sweep:
a node not joined within the join deadline is a ``never_joined`` failure, once, and no plan
uses its devices; a job whose agents all said goodbye is ``stopped``; one not heard for longer
than the deadline is ``stale``."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone

from controlplane.asgi import application
from controlplane.incidents.models import DecisionStatus, Failure, RecoveryDecision
from controlplane.jobs import detector, lifecycle, liveness
from controlplane.jobs.models import Device, DeviceState, Job, JobStatus, Node, NodeStatus
from controlplane.jobs.services import create_job
from worker_agent import protocol

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("eager_planning"),
]

ROOT = Path(__file__).resolve().parents[2]
# the demo's job: 8 layers, PP4 x DP2, 2 devices a node: node-3 holds devices 6 and 7
SCENARIO = json.loads((ROOT / "examples" / "reference-trainer-pp4-dp2.json").read_text())
POLICIES = ["rerouting", "dynamic", "odyssey"]
NODES = {f"node-{i}": [2 * i, 2 * i + 1] for i in range(4)}


async def new_job(name: str = "demo-auto") -> tuple[Job, str]:
    """A new job of the demo's scenario, with nothing in Redis under its id (ids are used
    again after a transactional test's flush; Redis keeps an earlier job's keys)."""
    job, token = await database_sync_to_async(create_job)(
        name, json.loads(json.dumps(SCENARIO)), enabled_policies=POLICIES
    )
    client = liveness.client()
    try:
        await client.delete(
            liveness.seen_key(job.pk), liveness.frames_key(job.pk), detector.heard_key(job.pk)
        )
    finally:
        await client.aclose()
    return job, token


async def join(job: Job, token: str, node: str) -> WebsocketCommunicator:
    """The node's agent says hello and beats once; its socket."""
    socket = WebsocketCommunicator(application, "/ws/agent/")
    connected, _ = await socket.connect()
    assert connected
    hello = protocol.Hello(job=job.name, node=node, token=token, devices=NODES[node])
    await socket.send_to(protocol.encode(hello))
    welcome = json.loads(await socket.receive_from(timeout=10))
    assert welcome["type"] == "welcome", welcome
    beat = protocol.Heartbeat(
        seq=1,
        at=time.time(),
        step=0,
        devices=[
            protocol.DeviceReport(device=d, state=protocol.DeviceState.TRAINING)
            for d in NODES[node]
        ],
    )
    await socket.send_to(protocol.encode(beat))
    return socket


async def goodbye(socket: WebsocketCommunicator) -> None:
    await socket.send_to(protocol.encode(protocol.Goodbye(reason="done")))
    for _ in range(10):  # past the commands sent meanwhile
        message = await socket.receive_output(timeout=10)
        if message["type"] == "websocket.close":
            break
    assert message == {"type": "websocket.close", "code": 1000}, message


@database_sync_to_async
def back_date_expected(job: Job, seconds: float) -> None:
    """As if the job's nodes still expected had been awaited for ``seconds`` already."""
    then = timezone.now() - dt.timedelta(seconds=seconds)
    Node.objects.filter(job=job, status=NodeStatus.EXPECTED).update(expected_at=then)


@database_sync_to_async
def status_of(job: Job) -> str:
    return str(Job.objects.get(pk=job.pk).status)


def plan_devices(plan: dict[str, Any]) -> set[int]:
    return {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}


async def test_a_node_not_joined_in_time_fails_once_as_never_joined_and_no_plan_uses_it(
    redis: Any,
) -> None:
    job, token = await new_job()
    sockets = [await join(job, token, node) for node in ("node-0", "node-1", "node-2")]
    # the sweeps' clock stays at the hellos: a slow machine makes no joined node silent here
    heard = time.time()
    try:
        deadline = lifecycle.join_deadline_s()
        await back_date_expected(job, deadline * 0.9 - (time.time() - heard))
        assert await detector.sweep(redis, now_s=heard) == []  # not yet
        await back_date_expected(job, deadline + 60)
        decided = await detector.sweep(redis, now_s=heard)
        assert len(decided) == 1
        assert await detector.sweep(redis, now_s=heard) == []  # recorded once
        failure = await database_sync_to_async(Failure.objects.get)(job=job)
        assert (failure.kind, failure.devices, failure.source) == (
            "never_joined",
            [6, 7],
            "heartbeat",
        )
        nodes = await database_sync_to_async(
            lambda: dict(Node.objects.filter(job=job).values_list("name", "status"))
        )()
        assert nodes == {
            "node-0": NodeStatus.HEALTHY,
            "node-1": NodeStatus.HEALTHY,
            "node-2": NodeStatus.HEALTHY,
            "node-3": NodeStatus.FAILED,
        }
        for _ in range(300):  # planned in this process, after the failure's commit
            decision = await database_sync_to_async(RecoveryDecision.objects.get)(pk=decided[0])
            if decision.status != DecisionStatus.PLANNING:
                break
            await asyncio.sleep(0.02)
        assert decision.status == DecisionStatus.APPLYING, decision.reason
        assert decision.plan is not None and not plan_devices(decision.plan) & {6, 7}
        for candidate in decision.decision["candidates"]:
            if candidate.get("plan"):
                assert not plan_devices(candidate["plan"]) & {6, 7}, candidate["policy"]
    finally:
        for socket in sockets:
            await goodbye(socket)


@database_sync_to_async
def plan_a_crash_with_node_3_unheard(back_dated_s: float) -> tuple[RecoveryDecision, set[int]]:
    """A crash of device 0 planned while node-3 is still expected since ``back_dated_s``."""
    from controlplane.incidents import decisions
    from controlplane.jobs.services import failed_devices

    job, _ = create_job("unheard", json.loads(json.dumps(SCENARIO)), enabled_policies=POLICIES)
    Node.objects.filter(job=job).exclude(name="node-3").update(status=NodeStatus.HEALTHY)
    then = timezone.now() - dt.timedelta(seconds=back_dated_s)
    Node.objects.filter(job=job, name="node-3").update(expected_at=then)
    _, decision = decisions.record_failure(
        job, kind="crash", devices=[0], source="agent", occurred_at=timezone.now()
    )
    decisions.plan(decision.pk)
    return RecoveryDecision.objects.get(pk=decision.pk), failed_devices(job)


async def test_devices_not_heard_within_the_deadline_count_as_failed_before_any_sweep() -> None:
    decision, failed = await plan_a_crash_with_node_3_unheard(lifecycle.join_deadline_s() + 1)
    assert failed == {0, 6, 7}
    assert decision.status == DecisionStatus.APPLYING, decision.reason
    assert decision.plan is not None and not plan_devices(decision.plan) & {0, 6, 7}
    # node-3's failure is not recorded yet (the sweep does): only the planner left them out
    states = await database_sync_to_async(
        lambda: set(
            Device.objects.filter(job=decision.job_id, index__in=[6, 7]).values_list(
                "state", flat=True
            )
        )
    )()
    assert DeviceState.FAILED not in states


async def test_a_job_whose_agents_all_said_goodbye_is_stopped(redis: Any) -> None:
    job, token = await new_job()
    sockets = {node: await join(job, token, node) for node in NODES}
    assert await status_of(job) == JobStatus.RUNNING
    for node in ("node-0", "node-1", "node-2"):
        await goodbye(sockets[node])
    assert await status_of(job) == JobStatus.RUNNING  # node-3 trains on
    await goodbye(sockets["node-3"])
    assert await status_of(job) == JobStatus.STOPPED
    assert not await database_sync_to_async(Failure.objects.exists)()
    # an agent coming back runs it again
    again = await join(job, token, "node-0")
    assert await status_of(job) == JobStatus.RUNNING
    await goodbye(again)


async def test_a_job_not_heard_for_longer_than_the_deadline_is_stale(redis: Any) -> None:
    job, token = await new_job()
    socket = await join(job, token, "node-0")
    await detector.sweep(redis, now_s=time.time())  # the detector sees it heard
    await socket.disconnect(code=1006)  # gone without goodbye: node lost, job recovering
    assert await status_of(job) == JobStatus.RECOVERING
    deadline = lifecycle.join_deadline_s()
    await detector.sweep(redis, now_s=time.time() + deadline * 0.9)
    assert await status_of(job) == JobStatus.RECOVERING  # not yet
    await detector.sweep(redis, now_s=time.time() + deadline + 1)
    assert await status_of(job) == JobStatus.STALE


async def test_a_job_nobody_joined_is_stale_and_its_nodes_are_not_failures(redis: Any) -> None:
    job, token = await new_job()
    await database_sync_to_async(Job.objects.filter(pk=job.pk).update)(
        created_at=timezone.now() - dt.timedelta(seconds=lifecycle.join_deadline_s() + 1)
    )
    await back_date_expected(job, lifecycle.join_deadline_s() + 1)
    assert await detector.sweep(redis, now_s=time.time()) == []
    assert await status_of(job) == JobStatus.STALE
    assert not await database_sync_to_async(Failure.objects.exists)()
    # its first agent runs it again, and the others' join deadline starts again with it
    socket = await join(job, token, "node-0")
    assert await status_of(job) == JobStatus.RUNNING
    assert await detector.sweep(redis, now_s=time.time()) == []
    assert not await database_sync_to_async(Failure.objects.exists)()
    await goodbye(socket)


@database_sync_to_async
def api_view(job: Job) -> tuple[dict[str, str], str]:
    viewer = User.objects.get_or_create(username="viewer-of-nodes")[0]
    viewer.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client = Client()
    client.force_login(viewer)
    nodes = client.get(f"/api/v1/nodes/?job={job.pk}").json()["results"]
    listed = client.get("/api/v1/jobs/").json()["results"]
    return {n["name"]: n["status"] for n in nodes}, next(
        j["status"] for j in listed if j["id"] == job.pk
    )


async def test_the_api_shows_nodes_not_yet_heard_and_stale_jobs(redis: Any) -> None:
    job, token = await new_job()
    socket = await join(job, token, "node-0")
    nodes, _ = await api_view(job)
    assert nodes == {
        "node-0": "healthy",
        "node-1": "expected",
        "node-2": "expected",
        "node-3": "expected",
    }
    await goodbye(socket)
    await detector.sweep(redis, now_s=time.time() + lifecycle.join_deadline_s() + 1)
    _, status = await api_view(job)
    assert status == "stale"


@database_sync_to_async
def shown(job: Job) -> tuple[str, dict[str, int], dict[str, float]]:
    """The job page's device letters and counts, and /metrics' nodes by status."""
    from prometheus_client.parser import text_string_to_metric_families

    from webui import data

    states = data.grid(job)["states"]
    text = Client().get("/metrics").content.decode()
    nodes = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "pitstop_nodes"
        for sample in family.samples
    }
    return states, data.device_counts(states), nodes


async def test_the_grid_and_the_metrics_show_nodes_not_yet_heard(redis: Any) -> None:
    job, token = await new_job()
    socket = await join(job, token, "node-0")
    heard = time.time()
    try:
        states, counts, nodes = await shown(job)
        assert states == "hhuuuuuu"
        assert (counts["healthy"], counts["unheard"]) == (2, 6)
        assert (nodes["healthy"], nodes["expected"]) == (1, 3)
        await back_date_expected(job, lifecycle.join_deadline_s() + 60)
        await detector.sweep(redis, now_s=heard)  # node-1..3 never joined
        states, counts, nodes = await shown(job)
        assert states == "hhffffff"
        assert (nodes["healthy"], nodes["expected"], nodes["failed"]) == (1, 0, 3)
    finally:
        await goodbye(socket)
