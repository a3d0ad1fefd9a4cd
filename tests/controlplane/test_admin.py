"""The admin lists every model in a fixed number of queries, however many rows there are."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from controlplane.incidents import decisions, tasks
from controlplane.incidents.models import (
    AgentCommand,
    DecisionStatus,
    Drill,
    FailureSource,
    RecoveryDecision,
)
from controlplane.jobs.models import Job, NodeStatus
from controlplane.jobs.services import create_job

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []

PAGES = [
    "jobs/job",
    "jobs/node",
    "jobs/device",
    "jobs/agenttoken",
    "incidents/failure",
    "incidents/recoverydecision",
    "incidents/agentcommand",
    "incidents/drill",
    "incidents/timelineevent",
]


def jobs_with_decisions(count: int) -> None:
    for i in range(count):
        job, _ = create_job(
            f"job-{Job.objects.count()}", copy.deepcopy(SCENARIO), approval_mode="manual"
        )
        job.nodes.update(status=NodeStatus.HEALTHY)  # as if every agent had said hello
        _, decision = decisions.record_failure(
            job,
            kind="crash",
            devices=[i % 8],
            source=FailureSource.HEARTBEAT,
            occurred_at=timezone.now(),
        )
        # planned by the Celery task, run in this process
        assert tasks.plan_recovery.apply((decision.pk,)).get() == DecisionStatus.PROPOSED
        node = job.nodes.first()
        assert node is not None
        Drill.objects.create(job=job, node=node, kind="kill", device=0, requested_by="user:olga")
        if i % 2:  # half of them approved: their plan is being sent to the agents
            operator = User.objects.get_or_create(username="olga")[0]
            decisions.approve(decision.pk, user=operator)
    applying = Job.objects.filter(decisions__status=DecisionStatus.APPLYING)
    assert AgentCommand.objects.count() == sum(job.nodes.count() for job in applying)


@pytest.mark.parametrize("page", PAGES)
def test_admin_lists_take_the_same_queries_for_2_and_6_jobs(
    page: str, client: Client, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    client.force_login(User.objects.create_superuser("root", password="x"))
    jobs_with_decisions(2)
    with django_assert_max_num_queries(12) as few:
        assert client.get(f"/admin/{page}/").status_code == 200
    jobs_with_decisions(4)
    with django_assert_max_num_queries(len(few.captured_queries)) as many:
        assert client.get(f"/admin/{page}/").status_code == 200
    assert len(many.captured_queries) == len(few.captured_queries), "no query per row"


def test_decisions_cannot_be_edited_in_the_admin(client: Client) -> None:
    client.force_login(User.objects.create_superuser("root", password="x"))
    jobs_with_decisions(1)
    decision = RecoveryDecision.objects.get()
    page = client.get(f"/admin/incidents/recoverydecision/{decision.pk}/change/")
    assert page.status_code == 200 and b'name="status"' not in page.content
    assert client.get("/admin/incidents/timelineevent/add/").status_code == 403
