"""A job's and a decision's plan are stored packed (``PlanField``) and read back as the plan."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection, models
from django.db.models import Value

from controlplane.demo import scale_scenario
from controlplane.jobs.models import Job
from controlplane.jobs.services import create_job

pytestmark = pytest.mark.django_db


def stored(job: Job) -> Any:
    """The plan's column as the database holds it, decoded from its JSON text."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT plan FROM {Job._meta.db_table} WHERE id = %s", [job.pk])
        (text,) = cursor.fetchone()
    return json.loads(text) if isinstance(text, str) else text


def test_a_16384_device_plan_is_stored_in_a_kilobyte_and_read_back_whole() -> None:
    scenario = scale_scenario(2048)
    job, _ = create_job("packed", scenario)
    kept = stored(job)
    assert isinstance(kept, str) and len(kept) < 1_024
    assert len(json.dumps(scenario["plan"])) > 500 * len(kept)
    assert Job.objects.get(pk=job.pk).plan == scenario["plan"]
    assert Job.objects.values_list("plan", flat=True).get(pk=job.pk) == scenario["plan"]
    # each read its own object: changing one changes no other
    first, second = Job.objects.get(pk=job.pk), Job.objects.get(pk=job.pk)
    first.plan["pipelines"].pop()
    assert second.plan == scenario["plan"]


def test_a_plan_stored_as_its_object_before_is_read_as_it_is() -> None:
    scenario = scale_scenario(2)
    job, _ = create_job("unpacked", scenario)
    Job.objects.filter(pk=job.pk).update(plan=Value(scenario["plan"], models.JSONField()))
    assert stored(job) == scenario["plan"]
    assert Job.objects.get(pk=job.pk).plan == scenario["plan"]
    Job.objects.filter(pk=job.pk).update(plan=Value("not a plan", models.JSONField()))
    assert Job.objects.get(pk=job.pk).plan == "not a plan"


@pytest.mark.parametrize("odd", [{}, {"pipelines": [1]}, {"pipelines": [{"stages": [7]}]}])
def test_an_object_that_is_no_plan_is_kept_as_it_is(odd: dict[str, Any]) -> None:
    job, _ = create_job("odd", scale_scenario(2))
    Job.objects.filter(pk=job.pk).update(plan=odd)
    assert Job.objects.get(pk=job.pk).plan == odd
