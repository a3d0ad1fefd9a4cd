"""Telling someone a decision needs them: webhooks (``PITSTOP_WEBHOOK_URLS``).

A proposal that waits for an operator (``manual``, ``manual_with_timeout``) and a decision that
failed (no policy can recover the job with the devices it has) are announced to every webhook:
``announce`` writes one ``Notification`` row per address in the transaction that made the
decision so, and hands the rows to the workers after the commit; nothing waits on a receiver.
The ``notify`` task posts the JSON (``body``: the event, the job, the decision, a link, and a
one-line ``text`` that Slack's incoming webhooks show as it is) and is retried with backoff
while the receiver fails or cannot be reached. A row delivered is never posted again, however
often its task runs (a redelivered message, a retry after a lost answer): one delivery a
decision, event and address.
"""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from controlplane.incidents.models import Notification, RecoveryDecision

log = structlog.get_logger(__name__)

# Seconds a receiver has to answer one delivery.
TIMEOUT_S = 5.0
PROPOSED = "proposed"
FAILED = "failed"


def announce(
    decision: RecoveryDecision,
    event: str,
    *,
    send: Callable[[int], None],
    urls: Sequence[str] | None = None,
) -> list[Notification]:
    """One notification of ``event`` for each webhook (``urls``, else the deployment's), sent
    with ``send`` (its id) after the commit. Call inside the transaction that made the
    decision so."""
    rows = [
        Notification.objects.get_or_create(decision=decision, event=event, url=url)[0]
        for url in (settings.PITSTOP_WEBHOOK_URLS if urls is None else urls)
    ]
    for row in rows:
        if row.delivered_at is None:
            transaction.on_commit(functools.partial(send, row.pk))
    return rows


def body(notification: Notification) -> dict[str, Any]:
    """What the webhook receives: the event, the job, the decision and its link, and ``text``,
    one line for people (Slack's incoming webhooks post it as it is)."""
    decision = notification.decision
    job = decision.job
    link = settings.PITSTOP_PUBLIC_URL.rstrip("/") + reverse("webui:recovery", args=[decision.pk])
    chosen = None
    if decision.chosen is not None and decision.candidates:
        chosen = decision.candidates[decision.chosen].get("policy")
    failure = decision.failure
    what = f"{failure.kind} of device{'s' * (len(failure.devices) != 1)} " + ", ".join(
        map(str, failure.devices)
    )
    if notification.event == PROPOSED:
        text = (
            f"{job.name}: recovery #{decision.pk} ({what}) proposes {chosen} and waits for approval"
        )
        if decision.deadline_at is not None:
            text += f" (applied at {decision.deadline_at:%H:%M:%S} UTC if nobody decides)"
    else:
        text = f"{job.name}: recovery #{decision.pk} ({what}) failed: {decision.reason}"
    return {
        "text": f"{text}: {link}",
        "event": notification.event,
        "job": {"id": job.pk, "name": job.name, "status": job.status},
        "decision": {
            "id": decision.pk,
            "status": decision.status,
            "proposed": chosen,
            "deadline_at": decision.deadline_at.isoformat() if decision.deadline_at else None,
            "grows": decision.grows,
        },
        "failure": {"kind": failure.kind, "devices": failure.devices},
        "url": link,
    }


def deliver(notification_id: int) -> bool:
    """Post the notification unless it was delivered; whether it is delivered now. A receiver
    that answers other than 2xx, or not at all within ``TIMEOUT_S``, is an attempt that
    failed (counted, its error kept)."""
    row = Notification.objects.select_related("decision__job", "decision__failure").get(
        pk=notification_id
    )
    if row.delivered_at is not None:
        return True
    request = urllib.request.Request(
        row.url,
        data=json.dumps(body(row)).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "pitstop"},
        method="POST",
    )
    error = ""
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        status, error = 0, str(getattr(exc, "reason", exc))
    ok = 200 <= status < 300
    Notification.objects.filter(pk=row.pk).update(
        attempts=row.attempts + 1,
        last_error="" if ok else error[:2000],
        delivered_at=timezone.now() if ok else None,
    )
    log.info("notification.sent" if ok else "notification.failed", notification=row.pk,
             decision=row.decision_id, on=row.event, error=error)  # fmt: skip
    return ok
