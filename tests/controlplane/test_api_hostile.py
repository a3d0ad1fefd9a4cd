"""Hostile requests get a coded 4xx, never a 500: ids and filters out of range, impossible dates,
unknown kinds, numbers beyond a float; a job's live picture stays finite JSON whatever finite
values its nodes report."""

from __future__ import annotations

import copy
import json
import math
import time
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.jobs import liveness, snapshot
from controlplane.jobs.services import create_job

from .test_api import SCENARIO, client_as, post, proposed

pytestmark = pytest.mark.django_db

HUGE = "9" * 5000  # over Python's 4,300-digit limit for int()


def _bad_gets(job: int, decision: int) -> list[str]:
    return [
        "/api/v1/failures/?job=²",
        f"/api/v1/recoveries/?job={HUGE}",
        "/api/v1/nodes/?job=99999999999999999999",
        f"/api/v1/jobs/{HUGE}/",
        "/api/v1/recoveries/99999999999999999999/",
        f"/api/v1/jobs/{job}/timeline/?since=2026-02-30T00:00:00Z",
        f"/api/v1/jobs/{job}/timeline/?since=2026-13-01T00:00:00Z",
        f"/api/v1/recoveries/{decision}/timeline/?until=2026-02-01T25:00:00Z",
    ]


def test_ids_filters_and_dates_out_of_range_are_coded_errors() -> None:
    decision = proposed()
    viewer = client_as("viewer")
    for url in _bad_gets(decision.job_id, decision.pk):
        response = viewer.get(url)
        assert response.status_code in (400, 404), url
        assert response.json()["code"] in ("invalid", "not_found"), url


def test_options_on_a_csv_timeline_is_answered() -> None:
    decision = proposed()
    response = client_as("viewer").options(f"/api/v1/jobs/{decision.job_id}/timeline/?format=csv")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "name" in response.content.decode()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"devices": [1], "kind": "meteor"}, "kind"),
        ({"devices": [10**30]}, "devices"),
        ({"devices": list(range(70_000))}, "devices"),
    ],
)
def test_what_if_with_an_unknown_kind_or_devices_out_of_range_is_a_400(
    body: dict[str, Any], field: str
) -> None:
    decision = proposed()
    response = post(client_as("viewer"), f"/api/v1/jobs/{decision.job_id}/what-if/", body)
    assert response.status_code == 400
    assert response.json()["field"].split(".")[0] == field


@pytest.mark.parametrize(
    ("raw", "field"),
    [('"seeds": 1e400', "seeds"), ('"base_seed": 1e400', "base_seed"),
     ('"base_seed": 99999999999999999999999', "base_seed")],
)  # fmt: skip
def test_a_simulation_with_numbers_beyond_range_is_a_400(raw: str, field: str) -> None:
    decision = proposed()
    body = f'{{"job": {decision.job_id}, "policies": ["dynamic"], {raw}}}'
    response = client_as("operator").post(
        "/api/v1/simulations/", body, content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["field"] == field


def test_the_policies_list_and_a_null_chooser_agree_with_the_schema() -> None:
    schema = client_as("viewer").get("/api/v1/schema/?format=json").json()
    ok = schema["paths"]["/api/v1/policies/"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"]["type"] == "array"
    recovery = schema["components"]["schemas"]["Recovery"]["properties"]
    assert recovery["chosen_by"].get("nullable") is True
    listing = schema["paths"]["/api/v1/recoveries/"]["get"]
    assert {"job", "status"} <= {p["name"] for p in listing["parameters"]}
    timeline = schema["paths"]["/api/v1/jobs/{id}/timeline/"]["get"]
    assert {"since", "until"} <= {p["name"] for p in timeline["parameters"]}
    assert {"400", "403", "404"} <= set(timeline["responses"])
    assert "409" in schema["paths"]["/api/v1/recoveries/{id}/approve/"]["post"]["responses"]
    assert "503" in schema["paths"]["/api/v1/jobs/{id}/live/"]["get"]["responses"]


# --- the live picture ------------------------------------------------------------------------

FINITE = st.floats(allow_nan=False, allow_infinity=False)


def _frames(job_id: int, reports: list[tuple[float, float, float]]) -> None:
    """Latest heartbeats as the server's writer leaves them: (loss, samples/s, step time)."""
    redis = liveness.sync_client()
    now = time.time()
    pipe = redis.pipeline()
    pipe.delete(liveness.seen_key(job_id), liveness.frames_key(job_id))
    pipe.delete(snapshot.snapshot_key(job_id), f"{snapshot.snapshot_key(job_id)}:last")
    for i, (loss, rate, step_time) in enumerate(reports):
        node = f"node-{i}"
        frame = {"step": i, "loss": loss, "samples_per_s": rate, "step_time_s": step_time}
        pipe.zadd(liveness.seen_key(job_id), {node: now})
        pipe.hset(liveness.frames_key(job_id), node, json.dumps(frame))
    pipe.execute()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reports=st.lists(st.tuples(FINITE, FINITE, FINITE), min_size=1, max_size=5))
def test_the_live_picture_of_any_finite_reports_is_finite_and_within_them(
    reports: list[tuple[float, float, float]],
) -> None:
    _frames(10_000, reports)
    built = snapshot.build(liveness.sync_client(), 10_000)
    json.dumps(built, allow_nan=False)  # raises on inf or NaN
    for name, i in (("loss", 0), ("step_time_s", 2)):
        values = [r[i] for r in reports]
        assert min(values) <= built[name] <= max(values), name
    assert math.isfinite(built["samples_per_s"])


def test_two_nodes_reporting_huge_values_leave_live_answering() -> None:
    job, _ = create_job("huge", copy.deepcopy(SCENARIO))
    _frames(job.pk, [(1e308, 1e308, 1e308), (1e308, 1e308, 1e308)])
    response = client_as("viewer").get(f"/api/v1/jobs/{job.pk}/live/")
    assert response.status_code == 200
    assert response.json()["loss"] == 1e308 and response.json()["step_time_s"] == 1e308
    assert Client().get(f"/api/v1/jobs/{job.pk}/live/").status_code == 403


def test_an_api_url_no_route_matches_is_a_coded_json_404() -> None:
    response = client_as("viewer").get("/api/v1/recoveries/0.15/timeline/")
    assert response.status_code == 404 and response.json()["code"] == "not_found"
    assert "text/html" in Client().get("/no-such-page/")["Content-Type"]
