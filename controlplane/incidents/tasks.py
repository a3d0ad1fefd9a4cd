"""Celery tasks of incidents: thin wrappers around ``decisions``, safe to run twice.

Tasks are acknowledged late and rejected when their worker dies, so a worker killed mid-task
leaves its message to another worker; ``decisions`` makes a second run harmless.
"""

from __future__ import annotations

from celery import shared_task

from controlplane.incidents import decisions


@shared_task(acks_late=True, reject_on_worker_lost=True, name="incidents.plan_recovery")
def plan_recovery(decision_id: int) -> str:
    """Plan a decision with the core; returns its status afterwards."""
    return decisions.plan(decision_id, schedule_timeout=schedule_deadline)


@shared_task(acks_late=True, reject_on_worker_lost=True, name="incidents.apply_after_deadline")
def apply_after_deadline(decision_id: int) -> str:
    """``manual_with_timeout``: apply the proposal once its deadline has passed."""
    return decisions.apply_after_deadline(decision_id)


def schedule_deadline(decision_id: int, delay_s: float) -> None:
    apply_after_deadline.apply_async((decision_id,), countdown=delay_s)


def enqueue_planning(decision_id: int) -> None:
    plan_recovery.delay(decision_id)
