"""The agent's websocket (``/ws/agent/``): protocol v1 (worker_agent/protocol.py).

Every frame is parsed by the protocol module; a frame it refuses gets an ``error`` frame with its
stable code, and the socket closes only for the fatal codes. After ``hello`` (checked against the
job's agent token, node and devices) heartbeats go to Redis, never the database; a ``fault``
frame and a socket that closes without ``goodbye`` are recorded as failures at once, and
planning is handed to Celery after the commit (a socket closed before its agent spoke after
its welcome is left to the heartbeat deadline: most likely the agent gave up on a server busy
with thousands of hellos, and says hello again). Nothing one agent sends reaches another job.

Commands reach the socket through the process's ``hub`` (no channel layer: see there). The
consumer sends its node's unfinished commands again at ``hello``, records acknowledgements,
and while a command awaits the agent's return to training, reports the heartbeats that show it
(``incidents.applying``); otherwise a heartbeat touches nothing but Redis. What a frame writes
to the database (an acknowledgement, a return to training, a fault, a profile) is written in
the order the frames came, behind the socket's reading (``AgentConsumer.later``): a heartbeat
read behind a write that waits its turn among 2,048 nodes' would reach Redis late, and the
deadline would fail a node that never stopped. A token revoked
(``AgentToken.revoke``) closes the sockets that said hello with it, through the same hub; so
does the heartbeat deadline's failure of a node (``jobs.detector``) for a socket a partition
left open and unheard since (``CloseCode.SILENT``, no second failure): its agent says hello
again, as a new member, when the link is back.

A socket must say hello within ``PITSTOP_HELLO_TIMEOUT_S``, and a process holds at most
``PITSTOP_MAX_WAITING_SOCKETS`` sockets that have not (unset: 256, or a quarter of its soft
descriptor limit if less): more are closed at once (``BUSY``), so silent sockets cannot use up
the descriptors that agents and ``/healthz`` need. Whichever way a
connection ends (a close by either side, a frame after the server's close, an error, the server
cancelling it), ``release`` gives the node back once and records its loss once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import itertools
import json
import math
import resource
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import connection
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.bridge.rows import InvalidScenario
from controlplane.incidents import applying, decisions, drills
from controlplane.incidents.models import FailureSource
from controlplane.incidents.tasks import enqueue_planning, enqueue_readying
from controlplane.jobs import lifecycle, liveness, services, snapshot
from controlplane.jobs.models import (
    AgentToken,
    Device,
    Node,
    NodeStatus,
    heavy,
)
from controlplane.streaming import hub
from worker_agent import protocol
from worker_agent.protocol import ErrorCode, ProtocolError

log = structlog.get_logger(__name__)

# The least time between two profiles a socket's job takes (``protocol.Profile``).
PROFILE_INTERVAL_S = 5.0
T = TypeVar("T")


# Hellos' threads, apart from every other call's (the event loop's default executor): when
# thousands of agents say hello at once, each hello's second call (``_revoked``) queued behind
# every first one, and no agent was welcomed until nearly all hellos had been read (a 2,048-node
# start welcomed its first agent after 35 s, and agents gave up waiting); acknowledgements,
# losses and plans queued behind them too.
HELLO_THREADS = 4
_hello_threads = ThreadPoolExecutor(HELLO_THREADS, thread_name_prefix="hello")


def in_thread(
    func: Callable[..., T], executor: ThreadPoolExecutor | None = None
) -> Callable[..., Awaitable[T]]:
    """``func`` run in a worker thread with fresh database connections, of ``executor`` (None:
    the event loop's default). Not Channels' default single thread: with thousands of agents
    connecting at once, their hellos' queries would queue behind each other there, and each
    socket's heartbeats behind its hello."""
    # an in-memory SQLite database (the test suite's) is one connection shared by every thread,
    # whose table locks wait for nobody: there, one thread it is
    shared = connection.vendor == "sqlite" and connection.is_in_memory_db()  # type: ignore[attr-defined]
    if shared:
        return database_sync_to_async(func)  # type: ignore[no-any-return]
    return database_sync_to_async(func, thread_sensitive=False, executor=executor)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Session:
    job_id: int
    job_name: str
    node_id: int
    node: str
    devices: frozenset[int]
    token_id: int  # the token that opened it: revoking it ends the session


# Per event loop (a server process has one), the sockets that have not said hello yet.
_waiting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[str]] = (
    weakref.WeakKeyDictionary()
)


