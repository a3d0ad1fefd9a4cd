"""The agent's websocket (``/ws/agent/``): protocol v1 (worker_agent/protocol.py).

Every frame is parsed by the protocol module; a frame it refuses gets an ``error`` frame with its
stable code, and the socket closes only for the fatal codes. After ``hello`` (checked against the
job's agent token, node and devices) heartbeats go to Redis, never the database; a ``fault``
frame and a socket that closes without ``goodbye`` are recorded as failures at once, and
planning is handed to Celery after the commit. Nothing one agent sends reaches another job.

Commands reach the socket through the process's ``hub`` (no channel layer: see there). The
consumer sends its node's unfinished commands again at ``hello``, records acknowledgements,
and while a command awaits the agent's return to training, reports the heartbeats that show it
(``incidents.applying``); otherwise a heartbeat touches nothing but Redis.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import connection
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.incidents import applying, decisions, drills
from controlplane.incidents.models import FailureSource
from controlplane.incidents.tasks import enqueue_planning
from controlplane.jobs import liveness, snapshot
from controlplane.jobs.models import (
    AgentToken,
    Device,
    Job,
    JobStatus,
    Node,
    NodeStatus,
    heavy,
)
from controlplane.streaming import hub
from worker_agent import protocol
from worker_agent.protocol import ErrorCode, ProtocolError

log = structlog.get_logger(__name__)
T = TypeVar("T")


def in_thread(func: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """``func`` run in a worker thread with fresh database connections. Not Channels' default
    single thread: with thousands of agents connecting at once, their hellos' queries would
    queue behind each other there, and each socket's heartbeats behind its hello."""
    # an in-memory SQLite database (the test suite's) is one connection shared by every thread,
    # whose table locks wait for nobody: there, one thread it is
    shared = connection.vendor == "sqlite" and connection.is_in_memory_db()  # type: ignore[attr-defined]
    return database_sync_to_async(func, thread_sensitive=shared)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Session:
    job_id: int
    job_name: str
    node_id: int
    node: str
    devices: frozenset[int]


def _hello(frame: protocol.Hello) -> tuple[Session, list[applying.Unfinished]]:
    """The session a hello opens and the node's unfinished commands (sent again while the
    agent was away, or not acknowledged before it left), or a fatal ``ProtocolError``."""
    if frame.version != protocol.VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"this server speaks version {protocol.VERSION}, not {frame.version}",
            field="version",
        )
    token = AgentToken.find(frame.token)
    if token is None or token.job.name != frame.job:
        # one answer for an unknown token and another job's: nothing to probe for
        raise ProtocolError(ErrorCode.UNAUTHORISED, "no such token for this job", field="token")
    job = token.job
    node = Node.objects.filter(job=job, name=frame.node).first()
    if node is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_NODE, f"job {job.name} has no node {frame.node!r}", field="node"
        )
    if token.node_id is not None and token.node_id != node.pk:
        raise ProtocolError(
            ErrorCode.UNAUTHORISED, "this token speaks for another node of the job", field="node"
        )
    owned = set(Device.objects.filter(node=node).values_list("index", flat=True))
    foreign = sorted(set(frame.devices) - owned)
    if foreign:
        raise ProtocolError(
            ErrorCode.WRONG_DEVICES,
            f"devices {foreign} are not on node {node.name} (it has {sorted(owned)})",
            field="devices",
        )
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.HEALTHY)
    # the first agent to arrive starts the job; a job recovering or failed keeps its status
    Job.objects.filter(pk=job.pk, status=JobStatus.PENDING).update(status=JobStatus.RUNNING)
    session = Session(job.pk, job.name, node.pk, node.name, frozenset(owned))
    return session, applying.unfinished(node.pk)


def _fault(session: Session, frame: protocol.Fault) -> int:
    """Record the agent's fault; returns the decision's id."""
    node = Node.objects.select_related("job").defer(*heavy("job")).get(pk=session.node_id)
    occurred = dt.datetime.fromtimestamp(frame.at, tz=dt.UTC)
    # the step the agent saw it at (its rank's last), fresher than a heartbeat (a beat old)
    step = frame.step
    if step is None:
        step = snapshot.job_step(session.job_id, node=session.node)
    _, decision = decisions.record_failure(
        node.job,
        kind=frame.kind.value,
        devices=frame.devices,
        source=FailureSource.AGENT,
        occurred_at=min(occurred, timezone.now()),
        node=node,
        message=frame.message,
        step=step,
        plan=enqueue_planning,
    )
    return decision.pk


