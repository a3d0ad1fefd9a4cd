"""Celery tasks of incidents: thin wrappers around ``decisions``, safe to run twice.

Tasks are acknowledged late and rejected when their worker dies, so a worker killed mid-task
leaves its message to another worker; ``decisions`` makes a second run harmless. The broker
gives a dead worker's message back only after its visibility timeout, so a worker planning a
decision also holds a short lease on it in Redis (``planning_lease``): a lease that lapses while
the decision is still planning means its worker is gone, and ``requeue_orphaned`` queues the
planning again at once instead of after ``requeue_overdue``'s 30 s.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

# The project's app, not shared_task's current one: a process that enqueues (the ASGI server,
# the detector) may never have loaded it, and would publish to Celery's default broker.
from controlplane.bridge import collector_paused
from controlplane.celery import app
from controlplane.incidents import applying, decisions, notifications
from controlplane.incidents.models import DecisionStatus, RecoveryDecision
from controlplane.jobs import liveness

log = structlog.get_logger(__name__)

# A planning worker's lease on its decision lapses this long after the worker stops renewing it
# (killed, frozen); it renews four times a lease.
PLANNING_LEASE_S = 2.0
PLANNING_KEY = f"{liveness.PREFIX}:planning"  # the decisions a worker took, for requeue_orphaned


def planning_lease_key(decision_id: int) -> str:
    """Who plans the decision (``host:pid``), while its lease lasts."""
    return f"{PLANNING_KEY}:{decision_id}"


@contextmanager
def planning_lease(decision_id: int) -> Iterator[None]:
    """Hold the decision's planning lease while the block runs, renewed by a thread. Without
    Redis the block runs all the same; ``requeue_overdue`` is then the fallback."""
    redis = liveness.sync_client()
    key, ttl_ms = planning_lease_key(decision_id), int(PLANNING_LEASE_S * 1000)
    done = threading.Event()

    def renew() -> None:
        while not done.wait(PLANNING_LEASE_S / 4):
            try:
                redis.pexpire(key, ttl_ms)
            except RedisError as exc:
                log.warning("planning.lease_lost", decision=decision_id, error=str(exc))

    try:
        # the lease first, then the mark: a marked decision without a lease has lost its worker
        redis.set(key, f"{socket.gethostname()}:{os.getpid()}", px=ttl_ms)
        redis.sadd(PLANNING_KEY, decision_id)
    except RedisError as exc:
        log.warning("planning.lease_failed", decision=decision_id, error=str(exc))
    renewer = threading.Thread(target=renew, name=f"lease-{decision_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        done.set()
        renewer.join()
        try:
            redis.srem(PLANNING_KEY, decision_id)
            redis.delete(key)
        except RedisError as exc:
            log.warning("planning.lease_release_failed", decision=decision_id, error=str(exc))


@app.task(acks_late=True, reject_on_worker_lost=True, name="incidents.plan_recovery")
def plan_recovery(decision_id: int) -> str:
    """Plan a decision with the core; returns its status afterwards. Python's garbage collector
    is paused meanwhile: reading and writing the job's and the candidates' plans is most of the
    task's objects at 16,384 devices, beside the core's own (``recovery/collector.py``)."""
    with planning_lease(decision_id), collector_paused():
        return decisions.plan(
            decision_id, schedule_timeout=schedule_deadline, notify=enqueue_notification
        )


@app.task(acks_late=True, reject_on_worker_lost=True, name="incidents.apply_after_deadline")
def apply_after_deadline(decision_id: int) -> str:
    """``manual_with_timeout``: apply the proposal once its deadline has passed."""
    with collector_paused():
        return decisions.apply_after_deadline(decision_id)


@app.task(ignore_result=True, name="incidents.ready_planner")
def ready_planner(job_id: int) -> bool:
    """Ready the planner of this worker process for the job (``decisions.ready``): a job that
    starts running, or whose scenario its script's profile changed."""
    with collector_paused():
        return decisions.ready(job_id)


