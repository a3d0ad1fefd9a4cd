"""Heartbeats in Redis: the last time each node was heard from, and its latest metrics.

A heartbeat is never a database row: it sets the node's metrics hash and its score in the job's
"last seen" sorted set. A server process writes them through its ``Writer``, which gathers the
heartbeats of all its sockets that arrive within a few milliseconds into one pipelined round
trip: one round trip per heartbeat, with thousands of sockets on one event loop, is what makes
ingest fall behind. The writer also keeps the ingest lag (the agent's send to the write in
Redis) as a histogram in Redis, for ``/metrics``. The failure detector asks which nodes have
been silent past the deadline; the dashboard reads the latest metrics.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import os
import socket
import time
import weakref
from typing import Any

import redis as redis_sync
import redis.asyncio as aioredis
import structlog
from django.conf import settings
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)

# The deployment's keys: its namespace and Redis database number (docs/operations.md).
PREFIX: str = settings.PITSTOP_REDIS_PREFIX
# Seconds between heartbeats and how many missed ones make a node failed (docs/protocol.md).
HEARTBEAT_INTERVAL_S: float = settings.PITSTOP_HEARTBEAT_INTERVAL_S
MISSED_BEATS: int = settings.PITSTOP_MISSED_BEATS


def seen_key(job_id: int) -> str:
    """The job's nodes being watched, scored by when each was last heard (server clock)."""
    return f"{PREFIX}:job:{job_id}:seen"


def frames_key(job_id: int) -> str:
    """Each watched node of the job's latest heartbeat, as the agent sent it (JSON text)."""
    return f"{PREFIX}:job:{job_id}:frames"


def steps_key(job_id: int) -> str:
    """Each node of the job's step in its latest heartbeat (those that sent one, until the node
    is forgotten), scored by it: the job's step is the highest, one read however many nodes."""
    return f"{PREFIX}:job:{job_id}:steps"


JOBS_KEY = f"{PREFIX}:jobs"  # jobs with a node connected, for the detector's scan
BEATS_KEY = f"{PREFIX}:heartbeats"  # every heartbeat received, for /metrics
LAG_KEY = f"{PREFIX}:ingest_lag"  # histogram of the ingest lag: bucket bound (s) -> count
# Upper bounds (seconds) of the ingest lag histogram's buckets; "+Inf" holds the rest.
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)  # fmt: skip
# How long the writer waits for more heartbeats before it writes.
LINGER_S = 0.005
# Server processes whose event loop fell behind, scored by when that stops counting (server
# clock): a loop late by more than this many deadlines holds heartbeats back long enough to make
# a node look silent, and the detector then judges only long silences (``jobs.detector``).
BEHIND_KEY = f"{PREFIX}:ingest:behind"
LOOP_BEHIND_DEADLINES = 0.25
# A server busy to its last cycle keeps its loop on time and its writes prompt, yet reads each
# socket late: beats come later than their agent's usual transit (``Transit``). A batch with at
# least this many such beats, and this share of its beats, says the process is behind; one agent
# with a slow link, or one that lies about its clocks, cannot.
LATE_BEATS_MIN = 2
LATE_BEATS_SHARE = 0.01
LOOP_PERIOD_S = 0.25  # how often a server process looks at its own event loop
# Server processes by when their event loop last found itself on time (server clock), said every
# ``LOOP_PERIOD_S``. A process whose loop is blocked, or whose Redis connections are held, cannot
# say it is behind; its silence says it instead: the detector counts a process behind once its
# word is ``quiet_s()`` old, until it is older than the detector's hold window (a process that
# stopped, whose word the detector then removes).
SERVERS_KEY = f"{PREFIX}:ingest:servers"
# Commands a server process handed to their agent's socket, scored by when (server clock): not
# worth publishing again (``incidents.applying.resend``). A socket that closes before its agent
# read one brings the agent back with a hello, which is sent its unfinished commands again.
DELIVERED_KEY = f"{PREFIX}:commands:delivered"
DELIVERED_KEPT_S = 3600.0


