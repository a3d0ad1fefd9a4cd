"""The state machine's one door: ``transition`` moves a decision, ``record`` appends an event.

Only ``transition`` changes a decision's status. It locks the row, refuses a move ``LEGAL`` does
not list (``IllegalTransition``), writes the timeline event in the same transaction and runs
the caller's notifications only after the commit, so nothing is announced that did not happen.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from django.db import transaction
from django.utils import timezone

from controlplane.incidents.models import (
    DECISION_HEAVY,
    LEGAL,
    DecisionStatus,
    EventKind,
    Failure,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs.models import Job, heavy

log = structlog.get_logger(__name__)

# The event each status is recorded as.
EVENT_OF: dict[str, str] = {
    DecisionStatus.PLANNING: EventKind.PLANNING_STARTED,
    DecisionStatus.PROPOSED: EventKind.PROPOSED,
    DecisionStatus.APPROVED: EventKind.APPROVED,
    DecisionStatus.OVERRIDDEN: EventKind.OVERRIDDEN,
    DecisionStatus.AUTO_APPLIED: EventKind.AUTO_APPLIED,
    DecisionStatus.APPLYING: EventKind.APPLYING,
    DecisionStatus.RECOVERED: EventKind.RECOVERED,
    DecisionStatus.FAILED: EventKind.FAILED,
    DecisionStatus.SUPERSEDED: EventKind.SUPERSEDED,
    DecisionStatus.DISMISSED: EventKind.DISMISSED,
}


class IllegalTransition(Exception):
    """A move the decision's state machine does not allow; ``code`` is stable for the API."""

    code = "illegal_transition"

    def __init__(self, decision: RecoveryDecision, to: str) -> None:
        allowed = ", ".join(sorted(LEGAL[decision.status])) or "none (it is final)"
        super().__init__(
            f"decision {decision.pk} is {decision.status}; it cannot become {to} "
            f"(allowed: {allowed})"
        )
        self.status, self.to = decision.status, to


def record(
    job: Job,
    kind: str,
    *,
    actor: str,
    decision: RecoveryDecision | None = None,
    failure: Failure | None = None,
    at: dt.datetime | None = None,
    **payload: Any,
) -> TimelineEvent:
    """Append one event to the job's timeline."""
    return TimelineEvent.objects.create(
        job=job,
        decision=decision,
        failure=failure,
        kind=kind,
        at=at or timezone.now(),
        actor=actor,
        payload=payload,
    )


def record_each(
    job: Job,
    kind: str,
    payloads: Iterable[dict[str, Any]],
    *,
    actor: str | Callable[[dict[str, Any]], str],
    decision: RecoveryDecision | None = None,
) -> list[TimelineEvent]:
    """Append one event to the job's timeline for each payload, at once (one insert for a
    command to each of 2,048 nodes); ``actor`` may be a function of the payload."""
    now = timezone.now()
    return TimelineEvent.objects.bulk_create(
        TimelineEvent(job=job, decision=decision, kind=kind, at=now,
                      actor=actor(payload) if callable(actor) else actor, payload=payload)
        for payload in payloads
    )  # fmt: skip


def transition(
    decision_id: int,
    to: str,
    *,
    actor: str,
    after_commit: Callable[[RecoveryDecision], None] | None = None,
    payload: dict[str, Any] | None = None,
    **changes: Any,
) -> RecoveryDecision:
    """Move a decision to ``to`` with ``changes`` to its fields, recorded on the timeline.

    The row is locked for the move, so two callers racing for the same decision (an operator's
    approval and the timeout, a worker and its redelivered task) cannot both win: the second
    sees the new status and gets ``IllegalTransition``. ``after_commit`` runs once the move is
    committed.
    """
    # the candidates and the plan are megabytes at 16,384 devices: read only if a caller asks
    unread = [name for name in DECISION_HEAVY if name not in changes]
    with transaction.atomic():
        decision = (
            RecoveryDecision.objects.select_for_update(of=("self",))
            .select_related("job")
            .defer(*heavy("job"), *unread)
            .get(pk=decision_id)
        )
        if to not in LEGAL[decision.status]:
            raise IllegalTransition(decision, to)
        before = decision.status
        decision.status = to
        for field, value in changes.items():
            setattr(decision, field, value)
        # the fields that moved: the candidates and the plan are megabytes at 16,384 devices
        decision.save(update_fields=["status", "updated_at", *changes])
        record(
            decision.job,
            EVENT_OF[to],
            actor=actor,
            decision=decision,
            failure=decision.failure,
            **{"from": before, **(payload or {})},
        )
        if after_commit is not None:
            transaction.on_commit(lambda: after_commit(decision))
    log.info("decision.transition", decision=decision.pk, job=decision.job_id, to=to, actor=actor)
    return decision
