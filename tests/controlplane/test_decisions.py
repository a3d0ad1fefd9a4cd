"""Jobs, failures and the recovery decision's state machine, on the configured database."""

from __future__ import annotations

import copy
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from controlplane.bridge import rows
from controlplane.bridge.rows import InvalidScenario
from controlplane.demo import scale_scenario
from controlplane.incidents import applying, decisions
from controlplane.incidents.decisions import IllegalTransition
from controlplane.incidents.models import (
    LEGAL,
    AgentCommand,
    AppendOnly,
    DecisionStatus,
    EventKind,
    Failure,
    FailureSource,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs.models import (
    AgentToken,
    ApprovalMode,
    Device,
    DeviceState,
    Job,
    JobStatus,
    Node,
    NodeStatus,
)
from controlplane.jobs.services import create_job
from controlplane.recovery.policies import get as get_policy

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
# 32 layers on 4 stages × 2 pipelines, one device each, 8 devices a node; two spares added
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["spares"] = 2


def scenario(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = copy.deepcopy(SCENARIO)
    data.update(changes)
    return data


def new_job(mode: str = ApprovalMode.AUTO, **kwargs: Any) -> Job:
    job, _ = create_job(
        f"job-{mode}-{Job.objects.count()}", scenario(), approval_mode=mode, **kwargs
    )
    return job


def fail(job: Job, *devices: int, kind: str = "crash") -> tuple[Failure, RecoveryDecision]:
    return decisions.record_failure(
        job,
        kind=kind,
        devices=devices,
        source=FailureSource.AGENT,
        occurred_at=timezone.now() - dt.timedelta(seconds=0.2),
    )


def events(job: Job) -> list[str]:
    return list(TimelineEvent.objects.filter(job=job).values_list("kind", flat=True))


def reload(decision: RecoveryDecision) -> RecoveryDecision:
    return RecoveryDecision.objects.get(pk=decision.pk)


@pytest.fixture
def operator() -> User:
    return User.objects.create_user("olga", password="x")


# --- jobs ----------------------------------------------------------------------------------


def test_a_job_gets_its_nodes_devices_and_a_token_stored_as_a_digest() -> None:
    job, token = create_job("llama", scenario(), enabled_policies=["odyssey", "checkpoint"])
    assert job.status == JobStatus.PENDING and job.plan == SCENARIO["plan"]
    states = dict(Device.objects.filter(job=job).values_list("index", "state"))
    assert states == {**{i: DeviceState.HEALTHY for i in range(8)}, 8: "spare", 9: "spare"}
    assert job.nodes.count() == 2  # 10 devices, 8 a node
    row = AgentToken.objects.get(job=job)
    assert token not in row.digest and len(row.digest) == 64
    assert AgentToken.find(token) == row
    assert AgentToken.find(token + "x") is None


def test_a_large_job_is_made_with_its_tables_analyzed_so_lookups_know_its_size() -> None:
    """The planner's estimate of a new 1,024-device job's rows is its size, not the few dozen
    it guesses for a table it has no statistics of (PostgreSQL; SQLite has no such planner)."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite plans without statistics; the PostgreSQL pass runs this")
    job, _ = create_job("large", scale_scenario(128))
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (FORMAT JSON) SELECT 1 FROM jobs_device WHERE job_id = %s", [job.pk]
        )
        estimate = cursor.fetchone()[0][0]["Plan"]["Plan Rows"]
    assert Device.objects.filter(job=job).count() == 1024
    assert estimate >= 512, estimate


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"plan": {"pipelines": []}}, "plan.pipelines"),
        ({"cluster": {"devices": 0}}, "cluster.devices"),
        ({"policies": {"oobleck": {"f": "three"}}}, "policies.oobleck.f"),
    ],
)
def test_a_bad_scenario_names_its_field_and_writes_nothing(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidScenario) as error:
        create_job("bad", scenario(**changes))
    assert error.value.field == field
    assert not Job.objects.exists() and not Device.objects.exists()


def test_job_names_are_unique() -> None:
    create_job("twice", scenario())
    with pytest.raises(InvalidScenario, match="exists already") as error:
        create_job("twice", scenario())
    assert error.value.field == "name" and Job.objects.count() == 1


def test_unknown_policies_and_modes_are_refused() -> None:
    with pytest.raises(InvalidScenario, match="unknown policy 'nope'"):
        create_job("bad", scenario(), enabled_policies=["odyssey", "nope"])
    with pytest.raises(InvalidScenario, match="unknown mode"):
        create_job("bad", scenario(), approval_mode="sometimes")
    assert not Job.objects.exists()


# --- failures and planning -----------------------------------------------------------------


def test_auto_job_applies_the_best_candidate_and_records_each_step(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    job = new_job(ApprovalMode.AUTO, enabled_policies=["odyssey", "rerouting", "checkpoint"])
    failure, decision = fail(job, 5)
    assert decision.status == DecisionStatus.PLANNING
    assert Job.objects.get(pk=job.pk).status == JobStatus.RECOVERING
    assert 0.2 <= failure.detection_latency_s < 5
    with django_capture_on_commit_callbacks() as callbacks:
        assert decisions.plan(decision.pk) == DecisionStatus.APPLYING
    # committed with the commands: every candidate but its plan and memory (megabytes at
    # scale), and the chosen plan as the decision's own; the rest once the commands are out
    light = reload(decision)
    assert light.plan is not None and light.chosen is not None
    assert [c["policy"] for c in light.candidates] == ["odyssey", "rerouting", "checkpoint"]
    assert not [c for c in light.candidates if {"plan", "peak_memory_bytes"} & c.keys()]
    for callback in callbacks[:-1]:  # the commands' publication comes first
        callback()
    assert not [c for c in reload(decision).candidates if "plan" in c]
    callbacks[-1]()
    decision = reload(decision)
    candidates = decision.candidates
    assert [c for c in candidates if c["feasible"] and "plan" not in c] == []
    assert [c["policy"] for c in candidates] == ["odyssey", "rerouting", "checkpoint"]
    feasible = [c for c in candidates if c["feasible"]]
    assert decision.chosen is not None
    best = candidates[decision.chosen]
    assert best["objective"] == max(c["objective"] for c in feasible)
    assert decision.plan == best["plan"]
    assert 5 not in {
        d for p in decision.plan["pipelines"] for s in p["stages"] for d in s["devices"]
    }
    assert events(job) == [
        "failure_detected",
        "planning_started",
        "proposed",
        "auto_applied",
        "applying",
    ]
    assert Job.objects.get(pk=job.pk).plan == decision.plan  # the plan the agents are sent


def test_commands_committed_but_not_yet_published_are_not_published_again_by_the_detector() -> None:
    """Between the commit that writes a decision's commands and their first publication (after
    it), the detector's pass took every one for lost: at 2,048 nodes, 2,047 published twice. A
    command never published (Redis down then) is published again once it is as old as a lost
    one would be."""
    job = new_job(ApprovalMode.AUTO)
    Node.objects.filter(job=job).update(status=NodeStatus.HEALTHY)
    _, decision = fail(job, 5)
    assert decisions.plan(decision.pk) == DecisionStatus.APPLYING  # its commit's callbacks wait
    mine = AgentCommand.objects.filter(decision=decision)
    assert mine.count() == 2 and not mine.filter(sent_at__isnull=False).exists()
    assert applying.resend() == 0
    mine.update(created_at=timezone.now() - dt.timedelta(seconds=applying.RESEND_AFTER_S + 1))
    assert applying.resend() == 2
    assert not mine.filter(sent_at__isnull=True).exists()


def test_planning_twice_changes_nothing_the_second_time() -> None:
    job = new_job(ApprovalMode.MANUAL)
    _, decision = fail(job, 2)
    assert decisions.plan(decision.pk) == DecisionStatus.PROPOSED
    before = (events(job), reload(decision).decision)
    assert decisions.plan(decision.pk) == DecisionStatus.PROPOSED  # a redelivered task
    assert (events(job), reload(decision).decision) == before


def test_devices_reported_while_planning_join_the_same_failure() -> None:
    job = new_job(ApprovalMode.MANUAL, enabled_policies=["dynamic"])
    first, decision = fail(job, 1)
    again, same = fail(job, 2, 1)
    assert (again.pk, same.pk) == (first.pk, decision.pk)
    assert Failure.objects.get(pk=first.pk).devices == [1, 2]
    decisions.plan(decision.pk)
    plan = reload(decision).plan
    assert plan is not None
    used = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert not used & {1, 2}
    assert Failure.objects.count() == 1


def test_a_device_lost_while_the_first_policy_plans_stops_it_there_and_all_plan_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of losses recorded one after another (a rack's nodes killed 20 ms apart): the
    loss recorded while the first policy planned stops the planning before the next policy,
    and every policy then plans the failure with both devices. Planned to the end with the
    first device alone, the burst's decision took twice as long at 16,384 devices."""
    job = new_job(ApprovalMode.MANUAL, enabled_policies=["rerouting", "dynamic"])
    _, decision = fail(job, 1)
    asked: list[tuple[str, set[int]]] = []
    for name in ("rerouting", "dynamic"):
        kind = type(get_policy(name))

        def recorded(
            self: Any, state: Any, failure: Any, _propose: Any = kind.propose, _name: str = name
        ) -> Any:
            asked.append((_name, set(failure.devices)))
            if len(asked) == 1:
                fail(job, 6)  # another device lost while the first policy plans
            return _propose(self, state, failure)

        monkeypatch.setattr(kind, "propose", recorded)
    assert decisions.plan(decision.pk) == DecisionStatus.PROPOSED
    assert asked == [("rerouting", {1}), ("rerouting", {1, 6}), ("dynamic", {1, 6})]
    answer = reload(decision).decision
    assert answer is not None and set(answer["failure"]["devices"]) == {1, 6}
    assert Failure.objects.count() == 1


def test_a_failure_during_a_recovery_supersedes_it_and_plans_again() -> None:
    job = new_job(ApprovalMode.MANUAL)
    _, first = fail(job, 1)
    decisions.plan(first.pk)
    _, second = fail(job, 6)
    first = reload(first)
    assert first.status == DecisionStatus.SUPERSEDED and first.superseded_by_id == second.pk
    assert second.status == DecisionStatus.PLANNING
    decisions.plan(second.pk)
    answer = reload(second).decision
    assert answer is not None and set(answer["failure"]["devices"]) == {6}
    for candidate in answer["candidates"]:
        if candidate["feasible"]:
            used = {
                d for p in candidate["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]
            }
            assert not used & {1, 6}, "planned around every device down, not only the new one"


def test_no_feasible_candidate_fails_the_decision_and_the_job() -> None:
    job = new_job(ApprovalMode.AUTO, enabled_policies=["checkpoint"])
    Device.objects.filter(job=job, index__in=[8, 9]).update(state=DeviceState.FAILED)
    _, decision = fail(job, 3)
    assert decisions.plan(decision.pk) == DecisionStatus.FAILED
    decision = reload(decision)
    assert decision.candidates[0]["code"] == "no_spare"
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED


def test_bad_failures_are_refused_and_write_nothing() -> None:
    job = new_job()
    with pytest.raises(InvalidScenario, match="do not exist"):
        fail(job, 42)
    with pytest.raises(InvalidScenario, match="unknown kind"):
        fail(job, 1, kind="gremlins")
    assert not Failure.objects.exists() and not TimelineEvent.objects.exists()
    assert not Device.objects.filter(state=DeviceState.FAILED).exists()


# --- operators -----------------------------------------------------------------------------


def proposed(mode: str = ApprovalMode.MANUAL, *devices: int) -> RecoveryDecision:
    job = new_job(mode, enabled_policies=["odyssey", "rerouting", "checkpoint"])
    _, decision = fail(job, *(devices or (5,)))
    decisions.plan(decision.pk)
    return reload(decision)


def test_an_operator_approves_once(operator: User) -> None:
    decision = proposed()
    assert decision.status == DecisionStatus.PROPOSED
    approved = decisions.approve(decision.pk, user=operator, reason="looks right")
    assert approved.status == DecisionStatus.APPLYING and approved.chosen_by == operator
    event = TimelineEvent.objects.get(decision=decision, kind="approved")
    assert event.actor == "olga"
    assert event.payload == {"from": "proposed", "reason": "looks right"}
    with pytest.raises(IllegalTransition, match="applying; it cannot become approved"):
        decisions.approve(decision.pk, user=operator)


def test_an_override_with_another_candidate_must_pick_a_feasible_one(operator: User) -> None:
    job = new_job(ApprovalMode.MANUAL, enabled_policies=["odyssey", "dynamic", "checkpoint"])
    Device.objects.filter(job=job, index__in=[8, 9]).update(state=DeviceState.FAILED)
    _, decision = fail(job, 5)
    decisions.plan(decision.pk)
    decision = reload(decision)
    codes = [c["code"] for c in decision.candidates]
    assert codes[2] == "no_spare"  # both spares are down: checkpoint restart cannot apply
    with pytest.raises(InvalidScenario) as error:
        decisions.override(decision.pk, user=operator, candidate=3)
    assert error.value.field == "candidate"
    with pytest.raises(InvalidScenario, match=r"does not apply: \[no_spare\]"):
        decisions.override(decision.pk, user=operator, candidate=2)
    with pytest.raises(InvalidScenario, match="either a candidate index or an edited plan"):
        decisions.override(decision.pk, user=operator)
    assert reload(decision).status == DecisionStatus.PROPOSED
    other = 1 - (decision.chosen or 0)
    assert codes[other] == "ok"
    overridden = decisions.override(decision.pk, user=operator, candidate=other, reason="slower")
    assert overridden.status == DecisionStatus.APPLYING and overridden.chosen == other
    assert TimelineEvent.objects.filter(decision=decision, kind="overridden").exists()
    assert overridden.plan == decision.candidates[other]["plan"]


def test_an_edited_plan_is_checked_by_the_core(operator: User) -> None:
    decision = proposed()
    edited = copy.deepcopy(decision.plan)
    assert edited is not None
    # put the failed device back into the plan: refused, naming the stage
    edited["pipelines"][0]["stages"][0]["devices"] = [5]
    with pytest.raises(InvalidScenario) as error:
        decisions.override(decision.pk, user=operator, edited_plan=edited)
    assert error.value.field is not None and error.value.field.startswith("plan.pipelines[0]")
    assert reload(decision).status == DecisionStatus.PROPOSED
    fine = decisions.override(decision.pk, user=operator, edited_plan=decision.plan, reason="ok")
    assert fine.status == DecisionStatus.APPLYING and fine.chosen is None


def test_the_timeout_applies_the_proposal_only_after_the_deadline(operator: User) -> None:
    decision = proposed(ApprovalMode.MANUAL_WITH_TIMEOUT)
    assert decision.deadline_at is not None
    assert decisions.apply_after_deadline(decision.pk) == DecisionStatus.PROPOSED  # too early
    RecoveryDecision.objects.filter(pk=decision.pk).update(
        deadline_at=timezone.now() - dt.timedelta(seconds=1)
    )
    assert decisions.apply_after_deadline(decision.pk) == DecisionStatus.APPLYING
    assert TimelineEvent.objects.get(decision=decision, kind="auto_applied").actor == "timeout"
    chosen = proposed(ApprovalMode.MANUAL_WITH_TIMEOUT, 2)
    decisions.approve(chosen.pk, user=operator)
    RecoveryDecision.objects.filter(pk=chosen.pk).update(deadline_at=timezone.now())
    assert decisions.apply_after_deadline(chosen.pk) == DecisionStatus.APPLYING
    assert TimelineEvent.objects.get(decision=chosen, kind="approved").actor == "olga"
    assert not TimelineEvent.objects.filter(decision=chosen, kind="auto_applied").exists()


# --- the state machine ---------------------------------------------------------------------

ILLEGAL = [
    (start, to) for start in DecisionStatus for to in DecisionStatus if to not in LEGAL[start]
]


@pytest.mark.parametrize(("start", "to"), ILLEGAL)
def test_every_illegal_transition_is_refused_and_records_nothing(start: str, to: str) -> None:
    decision = proposed()
    RecoveryDecision.objects.filter(pk=decision.pk).update(status=start)
    before = TimelineEvent.objects.count()
    with pytest.raises(IllegalTransition):
        decisions.transition(decision.pk, to, actor="test")
    assert reload(decision).status == start
    assert TimelineEvent.objects.count() == before


def test_one_open_decision_per_job_is_enforced_by_the_database() -> None:
    decision = proposed()
    with pytest.raises(IntegrityError), transaction.atomic():
        RecoveryDecision.objects.create(job=decision.job, failure=decision.failure)


def test_notifications_run_only_after_the_commit(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    decision = proposed()
    seen: list[str] = []
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        decisions.transition(
            decision.pk,
            DecisionStatus.AUTO_APPLIED,
            actor="auto",
            after_commit=lambda d: seen.append(d.status),
        )
        assert seen == []
    assert len(callbacks) == 1 and seen == [DecisionStatus.AUTO_APPLIED]


def test_a_new_failure_hands_its_decision_to_the_planner_after_commit(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    job = new_job()
    planned: list[int] = []
    with django_capture_on_commit_callbacks(execute=True):
        _, decision = decisions.record_failure(
            job,
            kind="crash",
            devices=[3],
            source=FailureSource.SOCKET,
            occurred_at=timezone.now(),
            plan=planned.append,
        )
    assert planned == [decision.pk]


def test_the_timeline_is_append_only() -> None:
    decision = proposed()
    event = TimelineEvent.objects.filter(decision=decision).first()
    assert event is not None
    event.actor = "someone else"
    with pytest.raises(AppendOnly):
        event.save()
    with pytest.raises(AppendOnly):
        event.delete()
    assert EventKind(event.kind)


# --- what-if -------------------------------------------------------------------------------


def test_what_if_plans_without_touching_the_job() -> None:
    job = new_job(enabled_policies=["odyssey", "flashrecovery"])
    counts = (
        Failure.objects.count(),
        RecoveryDecision.objects.count(),
        TimelineEvent.objects.count(),
    )
    answer = decisions.what_if(job, devices=[0, 1])
    assert [c["policy"] for c in answer["candidates"]] == ["odyssey", "flashrecovery"]
    assert answer["failure"]["devices"] == [0, 1]
    assert counts == (
        Failure.objects.count(),
        RecoveryDecision.objects.count(),
        TimelineEvent.objects.count(),
    )
    assert not Device.objects.filter(job=job, state=DeviceState.FAILED).exists()
    with pytest.raises(InvalidScenario, match=r"ids 0\.\.9"):
        decisions.what_if(job, devices=[10])


# --- readying ------------------------------------------------------------------------------


def running_job(mode: str = ApprovalMode.AUTO, **kwargs: Any) -> Job:
    """A running job of three nodes: devices 0-3, 4-7, and the spares 8-9."""
    data = scenario()
    data["cluster"]["devices_per_node"] = 4
    job, _ = create_job(f"running-{Job.objects.count()}", data, approval_mode=mode, **kwargs)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
    return Job.objects.get(pk=job.pk)


def test_readying_plans_the_first_nodes_loss_writes_nothing_and_leaves_the_planner_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from controlplane.recovery import planner

    job = running_job(enabled_policies=["dynamic", "odyssey"])
    asked: list[list[int]] = []
    real = decisions.what_if

    def what_if(job: Job, *, devices: Any, kind: str = "crash") -> dict[str, Any]:
        asked.append(sorted(devices))
        assert kind == "node_lost"
        return real(job, devices=devices, kind=kind)

    monkeypatch.setattr(decisions, "what_if", what_if)
    counts = (Failure.objects.count(), RecoveryDecision.objects.count(), events(job))
    planner.forget()
    assert decisions.ready(job.pk)
    assert planner._MEMO.searches  # the shapes for one node fewer, remembered
    # node-0 with a device down: node-1's loss instead
    Device.objects.filter(job=job, index=3).update(state=DeviceState.FAILED)
    assert decisions.ready(job.pk)
    assert asked == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert counts == (Failure.objects.count(), RecoveryDecision.objects.count(), events(job))
    # what a warm planner answers is what a cold one does
    warm = real(job, devices=[8, 9])
    planner.forget()
    cold = real(job, devices=[8, 9])
    assert warm.pop("search_time_s") >= 0 and cold.pop("search_time_s") >= 0
    assert cold == warm and cold["candidates"]


def test_a_jobs_scenario_is_parsed_again_only_when_its_json_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Readying leaves the job's scenario parsed for its first failure; a fresh read of the
    same JSON finds it, a changed one (a profile's measurement) is parsed again."""
    job = new_job()
    parses: list[Any] = []
    real = rows.parse_scenario

    def counted(data: Any) -> rows.Scenario:
        parses.append(data)
        return real(data)

    monkeypatch.setattr(rows, "parse_scenario", counted)
    first = decisions.scenario_of(job)
    assert decisions.scenario_of(Job.objects.get(pk=job.pk)) is first
    changed = scenario()
    changed["cluster"]["inter_node_gbps"] *= 2
    Job.objects.filter(pk=job.pk).update(scenario=changed)
    again = decisions.scenario_of(Job.objects.get(pk=job.pk))
    assert first.state.cluster.inter_node_gbps is not None
    assert again.state.cluster.inter_node_gbps == 2 * first.state.cluster.inter_node_gbps
    assert len(parses) == 2


def test_nothing_is_readied_for_a_job_not_running_or_planning_already() -> None:
    idle = new_job()
    assert idle.status != JobStatus.RUNNING and not decisions.ready(idle.pk)
    assert not decisions.ready(idle.pk + 1000)  # no such job
    job = running_job(mode=ApprovalMode.MANUAL)
    fail(job, 3)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)  # as if still running
    assert not decisions.ready(job.pk)  # its open decision's planning readies it


# --- nothing is lost to a broker or worker restart -----------------------------------------


def test_overdue_decisions_are_planned_again_and_late_proposals_applied() -> None:
    from controlplane.celery import app as celery_app
    from controlplane.incidents.tasks import requeue_overdue

    job = new_job(ApprovalMode.MANUAL)
    _, stuck = fail(job, 3)  # as if its planning task was lost with the broker
    assert requeue_overdue(planning_after_s=30) == ([], [])  # too recent to tell
    RecoveryDecision.objects.filter(pk=stuck.pk).update(
        updated_at=timezone.now() - dt.timedelta(seconds=31)
    )
    celery_app.conf.task_always_eager = True  # the re-queued task runs here
    try:
        requeued, _ = requeue_overdue(planning_after_s=30)
    finally:
        celery_app.conf.task_always_eager = False
    assert requeued == [stuck.pk] and reload(stuck).status == DecisionStatus.PROPOSED

    timed = proposed(ApprovalMode.MANUAL_WITH_TIMEOUT, 2)
    RecoveryDecision.objects.filter(pk=timed.pk).update(
        deadline_at=timezone.now() - dt.timedelta(seconds=1)
    )
    assert requeue_overdue(planning_after_s=30) == ([], [DecisionStatus.APPLYING])
    assert reload(timed).status == DecisionStatus.APPLYING


def test_devices_reported_again_change_nothing() -> None:
    job = new_job(ApprovalMode.MANUAL)
    failure, decision = fail(job, 3)
    decisions.plan(decision.pk)
    before = events(job)
    again, same = fail(job, 3)  # e.g. the socket closed, then the deadline passed
    assert (again.pk, same.pk) == (failure.pk, decision.pk)
    assert reload(decision).status == DecisionStatus.PROPOSED, "not superseded by a repeat"
    assert events(job) == before and Failure.objects.count() == 1
    _, newer = fail(job, 3, 4)  # a new device is a new incident
    assert newer.pk != decision.pk and reload(decision).status == DecisionStatus.SUPERSEDED


@pytest.mark.parametrize("its_scenarios", [True, False])
def test_the_state_runs_the_plan_given_whether_or_not_it_is_the_scenarios(
    its_scenarios: bool,
) -> None:
    """A job runs its scenario's plan until its first recovery (then parsed once, not twice),
    another one after: the state's plan is the one given, stage by stage as written."""
    data = scenario()
    given = copy.deepcopy(data["plan"])
    if not its_scenarios:
        given["pipelines"].reverse()  # the same devices and layers, in another order
    state = rows.state_of(data, given, {3})
    written = [[s["devices"] for s in p["stages"]] for p in given["pipelines"]]
    assert [[list(s.devices) for s in p.stages] for p in state.plan.pipelines] == written
    assert state.failed == frozenset({3})
