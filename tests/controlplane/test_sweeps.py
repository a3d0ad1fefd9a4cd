"""Simulation sweeps over the REST API: started by operators, cut into one Celery task a piece,
merged by a chord into the simulator's own summary; bad experiments are 400s naming the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from controlplane.jobs.services import create_job
from controlplane.recovery.codec import scenario_from_dict
from controlplane.recovery.simulator import Experiment, TraceSpec, run
from controlplane.simulations.models import Sweep, SweepStatus

from .test_api import SCENARIO, client_as, post

# The chord runs in this process: here the point is the pieces and the merge; a real worker
# runs one in tests/e2e/test_sweep_workers.py.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("eager_planning")]

EXPERIMENT = {
    "hours": 4,
    "policies": ["odyssey", "checkpoint"],
    "seeds": 3,
    "base_seed": 7,
    "trace": {"failure_rate_per_device_hour": 0.05, "repair_hours": 1},
}


def test_an_operator_sweeps_a_jobs_scenario_and_gets_the_simulators_summary(
    tmp_path: Path, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    job, _ = create_job("llama", copy.deepcopy(SCENARIO))
    operator = client_as("operator")
    with django_capture_on_commit_callbacks(execute=True):
        response = post(operator, "/api/v1/simulations/", {"job": job.pk, **EXPERIMENT})
    assert response.status_code == 202, response.json()
    started = response.json()
    assert started["pieces_total"] == 3 * 3  # two policies and the ideal, three seeds
    shown = client_as("viewer").get(f"/api/v1/simulations/{started['id']}/").json()
    assert (shown["status"], shown["progress"], shown["error"]) == ("done", 1.0, "")
    assert shown["workers"] and shown["duration_s"] >= 0
    summary = shown["summary"]
    curves = summary.pop("curves")
    assert set(curves["samples"]) == {"odyssey", "checkpoint", "ideal"}
    # the same experiment in one process, through the simulator's own command
    state = scenario_from_dict(SCENARIO).state
    alone = Experiment(
        hours=4,
        policies=("odyssey", "checkpoint"),
        trace=TraceSpec(failure_rate_per_device_hour=0.05, repair_hours=1),
        seeds=3,
        base_seed=7,
    )
    assert summary == run(state, alone, out_dir=tmp_path, report=False)
    listed = client_as("viewer").get("/api/v1/simulations/").json()
    assert [s["id"] for s in listed["results"]] == [started["id"]]
    assert "summary" not in listed["results"][0]  # the list stays light


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"policies": ["gremlins"]}, "policies"),
        ({"policies": []}, "policies"),
        ({"seeds": 0}, "seeds"),
        ({"hours": -1}, "hours"),
        ({"trace": {"burst_prob": 3}}, "trace.burst_prob"),
        ({"trace": {"colour": "red"}}, "trace.colour"),
        ({"options": {"oobleck": {"f": "many"}}, "policies": ["oobleck"]}, "f"),
        ({"scenario": SCENARIO}, "job"),  # a job and a scenario both
        ({"job": 999}, "job"),
        ({"trace_csv": "time_s,devices\n60,99\n", "trace": {}}, "trace_csv"),  # no device 99
        ({"trace_csv": "time_s,devices\n60,1\n", "trace": {"burst_prob": 0.1}}, "trace"),
    ],
)
def test_bad_experiments_are_400s_naming_the_field_and_start_nothing(
    change: dict[str, Any], field: str
) -> None:
    job, _ = create_job("llama", copy.deepcopy(SCENARIO))
    response = post(
        client_as("operator"), "/api/v1/simulations/", {"job": job.pk, **EXPERIMENT, **change}
    )
    assert response.status_code == 400, response.json()
    assert field in (response.json()["field"] or ""), response.json()
    assert not Sweep.objects.exists()


def test_viewers_read_sweeps_but_only_operators_start_them() -> None:
    body = {"scenario": SCENARIO, **EXPERIMENT, "seeds": 1}
    assert post(client_as("viewer"), "/api/v1/simulations/", body).status_code == 403
    assert post(Client(), "/api/v1/simulations/", body).status_code in (401, 403)
    assert not Sweep.objects.exists()
    response = post(client_as("admin"), "/api/v1/simulations/", body)
    assert response.status_code == 202
    sweep = Sweep.objects.get()
    assert sweep.status == SweepStatus.QUEUED  # handed to the workers only after the commit
