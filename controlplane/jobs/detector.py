"""The heartbeat deadline: a node silent for ``MISSED_BEATS`` intervals has failed.

A crashed agent closes its socket and is caught at once (``streaming.agent``); this catches a
host that stops without closing anything (frozen, partitioned, SIGSTOPped). ``sweep`` is one
pass; ``manage.py detect_failures`` runs it a few times a heartbeat interval.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import redis.asyncio as aioredis
import structlog
from channels.db import database_sync_to_async
from django.db import DatabaseError
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.incidents import decisions
from controlplane.incidents.models import FailureSource
from controlplane.incidents.tasks import enqueue_planning, requeue_overdue
from controlplane.jobs import liveness, snapshot
from controlplane.jobs.models import Device, Node, NodeStatus, heavy

log = structlog.get_logger(__name__)


def deadline_s() -> float:
    return liveness.HEARTBEAT_INTERVAL_S * liveness.MISSED_BEATS


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
        step=snapshot.job_step(job_id, node=node_name),
        plan=enqueue_planning,
    )
    return decision.pk


async def sweep(redis: aioredis.Redis, now_s: float | None = None) -> list[int]:
    """One pass: every node silent past the deadline becomes a failure, once."""
    now_s = time.time() if now_s is None else now_s
    decided = []
    for job_id, node, last_heard_s in await liveness.silent(redis, now_s, deadline_s()):
        # forget first: a second detector running the same pass finds nothing to report
        removed = await redis.zrem(liveness.seen_key(job_id), node)
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
        if decision is not None:
            decided.append(decision)
    return decided


# Seconds between looks for decisions a lost task left behind (tasks.requeue_overdue).
OVERDUE_PERIOD_S = 5.0


async def run(period_s: float | None = None) -> None:
    """Sweep forever, four times a heartbeat interval unless told otherwise; every few seconds
    also re-queue what a broker or worker restart left behind."""
    period_s = period_s or liveness.HEARTBEAT_INTERVAL_S / 4
    redis = liveness.client()
    next_overdue = 0.0
    try:
        while True:
            try:
                await sweep(redis)
            except RedisError as exc:  # Redis restarting: the deadline waits for it
                log.warning("detector.redis_lost", error=str(exc))
            if time.monotonic() >= next_overdue:
                try:
                    await database_sync_to_async(requeue_overdue)()
                except DatabaseError as exc:  # the next period tries again
                    log.warning("detector.overdue_failed", error=str(exc))
                next_overdue = time.monotonic() + OVERDUE_PERIOD_S
            await asyncio.sleep(period_s)
    finally:
        await redis.aclose()
