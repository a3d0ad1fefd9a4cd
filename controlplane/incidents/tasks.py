"""Celery tasks of incidents: thin wrappers around ``decisions``, safe to run twice.

Tasks are acknowledged late and rejected when their worker dies, so a worker killed mid-task
leaves its message to another worker; ``decisions`` makes a second run harmless.
"""

from __future__ import annotations

import structlog
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

# The project's app, not shared_task's current one: a process that enqueues (the ASGI server,
# the detector) may never have loaded it, and would publish to Celery's default broker.
from controlplane.celery import app
from controlplane.incidents import applying, decisions

log = structlog.get_logger(__name__)


@app.task(acks_late=True, reject_on_worker_lost=True, name="incidents.plan_recovery")
def plan_recovery(decision_id: int) -> str:
    """Plan a decision with the core; returns its status afterwards."""
    return decisions.plan(decision_id, schedule_timeout=schedule_deadline)


@app.task(acks_late=True, reject_on_worker_lost=True, name="incidents.apply_after_deadline")
def apply_after_deadline(decision_id: int) -> str:
    """``manual_with_timeout``: apply the proposal once its deadline has passed."""
    return decisions.apply_after_deadline(decision_id)


def schedule_deadline(decision_id: int, delay_s: float) -> None:
    apply_after_deadline.apply_async((decision_id,), countdown=delay_s)


def enqueue_planning(decision_id: int) -> None:
    """Hand a decision to the planners; with the broker down, ``requeue_overdue`` retries it."""
    try:
        plan_recovery.delay(decision_id)
    except (OperationalError, RedisError, OSError) as exc:
        log.warning("planning.enqueue_failed", decision=decision_id, error=str(exc))


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
