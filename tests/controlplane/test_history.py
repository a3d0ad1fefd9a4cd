"""A job's training history on the server: a point per live job every period from its
snapshot, old points merged two into one so that a job never holds more than its bound, and
the REST API that pages read it from."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import itertools

import pytest
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.jobs import history, liveness, snapshot
from controlplane.jobs.models import Job, JobStatus, MetricPoint
from controlplane.jobs.services import create_job
from tests.controlplane.test_api import SCENARIO, client_as
from tests.controlplane.test_live import beat

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


def fresh_job(name: str, status: str = JobStatus.RUNNING) -> Job:
    job, _ = create_job(name, copy.deepcopy(SCENARIO))
    Job.objects.filter(pk=job.pk).update(status=status)
    key = snapshot.snapshot_key(job.pk)  # a job id of an earlier test run may have left these
    stale = (liveness.seen_key(job.pk), liveness.frames_key(job.pk), key, f"{key}:last")
    liveness.sync_client().delete(*stale)
    return job


def test_a_point_is_written_for_each_live_job_that_reports_a_step() -> None:
    training, silent = fresh_job("training"), fresh_job("silent")
    stopped = fresh_job("stopped", JobStatus.STOPPED)
    for job in (training, stopped):
        asyncio.run(beat(job.pk, [("node-0", 40, ["training"] * 4)]))
    assert history.record_live(liveness.sync_client(), T0) == 1
    (point,) = MetricPoint.objects.all()
    assert (point.job_id, point.at, point.step) == (training.pk, T0, 40)
    # the test_live helper's node reports loss 2 + step / 100 and step time 1 + step / 1000
    assert point.loss == pytest.approx(2.4) and point.step_time_s == pytest.approx(1.04)
    assert point.samples_per_s == pytest.approx(10.0)
    assert not MetricPoint.objects.filter(job__in=[silent, stopped]).exists()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gaps=st.lists(st.floats(0.5, 30.0), min_size=1, max_size=120), most=st.integers(4, 40))
def test_a_jobs_history_stays_bounded_and_still_covers_the_whole_run(
    gaps: list[float], most: int
) -> None:
    job = fresh_job(f"bounded-{Job.objects.count()}")
    at, steps = T0, []
    for i, gap in enumerate(gaps):
        at += dt.timedelta(seconds=gap)
        steps.append(i)
        MetricPoint.objects.create(job=job, at=at, step=i, loss=float(i), step_time_s=1.0)
        history.compact(job.pk, most)
        assert MetricPoint.objects.filter(job=job).count() <= most
    kept = list(MetricPoint.objects.filter(job=job).order_by("at"))
    assert kept[0].at == T0 + dt.timedelta(seconds=gaps[0]), "the run's start is kept"
    assert kept[-1].at == at and kept[-1].step == steps[-1], "and its latest point"
    # the points tile the run: each ends (at + span) where the next begins, or before
    for earlier, later in itertools.pairwise(kept):
        assert earlier.at + dt.timedelta(seconds=earlier.span_s) <= later.at
        assert (earlier.step or 0) < (later.step or 0)
    assert all(p.step_time_s == pytest.approx(1.0) for p in kept)  # means of equal values
    losses = [p.loss for p in kept if p.loss is not None]
    assert len(losses) == len(kept) and 0 <= min(losses) <= max(losses) <= len(gaps) - 1


def test_two_points_merge_into_their_means_over_both_spans() -> None:
    job = fresh_job("merge")
    a = MetricPoint(job=job, at=T0, span_s=0, step=10, loss=2.0, samples_per_s=None,
                    step_time_s=1.0)  # fmt: skip
    b = MetricPoint(job=job, at=T0 + dt.timedelta(seconds=4), span_s=2.0, step=12, loss=1.0,
                    samples_per_s=8.0, step_time_s=3.0)  # fmt: skip
    one = history.merged([a, b])
    assert (one.at, one.span_s, one.step) == (T0, 6.0, 12)
    assert (one.loss, one.samples_per_s, one.step_time_s) == (1.5, 8.0, 2.0)


def test_the_api_gives_the_history_oldest_first_from_a_time() -> None:
    job = fresh_job("api-history")
    for i in range(5):
        MetricPoint.objects.create(job=job, at=T0 + dt.timedelta(seconds=2 * i), step=i, loss=1.0)
    url = f"/api/v1/jobs/{job.pk}/metrics/"
    viewer = client_as("viewer")
    every = viewer.get(url).json()
    assert [p["step"] for p in every] == [0, 1, 2, 3, 4]
    assert set(every[0]) == {"at", "span_s", "step", "loss", "samples_per_s", "step_time_s"}
    since = (T0 + dt.timedelta(seconds=5)).isoformat()
    assert [p["step"] for p in viewer.get(url, {"since": since}).json()] == [3, 4]
    assert viewer.get(url, {"since": "yesterday"}).status_code == 400
    assert Client().get(url).status_code in (401, 403)
    assert viewer.get(f"/api/v1/jobs/{job.pk + 1000}/metrics/").status_code == 404
    assert timezone.is_aware(dt.datetime.fromisoformat(every[0]["at"].replace("Z", "+00:00")))
