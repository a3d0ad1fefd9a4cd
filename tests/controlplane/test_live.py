"""A job's live picture: read from Redis, aggregated, and rebuilt at most twice a second however
many clients ask; every request's log events carry its request id."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
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


async def beat(job_id: int, beats: list[tuple[str, int, list[str]]]) -> None:
    """Heartbeats through a server process's writer: (node, step, device states)."""
    redis = liveness.client()
    writer = liveness.Writer(redis)
    try:
        for node, step, states in beats:
            first = int(node.split("-")[1]) * 4
            devices = [{"device": first + i, "state": s} for i, s in enumerate(states)]
            metrics: dict[str, Any] = {"step": step, "loss": 2.0 + step / 100,
                                       "samples_per_s": 10.0, "step_time_s": 1.0 + step / 1000,
                                       "devices": devices}  # fmt: skip
            now = time.time()
            writer.beat(job_id, node, now, json.dumps(metrics), now, step)
        while writer.flushing is not None:
            await asyncio.sleep(0.005)
    finally:
        await redis.aclose()


def test_the_live_picture_aggregates_the_nodes_and_is_rebuilt_at_most_twice_a_second() -> None:
    job, _ = create_job("live", copy.deepcopy(SCENARIO))
    asyncio.run(
        beat(job.pk, [("node-0", 10, ["training"] * 4), ("node-1", 12, ["training", "failed"])])
    )
    viewer = client_as("viewer")
    live = viewer.get(f"/api/v1/jobs/{job.pk}/live/").json()
    assert live["nodes_connected"] == 2 and live["step"] == 12
    assert live["device_states"] == {"training": 5, "failed": 1}
    assert live["samples_per_s"] == 20.0 and live["loss"] == pytest.approx(2.11)
    assert {n["node"]: n["step"] for n in live["nodes"]} == {"node-0": 10, "node-1": 12}
    asyncio.run(beat(job.pk, [("node-0", 13, ["training"] * 4)]))
    again = viewer.get(f"/api/v1/jobs/{job.pk}/live/").json()
    assert again == live  # cached: a second client in the same half second costs nothing
    time.sleep(snapshot.MAX_AGE_S + 0.05)
    fresh = viewer.get(f"/api/v1/jobs/{job.pk}/live/").json()
    assert fresh["step"] == 13 and fresh["at"] > live["at"]
    assert Client().get(f"/api/v1/jobs/{job.pk}/live/").status_code in (401, 403)
    assert viewer.get("/api/v1/jobs/999999/live/").status_code == 404
    asyncio.run(_forget(job.pk))


async def _forget(job_id: int) -> None:
    redis = liveness.client()
    writer = liveness.Writer(redis)
    for node in ("node-0", "node-1"):
        writer.forget(job_id, node)
    await writer.settle()
    await redis.aclose()


def test_every_log_event_of_a_request_carries_its_id(caplog: pytest.LogCaptureFixture) -> None:
    decision = proposed()
    operator = client_as("operator")
    caplog.clear()  # the planning above logged outside any request
    with caplog.at_level(logging.INFO):
        response = operator.post(
            f"/api/v1/recoveries/{decision.pk}/approve/",
            json.dumps({"reason": "ok"}),
            content_type="application/json",
            headers={"X-Request-ID": "req-42"},
        )
    assert response.status_code == 200 and response["X-Request-ID"] == "req-42"
    moves = [r.msg for r in caplog.records if isinstance(r.msg, dict)
             and r.msg.get("event") == "decision.transition"]  # fmt: skip
    assert moves and all(m["request_id"] == "req-42" for m in moves)
    assert all(m["path"].endswith("/approve/") and m["decision"] == decision.pk for m in moves)
    made_up = post(operator, "/api/v1/policies/", {})  # a 405, still answered with an id
    assert len(made_up["X-Request-ID"]) == 32
    too_long = Client().get("/healthz", headers={"X-Request-ID": "x" * 65})
    assert too_long["X-Request-ID"] != "x" * 65


def test_settling_waits_for_the_beats_queued_not_for_a_stream_that_never_stops() -> None:
    async def scenario() -> None:
        redis = liveness.client()
        writer = liveness.Writer(redis)
        streaming = True

        async def stream() -> None:  # another socket's beats, without a pause
            while streaming:
                now = time.time()
                writer.beat(999_999, "node-busy", now, "{}", now, None)
                await asyncio.sleep(0)

        other = asyncio.create_task(stream())
        try:
            await asyncio.sleep(0.05)
            now = time.time()
            writer.beat(999_999, "node-new", now, '{"step": 1}', now, 1)
            await asyncio.wait_for(writer.settle(), timeout=10)
            assert not other.done()  # settled while the stream went on
            assert await liveness.latest(redis, 999_999, "node-new") is not None
        finally:
            streaming = False
            await other
            writer.forget(999_999, "node-busy")
            writer.forget(999_999, "node-new")
            await writer.settle()
            await redis.aclose()

    asyncio.run(scenario())


NODES = ("node-0", "node-1", "node-2")
# a node's heartbeat with its step, one without (a hello's), or the node forgotten (lost, left)
BEATS = st.tuples(st.sampled_from(NODES), st.none() | st.integers(0, 2**53 - 1) | st.just("gone"))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rounds=st.lists(st.lists(BEATS, max_size=5), min_size=1, max_size=4),
    known=st.none() | st.integers(0, 2**53 - 1),
)
def test_the_job_step_is_the_highest_of_the_nodes_latest_steps(
    rounds: list[list[tuple[str, int | str | None]]], known: int | None
) -> None:
    """``job_step`` reads one key, kept by the writer: whatever the beats and losses, in
    whatever batches, it is the highest step of the nodes' latest heartbeats, or ``known``."""
    job_id = 999_998
    latest: dict[str, int] = {}  # the reference: each node's latest step, while it has one

    async def scenario() -> None:
        redis = liveness.client()
        writer = liveness.Writer(redis)
        try:
            for batch in rounds:
                for node, step in batch:
                    if step == "gone":
                        writer.forget(job_id, node)
                        latest.pop(node, None)
                        continue
                    assert not isinstance(step, str)
                    now = time.time()
                    frame = "{}" if step is None else json.dumps({"step": step})
                    writer.beat(job_id, node, now, frame, now, step)
                    if step is None:
                        latest.pop(node, None)
                    else:
                        latest[node] = step
                await writer.settle()
                expected = max([*latest.values(), *([known] if known is not None else [])],
                               default=None)  # fmt: skip
                assert await asyncio.to_thread(snapshot.job_step, job_id, known=known) == expected
        finally:
            keys = (liveness.seen_key(job_id), liveness.frames_key(job_id),
                    liveness.steps_key(job_id))  # fmt: skip
            await redis.delete(*keys)
            await redis.srem(liveness.JOBS_KEY, job_id)
            await redis.aclose()

    asyncio.run(scenario())
