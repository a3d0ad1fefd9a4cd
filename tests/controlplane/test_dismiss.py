"""An operator dismisses a false alarm: ``POST /api/v1/recoveries/{id}/dismiss/`` with a reason
ends the decision ``dismissed`` on its timeline and puts the devices back without a recovery."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from controlplane.api import views as api_views
from controlplane.incidents import decisions
from controlplane.incidents.models import (
    AgentCommand,
    DecisionStatus,
    EventKind,
    RecoveryDecision,
)
from controlplane.jobs import detector, liveness
from controlplane.jobs.models import Device, DeviceState, Job, JobStatus, Node, NodeStatus
from tests.controlplane.test_api import client_as, post, proposed, user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def patient_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat deadline of a minute: a node heard at the start of a test is still heard at
    its end on a slow, busy machine."""
    monkeypatch.setattr(liveness, "MISSED_BEATS", 60)


def heard(decision: RecoveryDecision, *, ago_s: float = 0.0) -> str:
    """The failed device's node as its agent's last heartbeat left it in Redis, ``ago_s``
    seconds ago; the node's name."""
    node = Device.objects.get(job=decision.job, index=decision.failure.devices[0]).node
    liveness.sync_client().zadd(
        liveness.seen_key(decision.job_id), {node.name: time.time() - ago_s}
    )
    return node.name


def url(decision: RecoveryDecision) -> str:
    return f"/api/v1/recoveries/{decision.pk}/dismiss/"


@pytest.mark.parametrize(("role", "code"), [("viewer", 403), ("operator", 200)])
def test_only_operators_dismiss_and_the_devices_come_back_without_a_recovery(
    role: str, code: int
) -> None:
    decision = proposed()
    name = heard(decision)
    Node.objects.filter(job=decision.job, name=name).update(status=NodeStatus.FAILED)
    client = client_as(role)
    response = post(client, url(decision), {"reason": "the control plane stalled"})
    assert response.status_code == code
    after = RecoveryDecision.objects.select_related("job").get(pk=decision.pk)
    device = Device.objects.get(job=decision.job, index=5)
    node = Node.objects.get(job=decision.job, name=name)
    if code == 403:
        assert response.json()["code"] == "permission_denied"
        assert after.status == DecisionStatus.PROPOSED
        assert (device.state, node.status) == (DeviceState.FAILED, NodeStatus.FAILED)
        return
    body = response.json()
    assert (body["status"], body["reason"]) == ("dismissed", "the control plane stalled")
    assert after.job.status == JobStatus.RUNNING
    assert RecoveryDecision.objects.filter(job=decision.job).count() == 1  # nothing re-planned
    assert (device.state, node.status) == (DeviceState.HEALTHY, NodeStatus.HEALTHY)
    assert not AgentCommand.objects.filter(decision=after).exists()  # nothing applied
    event = after.events.get(kind=EventKind.DISMISSED)
    assert after.chosen_by is not None and event.actor == after.chosen_by.get_username()
    assert event.payload == {
        "from": "proposed",
        "reason": "the control plane stalled",
        "devices_back": [5],
        "devices_down": [],
    }
    timeline = client.get(f"/api/v1/recoveries/{decision.pk}/timeline/?format=json").json()
    assert "dismissed" in [e["kind"] for e in timeline["results"]]


@pytest.mark.parametrize("data", [{}, {"reason": ""}])
def test_a_dismissal_needs_a_reason(data: dict[str, str]) -> None:
    decision = proposed()
    heard(decision)
    response = post(client_as("operator"), url(decision), data)
    assert response.status_code == 400
    assert response.json()["field"] == "reason"
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.PROPOSED
    assert Device.objects.get(job=decision.job, index=5).state == DeviceState.FAILED


def test_a_decision_being_applied_cannot_be_dismissed() -> None:
    decision = proposed()
    heard(decision)
    client = client_as("operator")
    assert post(client, f"/api/v1/recoveries/{decision.pk}/approve/", {}).status_code == 200
    response = post(client, url(decision), {"reason": "too late"})
    assert (response.status_code, response.json()["code"]) == (409, "illegal_transition")
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.APPLYING
    assert not RecoveryDecision.objects.get(pk=decision.pk).events.filter(kind="dismissed")


def test_a_decision_still_planning_is_dismissed_and_the_silent_nodes_failure_undone(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    """The detector's failure of a node whose agent is heard again: the node and its devices
    are back; the crash the dismissed decision took over is planned for anew, so the job does
    not wait in ``recovering`` with nothing planning."""
    queued: list[int] = []
    monkeypatch.setattr(api_views, "enqueue_planning", queued.append)
    decision = proposed()
    job = decision.job
    node = Device.objects.get(job=job, index=5).node
    spare_node = Node.objects.exclude(pk=node.pk).get(job=job)
    liveness.sync_client().zadd(liveness.seen_key(job.pk), {spare_node.name: time.time()})
    detector._silent_node(job.pk, spare_node.name, time.time() - 10)  # supersedes, plans anew
    planning = RecoveryDecision.objects.get(job=job, status=DecisionStatus.PLANNING)
    with django_capture_on_commit_callbacks(execute=True):
        response = post(client_as("operator"), url(planning), {"reason": "its agent beats"})
    assert response.status_code == 200 and response.json()["status"] == "dismissed"
    spares = Device.objects.filter(node=spare_node)
    assert set(spares.values_list("state", flat=True)) == {DeviceState.SPARE}
    assert Node.objects.get(pk=spare_node.pk).status == NodeStatus.HEALTHY
    event = planning.events.get(kind=EventKind.DISMISSED)
    back = sorted(spares.values_list("index", flat=True))
    assert (event.payload["devices_back"], event.payload["devices_down"]) == (back, [])
    # device 5, of the decision this one superseded, is still down: the job is not running
    assert Device.objects.get(job=job, index=5).state == DeviceState.FAILED
    assert Job.objects.get(pk=job.pk).status == JobStatus.RECOVERING
    # ... and its crash is planned for again, by a new decision handed to the planners
    replan = RecoveryDecision.objects.get(job=job, status=DecisionStatus.PLANNING)
    assert replan.failure_id == decision.failure_id
    assert replan.pk not in (decision.pk, planning.pk) and queued == [replan.pk]
    started = replan.events.get(kind=EventKind.PLANNING_STARTED)
    assert started.payload["replans_after"] == planning.pk


def test_a_node_not_heard_within_the_deadline_stays_failed() -> None:
    decision = proposed()
    name = heard(decision, ago_s=detector.deadline_s() + 1)
    Node.objects.filter(job=decision.job, name=name).update(status=NodeStatus.FAILED)
    dismissed = decisions.dismiss(decision.pk, user=user("operator"), reason="a slow node")
    assert dismissed.status == DecisionStatus.DISMISSED
    assert Device.objects.get(job=decision.job, index=5).state == DeviceState.FAILED
    assert Node.objects.get(job=decision.job, name=name).status == NodeStatus.FAILED


def test_the_schema_documents_dismiss() -> None:
    client = Client()
    client.force_login(user("operator"))
    schema = client.get("/api/v1/schema/?format=json").json()
    operation = schema["paths"]["/api/v1/recoveries/{id}/dismiss/"]["post"]
    assert {"200", "400", "403", "409"} <= set(operation["responses"])
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/Dismiss")
    assert "reason" in schema["components"]["schemas"]["Dismiss"]["required"]
