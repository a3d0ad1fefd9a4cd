"""A job's training history on the server: step, loss, throughput and step time, downsampled
and bounded per job, so that the dashboard draws the run however long ago the page was opened.

The detector's loop calls ``record_live`` every ``PERIOD_S``: one point per live job that has a
step, from its snapshot (``jobs/snapshot.py``, shared with the dashboard's readers). When a job
has more than ``MAX_POINTS``, its oldest half is merged two points into one (means of the
values, the later step, the spans added): the last minutes stay at full resolution, older
hours coarser, the whole run always there, and a job never holds more than ``MAX_POINTS``.
"""

from __future__ import annotations

import datetime as dt
import statistics
from typing import Any

import redis
from django.db import transaction
from django.utils import timezone

from controlplane.jobs import snapshot
from controlplane.jobs.models import LIVE_JOB, Job, MetricPoint

PERIOD_S = 2.0
MAX_POINTS = 2000
VALUES = ("loss", "samples_per_s", "step_time_s")


def record_live(client: redis.Redis, now: dt.datetime | None = None) -> int:
    """A point for every live job whose nodes report a step; how many were written."""
    now = now or timezone.now()
    written = 0
    for job_id in Job.objects.filter(status__in=LIVE_JOB).values_list("pk", flat=True):
        found = snapshot.latest(client, job_id)
        if found.get("step") is None:
            continue
        MetricPoint.objects.create(
            job_id=job_id, at=now, step=found["step"], **{v: found.get(v) for v in VALUES}
        )
        written += 1
        compact(job_id)
    return written


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def merged(pair: list[MetricPoint]) -> MetricPoint:
    """Two neighbouring points as one: from the first's time over both spans."""
    first, last = pair[0], pair[-1]
    span = (last.at - first.at).total_seconds() + last.span_s
    steps = [p.step for p in pair if p.step is not None]
    return MetricPoint(
        job_id=first.job_id,
        at=first.at,
        span_s=span,
        step=max(steps) if steps else None,
        **{v: _mean([getattr(p, v) for p in pair]) for v in VALUES},
    )


def compact(job_id: int, most: int = MAX_POINTS) -> int:
    """Merge the oldest half of the job's points two into one while it has more than
    ``most``; how many points it removed."""
    count = MetricPoint.objects.filter(job_id=job_id).count()
    if count <= most:
        return 0
    with transaction.atomic():
        oldest = list(MetricPoint.objects.filter(job_id=job_id).order_by("at", "pk")[: count // 2])
        pairs = [oldest[i : i + 2] for i in range(0, len(oldest), 2)]
        MetricPoint.objects.filter(pk__in=[p.pk for p in oldest]).delete()
        MetricPoint.objects.bulk_create([merged(pair) for pair in pairs])
    return len(oldest) - len(pairs)


def points(job_id: int, since: dt.datetime | None = None) -> list[dict[str, Any]]:
    """The job's history oldest first, from ``since`` when given."""
    found = MetricPoint.objects.filter(job_id=job_id)
    if since is not None:
        found = found.filter(at__gte=since)
    return list(found.order_by("at", "pk").values("at", "span_s", "step", *VALUES))
