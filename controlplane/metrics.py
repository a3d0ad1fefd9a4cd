"""``GET /metrics``: Prometheus metrics of the whole control plane, read at scrape time.

Every figure comes from the shared stores, not from one process's memory, so several ASGI
servers, Celery workers and the detector report one consistent picture: heartbeats and
connected nodes from Redis, failures, detection latency, planning time and decisions from the
database.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

import redis
from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Sum
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from controlplane.incidents.models import (
    DecisionStatus,
    EventKind,
    Failure,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs import liveness
from controlplane.jobs.detector import STALL_REASONS, STALLS_KEY
from controlplane.jobs.models import LIVE_JOB, Node, NodeStatus

# Planning and recovery times are taken over the most recent ones, so a scrape stays cheap.
PLANNING_WINDOW = 1000
RECOVERY_WINDOW = 1000


class ControlPlaneCollector(Collector):
    def collect(self) -> Iterator[Any]:
        yield from self._redis()
        yield from self._database()

    def _redis(self) -> Iterator[Any]:
        client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        try:
            beats = int(client.get(liveness.BEATS_KEY) or 0)
            jobs = client.smembers(liveness.JOBS_KEY)
            connected = sum(int(client.zcard(liveness.seen_key(int(job)))) for job in jobs)
            buckets, lag_sum = liveness.lag_histogram(client)
            stalls = client.hgetall(STALLS_KEY)
        finally:
            client.close()
        yield CounterMetricFamily(
            "pitstop_heartbeats", "heartbeats received from agents", value=beats
        )
        yield HistogramMetricFamily(
            "pitstop_heartbeat_ingest_lag_seconds",
            "from an agent sending a heartbeat (its clock) to the heartbeat written in Redis",
            buckets=buckets,
            sum_value=lag_sum,
        )
        yield GaugeMetricFamily(
            "pitstop_connected_nodes", "nodes whose agent is connected and watched", value=connected
        )
        held = CounterMetricFamily(
            "pitstop_detector_stalls",
            "detector passes held off because its own view was behind, by reason",
            labels=["reason"],
        )
        for reason in STALL_REASONS:
            held.add_metric([reason], int(stalls.get(reason, 0)))
        yield held

    def _database(self) -> Iterator[Any]:
        failures = CounterMetricFamily(
            "pitstop_failures", "failures recorded", labels=["source", "kind"]
        )
        for row in Failure.objects.values("source", "kind").annotate(n=Count("pk")):
            failures.add_metric([row["source"], row["kind"]], row["n"])
        yield failures

        latency = Failure.objects.aggregate(
            n=Count("pk"),
            total=Sum(
                ExpressionWrapper(F("detected_at") - F("occurred_at"), output_field=DurationField())
            ),
        )
        total = latency["total"].total_seconds() if latency["total"] is not None else 0.0
        yield SummaryMetricFamily(
            "pitstop_detection_latency_seconds",
            "from a failure to its detection",
            count_value=latency["n"],
            sum_value=total,
        )

        proposals = TimelineEvent.objects.filter(kind="proposed").order_by("-at")[:PLANNING_WINDOW]
        planning = [float(p["search_time_s"]) for p in proposals.values_list("payload", flat=True)
                    if isinstance(p, dict) and "search_time_s" in p]  # fmt: skip
        yield SummaryMetricFamily(
            "pitstop_planning_seconds",
            f"the core's search time of the last {PLANNING_WINDOW} proposals",
            count_value=len(planning),
            sum_value=sum(planning),
        )

        yield self._recoveries()

        nodes = GaugeMetricFamily(
            "pitstop_nodes",
            "nodes of live jobs by lifecycle status (expected: not yet heard)",
            labels=["status"],
        )
        by_status = dict(
            Node.objects.filter(job__status__in=LIVE_JOB)
            .values_list("status")
            .annotate(n=Count("pk"))
            .order_by()
        )
        for status in NodeStatus.values:
            nodes.add_metric([status], by_status.get(status, 0))
        yield nodes

        decisions = GaugeMetricFamily(
            "pitstop_decisions", "recovery decisions by status", labels=["status"]
        )
        counts = dict(
            RecoveryDecision.objects.values_list("status").annotate(n=Count("pk")).order_by()
        )
        for status in DecisionStatus.values:
            decisions.add_metric([status], counts.get(status, 0))
        yield decisions

    def _recoveries(self) -> SummaryMetricFamily:
        """From each failure to its decision's recovery (every agent training again), by the
        policy of the plan applied ("edited" for an operator's own plan)."""
        by_policy: dict[str, list[float]] = {}
        recovered = TimelineEvent.objects.filter(kind=EventKind.RECOVERED).values_list(
            "at", "decision__failure__occurred_at", "decision__chosen", "decision__decision"
        )
        for at, occurred, chosen, decision in recovered.order_by("-at")[:RECOVERY_WINDOW]:
            policy = "edited"
            if chosen is not None and decision is not None:
                policy = decision["candidates"][chosen]["policy"]
            by_policy.setdefault(policy, []).append((at - occurred).total_seconds())
        family = SummaryMetricFamily(
            "pitstop_recovery_seconds",
            f"from a failure to every agent training again, the last {RECOVERY_WINDOW} recoveries",
            labels=["policy"],
        )
        for policy, seconds in sorted(by_policy.items()):
            family.add_metric([policy], count_value=len(seconds), sum_value=sum(seconds))
        return family


def metrics(request: HttpRequest) -> HttpResponse:
    """The scrape; where ``PITSTOP_METRICS_TOKEN`` is set, only with ``Authorization: Bearer``
    and that token (401 otherwise)."""
    expected = settings.PITSTOP_METRICS_TOKEN
    if expected:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
            refused = HttpResponse(
                "metrics need Authorization: Bearer <PITSTOP_METRICS_TOKEN>\n",
                status=401,
                content_type="text/plain",
            )
            refused["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return refused
    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector())
    return HttpResponse(generate_latest(registry), content_type="text/plain; version=0.0.4")