# A client's connections: at most this many at once, and a command that finds them all in use
# waits for one (up to POOL_WAIT_S) rather than failing, as redis-py's own pool (100) does: a
# burst of agents saying hello is then slower, not lost.
POOL_SIZE = 64
POOL_WAIT_S = 10.0
# The longest an asynchronous client waits to connect, or to close a connection: redis-py waits
# for a closed socket's end (``StreamWriter.wait_closed``) with no bound by default, and that
# wait can hang (redis/redis-py#3941), holding up whatever closes the client after it.
CONNECT_TIMEOUT_S = 5.0


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` if the running task was cancelled and went on. Every loop that
    awaits Redis asks this at each turn: redis-py sends each command inside ``asyncio.wait_for``,
    and on Python 3.11 that returns the command's answer when a cancellation arrives in the turn
    the write completed, and the cancellation is lost (python/cpython#86296, fixed in 3.12). A
    loop told to stop then ran on, and whoever waited for it (a closing event loop) waited
    forever; one in two cancellations landed there in a loop of commands."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def deadline_s() -> float:
    """How long a node may be silent: ``MISSED_BEATS`` heartbeat intervals."""
    return HEARTBEAT_INTERVAL_S * MISSED_BEATS


def quiet_s() -> float:
    """How old a server process's last word may be before the detector counts it behind: the
    lateness ``watch_loop`` would say, and one period more for the word to come."""
    return LOOP_BEHIND_DEADLINES * deadline_s() + LOOP_PERIOD_S


def client(size: int = POOL_SIZE) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.REDIS_URL,
        decode_responses=True,
        max_connections=size,
        timeout=POOL_WAIT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
    )
    return aioredis.Redis(connection_pool=pool)


_sync: redis_sync.Redis | None = None


def sync_client() -> redis_sync.Redis:
    """This process's synchronous client (views, tasks), on one connection pool."""
    global _sync
    if _sync is None:
        _sync = redis_sync.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    return _sync


Beat = tuple[float, str, int | None]  # a node's latest heartbeat: heard at, its text, its step


class Transit:
    """One socket's heartbeats, from their agent's ``at`` to the server's reading: whether a
    beat was read late, against the fastest transit of that socket's beats so far.

    The agent's clock and the server's differ by an offset that is the same for every beat of
    a socket, so the fastest transit holds it, and a beat's transit beyond that is time spent
    waiting: on the agent's way out, on the link, or in the server's queues. That wait, not the
    clocks, is what makes a node look silent; more than ``LOOP_BEHIND_DEADLINES`` deadlines is
    late. The fastest transit may creep up ``DRIFT_S`` a beat, so that an agent's clock set back
    once does not make all its later beats late."""

    DRIFT_S = 0.001

    def __init__(self) -> None:
        self.fastest_s = math.inf

    def late(self, sent_s: float, read_s: float) -> bool:
        transit = read_s - sent_s
        self.fastest_s = min(transit, self.fastest_s + self.DRIFT_S)
        return transit - self.fastest_s > LOOP_BEHIND_DEADLINES * deadline_s()


class Writer:
    """One event loop's heartbeat writes: ``beat`` queues, a task writes what queued meanwhile
    in one pipeline (per job: a ZADD of when and one of the steps, and one HSET, for all its
    nodes), then records the lag of every beat received, superseded ones included."""

    def __init__(self, redis: aioredis.Redis, name: str = "") -> None:
        self.redis = redis
        self.name = name  # this process's and loop's, in ``BEHIND_KEY``
        self.since: float | None = None  # when the oldest beat queued now was queued (monotonic)
        self.writing_since: float | None = None  # the same, for the batch being written
        # per job, each node's latest beat (heard at, frame text, step), or None to forget it
        self.queued: dict[int, dict[str, Beat | None]] = {}
        self.sent: list[float] = []  # when each beat queued since the last write was sent
        self.late = 0  # beats queued since the last write that were read late (``Transit``)
        self.delivered: dict[str, float] = {}  # commands handed to their sockets, and when
        self.flushing: asyncio.Task[None] | None = None
        # resolved when the queue as it stands is written, and when the batch in flight is
        self.queued_done: asyncio.Future[None] | None = None
        self.writing_done: asyncio.Future[None] | None = None
        self.watching: asyncio.Task[None] | None = None  # its loop's ``watch_loop``

    def beat(
        self,
        job_id: int,
        node: str,
        at_s: float,
        frame: str,
        sent_s: float,
        step: int | None,
        *,
        late: bool = False,
    ) -> None:
        """Queue the heartbeat ``frame`` (its JSON text) heard at ``at_s``, which its agent sent
        at ``sent_s`` (the agent's clock); ``step``, the frame's (None: it has none); ``late``,
        read later than its agent's beats usually are (``Transit``)."""
        if self.since is None:
            self.since = time.monotonic()
        self.queued.setdefault(job_id, {})[node] = (at_s, frame, step)
        self.sent.append(sent_s)
        self.late += late
        self._schedule()

    def handed(self, command_id: str) -> None:
        """The command went to its agent's socket (``DELIVERED_KEY``), written with the beats."""
        self.delivered[command_id] = time.time()
        self._schedule()

    def forget(self, job_id: int, node: str) -> None:
        """Stop watching the node (it left, or failed), after any of its beats queued before:
        in the same queue, so no late beat brings it back."""
        self.queued.setdefault(job_id, {})[node] = None
        self._schedule()

    def _schedule(self) -> None:
        if self.flushing is None:
            self.flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(LINGER_S)
            while self.queued or self.delivered:
                wait = LINGER_S - (time.monotonic() - self.since) if self.since else 0.0
                if wait > 0:
                    # what came while the last batch was written lingers too: at 2,048 agents'
                    # beats, batches written back to back held three beats each, and their
                    # round trips were a seventh of the server's time. Not a turn more when the
                    # oldest beat waited long enough: a loop a second late (thousands of hellos)
                    # would hold every batch a second longer
                    await asyncio.sleep(wait)
                batch, self.queued = self.queued, {}
                delivered, self.delivered = self.delivered, {}
                sent, self.sent = self.sent, []
                late, self.late = self.late, 0
                since, self.since = self.since, None
                done, self.queued_done = self.queued_done, None
                self.writing_done = done or asyncio.get_running_loop().create_future()
                self.writing_since = since
                try:
                    await self._write(batch, sent, since, delivered, late)
                finally:
                    self.writing_since = None
                    self.writing_done.set_result(None)
                    self.writing_done = None
        finally:
            self.flushing = None
            if self.queued_done is not None and not self.queued_done.done():
                # cancelled (the loop closing) before the queue was written: who waits for it
                # is told, not left awaiting a write no task will make
                self.queued_done.cancel()
                self.queued_done = None

    def held_s(self) -> float:
        """How long the oldest beat not yet written has waited (0: none waits)."""
        waiting = [t for t in (self.writing_since, self.since) if t is not None]
        return time.monotonic() - min(waiting) if waiting else 0.0

    async def settle(self) -> None:
        """Wait until what is queued now is written (or lost to a Redis error); not for what
        comes after, which under a steady stream of beats never stops coming."""
        if self.queued:
            if self.queued_done is None:
                self.queued_done = asyncio.get_running_loop().create_future()
            await asyncio.shield(self.queued_done)
        elif self.writing_done is not None:
            await asyncio.shield(self.writing_done)

    async def _write(
        self,
        batch: dict[int, dict[str, Beat | None]],
        sent: list[float],
        since: float | None,
        delivered: dict[str, float] | None = None,
        late: int = 0,
    ) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                held = 0.0 if since is None else time.monotonic() - since
                if held > LOOP_BEHIND_DEADLINES * deadline_s():
                    # beats queued behind slow writes: as late to Redis as a late loop makes them
                    log.warning("ingest.behind", held_s=round(held, 3), beats=len(sent))
                    pipe.zadd(BEHIND_KEY, {self.name: time.time() + deadline_s()})
                elif late >= max(LATE_BEATS_MIN, LATE_BEATS_SHARE * len(sent)):
                    # beats read late from their sockets: a node whose beats wait as long looks
                    # silent as surely as behind a late loop
                    log.warning("ingest.behind", late_beats=late, beats=len(sent))
                    pipe.zadd(BEHIND_KEY, {self.name: time.time() + deadline_s()})
                for job_id, nodes in batch.items():
                    beats = {node: beat for node, beat in nodes.items() if beat is not None}
                    gone = [node for node, beat in nodes.items() if beat is None]
                    stepped = {n: s for n, (_, _, s) in beats.items() if s is not None}
                    stepless = [n for n, (_, _, s) in beats.items() if s is None]
                    if beats:
                        pipe.zadd(seen_key(job_id), {n: at for n, (at, _, _) in beats.items()})
                        pipe.hset(
                            frames_key(job_id), mapping={n: f for n, (_, f, _) in beats.items()}
                        )
                    if stepped:
                        pipe.zadd(steps_key(job_id), stepped)
                    if gone:
                        pipe.zrem(seen_key(job_id), *gone)
                        pipe.hdel(frames_key(job_id), *gone)
                    if gone or stepless:
                        pipe.zrem(steps_key(job_id), *gone, *stepless)
                if batch:
                    pipe.sadd(JOBS_KEY, *batch)
                if delivered:
                    pipe.zadd(DELIVERED_KEY, delivered)
                pipe.incrby(BEATS_KEY, len(sent))
                self._lag_into(pipe, sent)
                await pipe.execute()
        except RedisError as exc:
            # Redis restarting: these beats are lost, the agents are not (their next beats land)
            log.warning("heartbeats.lost", count=len(sent), error=str(exc))

    def _lag_into(self, pipe: Any, sent: list[float]) -> None:
        """Add the lags (now, as they are written, minus each send) to the histogram."""
        now = time.time()
        counts = [0] * (len(LAG_BUCKETS_S) + 1)
        total = 0.0
        for sent_s in sent:
            lag = max(now - sent_s, 0.0)
            counts[bisect.bisect_left(LAG_BUCKETS_S, lag)] += 1
            total += lag
        for bound, count in zip((*LAG_BUCKETS_S, "+Inf"), counts, strict=True):
            if count:
                pipe.hincrby(LAG_KEY, str(bound), count)
        if sent:
            pipe.hincrbyfloat(LAG_KEY, "sum", total)


_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[aioredis.Redis, Writer]] = (
    weakref.WeakKeyDictionary()
)


def shared() -> tuple[aioredis.Redis, Writer]:
    """The running event loop's Redis client, shared by its sockets (one connection pool, not
    one per socket), and its heartbeat writer, on a connection of its own: it writes one batch
    at a time, and no burst of the sockets' other commands makes it wait for a connection. The
    first call also starts watching the loop (``watch_loop``), on a third connection."""
    loop = asyncio.get_running_loop()
    found = _shared.get(loop)
    if found is None:
        name = f"{socket.gethostname()}:{os.getpid()}:{id(loop)}"
        writer = Writer(client(size=1), name)
        found = _shared[loop] = (client(), writer)
        # on a connection of its own too: a burst of hellos that takes every connection of the
        # pool would hold back the very word that the server is behind
        writer.watching = loop.create_task(watch_loop(client(size=1), name, writer))
    return found


async def watch_loop(redis: aioredis.Redis, name: str, writer: Writer | None = None) -> None:
    """Every ``LOOP_PERIOD_S``, how late this event loop wakes, and how long the oldest beat
    ``writer`` has not written yet has waited: either longer than ``LOOP_BEHIND_DEADLINES``
    deadlines (a burst of hellos, a long garbage collection, writes that Redis answers late),
    the process is in ``BEHIND_KEY`` for a deadline from now. Said while the beats still wait,
    on a connection other than the writer's, so that the detector hears it before their nodes
    look silent; the writer says it again with the late beats (``Writer._write``). On time, it
    says that instead (``SERVERS_KEY``), so that a loop too blocked to say anything is heard too."""
    loop = asyncio.get_running_loop()
    deadline = deadline_s()
    try:
        while True:
            stop_if_cancelled()
            started = loop.time()
            await asyncio.sleep(LOOP_PERIOD_S)
            late = loop.time() - started - LOOP_PERIOD_S
            held = 0.0 if writer is None else writer.held_s()
            with contextlib.suppress(RedisError):
                if max(late, held) > LOOP_BEHIND_DEADLINES * deadline:
                    log.warning("ingest.behind", late_s=round(late, 3), held_s=round(held, 3))
                    await redis.zadd(BEHIND_KEY, {name: time.time() + deadline})
                else:  # on time: the word whose absence the detector reads (``SERVERS_KEY``)
                    await redis.zadd(SERVERS_KEY, {name: time.time()})
    finally:
        # a loop that ends says so: its silence would hold the detector off for a hold window
        with contextlib.suppress(RedisError, OSError, asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(redis.zrem(SERVERS_KEY, name), LOOP_PERIOD_S)


def handed_of(command_ids: list[str]) -> set[str]:
    """Those of the commands a server handed to their agent's socket (``Writer.handed``),
    from this process's synchronous client; the older records are dropped."""
    if not command_ids:
        return set()
    client = sync_client()
    with client.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(DELIVERED_KEY, "-inf", f"({time.time() - DELIVERED_KEPT_S}")
        pipe.zmscore(DELIVERED_KEY, command_ids)
        _, scores = pipe.execute()
    return {command_id for command_id, score in zip(command_ids, scores, strict=True) if score}


def lag_histogram(redis: Any) -> tuple[list[tuple[str, int]], float]:
    """The ingest lag histogram as Prometheus wants it: cumulative (bound, count) pairs up to
    "+Inf", and the sum of lags (``redis`` is a synchronous client)."""
    raw = redis.hgetall(LAG_KEY) or {}
    values = {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}
    cumulative, running = [], 0
    for bound in (*LAG_BUCKETS_S, "+Inf"):
        running += int(values.get(str(bound), 0))
        cumulative.append((str(bound), running))
    return cumulative, float(values.get("sum", 0.0))


async def silent(
    redis: aioredis.Redis, now_s: float, deadline_s: float
) -> list[tuple[int, str, float]]:
    """(job, node, last heard) of every watched node silent for more than ``deadline_s``."""
    out: list[tuple[int, str, float]] = []
    for job in await redis.smembers(JOBS_KEY):
        found: list[Any] = await redis.zrangebyscore(
            seen_key(int(job)), "-inf", f"({now_s - deadline_s}", withscores=True
        )
        out.extend((int(job), str(pair[0]), float(pair[1])) for pair in found)
    return out


async def latest(redis: aioredis.Redis, job_id: int, node: str) -> dict[str, Any] | None:
    """The node's last heartbeat: when it was heard and the frame; None if not watched."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zscore(seen_key(job_id), node)
        pipe.hget(frames_key(job_id), node)
        at, frame = await pipe.execute()
    if at is None or frame is None:
        return None
    return {"at": float(at), "metrics": json.loads(frame)}
