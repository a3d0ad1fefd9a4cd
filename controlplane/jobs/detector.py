"""The heartbeat deadline: a node silent for ``MISSED_BEATS`` intervals has failed; and the
join deadline (``jobs.lifecycle``): a node not joined in time has failed, a job unheard is stale.

A crashed agent closes its socket and is caught at once (``streaming.agent``); this catches a
host that stops without closing anything (frozen, partitioned, SIGSTOPped). ``sweep`` is one
pass; ``manage.py detect_failures`` runs it a few times a heartbeat interval. Several detectors
may run: the one holding the lease in Redis (``Lease``) sweeps, another takes over within
``LEASE_TTL_S`` of its death.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from channels.db import database_sync_to_async
from django.db import DatabaseError, transaction
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.incidents import accuracy, decisions
from controlplane.incidents.models import FailureSource
from controlplane.incidents.tasks import enqueue_planning, requeue_orphaned, requeue_overdue
from controlplane.jobs import history, lifecycle, liveness, snapshot
from controlplane.jobs.models import Device, Job, Node, NodeStatus, heavy
from controlplane.streaming import hub
from worker_agent.protocol import plan_devices

log = structlog.get_logger(__name__)


deadline_s = liveness.deadline_s


def _silent_node(job_id: int, node_name: str, last_heard_s: float) -> int | None:
    """Record the silent node's failure; the decision's id, or None if the node is gone."""
    node = (
        Node.objects.select_related("job")
        .defer(*heavy("job"))
        .filter(job_id=job_id, name=node_name)
        .first()
    )
    if node is None:
        return None
    devices = sorted(Device.objects.filter(node=node).values_list("index", flat=True))
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.FAILED)
    heard = dt.datetime.fromtimestamp(last_heard_s, tz=dt.UTC)
    _, decision = decisions.record_failure(
        node.job,
        kind="hang",
        devices=devices,
        source=FailureSource.HEARTBEAT,
        occurred_at=min(heard, timezone.now()),
        node=node,
        message=f"no heartbeat for {deadline_s():g} s ({liveness.MISSED_BEATS} missed)",
        step=snapshot.job_step(job_id),
        plan=enqueue_planning,
    )
    return decision.pk


def _plan_devices(job_id: int) -> set[int]:
    return plan_devices(Job.objects.values_list("plan", flat=True).get(pk=job_id))


def _never_joined(node_id: int, now: dt.datetime, used: set[int] | None = None) -> int | None:
    """Record the failure of a node expected and not joined within the join deadline; the
    decision's id, or None if it joined (or another detector recorded it) meanwhile, or if
    the running plan uses none of its devices (then no decision is opened). ``used``, the plan's
    devices as the caller read them this pass, spares reading the plan again for every node of
    a job (megabytes at thousands of nodes)."""
    with transaction.atomic():
        # the node's status moves once: a second detector's pass finds it failed already
        if not Node.objects.filter(pk=node_id, status=NodeStatus.EXPECTED).update(
            status=NodeStatus.FAILED
        ):
            return None
        node = Node.objects.select_related("job").defer(*heavy("job")).get(pk=node_id)
        devices = sorted(Device.objects.filter(node=node).values_list("index", flat=True))
        failure: dict[str, Any] = {
            "kind": "never_joined",
            "devices": devices,
            "source": FailureSource.HEARTBEAT,
            "occurred_at": node.expected_at + dt.timedelta(seconds=lifecycle.join_deadline_s()),
            "node": node,
            "message": f"no hello within {lifecycle.join_deadline_s():g} s of being expected",
            "step": snapshot.job_step(node.job_id),
        }
        used = _plan_devices(node.job_id) if used is None else used
        if used.isdisjoint(devices):  # spares: capacity lost, nothing to recover
            decisions.record_idle_failure(node.job, **failure)
            return None
        _, decision = decisions.record_failure(node.job, plan=enqueue_planning, **failure)
    return decision.pk


async def _lifecycle(redis: aioredis.Redis, now_s: float) -> list[int]:
    """The join deadline: a live job none of whose nodes was heard for longer than it is
    ``stale``; in the others, each node still expected past it is a ``never_joined`` failure."""
    deadline = lifecycle.join_deadline_s()
    begun = await database_sync_to_async(lifecycle.live_jobs)()
    ids = list(begun)
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.zrevrange(liveness.seen_key(job_id), 0, 0, withscores=True)
            pipe.get(heard_key(job_id))
        found = await pipe.execute() if ids else []
    async with redis.pipeline(transaction=False) as pipe:
        stale = []
        for i, job_id in enumerate(ids):
            newest, kept = found[2 * i], found[2 * i + 1]
            watched = float(newest[0][1]) if newest else 0.0
            if watched > float(kept or 0.0):  # remembered for when no node is watched
                pipe.set(heard_key(job_id), watched, ex=HEARD_TTL_S)
            if now_s - max(begun[job_id], watched, float(kept or 0.0)) > deadline:
                stale.append(job_id)
        await pipe.execute()
    if stale:
        for job_id in await database_sync_to_async(lifecycle.mark_stale)(stale):
            log.info("detector.stale", job=job_id, deadline_s=deadline)
    decided = []
    now = dt.datetime.fromtimestamp(now_s, tz=dt.UTC)
    plans: dict[int, set[int]] = {}  # each job's plan devices, read once this pass
    for job_id, node_id, name in await database_sync_to_async(lifecycle.overdue_nodes)(now):
        if job_id in stale:
            continue
        if job_id not in plans:
            plans[job_id] = await database_sync_to_async(_plan_devices)(job_id)
        decision = await database_sync_to_async(_never_joined)(node_id, now, plans[job_id])
        if decision is not None:
            log.info("detector.never_joined", job=job_id, node=name, deadline_s=deadline)
            decided.append(decision)
    return decided


def heard_key(job_id: int) -> str:
    """The newest heartbeat of the job's nodes the detector has seen (a job's nodes are no
    longer watched once they failed or left)."""
    return f"{liveness.PREFIX}:job:{job_id}:heard"


HEARD_TTL_S = 7 * 24 * 3600
# Seconds between passes over the join deadline (tens of seconds) and stale jobs.
LIFECYCLE_PERIOD_S = 1.0
_next_lifecycle_s = 0.0  # this process's next one (monotonic clock)


# When the detector's own view is behind, silence proves nothing about the nodes: a pass is held
# off (``stall``) when this process came late to it, when Redis answers slowly, or when no watched
# node at all was heard within the deadline while several were heard shortly before it (every
# node falling silent at once is likelier a stalled control plane than a stalled cluster).
STALL_GAP_DEADLINES = 0.5  # this process's previous pass longer ago than this many deadlines
STALL_RTT_DEADLINES = 0.25  # the Redis round trip longer than this many deadlines
STALL_MIN_WATCHED = 2  # this many nodes heard within the hold window, none within the deadline
# A silence of every node longer than the deadline and this many deadlines more is not ours:
# the nodes are judged again (a control plane stalled that long has lost its agents anyway).
STALL_HOLD_DEADLINES = 4.0
STALLS_KEY = f"{liveness.PREFIX}:detector:stalls"  # held-off passes by reason, for /metrics
# ``ingest_behind`` (a server process's event loop fell behind, as it said or as its silence
# says: ``liveness.watch_loop``, ``liveness.SERVERS_KEY``) holds off only the short silences: the
# pass judges nodes silent longer than the deadline and ``STALL_HOLD_DEADLINES`` more, so a server
# that stays behind delays detection, never blinds it.
STALL_REASONS = ("detector_lag", "redis_slow", "none_heard", "ingest_behind")
_last_pass_s: float | None = None  # this process's previous pass (monotonic clock)


@dataclass(frozen=True)
class View:
    """What the detector sees of itself at the start of a pass."""

    gap_s: float  # since this process's previous pass (0 for its first, or a given ``now_s``)
    rtt_s: float  # the Redis round trip reading the watched nodes
    newest_age_s: float | None  # the newest heartbeat of any watched node (None: none watched)
    recent: int  # watched nodes heard within the deadline and the hold window after it
    behind: int = 0  # server processes whose event loop fell behind within the last deadline
    quiet: int = 0  # server processes not heard on time for ``liveness.quiet_s()`` (blocked)


@dataclass(frozen=True)
class Stall:
    reason: str  # detector_lag, redis_slow or none_heard
    message: str


def stall(view: View, deadline_s: float) -> Stall | None:
    """Whether the pass must be held off: its ``Stall`` (reason), else None."""
    if view.gap_s > STALL_GAP_DEADLINES * deadline_s:
        return Stall("detector_lag", f"the detector's previous pass was {view.gap_s:.2f} s ago")
    if view.rtt_s > STALL_RTT_DEADLINES * deadline_s:
        return Stall("redis_slow", f"a Redis round trip took {view.rtt_s:.2f} s")
    age = view.newest_age_s
    if age is not None and age > deadline_s and view.recent >= STALL_MIN_WATCHED:
        return Stall("none_heard", f"none of {view.recent} watched nodes heard for {age:.2f} s")
    if view.behind or view.quiet:
        return Stall(
            "ingest_behind",
            f"{view.behind} server(s) behind on heartbeats, {view.quiet} not heard on time",
        )
    return None


async def _view(redis: aioredis.Redis, now_s: float, gap_s: float) -> View:
    """The Redis round trip and the newest heartbeat of any watched node, in one pipeline."""
    window_s = deadline_s() * (1 + STALL_HOLD_DEADLINES)
    started = time.monotonic()
    jobs = list(await redis.smembers(liveness.JOBS_KEY))
    # servers are heard on the real clock, whatever time the pass judges (tests give one)
    real_s = time.time()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcount(liveness.BEHIND_KEY, now_s, "+inf")
        # a server silent longer than the hold window stopped: it holds nothing off any more
        pipe.zremrangebyscore(liveness.SERVERS_KEY, "-inf", f"({real_s - window_s}")
        pipe.zcount(liveness.SERVERS_KEY, "-inf", f"({real_s - liveness.quiet_s()}")
        for job in jobs:
            pipe.zrevrange(liveness.seen_key(int(job)), 0, 0, withscores=True)
            pipe.zcount(liveness.seen_key(int(job)), now_s - window_s, "+inf")
        behind, _, quiet, *found = await pipe.execute()
    rtt_s = time.monotonic() - started
    newest = [float(pair[0][1]) for pair in found[0::2] if pair]
    return View(
        gap_s=gap_s,
        rtt_s=rtt_s,
        newest_age_s=now_s - max(newest) if newest else None,
        recent=sum(int(n) for n in found[1::2]),
        behind=int(behind),
        quiet=int(quiet),
    )


async def sweep(redis: aioredis.Redis, now_s: float | None = None) -> list[int]:
    """One pass: every node silent past the deadline becomes a failure, once; and, once a
    ``LIFECYCLE_PERIOD_S`` (every pass when ``now_s`` is given), the join deadline
    (``_lifecycle``). A pass whose view is behind (``stall``) records the stall instead and
    judges nothing: the next pass looks again."""
    global _next_lifecycle_s, _last_pass_s
    gap_s = 0.0
    if now_s is None:
        now_mono = time.monotonic()
        gap_s = 0.0 if _last_pass_s is None else now_mono - _last_pass_s
        _last_pass_s = now_mono
    lifecycle_due = now_s is not None or time.monotonic() >= _next_lifecycle_s
    now_s = time.time() if now_s is None else now_s
    held = stall(await _view(redis, now_s, gap_s), deadline_s())
    silence_s = deadline_s()
    if held is not None:
        await redis.hincrby(STALLS_KEY, held.reason, 1)
        log.warning("detector.stall", reason=held.reason, message=held.message)
        if held.reason != "ingest_behind":
            return []
        silence_s, lifecycle_due = deadline_s() * (1 + STALL_HOLD_DEADLINES), False
    decided = []
    cutoff_s = now_s - silence_s
    for job_id, node, last_heard_s in await liveness.silent(redis, now_s, silence_s):
        # forget first: a second detector running the same pass finds nothing to report; and
        # only if still silent: a pass that records many failures reaches the last ones seconds
        # after it listed them, and a node heard meanwhile has not failed
        removed = await redis.eval(_FORGET_SILENT, 1, liveness.seen_key(job_id), node, cutoff_s)
        if not removed:
            continue
        try:
            decision = await database_sync_to_async(_silent_node)(job_id, node, last_heard_s)
        except DatabaseError as exc:
            # the database is away or busy: watch the node again, the next pass retries
            await redis.zadd(liveness.seen_key(job_id), {node: last_heard_s})
            log.warning("detector.record_failed", job=job_id, node=node, error=str(exc))
            continue
        log.info("detector.silent", job=job_id, node=node, silent_s=now_s - last_heard_s)
        # a socket of the node still open (a partition closes nothing) is closed: when the link
        # comes back, the agent says hello again as a new member
        with contextlib.suppress(RedisError):
            await hub.apublish(redis, job_id, node, {"silent_since": last_heard_s})
        if decision is not None:
            decided.append(decision)
    if lifecycle_due:
        _next_lifecycle_s = time.monotonic() + LIFECYCLE_PERIOD_S
        try:
            decided.extend(await _lifecycle(redis, now_s))
        except DatabaseError as exc:  # the next pass tries again
            log.warning("detector.lifecycle_failed", error=str(exc))
    return decided


# Stop watching a node (ARGV[1]) only if it was last heard before ARGV[2]: 1 if it was.
_FORGET_SILENT = """
local heard = redis.call('zscore', KEYS[1], ARGV[1])
if heard and tonumber(heard) < tonumber(ARGV[2]) then
  return redis.call('zrem', KEYS[1], ARGV[1])
