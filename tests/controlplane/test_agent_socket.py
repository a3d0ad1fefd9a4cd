"""The agent's websocket: hello, heartbeats to Redis, faults and dropped sockets as failures,
and a coded error for every frame it refuses."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
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

from controlplane.asgi import application
from controlplane.incidents.models import DecisionStatus, Failure, RecoveryDecision
from controlplane.jobs import detector, liveness
from controlplane.jobs.models import AgentToken, Job, JobStatus, Node, NodeStatus
from controlplane.jobs.services import create_job, issue_agent_token
from controlplane.streaming import agent as agent_socket
from controlplane.streaming import hub
from worker_agent import protocol

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("eager_planning"),
]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["devices_per_node"] = 4  # node-0: devices 0-3, node-1: devices 4-7


@database_sync_to_async
def new_job(name: str = "llama", mode: str = "auto") -> tuple[Job, str]:
    return create_job(
        name, copy.deepcopy(SCENARIO), approval_mode=mode, enabled_policies=["dynamic"]
    )


def hello(job: Job, token: str, node: str = "node-0", devices: list[int] | None = None) -> str:
    frame = protocol.Hello(job=job.name, node=node, token=token, devices=devices or [0, 1, 2, 3])
    return protocol.encode(frame)


def heartbeat(seq: int, step: int = 10, device: int = 0) -> str:
    return protocol.encode(
        protocol.Heartbeat(
            seq=seq,
            at=time.time(),
            step=step,
            loss=2.5,
            devices=[protocol.DeviceReport(device=device, state=protocol.DeviceState.TRAINING)],
        )
    )


async def connect() -> WebsocketCommunicator:
    socket = WebsocketCommunicator(application, "/ws/agent/")
    connected, _ = await socket.connect()
    assert connected
    return socket


async def said(socket: WebsocketCommunicator) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await socket.receive_from(timeout=10))
    return frame


async def closed_with(socket: WebsocketCommunicator) -> int:
    message = await socket.receive_output(timeout=10)
    assert message["type"] == "websocket.close", message
    return int(message["code"])


@pytest_asyncio.fixture
async def agent() -> AsyncIterator[tuple[Job, WebsocketCommunicator]]:
    job, token = await new_job()
    socket = await connect()
    await socket.send_to(hello(job, token))
    welcome = await said(socket)
    assert welcome["type"] == "welcome" and welcome["missed_beats"] == liveness.MISSED_BEATS
    yield job, socket
    await socket.disconnect()


async def test_heartbeats_go_to_redis_and_goodbye_leaves_quietly(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    await socket.send_to(heartbeat(1, step=42))
    await socket.send_to(heartbeat(2, step=43))
    redis = liveness.client()
    try:
        for _ in range(50):
            last = await liveness.latest(redis, job.pk, "node-0")
            if last is not None and last["metrics"].get("step") == 43:
                break
            await asyncio.sleep(0.02)
        assert last is not None and last["metrics"]["step"] == 43 and last["metrics"]["loss"] == 2.5
        await socket.send_to(protocol.encode(protocol.Goodbye(reason="done")))
        assert await closed_with(socket) == 1000
        assert await liveness.latest(redis, job.pk, "node-0") is None
    finally:
        await redis.aclose()
    node = await database_sync_to_async(Node.objects.get)(job=job, name="node-0")
    assert node.status == NodeStatus.LEFT
    assert not await database_sync_to_async(Failure.objects.exists)()
    # the first hello started the job; leaving does not stop it (other nodes may train on)
    assert (await database_sync_to_async(Job.objects.get)(pk=job.pk)).status == JobStatus.RUNNING


async def test_a_fault_frame_is_a_failure_at_once_and_is_planned(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    await socket.send_to(
        protocol.encode(
            protocol.Fault(seq=1, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[2])
        )
    )
    await socket.send_to(heartbeat(2))  # the conversation goes on
    for _ in range(200):
        failure = await database_sync_to_async(Failure.objects.filter(job=job).first)()
        if failure is not None:
            break
        await asyncio.sleep(0.02)
    assert failure is not None and failure.devices == [2] and failure.source == "agent"
    for _ in range(200):  # planned in this process (eager), just after the failure's commit
        decision = await database_sync_to_async(RecoveryDecision.objects.get)(failure=failure)
        if decision.status != DecisionStatus.PLANNING:
            break
        await asyncio.sleep(0.02)
    assert decision.status == DecisionStatus.APPLYING


async def test_a_fault_naming_its_process_keeps_its_pid_exit_code_and_output(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    log = ["Traceback (most recent call last):", "RuntimeError: CUDA error: an illegal address"]
    fault = protocol.Fault(
        seq=1, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[2], pid=31337,
        exit_code=-6, log=log,
    )  # fmt: skip
    await socket.send_to(protocol.encode(fault))
    failure = await failure_of(job)
    assert failure.processes == [{"device": 2, "pid": 31337, "exit_code": -6, "log": log}]
    # the same device reported again (its peer's agent, the heartbeat deadline): one failure
    again = protocol.Fault(seq=2, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[2])
    await socket.send_to(protocol.encode(again))
    await socket.send_to(heartbeat(3))
    await beaten(job, 10)
    refreshed = await database_sync_to_async(Failure.objects.get)(job=job)
    assert refreshed.pk == failure.pk and refreshed.processes == failure.processes


async def beaten(job: Job, step: int, node: str = "node-0") -> None:
    """Wait until the node's heartbeat at ``step`` is in Redis (they are written in batches)."""
    redis = liveness.client()
    try:
        for _ in range(100):
            last = await liveness.latest(redis, job.pk, node)
            if last is not None and last["metrics"].get("step") == step:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no heartbeat at step {step} in Redis")
    finally:
        await redis.aclose()


