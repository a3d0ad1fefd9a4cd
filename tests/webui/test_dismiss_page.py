"""The recovery page's Dismiss button: operators only, a reason required, the decision dismissed
and its devices back."""

from __future__ import annotations

import re
import time

import pytest
from django.test import Client

from controlplane.incidents.models import DecisionStatus, RecoveryDecision
from controlplane.jobs import liveness
from controlplane.jobs.models import Device, DeviceState
from tests.controlplane.test_api import client_as, proposed, user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def patient_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node heard at the start of a test is still heard at its end on a busy machine."""
    monkeypatch.setattr(liveness, "MISSED_BEATS", 60)


def test_a_viewer_sees_no_dismiss_button_and_cannot_dismiss() -> None:
    decision = proposed("manual")
    viewer = client_as("viewer")
    page = viewer.get(f"/recoveries/{decision.pk}/").content.decode()
    assert 'id="dismiss"' not in page and "dismissing needs the operator role" in page
    response = viewer.post(f"/recoveries/{decision.pk}/dismiss/", {"reason": "x"})
    assert response.status_code == 403
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.PROPOSED


def test_an_operator_dismisses_with_a_reason_and_the_devices_come_back() -> None:
    decision = proposed("manual")
    node = Device.objects.get(job=decision.job, index=5).node
    liveness.sync_client().zadd(liveness.seen_key(decision.job_id), {node.name: time.time()})
    operator = Client(enforce_csrf_checks=True)
    operator.force_login(user("operator"))
    page = operator.get(f"/recoveries/{decision.pk}/").content.decode()
    assert 'id="approve"' in page and 'id="override"' in page and 'id="dismiss"' in page
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    url = f"/recoveries/{decision.pk}/dismiss/"
    blank = operator.post(url, {"reason": " ", "csrfmiddlewaretoken": token[1]})
    assert blank.status_code == 400 and 'id="dismiss-error"' in blank.content.decode()
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.PROPOSED
    done = operator.post(url, {"reason": "a stalled detector", "csrfmiddlewaretoken": token[1]})
    assert done.status_code == 302
    after = RecoveryDecision.objects.get(pk=decision.pk)
    assert (after.status, after.reason) == (DecisionStatus.DISMISSED, "a stalled detector")
    assert Device.objects.get(job=decision.job, index=5).state == DeviceState.HEALTHY
    page = operator.get(f"/recoveries/{decision.pk}/").content.decode()
    assert 'id="dismiss"' not in page and "dismissed" in page
    again = operator.post(url, {"reason": "twice", "csrfmiddlewaretoken": token[1]})
    assert again.status_code == 409


def test_a_decision_to_grow_says_so_and_its_dismiss_keeps_the_running_plan() -> None:
    decision = proposed("manual")
    operator = client_as("operator")
    page = operator.get(f"/recoveries/{decision.pk}/").content.decode()
    assert 'id="grows"' not in page and "a false alarm, nothing to recover" in page
    RecoveryDecision.objects.filter(pk=decision.pk).update(grows=True)
    page = operator.get(f"/recoveries/{decision.pk}/").content.decode()
    assert 'id="grows"' in page and "Growing back" in page
    assert "Dismiss: keep the running plan" in page and "false alarm" not in page