end
return 0
"""

# Seconds between looks for decisions a lost task left behind (tasks.requeue_overdue).
OVERDUE_PERIOD_S = 5.0
# The detectors' lease: one of several running detectors sweeps and re-queues, the others wait
# to take over; the holder renews it every period, so it lapses this long after the holder died.
LEASE_TTL_S = 3.0
LEASE_KEY = f"{liveness.PREFIX}:detector:lease"  # "{token}:{host}:{pid}" of the holder
TOKEN_KEY = f"{liveness.PREFIX}:detector:token"  # the fencing tokens handed out so far

# Take the lease if nobody holds it, with a fencing token one higher than the last holder's.
_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return 0 end
local token = redis.call('incr', KEYS[2])
redis.call('set', KEYS[1], token .. ':' .. ARGV[1], 'px', ARGV[2])
return token
"""
# Renew (ARGV[2] > 0) or release (ARGV[2] == 0) the lease if it is still the caller's.
_KEEP = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('pexpire', KEYS[1], ARGV[2])
else redis.call('del', KEYS[1]) end
return 1
"""


class Lease:
    """The detectors' lease in Redis: at most one holder at a time, each with a fencing token
    higher than every earlier holder's."""

    def __init__(
        self,
        redis: aioredis.Redis,
        holder: str,
        ttl_s: float = LEASE_TTL_S,
        keys: tuple[str, str] = (LEASE_KEY, TOKEN_KEY),
    ) -> None:
        self.holder, self.ttl_ms, self.keys = holder, int(ttl_s * 1000), keys
        self.token = 0  # this process's token while it holds the lease, else 0
        self._acquire = redis.register_script(_ACQUIRE)
        self._keep = redis.register_script(_KEEP)

    @property
    def value(self) -> str:
        return f"{self.token}:{self.holder}"

    async def hold(self) -> bool:
        """Renew the lease if this process holds it, else try to take it; whether it holds it."""
        if self.token:
            if await self._keep(keys=[self.keys[0]], args=[self.value, self.ttl_ms]):
                return True
            log.warning("detector.lease_lost", fencing=self.token)
            self.token = 0
        self.token = int(await self._acquire(keys=list(self.keys), args=[self.holder, self.ttl_ms]))
        if self.token:
            log.info("detector.leading", fencing=self.token, holder=self.holder)
        return bool(self.token)

    async def release(self) -> None:
        if self.token:
            await self._keep(keys=[self.keys[0]], args=[self.value, 0])
            self.token = 0


