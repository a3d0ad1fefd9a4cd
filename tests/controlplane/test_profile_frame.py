"""A script's ``profile`` frame makes its job's scenario: a launcher's job (one replica a
process, a placeholder model) gets the measured modules as its layers, its plans fitted to them
and the link its gradient sync showed; a profile that cannot fit is refused naming its field,
and one sent while a recovery is open changes nothing."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from controlplane.bridge import rows
from controlplane.incidents.models import DecisionStatus, Failure, RecoveryDecision
from controlplane.jobs.models import Job
from controlplane.jobs.services import create_job
from controlplane.streaming import agent as streaming_agent
from tests.controlplane.test_agent_socket import connect, heartbeat, hello, said
from worker_agent import protocol
from worker_agent.launch import World, job_scenario

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    {"name": "0", "fwd_s": 0.004, "bwd_s": 0.007, "update_s": 0.001, "m_p": 8448.0,
     "m_o": 16904.0, "m_g": 8448.0, "m_a": 2048.0},
    {"name": "1", "fwd_s": 0.001, "bwd_s": 0.001, "update_s": 0.0, "m_p": 0.0, "m_o": 0.0,
     "m_g": 0.0, "m_a": 4096.0},
    {"name": "2", "fwd_s": 0.002, "bwd_s": 0.003, "update_s": 0.0002, "m_p": 260.0,
     "m_o": 528.0, "m_g": 260.0, "m_a": 4096.0},
]  # fmt: skip


def launcher_scenario(nodes: int = 2) -> dict[str, Any]:
    world = World(nodes, 1, 0, "127.0.0.1", 29500, "run", 3, "SIGTERM", "/tmp", elastic=True)
    return job_scenario(world, nodes, "/work/train.py")


def profile(seq: int = 1, **fields: Any) -> str:
    frame = {"type": "profile", "seq": seq, "at": time.time(), "devices": [0],
             "modules": MODULES, "micro_batches": 4, **fields}  # fmt: skip
    return json.dumps(frame)


async def joined(
    scenario: dict[str, Any], devices: list[int], name: str = "ddp"
) -> tuple[Job, WebsocketCommunicator]:
    job, token = await database_sync_to_async(create_job)(name, scenario)
    socket = await connect()
    await socket.send_to(hello(job, token, devices=devices))
    assert (await said(socket))["type"] == "welcome"
    return job, socket


async def reloaded(job: Job) -> Job:
    found: Job = await database_sync_to_async(Job.objects.get)(pk=job.pk)
    return found


async def settled(job: Job, check: Any) -> Job:
    for _ in range(100):
        now = await reloaded(job)
        if check(now):
            return now
        await database_sync_to_async(time.sleep)(0.02)
    raise AssertionError("the job never changed")


async def test_a_profile_makes_a_launcher_jobs_model_and_fits_its_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readied: list[int] = []
    monkeypatch.setattr(streaming_agent, "enqueue_readying", readied.append)
    job, socket = await joined(launcher_scenario(), [0])
    assert readied == [job.pk]  # the hello that started it
    try:
        await socket.send_to(profile(sync_bytes=34052.0, sync_s=0.001, sync_members=2))
        now = await settled(job, lambda j: j.scenario["model"]["layers"] == 3)
        for _ in range(100):  # readied again for the new scenario, once it is stored
            if len(readied) == 2:
                break
            await database_sync_to_async(time.sleep)(0.02)
    finally:
        await socket.disconnect()
    assert readied == [job.pk, job.pk]
    model = now.scenario["model"]
    assert model["name"] == "train.py (measured by the script)"
    assert model["fwd_s"] == [m["fwd_s"] for m in MODULES]
    assert model["m_o"] == [m["m_o"] for m in MODULES]
    for plan in (now.scenario["plan"], now.plan):
        assert [p["stages"][0]["layers"] for p in plan["pipelines"]] == [[0, 3], [0, 3]]
        assert [p["micro_batches"] for p in plan["pipelines"]] == [2, 2]
    assert now.scenario["training"]["global_batch"] == 4
    # two nodes: the sync crossed them; a ring of two moves the bytes once each way
    assert now.scenario["cluster"]["inter_node_gbps"] == pytest.approx(34052 * 8 / 0.001 / 1e9)
    state = rows.parse_scenario(now.scenario).state  # the core takes it
    assert state.profile.layers == 3


async def test_a_profile_that_cannot_fit_is_refused_naming_its_field_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streaming_agent, "PROFILE_INTERVAL_S", 0.0)  # two in a row, both read
    pipelines = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
    pipelines["failed"], pipelines["cluster"]["devices_per_node"] = [], 4
    job, socket = await joined(copy.deepcopy(pipelines), [0, 1, 2, 3])
    try:
        await socket.send_to(profile(seq=1))  # 3 modules for a job whose stages split 32 layers
        refused = await said(socket)
        assert (refused["code"], refused["field"]) == ("invalid", "modules")
        assert "split its 32 layers" in refused["message"]
        await socket.send_to(profile(seq=2, micro_batches=7))
        wrong = await said(socket)
        assert (wrong["code"], wrong.get("field")) == ("invalid", "modules")
    finally:
        await socket.disconnect()
    assert (await reloaded(job)).scenario == job.scenario

    few, other = await joined(launcher_scenario(), [0], name="few")
    try:
        await other.send_to(profile(micro_batches=1))  # two replicas need one each
        refused = await said(other)
        assert (refused["code"], refused["field"]) == ("invalid", "micro_batches")
    finally:
        await other.disconnect()
    assert (await reloaded(few)).scenario == few.scenario


async def test_a_profile_sent_while_a_recovery_is_open_waits_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readied: list[int] = []
    monkeypatch.setattr(streaming_agent, "enqueue_readying", readied.append)
    job, socket = await joined(launcher_scenario(), [0])

    @database_sync_to_async
    def open_one() -> None:
        failure = Failure.objects.create(
            job=job,
            kind="crash",
            devices=[1],
            source="agent",
            occurred_at=timezone.now(),
            detected_at=timezone.now(),
        )
        RecoveryDecision.objects.create(job=job, failure=failure, status=DecisionStatus.PLANNING)

    await open_one()
    try:
        await socket.send_to(profile())
        await socket.send_to(
            protocol.encode(protocol.Goodbye(reason="the profile was read before this"))
        )
        await socket.receive_output(timeout=10)  # closed once the goodbye was handled
    finally:
        await socket.disconnect()
    assert (await reloaded(job)).scenario == job.scenario
    assert readied == [job.pk]  # by the hello only: nothing new to ready for


async def test_a_socket_that_sends_profiles_in_a_loop_has_one_taken_per_interval() -> None:
    """Each profile rewrites the job's row: one in ``PROFILE_INTERVAL_S`` is taken, the others
    are dropped without an error (the script measures itself once a world)."""
    job, socket = await joined(launcher_scenario(), [0])
    try:
        await socket.send_to(profile(seq=1))
        for seq in range(2, 12):
            await socket.send_to(profile(seq=seq, micro_batches=seq))
        await socket.send_to(heartbeat(12))
        await socket.send_to(protocol.encode(protocol.Goodbye(reason="every frame was read")))
        closed = await socket.receive_output(timeout=10)  # no error frame for the dropped ones
        assert closed["type"] == "websocket.close", closed
    finally:
        await socket.disconnect()
    taken = await reloaded(job)
    assert taken.scenario["model"]["layers"] == 3
    assert taken.scenario["training"]["global_batch"] == 4  # the first one's