def _lost(session: Session, last_heard_s: float | None, last_step: int | None) -> None:
    """The socket closed without goodbye: every device of the node failed, now."""
    node = Node.objects.select_related("job").defer(*heavy("job")).get(pk=session.node_id)
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.FAILED)
    now = timezone.now()
    heard = now if last_heard_s is None else dt.datetime.fromtimestamp(last_heard_s, tz=dt.UTC)
    decisions.record_failure(
        node.job,
        kind="node_lost",
        devices=sorted(session.devices),
        source=FailureSource.SOCKET,
        occurred_at=min(heard, now),
        node=node,
        message="the agent's socket closed without goodbye",
        step=snapshot.job_step(session.job_id, known=last_step),
        plan=enqueue_planning,
    )


def _goodbye(session: Session) -> None:
    Node.objects.filter(pk=session.node_id).update(status=NodeStatus.LEFT)


@dataclass
class Awaited:
    """A command sent to this agent: acknowledged yet, and the step it resumed training at."""

    acked: bool = False
    resumed_step: int | None = None


def _training(frame: protocol.Heartbeat) -> bool:
    """The node trains: some device is training, none is paused, restoring or failed."""
    states = {report.state for report in frame.devices}
    return protocol.DeviceState.TRAINING in states and states <= {
        protocol.DeviceState.TRAINING,
        protocol.DeviceState.IDLE,
    }


