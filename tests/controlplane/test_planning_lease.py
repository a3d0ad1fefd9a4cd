"""A worker planning a decision holds a lease on it in Redis (``tasks.planning_lease``); a
decision still planning whose lease lapsed lost its worker and is queued again at once
(``tasks.requeue_orphaned``), once, and only while it is still planning."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from controlplane.celery import app as celery_app
from controlplane.incidents import decisions, tasks
from controlplane.incidents.models import DecisionStatus, RecoveryDecision
from controlplane.jobs import liveness
from controlplane.jobs.models import ApprovalMode

from .test_decisions import fail, new_job, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_marks() -> Iterator[None]:
    liveness.sync_client().delete(tasks.PLANNING_KEY)
    yield
    liveness.sync_client().delete(tasks.PLANNING_KEY)


@pytest.fixture
def eager() -> Iterator[None]:
    """The re-queued task runs here; a real worker killed mid-plan is in
    tests/e2e/test_orphaned_planning.py."""
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


def planning() -> RecoveryDecision:
    _, decision = fail(new_job(ApprovalMode.MANUAL), 3)
    assert decision.status == DecisionStatus.PLANNING
    return decision


def test_the_worker_holds_the_lease_while_it_plans_and_renews_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks, "PLANNING_LEASE_S", 0.4)
    redis = liveness.sync_client()
    key = tasks.planning_lease_key(41)
    with tasks.planning_lease(41):
        time.sleep(1.0)  # more than twice the lease: only the renewals keep it
        assert redis.get(key) == f"{socket.gethostname()}:{os.getpid()}".encode()
        assert 0 < redis.pttl(key) <= 400
        assert redis.sismember(tasks.PLANNING_KEY, "41")
        assert tasks.requeue_orphaned() == []  # alive: nothing to do
    assert redis.get(key) is None and not redis.sismember(tasks.PLANNING_KEY, "41")


def test_a_decision_whose_lease_lapsed_is_planned_again_once(eager: None) -> None:
    decision = planning()
    redis = liveness.sync_client()
    # what a worker killed mid-plan leaves: the mark, and a lease that lapsed
    redis.sadd(tasks.PLANNING_KEY, decision.pk)
    assert tasks.requeue_orphaned() == [decision.pk]
    assert reload(decision).status == DecisionStatus.PROPOSED
    assert tasks.requeue_orphaned() == []  # claimed once
    proposals = reload(decision).events.filter(kind="proposed").count()
    assert proposals == 1


def test_a_lapsed_lease_of_a_decision_no_longer_planning_is_only_forgotten(eager: None) -> None:
    decision = planning()
    decisions.plan(decision.pk)  # the worker finished, then died before it let go
    redis = liveness.sync_client()
    redis.sadd(tasks.PLANNING_KEY, decision.pk)
    assert tasks.requeue_orphaned() == []
    assert not redis.sismember(tasks.PLANNING_KEY, str(decision.pk))
    assert reload(decision).events.filter(kind="proposed").count() == 1


def test_a_held_lease_keeps_its_decision_from_being_queued_again(eager: None) -> None:
    decision = planning()
    redis = liveness.sync_client()
    redis.set(tasks.planning_lease_key(decision.pk), "elsewhere:1", px=60_000)
    redis.sadd(tasks.PLANNING_KEY, decision.pk)
    try:
        assert tasks.requeue_orphaned() == []
        assert reload(decision).status == DecisionStatus.PLANNING
        redis.delete(tasks.planning_lease_key(decision.pk))  # its worker died
        assert tasks.requeue_orphaned() == [decision.pk]
    finally:
        redis.delete(tasks.planning_lease_key(decision.pk))


def test_a_serving_process_connects_to_the_broker_before_its_first_publish(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """``warm_publishing`` (started with the ASGI application) leaves a connected producer in
    the pool, so the first failure's ``delay`` does not pay the connection."""
    fresh = Celery(
        "warm", broker=settings.CELERY_BROKER_URL, backend=settings.CELERY_RESULT_BACKEND
    )
    with fresh.producer_or_acquire() as producer:
        assert not producer.connection.connected  # kombu connects on first use
    monkeypatch.setattr(tasks, "app", fresh)
    tasks.warm_publishing()
    with fresh.producer_or_acquire() as producer:
        assert producer.connection.connected


def test_warming_with_the_broker_down_is_left_to_the_first_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    nowhere = f"redis://127.0.0.1:{port}/0"
    monkeypatch.setattr(tasks, "app", Celery("down", broker=nowhere, backend=nowhere))
    started = time.monotonic()
    tasks.warm_publishing()  # logs planning.warm_failed, raises nothing
    assert time.monotonic() - started < 10


def test_a_worker_plans_with_the_garbage_collector_off_and_turns_it_on_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planning task makes millions of objects at 16,384 devices, and collections walking
    them were 45 % of its time; the collector is back on afterwards, also when planning fails,
    and a collector someone had turned off stays off."""
    import gc

    decision = planning()
    seen: list[bool] = []

    def plan(decision_id: int, **_: Any) -> str:
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise RuntimeError("the planner failed")
        return DecisionStatus.PROPOSED

    monkeypatch.setattr(decisions, "plan", plan)
    assert gc.isenabled()
    assert tasks.plan_recovery.apply((decision.pk,)).get() == DecisionStatus.PROPOSED
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        tasks.plan_recovery.apply((decision.pk,)).get()
    assert gc.isenabled()
    gc.disable()
    try:
        tasks.plan_recovery.apply((decision.pk,)).get()
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False, False]