async def failure_of(job: Job) -> Failure:
    for _ in range(200):
        failure: Failure | None = await database_sync_to_async(
            Failure.objects.filter(job=job).first
        )()
        if failure is not None:
            return failure
        await asyncio.sleep(0.02)
    raise AssertionError("no failure recorded")


@pytest.mark.parametrize(("fault_step", "recorded"), [(41, 41), (None, 43)])
async def test_a_failure_keeps_the_step_it_happened_at(
    agent: tuple[Job, WebsocketCommunicator], fault_step: int | None, recorded: int
) -> None:
    """The step the agent sends with its fault (its rank's last, fresher than a heartbeat), or
    without one the job's last reported step from the heartbeats."""
    job, socket = agent
    await socket.send_to(heartbeat(1, step=42))
    await socket.send_to(heartbeat(2, step=43))
    await beaten(job, 43)
    fault = protocol.Fault(
        seq=3, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[2], step=fault_step
    )
    await socket.send_to(protocol.encode(fault))
    failure = await failure_of(job)
    assert failure.step == recorded
    event = await database_sync_to_async(
        lambda: failure.events.get(kind="failure_detected").payload
    )()
    assert event["step"] == recorded


async def test_a_socket_closed_without_goodbye_fails_the_whole_node() -> None:
    job, token = await new_job()
    socket = await connect()
    await socket.send_to(hello(job, token, node="node-1", devices=[4, 5, 6, 7]))
    await said(socket)
    await socket.send_to(heartbeat(1, step=17, device=4))
    await socket.disconnect(code=1006)
    failure = await database_sync_to_async(Failure.objects.get)(job=job)
    assert (failure.kind, failure.source, failure.devices) == ("node_lost", "socket", [4, 5, 6, 7])
    assert failure.detection_latency_s < 5
    assert failure.step == 17  # its last heartbeat's, though the socket's close forgets it
    node = await database_sync_to_async(Node.objects.get)(job=job, name="node-1")
    assert node.status == NodeStatus.FAILED


