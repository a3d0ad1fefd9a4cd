"""The cost model against what happened: a recovery's estimated transition and step time beside
the measured ones, stored once the recovery settled, shown on its page and summed up per job."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from typing import Any

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from controlplane.incidents import accuracy, decisions
from controlplane.incidents.models import DecisionStatus, EventKind, RecoveryDecision
from controlplane.incidents.transitions import record, transition
from controlplane.jobs import liveness, snapshot
from tests.controlplane.test_api import client_as, proposed
from tests.controlplane.test_live import beat

pytestmark = pytest.mark.django_db


def recovered(step_time_s: float | None = 0.25) -> RecoveryDecision:
    """An auto job's decision taken through its agents' stages to recovered, 0.3, 0.2 and 0.1 s
    apart after the plan went out, the job's heartbeats saying ``step_time_s`` (about)."""
    decision = proposed("auto")  # applying
    job = decision.job
    key = snapshot.snapshot_key(job.pk)  # a job id of an earlier test run may have left these
    stale = (liveness.seen_key(job.pk), liveness.frames_key(job.pk), key, f"{key}:last")
    liveness.sync_client().delete(*stale)
    applying = decision.events.get(kind=EventKind.APPLYING).at
    for kind, after in ((EventKind.COMMAND_ACKED, 0.3), (EventKind.RESUMED, 0.5),
                        (EventKind.FIRST_STEP, 0.6)):  # fmt: skip
        record(job, kind, actor="system", decision=decision,
               at=applying + dt.timedelta(seconds=after))  # fmt: skip
    transition(decision.pk, DecisionStatus.RECOVERED, actor="system")
    if step_time_s is not None:  # the test_live helper's nodes report 1 + step / 1000 s
        step = round((step_time_s - 1.0) * 1000)
        asyncio.run(beat(job.pk, [("node-0", step, ["training"] * 4)]))
    return RecoveryDecision.objects.get(pk=decision.pk)


def settle(decision: RecoveryDecision, seconds: float = accuracy.SETTLE_S + 1) -> None:
    before = timezone.now() - dt.timedelta(seconds=seconds)
    RecoveryDecision.objects.filter(pk=decision.pk).update(updated_at=before)


def test_a_settled_recovery_is_measured_once_against_its_estimates() -> None:
    decision = recovered(step_time_s=1.25)
    assert accuracy.measure_settled() == [], "not settled yet"
    settle(decision)
    assert accuracy.measure_settled() == [decision.pk]
    assert accuracy.measure_settled() == [], "measured once"
    stored = RecoveryDecision.objects.get(pk=decision.pk)
    chosen = decision.decision["candidates"][decision.chosen]  # type: ignore[index]
    at = {e.kind: e.at for e in decision.events.all()}
    failure = decision.failure
    # without the wait for an operator: detect, plan, then from the plan sent to the first step
    by_hand = (
        (failure.detected_at - failure.occurred_at)
        + (at[EventKind.PROPOSED] - at[EventKind.PLANNING_STARTED])
        + (at[EventKind.FIRST_STEP] - at[EventKind.APPLYING])
    ).total_seconds()
    record_ = stored.accuracy
    assert record_ is not None
    assert record_["transition_s"] == {
        "estimated": chosen["transition"]["total_s"],
        "measured": pytest.approx(by_hand, abs=1e-6),
    }
    assert record_["step_time_s"] == {"estimated": chosen["est_step_time_s"], "measured": 1.25}
    assert stored.updated_at > decision.updated_at  # the dashboard's socket sees it


def test_a_later_failure_leaves_the_step_time_unmeasured_and_says_why() -> None:
    decision = recovered()
    settle(decision)
    proposed_later = proposed("auto")  # another job: does not count
    assert proposed_later.job_id != decision.job_id
    decisions.record_failure(decision.job, kind="crash", devices=[2], source="agent",
                             occurred_at=timezone.now())  # fmt: skip
    accuracy.measure_settled()
    stored = RecoveryDecision.objects.get(pk=decision.pk).accuracy
    assert stored is not None and stored["step_time_s"]["measured"] is None
    assert stored["transition_s"]["measured"] is not None
    assert stored["note"] == "a later failure came before the step time settled"


def test_a_recovery_missed_for_ten_minutes_or_of_an_edited_plan_is_left() -> None:
    old = recovered()
    settle(old, accuracy.MISSED_AFTER_S + 5)
    edited = recovered()
    RecoveryDecision.objects.filter(pk=edited.pk).update(chosen=None)
    settle(edited)
    assert accuracy.measure_settled() == []


@given(
    estimated=st.floats(0.01, 1e4),
    measured=st.floats(0.0, 1e4),
)
def test_the_error_is_the_measured_over_the_estimated_less_one(
    estimated: float, measured: float
) -> None:
    pair = {"transition_s": {"estimated": estimated, "measured": measured}}
    err = accuracy.error(pair, "transition_s")
    assert err is not None
    assert estimated * (1 + err) == pytest.approx(measured, rel=1e-9, abs=1e-9)
    assert (err > 0) == (measured > estimated) or measured == pytest.approx(estimated)


def test_the_running_error_takes_the_median_and_the_mean_absolute_error() -> None:
    records: list[dict[str, Any]] = [
        {"transition_s": {"estimated": 2.0, "measured": 1.5},
         "step_time_s": {"estimated": 0.1, "measured": 0.15}},
        {"transition_s": {"estimated": 2.0, "measured": 3.0},
         "step_time_s": {"estimated": 0.1, "measured": None}},
        {"transition_s": {"estimated": 4.0, "measured": 4.0},
         "step_time_s": {"estimated": None, "measured": 0.2}},
    ]  # fmt: skip
    summary = accuracy.running_error(records)
    # transitions: -25 %, +50 %, 0 %; step times: +50 % alone
    assert summary["transition_s"] == {
        "median": pytest.approx(0.0), "mean_abs": pytest.approx(0.25), "n": 3,
    }  # fmt: skip
    assert summary["step_time_s"] == {
        "median": pytest.approx(0.5), "mean_abs": pytest.approx(0.5), "n": 1,
    }  # fmt: skip
    assert accuracy.running_error([]) == {}


def test_the_pages_show_the_estimate_beside_the_measurement_and_the_jobs_running_error() -> None:
    decision = recovered(step_time_s=1.25)
    viewer = client_as("viewer")
    page = viewer.get(f"/recoveries/{decision.pk}/").content.decode()
    table = re.search(r'<table id="estimates">(.*?)</table>', page, re.S)
    assert table is not None and "not yet" in table[1]  # the step time: not settled
    settle(decision)
    accuracy.measure_settled()
    stored = RecoveryDecision.objects.get(pk=decision.pk).accuracy
    assert stored is not None
    page = viewer.get(f"/recoveries/{decision.pk}/").content.decode()
    table = re.search(r'<table id="estimates">(.*?)</table>', page, re.S)
    assert table is not None and "not yet" not in table[1]
    step = stored["step_time_s"]
    percent = round((step["measured"] / step["estimated"] - 1) * 100)
    shown = f"{percent:+d} %".replace("+", "+" if percent > 0 else "")
    assert f"<td>{step['estimated']:.3f} s</td><td>1.250 s</td><td>{shown}</td>" in table[1]
    parts = viewer.get(f"/jobs/{decision.job_id}/parts/").json()
    way = "longer" if percent >= 0 else "shorter"
    assert re.search(
        rf"step times {way} than estimated by {abs(percent)}% \(median of 1; mean absolute "
        rf"error {abs(percent)}%\)",
        parts["recent"],
    ), parts["recent"]
