"""Webhooks told when a decision needs someone, against a real HTTP receiver on loopback: one
row a decision, event and address, written with the decision and sent after its commit (the
decision never waits on a receiver); delivered once, however often it is tried; tried again
while the receiver fails."""

from __future__ import annotations

import copy
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from controlplane.incidents import decisions, notifications
from controlplane.incidents.models import DecisionStatus, FailureSource, Notification
from controlplane.incidents.tasks import notify
from controlplane.jobs.services import create_job
from tests.controlplane.test_api import SCENARIO

pytestmark = pytest.mark.django_db


class Receiver:
    """An HTTP server on loopback that answers ``statuses`` in turn (then 200) and keeps every
    JSON body it was posted."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.bodies: list[dict[str, Any]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                receiver.bodies.append(json.loads(self.rfile.read(length)))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings: Any) -> Iterator[Receiver]:
    running = Receiver([])
    settings.PITSTOP_WEBHOOK_URLS = [running.url]
    settings.PITSTOP_PUBLIC_URL = "https://pitstop.example"
    try:
        yield running
    finally:
        running.close()


def planned(
    mode: str, sent: list[int], policies: tuple[str, ...] = ("dynamic",), spares: int = 2
) -> int:
    scenario = copy.deepcopy(SCENARIO)
    scenario["cluster"]["spares"] = spares
    job, _ = create_job(
        f"job-{mode}", scenario, approval_mode=mode, enabled_policies=list(policies)
    )
    _, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now()
    )
    decisions.plan(decision.pk, notify=sent.append)
    return decision.pk


def test_a_proposal_waiting_for_approval_is_announced_after_its_commit_and_delivered_once(
    receiver: Receiver, django_capture_on_commit_callbacks: Any
) -> None:
    sent: list[int] = []
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        decision = planned("manual_with_timeout", sent)
        assert sent == []  # written with the decision, sent only once it is committed
    assert len(callbacks) >= 1
    (row,) = Notification.objects.filter(decision_id=decision)
    assert sent == [row.pk] and (row.event, row.url) == ("proposed", receiver.url)
    assert notifications.deliver(row.pk) is True
    assert notifications.deliver(row.pk) is True  # a second run: nothing posted again
    (body,) = receiver.bodies
    assert body["event"] == "proposed" and body["decision"]["id"] == decision
    assert body["decision"]["proposed"] == "dynamic" and body["decision"]["deadline_at"]
    assert body["url"] == f"https://pitstop.example/recoveries/{decision}/"
    assert body["text"].startswith(f"job-manual_with_timeout: recovery #{decision} (crash of")
    assert "waits for approval" in body["text"] and body["url"] in body["text"]
    row.refresh_from_db()
    assert row.delivered_at is not None and row.attempts == 1 and row.last_error == ""


def test_an_automatic_decision_needs_nobody_and_a_failed_one_is_announced(
    receiver: Receiver,
) -> None:
    sent: list[int] = []
    planned("auto", sent)
    assert not Notification.objects.exists()
    # spares only, and none: nothing can recover the job, someone has to look
    failed = planned("manual", sent, policies=("flashrecovery",), spares=0)
    assert decisions.RecoveryDecision.objects.get(pk=failed).status == DecisionStatus.FAILED
    (row,) = Notification.objects.all()
    assert row.decision_id == failed and row.event == "failed" and notifications.deliver(row.pk)
    assert "failed: no policy can recover the job" in receiver.bodies[-1]["text"]


def test_a_failing_receiver_is_tried_again_until_it_takes_the_notification(
    receiver: Receiver,
) -> None:
    receiver.statuses = [500, 503]
    sent: list[int] = []
    planned("manual", sent)
    (row,) = Notification.objects.all()
    assert notifications.deliver(row.pk) is False
    row.refresh_from_db()
    assert (row.attempts, row.last_error, row.delivered_at) == (1, "HTTP 500", None)
    # the task retries (eagerly here: Celery runs the retries at once in place of waiting)
    assert notify.apply(args=(row.pk,)).get() is True
    row.refresh_from_db()
    assert row.attempts == 3 and row.delivered_at is not None
    assert len(receiver.bodies) == 3  # two refused, one taken; none after


def test_an_unreachable_receiver_fails_the_attempt_and_keeps_the_reason(settings: Any) -> None:
    closed = Receiver([])
    closed.close()  # its port no longer listens
    settings.PITSTOP_WEBHOOK_URLS = [closed.url]
    sent: list[int] = []
    decision = planned("manual", sent)
    assert decisions.RecoveryDecision.objects.get(pk=decision).status == DecisionStatus.PROPOSED
    (row,) = Notification.objects.all()
    assert notifications.deliver(row.pk) is False
    row.refresh_from_db()
    assert row.attempts == 1 and "refused" in row.last_error.lower()
