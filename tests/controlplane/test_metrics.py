"""GET /metrics: Prometheus text with the control plane's figures, read from Redis and the DB."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import time
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlplane.incidents import decisions
from controlplane.incidents.models import FailureSource
from controlplane.jobs import liveness
from controlplane.jobs.services import create_job

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []


def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


async def beats(job_id: int, lags_s: list[float], *, forget: bool = False) -> None:
    """Heartbeats through a server process's writer, each sent ``lag`` seconds before now."""
    redis = liveness.client()
    writer = liveness.Writer(redis)
    try:
        for lag in lags_s:
            now = time.time()
            writer.beat(job_id, "node-0", now, '{"step": 1}', now - lag, 1)
        if forget:
            writer.forget(job_id, "node-0")
        while writer.flushing is not None:
            await asyncio.sleep(0.005)
    finally:
        await redis.aclose()


def test_metrics_count_heartbeats_failures_latency_planning_and_decisions(client: Client) -> None:
    before = scrape(client)
    job, _ = create_job("metered", copy.deepcopy(SCENARIO), approval_mode="manual")
    asyncio.run(beats(job.pk, [0.0, 0.04, 0.04, 0.4, 3.0]))
    _, decision = decisions.record_failure(
        job,
        kind="crash",
        devices=[2],
        source=FailureSource.AGENT,
        occurred_at=timezone.now() - dt.timedelta(seconds=0.5),
    )
    decisions.plan(decision.pk)
    after = scrape(client)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("pitstop_heartbeats_total") == 5
    lag = "pitstop_heartbeat_ingest_lag_seconds"
    assert grew(f"{lag}_count") == 5
    # measured when written (the writer lingers a few ms), in cumulative buckets
    assert grew(f"{lag}_bucket", (("le", "0.001"),)) == 0
    assert grew(f"{lag}_bucket", (("le", "0.03"),)) == 1
    assert grew(f"{lag}_bucket", (("le", "0.05"),)) == 3
    assert grew(f"{lag}_bucket", (("le", "2.0"),)) == 4
    assert grew(f"{lag}_bucket", (("le", "+Inf"),)) == 5
    assert 3.48 <= grew(f"{lag}_sum") < 3.7
    assert after[("pitstop_connected_nodes", ())] >= 1
    assert grew("pitstop_failures_total", (("kind", "crash"), ("source", "agent"))) == 1
    assert grew("pitstop_detection_latency_seconds_count") == 1
    assert 0.5 <= grew("pitstop_detection_latency_seconds_sum") < 5
    assert grew("pitstop_planning_seconds_count") == 1
    assert grew("pitstop_planning_seconds_sum") > 0
    assert after[("pitstop_decisions", (("status", "proposed"),))] >= 1
    asyncio.run(beats(job.pk, [], forget=True))
    assert (
        scrape(client)[("pitstop_connected_nodes", ())]
        == after[("pitstop_connected_nodes", ())] - 1
    )