class AgentConsumer(AsyncWebsocketConsumer):
    """One agent's conversation; see the module docstring."""

    channel_layer_alias = None  # no layer: commands come through the hub
    session: Session | None = None
    last_seq = -1
    last_heard_s: float | None = None
    last_step: int | None = None  # the step of its latest heartbeat
    leaving = False  # goodbye received, or replaced: the close is not a failure
    raw = "{}"  # the heartbeat being handled, as received

    async def dispatch(self, message: dict[str, Any]) -> None:
        # Channels closes stale database connections before every message, through a thread
        # hop that serialises the process; every database call here goes through
        # a thread through database_sync_to_async, which does that itself, so heartbeats skip
        # the hop.
        handler = getattr(self, message["type"].replace(".", "_"), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def connect(self) -> None:
        self.redis, self.writer = liveness.shared()
        self.id = uuid.uuid4().hex
        self.awaited: dict[str, Awaited] = {}
        await self.accept()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        raw = text_data if text_data is not None else bytes_data or b""
        try:
            frame = protocol.parse_agent_frame(raw)
            if isinstance(frame, protocol.Heartbeat) and self.session is not None:
                # validated: kept as the agent wrote it, the cheapest form to store
                self.raw = raw if isinstance(raw, str) else raw.decode()
            await self.handle(frame)
        except ProtocolError as error:
            await self.refuse(error)

    async def refuse(self, error: ProtocolError, seq: int | None = None) -> None:
        log.info("agent.refused", code=error.code, field=error.field, session=self.session)
        await self.send(protocol.encode(error.frame(seq=seq)))
        close = protocol.FATAL.get(error.code)
        if close is not None:
            # a replaced connection hands the node over: its close is no failure
            self.leaving = self.leaving or error.code is ErrorCode.REPLACED
            await self.close(code=int(close))

    async def handle(self, frame: Any) -> None:
        if isinstance(frame, protocol.Hello):
            if self.session is not None:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello was already said")
            await self.open(frame)
            return
        if self.session is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{frame.type} before hello")
        if isinstance(frame, protocol.Goodbye):
            self.leaving = True
            await in_thread(_goodbye)(self.session)
            self.writer.forget(self.session.job_id, self.session.node)
            await self.writer.settle()  # unwatched before the agent sees the close
            await self.close(code=1000)
            return
        if isinstance(frame, protocol.Ack):
            await self.acked(frame)
            return
        if frame.seq <= self.last_seq:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{frame.type} {frame.seq} after {self.last_seq}",
                field="seq",
            )
        self.last_seq = frame.seq
        if isinstance(frame, protocol.Heartbeat):
            self.last_heard_s, self.last_step = time.time(), frame.step
            session = self.session
            self.writer.beat(session.job_id, session.node, self.last_heard_s, self.raw, frame.at)
            if self.awaited and _training(frame):
                await self.trains(frame.step)
        elif isinstance(frame, protocol.Fault):
            foreign = sorted(set(frame.devices) - self.session.devices)
            if foreign:
                raise ProtocolError(
                    ErrorCode.WRONG_DEVICES,
                    f"devices {foreign} are not this node's",
                    field="devices",
                )
            decision = await in_thread(_fault)(self.session, frame)
            log.info(
                "agent.fault", job=self.session.job_id, node=self.session.node, decision=decision
            )

    async def acked(self, frame: protocol.Ack) -> None:
        session = self.session
        assert session is not None
        command = await in_thread(applying.acked)(session.node_id, frame)
        if command is None:
            if await in_thread(drills.acked)(session.node_id, frame) is not None:
                log.info("agent.drill_ack", node=session.node, drill=frame.command, ok=frame.ok)
                return
            raise ProtocolError(
                ErrorCode.UNKNOWN_COMMAND,
                f"no command {frame.command!r} was sent to this node",
                field="command",
            )
        if frame.ok:
            self.awaited.setdefault(frame.command, Awaited()).acked = True
        else:
            self.awaited.pop(frame.command, None)
        log.info("agent.ack", node=session.node, command=frame.command, ok=frame.ok)

    async def trains(self, step: int) -> None:
        """The node trains at ``step``: tell each acknowledged command's decision, once per
        stage (resumed, then a step past it)."""
        for command, awaited in list(self.awaited.items()):
            if not awaited.acked or (
                awaited.resumed_step is not None and step <= awaited.resumed_step
            ):
                continue
            resumed = await in_thread(applying.progress)(command, step=step)
            if resumed is None:
                self.awaited.pop(command, None)  # done, or its decision moved on
            else:
                awaited.resumed_step = resumed

    async def on_hub(self, message: dict[str, Any]) -> None:
        """A message published to this node (``hub``): a command, or a newer connection."""
        if message.get("replaced_by", self.id) != self.id:
            await self.refuse(
                ProtocolError(ErrorCode.REPLACED, "another connection took this node")
            )
        elif "command" in message:
            await self.command(message["command"])

    async def command(self, frame: dict[str, Any]) -> None:
        if frame.get("action") != protocol.Action.INJECT:  # a drill awaits no training
            self.awaited.setdefault(str(frame["id"]), Awaited())
        await self.send(json.dumps(frame, separators=(",", ":")))

    async def open(self, frame: protocol.Hello) -> None:
        session, unfinished = await in_thread(_hello)(frame)
        self.session = session
        # an older connection of the same node steps aside, in whichever process it is
        with contextlib.suppress(RedisError):
            await hub.apublish(self.redis, session.job_id, session.node, {"replaced_by": self.id})
        await hub.hub().join(session.job_id, session.node, self.id, self.on_hub)
        self.last_heard_s = time.time()
        self.writer.beat(session.job_id, session.node, self.last_heard_s, "{}", self.last_heard_s)
        await self.writer.settle()  # watched by the deadline before the agent is welcomed
        await self.send(
            protocol.encode(
                protocol.Welcome(
                    job=session.job_name,
                    node=session.node,
                    heartbeat_interval_s=liveness.HEARTBEAT_INTERVAL_S,
                    missed_beats=liveness.MISSED_BEATS,
                    server_time=time.time(),
                )
            )
        )
        log.info("agent.hello", job=session.job_id, node=session.node)
        # what was sent while this agent was away, or not acknowledged before it reconnected
        for command in unfinished:
            if command.acked:
                self.awaited[command.id] = Awaited(True, command.resumed_step)
            else:
                await self.command(command.frame)

    async def disconnect(self, code: int) -> None:
        session = self.session
        if session is not None:
            hub.hub().leave(session.job_id, session.node, self.id)
            if not self.leaving:
                self.writer.forget(session.job_id, session.node)
                await in_thread(_lost)(session, self.last_heard_s, self.last_step)
                log.info("agent.lost", job=session.job_id, node=session.node, code=code)