@pytest.mark.parametrize("comes_back", [False, True])
async def test_a_socket_closed_between_hello_and_welcome_is_left_to_the_deadline(
    monkeypatch: pytest.MonkeyPatch, comes_back: bool
) -> None:
    """An agent that stops waiting for a server busy with thousands of hellos closes before
    its welcome (sent after the close, and lost), and says hello again: no failure at once
    (hundreds of those made a 2,048-node job's start a recovery); the deadline fails its node
    unless it is heard again by then."""
    job, token = await new_job()
    held, real = threading.Event(), agent_socket._hello

    def busy_hello(frame: protocol.Hello) -> Any:
        held.wait(10)  # the server's hello, queued behind thousands of others
        return real(frame)

    monkeypatch.setattr(agent_socket, "_hello", busy_hello)
    gone = await connect()
    await gone.send_to(hello(job, token, node="node-1", devices=[4, 5, 6, 7]))
    await asyncio.sleep(0.1)  # the hello is being answered
    await gone.send_input({"type": "websocket.disconnect", "code": 1011})  # the agent gave up
    closed_s = time.time()
    held.set()
    await gone.wait(timeout=10)
    assert await database_sync_to_async(Failure.objects.count)() == 0
    node = await database_sync_to_async(Node.objects.get)(job=job, name="node-1")
    assert node.status == NodeStatus.HEALTHY  # its hello was answered: joined, not failed
    redis = liveness.client()
    try:
        heard = (await liveness.latest(redis, job.pk, "node-1") or {})["at"]
        assert closed_s <= heard <= time.time()  # watched from the close
        if comes_back:
            again = await connect()
            await again.send_to(hello(job, token, node="node-1", devices=[4, 5, 6, 7]))
            assert (await said(again))["type"] == "welcome"
            await again.send_to(heartbeat(1, step=3, device=4))
            await beaten(job, 3, node="node-1")
        deadline = detector.deadline_s()
        assert await detector.sweep(redis, now_s=heard + deadline * 0.9) == []
        decided = await detector.sweep(redis, now_s=heard + deadline + 0.01)
    finally:
        await redis.aclose()
    if comes_back:
        assert decided == []
        assert await database_sync_to_async(Failure.objects.count)() == 0
        await again.send_to(protocol.encode(protocol.Goodbye()))
        assert await closed_with(again) == 1000
        await again.disconnect()
    else:
        assert len(decided) == 1
        failure = await failure_of(job)
        assert (failure.source, failure.devices) == ("heartbeat", [4, 5, 6, 7])


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "malformed"),
        (json.dumps({"type": "heartbeat", "seq": 1}), "invalid"),
        ("x" * (protocol.MAX_FRAME_BYTES + 1), "oversized"),
        (heartbeat(1), "out_of_order"),  # before hello
    ],
)
async def test_bad_frames_get_a_coded_error_and_the_socket_stays_open(
    frame: str, code: str
) -> None:
    job, token = await new_job()
    socket = await connect()
    await socket.send_to(frame)
    error = await said(socket)
    assert (error["type"], error["code"]) == ("error", code)
    await socket.send_to(hello(job, token))
    assert (await said(socket))["type"] == "welcome"
    await socket.disconnect()


async def test_sequence_numbers_must_grow(agent: tuple[Job, WebsocketCommunicator]) -> None:
    _, socket = agent
    await socket.send_to(heartbeat(5))
    await socket.send_to(heartbeat(5))
    error = await said(socket)
    assert (error["code"], error["field"]) == ("out_of_order", "seq")


async def test_hello_is_checked_and_refusals_close_the_socket() -> None:
    job, token = await new_job("one")
    _, other_token = await new_job("two")
    cases = [
        (hello(job, "wrong"), "unauthorised", 4001),
        (hello(job, other_token), "unauthorised", 4001),  # another job's token
        (hello(job, token, node="node-9"), "unknown_node", 4001),
        (hello(job, token, devices=[4]), "wrong_devices", 4002),
        (hello(job, token).replace('"version":1', '"version":2'), "unsupported_version", 4002),
    ]
    for frame, code, close in cases:
        socket = await connect()
        await socket.send_to(frame)
        assert (await said(socket))["code"] == code
        assert await closed_with(socket) == close
    assert not await database_sync_to_async(Failure.objects.exists)()


async def test_a_node_token_speaks_for_its_node_only() -> None:
    job, _ = await new_job()
    node_token = await database_sync_to_async(issue_agent_token)(job, node="node-1")
    socket = await connect()
    await socket.send_to(hello(job, node_token, node="node-0"))
    error = await said(socket)
    assert (error["code"], error["field"]) == ("unauthorised", "node")
    assert await closed_with(socket) == 4001
    socket = await connect()
    await socket.send_to(hello(job, node_token, node="node-1", devices=[4, 5, 6, 7]))
    assert (await said(socket))["type"] == "welcome"
    await socket.send_to(protocol.encode(protocol.Goodbye(reason="done")))
    await socket.disconnect()