async def run(period_s: float | None = None, *, lease_ttl_s: float = LEASE_TTL_S) -> None:
    """Sweep forever, four times a heartbeat interval unless told otherwise, while this process
    holds the detectors' lease (``Lease``); every period also re-queue planning whose worker
    died, every few seconds what a broker or worker restart left behind and measure the
    recoveries that settled (``incidents.accuracy``), every ``history.PERIOD_S`` a point of
    every live job's training history (``jobs.history``)."""
    period_s = period_s or liveness.HEARTBEAT_INTERVAL_S / 4
    redis = liveness.client()
    lease = Lease(redis, f"{socket.gethostname()}:{os.getpid()}", lease_ttl_s)
    next_overdue = next_history = 0.0
    try:
        while True:
            liveness.stop_if_cancelled()
            leading = False
            try:
                leading = await lease.hold()
                if leading:
                    await sweep(redis)
                    await database_sync_to_async(requeue_orphaned)()
            except RedisError as exc:  # Redis restarting: the deadline waits for it
                log.warning("detector.redis_lost", error=str(exc))
            except DatabaseError as exc:  # the next period tries again
                log.warning("detector.orphans_failed", error=str(exc))
            if leading and time.monotonic() >= next_overdue:
                try:
                    await database_sync_to_async(requeue_overdue)()
                except DatabaseError as exc:  # the next period tries again
                    log.warning("detector.overdue_failed", error=str(exc))
                try:  # the cost model against what happened, once a recovery settled
                    await database_sync_to_async(accuracy.measure_settled)()
                except (DatabaseError, RedisError) as exc:  # the next period tries again
                    log.warning("detector.measure_failed", error=str(exc))
                next_overdue = time.monotonic() + OVERDUE_PERIOD_S
            if leading and time.monotonic() >= next_history:
                try:  # the jobs' training history, for pages opened later
                    await database_sync_to_async(history.record_live)(liveness.sync_client())
                except (DatabaseError, RedisError) as exc:  # the next period tries again
                    log.warning("detector.history_failed", error=str(exc))
                next_history = time.monotonic() + history.PERIOD_S
            await asyncio.sleep(period_s)
    finally:
        with contextlib.suppress(RedisError):  # a clean stop hands over at once
            await lease.release()
        await redis.aclose()
