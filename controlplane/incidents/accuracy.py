"""How right the cost model was: each recovery's estimated transition and step time beside the
measured ones, and a job's running error.

- *Transition*: estimated, the chosen candidate's transition (detect, search, transfer,
  restart, lost work); measured, the recovery's phases without the wait for an operator, which
  the model does not count (detect + plan + transfer + restart + first step: from the fault to
  every agent's first step under the new plan).
- *Step time*: estimated, the chosen candidate's; measured, the job's live step time (the
  nodes' median, ``jobs/snapshot.py``) ``SETTLE_S`` after the recovery, unless a later failure
  came first.

``measure_settled`` runs in the detector's loop every few seconds (``jobs/detector.py``) and
writes ``RecoveryDecision.accuracy`` once. An edited plan has no estimate: it is not measured.
"""

from __future__ import annotations

import datetime as dt
import statistics
from typing import Any

import redis
import structlog
from django.utils import timezone

from controlplane.incidents.models import DecisionStatus, RecoveryDecision
from controlplane.incidents.phases import phases
from controlplane.jobs import liveness, snapshot

log = structlog.get_logger(__name__)

SETTLE_S = 10.0  # a recovery's step time is read this long after it recovered
MISSED_AFTER_S = 600.0  # a recovery not measured by then (no detector running) is left
UNMODELLED = frozenset({"approve"})  # the phases the cost model does not estimate
METRICS = ("transition_s", "step_time_s")


def estimates(decision: RecoveryDecision) -> dict[str, float] | None:
    """The chosen candidate's estimated transition and step time; None for an edited plan."""
    answer, chosen = decision.decision or {}, decision.chosen
    if chosen is None or chosen >= len(answer.get("candidates", [])):
        return None
    candidate = answer["candidates"][chosen]
    total = (candidate.get("transition") or {}).get("total_s")
    step = candidate.get("est_step_time_s")
    if total is None or step is None:
        return None
    return {"transition_s": float(total), "step_time_s": float(step)}


def measured_transition(decision: RecoveryDecision) -> float | None:
    """The seconds from the fault to every agent's first step, less the wait for an operator;
    None until every phase has ended."""
    found = [
        p for p in phases(decision, list(decision.events.all())) if p["phase"] not in UNMODELLED
    ]
    if any(p["seconds"] is None for p in found):
        return None
    return float(sum(p["seconds"] for p in found))


def measure(decision: RecoveryDecision, client: redis.Redis, now: dt.datetime) -> dict[str, Any]:
    """The decision's accuracy record, measured now."""
    estimated = estimates(decision) or {}
    later = RecoveryDecision.objects.filter(
        job_id=decision.job_id, created_at__gt=decision.created_at
    ).exists()
    step = None if later else snapshot.latest(client, decision.job_id).get("step_time_s")
    record: dict[str, Any] = {
        "transition_s": {
            "estimated": estimated.get("transition_s"),
            "measured": measured_transition(decision),
        },
        "step_time_s": {"estimated": estimated.get("step_time_s"), "measured": step},
        "measured_at": now.isoformat(),
    }
    if later:
        record["note"] = "a later failure came before the step time settled"
    return record


def measure_settled(now: dt.datetime | None = None) -> list[int]:
    """Measure every recovery that recovered ``SETTLE_S`` ago and has no record yet; the ids."""
    now = now or timezone.now()
    due = RecoveryDecision.objects.filter(
        status=DecisionStatus.RECOVERED,
        accuracy__isnull=True,
        chosen__isnull=False,
        updated_at__lte=now - dt.timedelta(seconds=SETTLE_S),
        updated_at__gte=now - dt.timedelta(seconds=MISSED_AFTER_S),
    ).select_related("failure")
    client = liveness.sync_client()
    done = []
    for decision in due:
        record = measure(decision, client, now)
        # updated_at too: the dashboard's socket sees the change and the pages draw it
        RecoveryDecision.objects.filter(pk=decision.pk, accuracy__isnull=True).update(
            accuracy=record, updated_at=now
        )
        log.info("recovery.measured", decision=decision.pk, job=decision.job_id, **{
            m: record[m] for m in METRICS
        })  # fmt: skip
        done.append(decision.pk)
    return done


def error(record: dict[str, Any], metric: str) -> float | None:
    """(measured - estimated) / estimated: above 0, it took longer than the model said."""
    pair = record.get(metric) or {}
    estimated, measured = pair.get("estimated"), pair.get("measured")
    if estimated is None or measured is None or estimated <= 0:
        return None
    return float(measured) / float(estimated) - 1


def running_error(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Over a job's measured recoveries, each metric's median error, mean absolute error and
    count (metrics without a measurement left out)."""
    out = {}
    for metric in METRICS:
        errors = [e for r in records if (e := error(r, metric)) is not None]
        if errors:
            out[metric] = {
                "median": statistics.median(errors),
                "mean_abs": statistics.fmean(abs(e) for e in errors),
                "n": len(errors),
            }
    return out