async def test_a_second_connection_replaces_the_first_without_a_failure() -> None:
    job, token = await new_job()
    first = await connect()
    await first.send_to(hello(job, token))
    await said(first)
    second = await connect()
    await second.send_to(hello(job, token))
    assert (await said(second))["type"] == "welcome"
    assert (await said(first))["code"] == "replaced"
    assert await closed_with(first) == 4003
    await first.disconnect()
    assert not await database_sync_to_async(Failure.objects.exists)()
    await second.send_to(protocol.encode(protocol.Goodbye()))
    assert await closed_with(second) == 1000


async def test_the_hello_that_starts_a_job_readies_its_planner_and_no_other_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readied: list[int] = []
    monkeypatch.setattr(agent_socket, "enqueue_readying", readied.append)
    job, token = await new_job()
    sockets = []
    for node, devices in (("node-0", [0, 1, 2, 3]), ("node-1", [4, 5, 6, 7])):
        socket = await connect()
        await socket.send_to(hello(job, token, node, devices))
        assert (await said(socket))["type"] == "welcome"
        sockets.append(socket)
    assert readied == [job.pk]
    for socket in sockets:
        await socket.send_to(protocol.encode(protocol.Goodbye()))
        assert await closed_with(socket) == 1000
    # every node gone, the job stopped: its next hello starts it again, and readies it again
    again = await connect()
    await again.send_to(hello(job, token))
    assert (await said(again))["type"] == "welcome"
    assert readied == [job.pk, job.pk]
    await again.disconnect()


# --- the heartbeat deadline ------------------------------------------------------------------