def waiting() -> set[str]:
    """The ids of this event loop's sockets that have not said hello."""
    return _waiting.setdefault(asyncio.get_running_loop(), set())


# At most this many sockets waiting for hello, and never more than a quarter of the descriptors.
WAITING_CAP = 256


def default_waiting_cap(soft_nofile: int) -> int:
    """The cap on sockets waiting for hello when ``PITSTOP_MAX_WAITING_SOCKETS`` is not set:
    256, or a quarter of the soft descriptor limit if that is smaller (at least 1), so that
    silent sockets leave three quarters to agents that said hello, ``/healthz``, the database
    and Redis. A negative limit (``RLIM_INFINITY``) is no limit."""
    if soft_nofile < 0:
        return WAITING_CAP
    return max(1, min(WAITING_CAP, soft_nofile // 4))


def waiting_cap() -> int:
    """The setting if given, else the default for this process's descriptor limit now."""
    given: int | None = settings.PITSTOP_MAX_WAITING_SOCKETS
    if given is not None:
        return given
    return default_waiting_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _revoked(token_id: int) -> bool:
    return not AgentToken.objects.filter(pk=token_id, revoked_at__isnull=True).exists()


def _refuse_if_revoked(session: Session) -> None:
    if _revoked(session.token_id):
        raise ProtocolError(ErrorCode.UNAUTHORISED, "the token was revoked", field="token")


def _live_tokens(token_ids: set[int] | list[int]) -> set[int]:
    """Those of the tokens not revoked, in one query."""
    live = AgentToken.objects.filter(pk__in=token_ids, revoked_at__isnull=True)
    return set(live.values_list("pk", flat=True))


def _revoked_each(token_ids: list[int]) -> list[bool]:
    """``_revoked`` of each token, in one query (``batches("revoked")``)."""
    live = _live_tokens(token_ids)
    return [token_id not in live for token_id in token_ids]


@dataclass(frozen=True)
class Opened:
    """What a hello opens."""

    session: Session
    unfinished: list[applying.Unfinished]  # sent again: see ``_hello``
    came_back: bool  # the node comes back from failed (``lifecycle.joined``)
    first: bool  # the node's first hello: no older connection of it to replace


def _hello(frame: protocol.Hello) -> Opened:
    """The session a hello opens, the node's unfinished commands (sent again while the agent
    was away, or not acknowledged before it left), whether the node comes back from failed
    and whether it never said hello before; or a fatal ``ProtocolError``."""
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
    # a thousand agents say hello at once when a job starts: each read is as plain as it can be
    # (no ordering, no model built), and the node's status read here spares ``joined`` its own
    found = (
        Node.objects.filter(job=job, name=frame.node).order_by().values_list("pk", "status").first()
    )
    if found is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_NODE, f"job {job.name} has no node {frame.node!r}", field="node"
        )
    node_id, status = found
    if token.node_id is not None and token.node_id != node_id:
        raise ProtocolError(
            ErrorCode.UNAUTHORISED, "this token speaks for another node of the job", field="node"
        )
    owned = set(Device.objects.filter(node_id=node_id).order_by().values_list("index", flat=True))
    foreign = sorted(set(frame.devices) - owned)
    if foreign:
        raise ProtocolError(
            ErrorCode.WRONG_DEVICES,
            f"devices {foreign} are not on node {frame.node} (it has {sorted(owned)})",
            field="devices",
        )
    # joined; the first agent to arrive (again) runs the job, one recovering keeps its status
    came_back = lifecycle.joined(
        job_id=job.pk, node_id=node_id, node_status=status, started=enqueue_readying
    )
    session = Session(job.pk, job.name, node_id, frame.node, frozenset(owned), token.pk)
    first = status == NodeStatus.EXPECTED
    return Opened(session, applying.unfinished(node_id), came_back, first)


def _fault(session: Session, frame: protocol.Fault) -> int:
    """Record the agent's fault; returns the decision's id."""
    _refuse_if_revoked(session)
    node = Node.objects.select_related("job").defer(*heavy("job")).get(pk=session.node_id)
    occurred = dt.datetime.fromtimestamp(frame.at, tz=dt.UTC)
    # the step the agent saw it at (its rank's last), fresher than a heartbeat (a beat old)
    step = frame.step
    if step is None:
        step = snapshot.job_step(session.job_id)
    _, decision = decisions.record_failure(
        node.job,
        kind=frame.kind.value,
        devices=frame.devices,
        source=FailureSource.AGENT,
        occurred_at=min(occurred, timezone.now()),
        node=node,
        message=frame.message,
        step=step,
        process=_process(frame),
        plan=enqueue_planning,
    )
    return decision.pk


def _process(frame: protocol.Fault) -> dict[str, Any] | None:
    """The fault's process at fault, as ``Failure.processes`` keeps it (None: it named none)."""
    if frame.pid is None and frame.exit_code is None and not frame.log:
        return None
    return {
        "device": frame.devices[0] if len(frame.devices) == 1 else None,
        "pid": frame.pid,
        "exit_code": frame.exit_code,
        "log": list(frame.log or ()),
    }


def _profiled(session: Session, frame: protocol.Profile) -> bool:
    """The job's scenario made anew from its script's measurement (False: deferred while a
    recovery is open); a measurement that cannot fit is refused, naming its field."""
    _refuse_if_revoked(session)
    try:
        taken = services.take_profile(session.job_id, frame)
    except InvalidScenario as exc:
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        raise ProtocolError(ErrorCode.INVALID, message, field=exc.field) from exc
    if taken:  # a new scenario: what the planner remembered of the old one does not serve it
        enqueue_readying(session.job_id)
    return taken


def _lost(losses: list[Loss]) -> None:
    """Sockets of one job's nodes closed without goodbye: every device of those nodes failed,
    now, as one failure (a switch or a rack that fails drops them together; unless a node is
    gone with its job meanwhile)."""
    sessions = {loss.session.node_id: loss.session for loss in losses}
    nodes = list(
        Node.objects.select_related("job")
        .defer(*heavy("job"))
        .filter(pk__in=sessions)
        .order_by("index")
    )
    if not nodes:
        return
    Node.objects.filter(pk__in=[node.pk for node in nodes]).update(status=NodeStatus.FAILED)
    now = timezone.now()
    heard = min(
        (dt.datetime.fromtimestamp(loss.last_heard_s, tz=dt.UTC) for loss in losses
         if loss.last_heard_s is not None),
        default=now,
    )  # fmt: skip
    steps = [loss.last_step for loss in losses if loss.last_step is not None]
    names = ", ".join(node.name for node in nodes)
    decisions.record_failure(
        nodes[0].job,
        kind="node_lost",
        devices=sorted(d for node in nodes for d in sessions[node.pk].devices),
        source=FailureSource.SOCKET,
        occurred_at=min(heard, now),
        node=nodes[0],
        message=(
            "the agent's socket closed without goodbye"
            if len(nodes) == 1
            else f"the agents' sockets of {names} closed without goodbye"
        ),
        step=snapshot.job_step(nodes[0].job_id, known=max(steps, default=None)),
        plan=enqueue_planning,
    )


@dataclass
class Loss:
    """A socket closed without goodbye, waiting to be recorded (``batches``)."""

    session: Session
    last_heard_s: float | None
    last_step: int | None


Item = TypeVar("Item")
Result = TypeVar("Result")


class Batches(Generic[Item, Result]):
    """One event loop's items of one kind, from any of its sockets, recorded together in one
    worker thread: while a batch is recorded the next one queues. A switch or a rack that fails
    drops many sockets at once, and a plan applied on 2,048 nodes brings 2,048 acknowledgements
    and twice as many reports of training again: recorded in a thread each, they waited on each
    other's database locks, and each thread held the interpreter lock from the event loop, which
    then fell behind on every other agent's heartbeats. ``record(batch)`` returns each item's
    result, or the exception it is refused with."""

    def __init__(self, record: Callable[[list[Item]], list[Result | Exception]]) -> None:
        self.record = record
        self.queued: list[tuple[Item, asyncio.Future[Result]]] = []
        self.draining: asyncio.Task[None] | None = None

    def add(self, item: Item) -> asyncio.Future[Result]:
        """Queue the item; the future is done once it is recorded, or raises why not."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Result] = loop.create_future()
        self.queued.append((item, done))
        if self.draining is None:
            self.draining = loop.create_task(self._drain())
        return done

    async def _drain(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
        try:
            while self.queued:
                batch, self.queued = self.queued, []
                items = [item for item, _ in batch]
                try:
                    results = await in_thread(self.record)(items)
                except Exception:  # the batch failed as a whole: each item alone, told its own
                    results = await in_thread(self._each)(items)
                for (_, done), result in zip(batch, results, strict=True):
                    if done.done():  # its socket stopped waiting (cancelled)
                        continue
                    if isinstance(result, Exception):
                        done.set_exception(result)
                    else:
                        done.set_result(result)
        finally:
            self.draining = None
            # cancelled (the loop closing): what waits is recorded by no one, so its waiters
            # are told, not left awaiting (a closing socket's loss, shielded, hung there)
            for _, done in (*batch, *self.queued):
                if not done.done():
                    done.cancel()

    def _each(self, items: list[Item]) -> list[Result | Exception]:
        """Each item recorded alone: one that cannot be (a database error, a bad row) does not
        fail the others; thousands of sockets closed for one would be thousands of losses."""
        results: list[Result | Exception] = []
        for item in items:
            try:
                results.extend(self.record([item]))
            except Exception as exc:
                results.append(exc)
        return results


def _record_losses(batch: list[Loss]) -> list[Exception | None]:
    """The losses recorded in turn, those of one job queued together as one failure
    (``_lost``); what each raised, or None."""
    results: list[Exception | None] = []
    for _, group in itertools.groupby(batch, key=lambda loss: loss.session.job_id):
        together = list(group)
        try:
            _lost(together)
            results.extend([None] * len(together))
        except Exception as exc:  # left to the deadline; the other jobs' are recorded
            results.extend([exc] * len(together))
    return results


def _record_acks(batch: list[tuple[Session, protocol.Ack]]) -> list[str | Exception | None]:
    """Acknowledgements recorded together (``applying.acked_each``, a drill's each alone): for
    each, "command" or "drill" by what it acknowledged, None for a command never sent to the
    node, or the refusal of a token revoked meanwhile."""
    live = _live_tokens({session.token_id for session, _ in batch})
    allowed = [(session, ack) for session, ack in batch if session.token_id in live]
    commands = iter(applying.acked_each([(session.node_id, ack) for session, ack in allowed]))
    results: list[str | Exception | None] = []
    for session, ack in batch:
        if session.token_id not in live:
            results.append(
                ProtocolError(ErrorCode.UNAUTHORISED, "the token was revoked", field="token")
            )
        elif next(commands) is not None:
            results.append("command")
        else:
            results.append("drill" if drills.acked(session.node_id, ack) is not None else None)
    log.info("agent.acks", recorded=results.count("command"), of=len(batch))
    return results


_batches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Batches[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)
_RECORDERS: dict[str, Callable[[list[Any]], list[Any]]] = {
    "losses": _record_losses,
    "acks": _record_acks,
    "progress": applying.progress_each,
    "revoked": _revoked_each,
}


def batches(kind: str) -> Batches[Any, Any]:
    """The running event loop's ``Batches`` of ``kind``: losses, acks, progress, or revoked
    (the tokens hellos look at once more)."""
    mine = _batches.setdefault(asyncio.get_running_loop(), {})
    found = mine.get(kind)
    if found is None:
        found = mine[kind] = Batches(_RECORDERS[kind])
    return found


class Plans:
    """One event loop's packed plans by decision, as the end of a command's JSON
    (``,"plan":"..."}``): read and encoded once however many of its sockets are sent one (a
    decision's plan does not change once applying begins); kept a minute."""

    KEPT_S = 60.0

    def __init__(self) -> None:
        self.found: dict[int, asyncio.Future[str]] = {}

    async def tail(self, decision_id: int) -> str:
        found = self.found.get(decision_id)
        if found is None:
            loop = asyncio.get_running_loop()
            found = self.found[decision_id] = asyncio.ensure_future(
                in_thread(_plan_tail)(decision_id)
            )
            loop.call_later(self.KEPT_S, self.found.pop, decision_id, None)
        try:
            return await asyncio.shield(found)
        except Exception:
            self.found.pop(decision_id, None)  # not kept: the next socket reads it again
            raise


_plans: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Plans] = weakref.WeakKeyDictionary()


def _plan_tail(decision_id: int) -> str:
    return ',"plan":' + json.dumps(applying.packed_plan(decision_id)) + "}"


def plans() -> Plans:
    """The running event loop's ``Plans``."""
    return _plans.setdefault(asyncio.get_running_loop(), Plans())


def _goodbye(session: Session) -> None:
    lifecycle.left(job_id=session.job_id, node_id=session.node_id)


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
    id = ""  # this connection's, set when it opens
    session: Session | None = None
    last_seq = -1
    last_heard_s: float | None = None
    last_step: int | None = None  # the step of its latest heartbeat
    leaving = False  # goodbye received, or replaced: the close is not a failure
    # the agent spoke after its welcome, so it has it: the node is this socket's to lose (a
    # welcome sent after the agent closed is dropped unseen, and nothing here can tell)
    confirmed = False
    closing = False  # the server closed the socket (or found it gone): frames are dropped now
    released = False
    raw = "{}"  # the latest heartbeat, as stored
    profiled_s = -math.inf  # when this socket's latest profile was taken
    hello_deadline: asyncio.TimerHandle | None = None
    writing: asyncio.Task[None] | None = None  # the frames' database work (``later``)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # Channels' own loop (``await_many_dispatch``) wraps every message in a new task and an
        # ``asyncio.wait`` to listen to a channel layer too; this consumer has none, and those
        # were a fifth of the server's time at 2,048 agents' heartbeats
        self.scope, self.channel_layer, self.base_send = scope, None, send
        try:
            while True:
                liveness.stop_if_cancelled()  # a frame's Redis write may have swallowed it
                await self.dispatch(await receive())
        except StopConsumer:  # the socket closed (``websocket_disconnect``)
            pass
        finally:
            # an error or a cancellation skips ``disconnect``: release here what it would have
            await self.release(code=None)

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
        self.told: set[str] = set()  # the commands sent on this socket
        self.to_write: list[Callable[[], Awaitable[None]]] = []  # ``later``'s queue
        self.transit = liveness.Transit()  # how late its beats are read
        await self.accept()
        if len(waiting()) >= waiting_cap():
            log.warning("agent.busy", waiting=len(waiting()))
            await self.shut(int(protocol.CloseCode.BUSY))
            return
        waiting().add(self.id)
        self.hello_deadline = asyncio.get_running_loop().call_later(
            settings.PITSTOP_HELLO_TIMEOUT_S, self.too_late
        )

    def heard_hello(self) -> None:
        """Hello arrived (or the socket closes): no longer one that waits for it."""
        waiting().discard(self.id)
        if self.hello_deadline is not None:
            self.hello_deadline.cancel()
            self.hello_deadline = None

    def too_late(self) -> None:
        self.hello_deadline = None
        if self.session is None and not self.closing:
            timeout = protocol.ErrorCode.TIMEOUT
            error = ProtocolError(timeout, f"no hello in {settings.PITSTOP_HELLO_TIMEOUT_S} s")
            self.refusing = asyncio.get_running_loop().create_task(self.refuse(error))

    async def tell(self, text: str) -> None:
        """Send a frame, unless the socket is closed or closing (then it is dropped)."""
        if self.closing:
            return
        try:
            await self.send(text)
        except (OSError, RuntimeError):  # the server found the socket closed by the agent
            self.closing = True

    async def shut(self, code: int) -> None:
        """Close the socket, once; what the agent sends after that is dropped unread."""
        if self.closing:
            return
        self.closing = True
        self.heard_hello()
        with contextlib.suppress(OSError, RuntimeError):
            await self.close(code=code)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closing:  # sent before the agent saw the close: nothing to answer
            return
        raw = text_data if text_data is not None else bytes_data or b""
        await self.answering(lambda: self.handle(protocol.parse_agent_frame(raw)))

    async def answering(self, work: Callable[[], Awaitable[None]]) -> None:
        """Do a frame's ``work``: what it refuses is answered with an error frame, and a bug or
        an outage ends this socket, not the process."""
        try:
            await work()
        except ProtocolError as error:
            await self.refuse(error)
        except Exception:
            log.exception("agent.frame_failed", session=self.session)
            await self.shut(1011)

    def later(self, work: Callable[[], Awaitable[None]]) -> None:
        """Do ``work`` (a frame's database writes) after the socket's earlier such work, in a
        task of its own, while the socket goes on reading: its heartbeats reach Redis on time
        however long the writes wait for their batch (``Batches``)."""
        self.to_write.append(work)
        if self.writing is None:
            self.writing = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        try:
            while self.to_write:
                await self.answering(self.to_write.pop(0))
        finally:
            self.writing = None

    async def written(self) -> None:
        """Wait until the work ``later`` queued is done (a goodbye, a close: after it)."""
        while self.writing is not None:
            await asyncio.shield(self.writing)

    async def refuse(self, error: ProtocolError, seq: int | None = None) -> None:
        if self.closing:
            return
        log.info("agent.refused", code=error.code, field=error.field, session=self.session)
        await self.tell(protocol.encode(error.frame(seq=seq)))
        close = protocol.FATAL.get(error.code)
        if close is not None:
            # a replaced connection hands the node over: its close is no failure
            self.leaving = self.leaving or error.code is ErrorCode.REPLACED
            await self.shut(int(close))

    async def handle(self, frame: Any) -> None:
        if isinstance(frame, protocol.Hello):
            if self.session is not None:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello was already said")
            self.heard_hello()
            await self.open(frame)
            return
        if self.session is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{frame.type} before hello")
        self.confirmed = True
        if isinstance(frame, protocol.Goodbye):
            self.leaving = True
            await self.written()
            await in_thread(_goodbye)(self.session)
            self.writer.forget(self.session.job_id, self.session.node)
            await self.writer.settle()  # unwatched before the agent sees the close
            await self.shut(1000)
            return
        if isinstance(frame, protocol.Ack):
            self.later(functools.partial(self.acked, frame))
            return
        if frame.seq <= self.last_seq:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{frame.type} {frame.seq} after {self.last_seq}",
                field="seq",
            )
        # devices are checked before the sequence number moves on: a refused frame is no step
        reported = (
            [r.device for r in frame.devices]
            if isinstance(frame, protocol.Heartbeat)
            else frame.devices
        )
        foreign = sorted(set(reported) - self.session.devices)
        if foreign:
            raise ProtocolError(
                ErrorCode.WRONG_DEVICES,
                f"devices {foreign} are not this node's",
                field="devices",
            )
        self.last_seq = frame.seq
        if isinstance(frame, protocol.Heartbeat):
            self.last_heard_s, self.last_step = time.time(), frame.step
            # stored as validated and written again: one form whatever the agent wrote
            # (``1e3`` for a step, a key twice), so that readers parse what the schema says
            self.raw = protocol.encode(frame)
            session = self.session
            heard = self.last_heard_s
            late = self.transit.late(frame.at, heard)
            self.writer.beat(
                session.job_id, session.node, heard, self.raw, frame.at, frame.step, late=late
            )
            if self.awaited and _training(frame):
                self.later(functools.partial(self.trains, frame.step))
        elif isinstance(frame, protocol.Profile):
            # a script measures itself once a world: more often is a loop gone wrong, and each
            # profile rewrites the job's row, so one in PROFILE_INTERVAL_S is taken
            now = time.monotonic()
            if now - self.profiled_s < PROFILE_INTERVAL_S:
                log.info("agent.profile_skipped", job=self.session.job_id, node=self.session.node)
                return
            self.profiled_s = now
            self.later(functools.partial(self.profiled, self.session, frame))
        else:
            self.later(functools.partial(self.fault, self.session, frame))

    async def profiled(self, session: Session, frame: protocol.Profile) -> None:
        taken = await in_thread(_profiled)(session, frame)
        log.info("agent.profile", job=session.job_id, node=session.node, taken=taken)

    async def fault(self, session: Session, frame: protocol.Fault) -> None:
        decision = await in_thread(_fault)(session, frame)
        log.info("agent.fault", job=session.job_id, node=session.node, decision=decision)

    async def acked(self, frame: protocol.Ack) -> None:
        session = self.session
        assert session is not None
        what = await batches("acks").add((session, frame))
        if what is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_COMMAND,
                f"no command {frame.command!r} was sent to this node",
                field="command",
            )
        if what == "drill":
            log.info("agent.drill_ack", node=session.node, drill=frame.command, ok=frame.ok)
            return
        if frame.ok:
            self.awaited.setdefault(frame.command, Awaited()).acked = True
            # one line a batch says how many (``_record_acks``): a line each was 2,047 lines and
            # 0.08 s of the event loop in every recovery of a 2,048-node job
            log.debug("agent.ack", node=session.node, command=frame.command, ok=True)
        else:
            self.awaited.pop(frame.command, None)
            log.info("agent.ack", node=session.node, command=frame.command, ok=False)

    async def trains(self, step: int) -> None:
        """The node trains at ``step``: tell each acknowledged command's decision, once per
        stage (resumed, then a step past it)."""
        for command, awaited in list(self.awaited.items()):
            if not awaited.acked or (
                awaited.resumed_step is not None and step <= awaited.resumed_step
            ):
                continue
            resumed = await batches("progress").add((command, step))
            if resumed is None:
                self.awaited.pop(command, None)  # done, or its decision moved on
            else:
                awaited.resumed_step = resumed

    async def on_hub(self, message: dict[str, Any]) -> None:
        """A message published to this node (``hub``): a command, a newer connection, a token
        revoked, or the heartbeat deadline's failure of the node."""
        session = self.session
        if self.closing or session is None:
            return
        if message.get("replaced_by", self.id) != self.id:
            await self.refuse(
                ProtocolError(ErrorCode.REPLACED, "another connection took this node")
            )
        elif message.get("revoked_token") == session.token_id:
            await self.refuse(
                ProtocolError(ErrorCode.UNAUTHORISED, "the token was revoked", field="token")
            )
        elif "silent_since" in message:
            # heard nothing since (a partition, no close): the deadline failed the node, and
            # this close is no second failure; a newer socket, heard since, stays
            if self.last_heard_s is None or self.last_heard_s <= float(message["silent_since"]):
                log.info("agent.silent", job=session.job_id, node=session.node)
                self.leaving = True
                await self.shut(int(protocol.CloseCode.SILENT))
        elif "command" in message:
            await self.command(message["command"])

    async def command(self, frame: dict[str, Any]) -> None:
        command_id = str(frame["id"])
        if self.closing or command_id in self.told:
            # sent on this socket already: its agent has it (``applying.resend`` publishes again
            # what it does not know was handed over; the plan with each)
            return
        if frame.get("action") != protocol.Action.INJECT:  # a drill awaits no training
            self.awaited.setdefault(command_id, Awaited())
        text = json.dumps(frame, separators=(",", ":"))
        if applying.lacks_plan(frame):
            # the plan is encoded once a decision, not once a node
            text = text[:-1] + await plans().tail(int(frame["decision"]))
        await self.tell(text)
        if not self.closing:  # not published again (``applying.resend``)
            self.told.add(command_id)
            self.writer.handed(command_id)

    async def open(self, frame: protocol.Hello) -> None:
        opened = await in_thread(_hello, _hello_threads)(frame)
        session = self.session = opened.session
        if not opened.first:
            # an older connection of the same node steps aside, in whichever process it is (a
            # job's start, thousands of first hellos, spares Redis as many messages)
            with contextlib.suppress(RedisError):
                message = {"replaced_by": self.id}
                await hub.apublish(self.redis, session.job_id, session.node, message)
        await hub.hub().join(session.job_id, session.node, self.id, self.on_hub)
        # a revocation published before the join was not heard: look once more (the hellos of
        # a job's start together, in one query)
        if await batches("revoked").add(session.token_id):
            self.leaving = True  # never welcomed: the node is not this socket's to lose
            raise ProtocolError(ErrorCode.UNAUTHORISED, "the token was revoked", field="token")
        self.last_heard_s = time.time()
        self.writer.beat(
            session.job_id, session.node, self.last_heard_s, "{}", self.last_heard_s, None
        )
        await self.writer.settle()  # watched by the deadline before the agent is welcomed
        await self.tell(
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
        welcomed_s = time.time()
        if welcomed_s - self.last_heard_s > liveness.HEARTBEAT_INTERVAL_S:
            # a welcome slow to leave (a server busy with many hellos): the agent's first beat
            # is due an interval after it, so the deadline counts from the welcome
            self.last_heard_s = welcomed_s
            self.writer.beat(session.job_id, session.node, welcomed_s, "{}", welcomed_s, None)
        log.info("agent.hello", job=session.job_id, node=session.node)
        # what was sent while this agent was away, or not acknowledged before it reconnected
        for command in opened.unfinished:
            if command.acked:
                self.awaited[command.id] = Awaited(True, command.resumed_step)
            else:
                await self.command(command.frame)
        if opened.came_back:  # in a lost node's place: a job waiting for one plans again, with it
            await in_thread(decisions.node_came_back)(
                session.job_id, session.node_id, plan=enqueue_planning
            )

    async def disconnect(self, code: int) -> None:
        await self.release(code=code)

    async def release(self, *, code: int | None) -> None:
        """Give back what the connection took, once: its place among the sockets waiting for
        hello, its hub handler, and, unless it left or was replaced, its node, whose loss is
        recorded (and, should that fail, left to the heartbeat deadline)."""
        if self.released:
            return
        self.released = self.closing = True
        self.heard_hello()
        session = self.session
        if session is None:
            return
        # what the agent said before it went (an acknowledgement, a fault) is recorded first
        with contextlib.suppress(Exception):
            await self.written()
        hub.hub().leave(session.job_id, session.node, self.id)
        if self.leaving:
            return
        if not self.confirmed:
            # closed before a word after its welcome: most likely an agent that waited too long
            # for a server busy with thousands of hellos, and will say hello again. Not a loss:
            # watched from now, the node is failed at the deadline unless heard again by then
            log.info("agent.closed_unconfirmed", job=session.job_id, node=session.node)
            now = time.time()
            self.writer.beat(session.job_id, session.node, now, self.raw, now, self.last_step)
            return
        self.writer.forget(session.job_id, session.node)
        try:
            lost = Loss(session, self.last_heard_s, self.last_step)
            await asyncio.shield(batches("losses").add(lost))
        except Exception:
            # watched again from its last beat: the detector records it at the deadline
            log.exception("agent.loss_not_recorded", job=session.job_id, node=session.node)
            heard = self.last_heard_s or time.time()
            self.writer.beat(session.job_id, session.node, heard, self.raw, heard, self.last_step)
            return
        log.info("agent.lost", job=session.job_id, node=session.node, code=code)