def enqueue_readying(job_id: int) -> None:
    """Hand the job's readying to a worker; lost with the broker down (its first failure is
    then planned cold, as it was before readying)."""
    try:
        ready_planner.delay(job_id)
    except (OperationalError, RedisError, OSError) as exc:
        log.warning("planner.ready_enqueue_failed", job=job_id, error=str(exc))


# A webhook that keeps failing is tried this many times more, waiting 1, 2, 4 ... 60 s between.
NOTIFY_RETRIES = 10


@app.task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    name="incidents.notify",
    max_retries=NOTIFY_RETRIES,
)
def notify(self: Any, notification_id: int) -> bool:
    """Deliver a notification to its webhook, again later while the receiver fails."""
    if notifications.deliver(notification_id):
        return True
    raise self.retry(countdown=min(2**self.request.retries, 60))


def enqueue_notification(notification_id: int) -> None:
    try:
        notify.delay(notification_id)
    except (OperationalError, RedisError, OSError) as exc:
        log.warning("notification.enqueue_failed", notification=notification_id, error=str(exc))


def schedule_deadline(decision_id: int, delay_s: float) -> None:
    apply_after_deadline.apply_async((decision_id,), countdown=delay_s)


def warm_publishing() -> None:
    """Pay now what a serving process's first ``delay`` would pay when the first failure is
    recorded: the result backend's import (an entry-point scan) and the broker's connection.
    Measured with Redis on loopback: the first publish 72 ms cold, 14 ms after this, 2–8 ms
    later. A broker that is down is left to the first real publish, which
    ``enqueue_planning`` survives."""
    try:
        app.backend  # noqa: B018 (a property that loads the backend)
        with app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=1)
    except (OperationalError, RedisError, OSError) as exc:
        log.warning("planning.warm_failed", error=str(exc))


def enqueue_planning(decision_id: int) -> None:
    """Hand a decision to the planners; with the broker down, ``requeue_overdue`` retries it."""
    try:
        plan_recovery.delay(decision_id)
    except (OperationalError, RedisError, OSError) as exc:
        log.warning("planning.enqueue_failed", decision=decision_id, error=str(exc))


def requeue_orphaned() -> list[int]:
    """Queue again the planning of every decision whose worker took it and let its lease lapse
    (the worker died or froze) while it is still planning; returns their ids. Each lapse is
    claimed once (``SREM``), so two callers re-queue a decision once; a frozen worker that wakes
    finds the decision planned and leaves it (``decisions.plan``). Raises ``RedisError``."""
    redis = liveness.sync_client()
    marked = [int(d) for d in redis.smembers(PLANNING_KEY)]
    if not marked:
        return []
    leases = redis.mget([planning_lease_key(d) for d in marked])
    lapsed = [d for d, holder in zip(marked, leases, strict=True) if holder is None]
    if not lapsed:
        return []
    planning = set(
        RecoveryDecision.objects.filter(pk__in=lapsed, status=DecisionStatus.PLANNING).values_list(
            "pk", flat=True
        )
    )
    orphaned = []
    for decision_id in lapsed:
        if redis.srem(PLANNING_KEY, decision_id) and decision_id in planning:
            log.warning("planning.orphaned", decision=decision_id)
            enqueue_planning(decision_id)
            orphaned.append(decision_id)
    return orphaned


def requeue_overdue(*, planning_after_s: float = 30.0) -> tuple[list[int], list[str]]:
    """Nothing is lost to a broker, worker or Redis restart: decisions planning for longer than
    ``planning_after_s`` are queued again (planning twice is harmless), proposals past their
    deadline are applied now, commands still unacknowledged are sent again and decisions whose
    agents stay silent too long fail. Returns the re-queued ids and the deadlines' outcomes."""
    stuck, late = decisions.overdue(planning_after_s=planning_after_s)
    for decision_id in stuck:
        enqueue_planning(decision_id)
    outcomes = [decisions.apply_after_deadline(d) for d in late]
    applying.resend()
    applying.expire()
    return stuck, outcomes