async def test_a_silent_node_fails_once_after_the_deadline(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    await socket.send_to(heartbeat(1, step=7))
    await beaten(job, 7)
    redis = liveness.client()
    try:
        heard = (await liveness.latest(redis, job.pk, "node-0") or {})["at"]
        deadline = detector.deadline_s()
        assert await detector.sweep(redis, now_s=heard + deadline * 0.9) == []  # not yet
        decided = await detector.sweep(redis, now_s=heard + deadline + 0.01)
        assert len(decided) == 1
        assert await detector.sweep(redis, now_s=heard + deadline + 5) == []  # reported once
    finally:
        await redis.aclose()
    failure = await database_sync_to_async(Failure.objects.get)(job=job)
    assert (failure.kind, failure.source, failure.devices) == ("hang", "heartbeat", [0, 1, 2, 3])
    assert failure.step == 7  # the silent node's last heartbeat, though it is no longer watched
    # its socket, left open (a partition closes nothing), is closed: no second failure, and the
    # host, back, says hello again as a new member
    assert await closed_with(socket) == protocol.CloseCode.SILENT
    again = await connect()
    await again.send_to(hello(job, await database_sync_to_async(issue_agent_token)(job)))
    assert (await said(again))["type"] == "welcome"
    node = await database_sync_to_async(Node.objects.get)(job=job, name="node-0")
    assert node.status == NodeStatus.HEALTHY
    redis = liveness.client()
    try:  # the same news late: a socket heard since stays
        assert await hub.apublish(redis, job.pk, "node-0", {"silent_since": heard}) == 1
        await asyncio.sleep(0.5)  # delivered meanwhile
    finally:
        await redis.aclose()
    await again.send_to(protocol.encode(protocol.Goodbye()))
    assert await closed_with(again) == 1000
    assert await database_sync_to_async(Failure.objects.count)() == 1
    await again.disconnect()


# --- hostile input: bounds, devices, revocation, deadlines ------------------------------------


async def test_a_step_out_of_range_is_refused_and_another_nodes_failure_is_still_recorded() -> None:
    """A step past the bound (once stored, it broke every later failure's write) is refused
    naming the field; the largest step allowed still lets another node's loss be recorded."""
    job, token = await new_job(mode="manual")
    first = await connect()
    await first.send_to(hello(job, token))
    await said(first)
    beat = json.loads(heartbeat(1))
    await first.send_to(json.dumps({**beat, "step": 2**63}))
    error = await said(first)
    assert (error["code"], error["field"]) == ("invalid", "step")
    await first.send_to(heartbeat(2, step=protocol.MAX_STEP))
    await beaten(job, protocol.MAX_STEP)
    second = await connect()
    await second.send_to(hello(job, token, node="node-1", devices=[4, 5, 6, 7]))
    await said(second)
    await second.send_to(heartbeat(1, step=5, device=4))
    await beaten(job, 5, node="node-1")
    await second.disconnect(code=1006)
    failure = await failure_of(job)
    assert (failure.devices, failure.step) == ([4, 5, 6, 7], protocol.MAX_STEP)
    await first.send_to(protocol.encode(protocol.Goodbye()))
    assert await closed_with(first) == 1000


async def test_a_fault_dated_past_year_9999_is_refused_as_invalid_and_the_socket_goes_on(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    fault = {"type": "fault", "seq": 1, "at": 1e12, "kind": "crash", "devices": [2]}
    await socket.send_to(json.dumps(fault))
    error = await said(socket)
    assert (error["code"], error["field"]) == ("invalid", "at")
    await socket.send_to(heartbeat(2, step=5))
    await beaten(job, 5)  # the conversation goes on
    assert not await database_sync_to_async(Failure.objects.exists)()


async def test_a_heartbeat_about_another_nodes_devices_is_refused_and_closes(
    agent: tuple[Job, WebsocketCommunicator],
) -> None:
    job, socket = agent
    await socket.send_to(heartbeat(1, step=3, device=5))
    error = await said(socket)
    assert (error["code"], error["field"]) == ("wrong_devices", "devices")
    assert await closed_with(socket) == 4002
    redis = liveness.client()
    try:
        stored = await liveness.latest(redis, job.pk, "node-0")
        assert stored is not None and stored["metrics"] == {}  # hello's mark, never the beat
    finally:
        await redis.aclose()


@database_sync_to_async
def admin_client() -> Client:
    """An administrator's browser, the token list already seen once (the admin's first page is
    slow to render: the sockets' silence deadline is a few seconds)."""
    client = Client()
    client.force_login(User.objects.create_superuser("root", password=None))  # no hashing
    assert client.get("/admin/jobs/agenttoken/").status_code == 200
    return client


@database_sync_to_async
def revoke_in_the_admin(client: Client, token: str) -> int:
    """Revoke ``token`` with the admin's action, as an administrator does; the response code."""
    row = AgentToken.find(token)
    assert row is not None
    response = client.post(
        "/admin/jobs/agenttoken/", {"action": "revoke", "_selected_action": [row.pk]}
    )
    return response.status_code


async def test_revoking_a_token_closes_its_sockets_at_once_and_nothing_else() -> None:
    job, token = await new_job(mode="manual")
    node_token = await database_sync_to_async(issue_agent_token)(job, node="node-1")
    browser = await admin_client()
    kept = await connect()
    await kept.send_to(hello(job, token))
    await said(kept)
    revoked = await connect()
    await revoked.send_to(hello(job, node_token, node="node-1", devices=[4, 5, 6, 7]))
    await said(revoked)
    for socket, device in ((kept, 0), (revoked, 4)):  # both fresh: far from a silence deadline
        await socket.send_to(heartbeat(1, step=7, device=device))
    assert await revoke_in_the_admin(browser, node_token) == 302
    error = await said(revoked)
    assert (error["code"], error["field"]) == ("unauthorised", "token")
    assert await closed_with(revoked) == 4001
    # the job's other token is untouched: its socket goes on
    await kept.send_to(heartbeat(2, step=8))
    await beaten(job, 8)
    # what the revoked agent sends after the close opens nothing
    fault = protocol.Fault(seq=1, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[4])
    await revoked.send_to(protocol.encode(fault))
    await revoked.disconnect(code=4001)
    failure = await failure_of(job)  # its node is lost, once
    assert (failure.kind, failure.devices) == ("node_lost", [4, 5, 6, 7])
    assert await database_sync_to_async(Failure.objects.count)() == 1
    await kept.send_to(heartbeat(3, step=9))  # (far from its silence deadline)
    # and the revoked token says hello no more
    again = await connect()
    await again.send_to(hello(job, node_token, node="node-1", devices=[4, 5, 6, 7]))
    assert (await said(again))["code"] == "unauthorised"
    assert await closed_with(again) == 4001
    await kept.send_to(protocol.encode(protocol.Goodbye()))
    assert await closed_with(kept) == 1000
    for socket in (kept, again):
        await socket.disconnect()
    assert hub.hub().handlers == {}  # every socket gave its handler back


async def test_a_revocation_between_the_hellos_check_and_its_join_is_still_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Revoked after the hello found the token good, before the socket listens for revocations
    (its message unheard): the look after the join refuses it, and nothing is lost."""
    job, token = await new_job()
    real = agent_socket._hello

    def revoked_meanwhile(frame: protocol.Hello) -> Any:
        opened = real(frame)
        AgentToken.objects.filter(job=job).update(revoked_at=timezone.now())
        return opened

    monkeypatch.setattr(agent_socket, "_hello", revoked_meanwhile)
    socket = await connect()
    await socket.send_to(hello(job, token))
    error = await said(socket)
    assert (error["type"], error["code"], error["field"]) == ("error", "unauthorised", "token")
    assert await closed_with(socket) == 4001
    await socket.disconnect(code=4001)
    assert await database_sync_to_async(Failure.objects.count)() == 0


async def test_a_socket_that_never_says_hello_is_closed_at_the_deadline(
    settings: Any,
) -> None:
    settings.PITSTOP_HELLO_TIMEOUT_S = 0.3
    socket = await connect()
    started = time.monotonic()
    error = await said(socket)
    assert (error["type"], error["code"]) == ("error", "timeout")
    assert await closed_with(socket) == 4002
    assert 0.3 <= time.monotonic() - started < 5


async def test_sockets_waiting_for_hello_are_limited_per_process(settings: Any) -> None:
    settings.PITSTOP_MAX_WAITING_SOCKETS = 2
    job, token = await new_job()
    silent = [await connect(), await connect()]
    extra = await connect()
    assert await closed_with(extra) == protocol.CloseCode.BUSY  # closed before any frame
    await silent[0].send_to(hello(job, token))  # one says hello: a place is free again
    assert (await said(silent[0]))["type"] == "welcome"
    late = await connect()
    await late.send_to(hello(job, token, node="node-1", devices=[4, 5, 6, 7]))
    assert (await said(late))["type"] == "welcome"
    for socket in (silent[0], late):
        await socket.send_to(protocol.encode(protocol.Goodbye()))
        assert await closed_with(socket) == 1000
    await silent[1].disconnect()


async def test_a_fault_after_a_revocation_the_socket_has_not_heard_of_opens_nothing() -> None:
    """The revocation's message to the sockets may be lost (Redis restarting): a fault frame
    still finds the token revoked, and is refused without a decision."""
    job, token = await new_job(mode="manual")
    socket = await connect()
    await socket.send_to(hello(job, token))
    await said(socket)
    await database_sync_to_async(  # revoked in the database only: no message to the socket
        lambda: AgentToken.objects.filter(job=job).update(revoked_at=timezone.now())
    )()
    fault = protocol.Fault(seq=1, at=time.time(), kind=protocol.FaultKind.CRASH, devices=[2])
    await socket.send_to(protocol.encode(fault))
    error = await said(socket)
    assert (error["code"], error["field"]) == ("unauthorised", "token")
    assert await closed_with(socket) == 4001
    await socket.disconnect(code=4001)
    failure = await failure_of(job)  # the node's loss, never the revoked agent's fault
    assert (failure.source, failure.kind) == ("socket", "node_lost")
    assert await database_sync_to_async(Failure.objects.count)() == 1


async def test_a_heartbeat_reaches_redis_while_an_acknowledgement_waits_for_the_database(
    agent: tuple[Job, WebsocketCommunicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 2,048 nodes a plan's acknowledgements wait seconds for their batch; a heartbeat read
    behind one reached Redis that late, and the deadline failed a node that never stopped."""
    job, socket = agent
    gate = threading.Event()
    record = agent_socket._RECORDERS["acks"]

    def held(batch: list[Any]) -> list[Any]:
        gate.wait(10)
        return record(batch)

    monkeypatch.setitem(agent_socket._RECORDERS, "acks", held)
    redis = liveness.client()
    try:
        ack = protocol.Ack(command="never-sent", ok=True, at=time.time())
        await socket.send_to(protocol.encode(ack))
        await socket.send_to(heartbeat(1, step=77))
        for _ in range(100):
            last = await liveness.latest(redis, job.pk, "node-0")
            if last is not None and last["metrics"].get("step") == 77:
                break
            await asyncio.sleep(0.02)
        assert last is not None and last["metrics"]["step"] == 77
        assert not gate.is_set()
        gate.set()
        # the acknowledgement is still answered, once its batch is recorded
        refused = await said(socket)
        assert refused["type"] == "error" and refused["code"] == "unknown_command"
    finally:
        gate.set()
        await redis.aclose()
