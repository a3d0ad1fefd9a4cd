"""Nodes that register themselves: a launcher with an admin's API token asks for its job
(``POST /api/v1/jobs/launch/``), the first creates it and the others join it, each with an
agent token of its own; a node that joins in a lost one's place brings its devices back, and a
job that no policy could recover without them plans again."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from controlplane.incidents import decisions
from controlplane.incidents.models import DecisionStatus, EventKind, FailureSource
from controlplane.jobs import lifecycle
from controlplane.jobs.models import AgentToken, Device, Job, JobStatus, Node, NodeStatus
from controlplane.jobs.services import create_job
from tests.controlplane.test_api import client_as, post

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
# two nodes of one process each, one replica a process (as the launcher's jobs are)
SCENARIO = json.loads((ROOT / "examples" / "torchrun-ddp-2x1.json").read_text())
URL = "/api/v1/jobs/launch/"


def launch(role: str, name: str, scenario: dict[str, Any] = SCENARIO) -> Any:
    body = {"name": name, "scenario": copy.deepcopy(scenario), "enabled_policies": ["restart"]}
    return post(client_as(role), URL, body)


def test_the_first_node_creates_the_job_and_the_others_join_it_each_with_a_token() -> None:
    first = launch("admin", "ddp")
    assert first.status_code == 201, first.json()
    assert first.json()["created"] is True
    job = Job.objects.get(name="ddp")
    assert job.enabled_policies == ["restart"] and job.status == JobStatus.PENDING
    nodes = dict(Node.objects.filter(job=job).values_list("name", "status"))
    assert nodes == {"node-0": NodeStatus.EXPECTED, "node-1": NodeStatus.EXPECTED}
    tokens = [first.json()["agent_token"]]
    for _ in range(2):
        again = launch("admin", "ddp")
        assert again.status_code == 200 and again.json()["created"] is False
        assert again.json()["job"]["id"] == job.pk
        tokens.append(again.json()["agent_token"])
    assert len(set(tokens)) == 3  # one each, each good for the job
    assert all(getattr(AgentToken.find(t), "job_id", None) == job.pk for t in tokens)
    assert Job.objects.count() == 1


def test_a_node_launched_with_another_world_is_refused_naming_the_scenario() -> None:
    assert launch("admin", "ddp").status_code == 201
    bigger = copy.deepcopy(SCENARIO)
    bigger["cluster"]["devices"] = 3
    bigger["training"]["global_batch"] = 48
    bigger["plan"]["pipelines"].append(copy.deepcopy(bigger["plan"]["pipelines"][0]))
    bigger["plan"]["pipelines"][2]["stages"][0]["devices"] = [2]
    answer = launch("admin", "ddp", bigger)
    assert answer.status_code == 400, answer.json()
    assert answer.json()["field"] == "scenario"
    assert "has 2 devices, this launch 3" in answer.json()["message"]
    assert AgentToken.objects.count() == 1  # nothing issued


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_only_admins_launch(role: str) -> None:
    answer = launch(role, "ddp")
    assert answer.status_code == 403
    assert not Job.objects.exists() and not AgentToken.objects.exists()


def test_a_bad_scenario_is_refused_naming_its_field_and_nothing_is_made() -> None:
    broken = copy.deepcopy(SCENARIO)
    del broken["plan"]
    answer = launch("admin", "ddp", broken)
    assert answer.status_code == 400 and answer.json()["field"]
    assert not Job.objects.exists()


def _lose_node_1(job: Job) -> int:
    """node-1's agent is gone (its socket closed): the decision, planned."""
    node = Node.objects.get(job=job, name="node-1")
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.FAILED)
    _, decision = decisions.record_failure(
        job,
        kind="node_lost",
        devices=[1],
        source=FailureSource.SOCKET,
        occurred_at=timezone.now(),
        node=node,
    )
    decisions.plan(decision.pk)
    return decision.pk


def test_a_job_no_policy_could_recover_plans_again_when_a_node_joins_in_the_lost_ones_place() -> (
    None
):
    job, _ = create_job("ddp", copy.deepcopy(SCENARIO), enabled_policies=["restart"])
    for node in Node.objects.filter(job=job):
        lifecycle.joined(job_id=job.pk, node_id=node.pk)
    first = _lose_node_1(job)
    # no spare, no smaller world allowed, the lost device not restartable: nothing to do yet
    failed = decisions.RecoveryDecision.objects.get(pk=first)
    assert failed.status == DecisionStatus.FAILED
    assert [c["code"] for c in failed.candidates] == ["no_spare"]
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED

    node = Node.objects.get(job=job, name="node-1")
    assert lifecycle.joined(job_id=job.pk, node_id=node.pk) is True  # came back from failed
    again = decisions.node_came_back(job.pk, node.pk)
    assert again is not None and again.failure_id == failed.failure_id
    assert Device.objects.get(job=job, index=1).state == "healthy"  # in the running plan
    assert Job.objects.get(pk=job.pk).status == JobStatus.RECOVERING
    started = again.events.get(kind=EventKind.PLANNING_STARTED).payload
    assert started == {"replans_after": first, "joined": "node-1", "devices_back": [1]}

    decisions.plan(again.pk)
    applied = decisions.RecoveryDecision.objects.get(pk=again.pk)
    assert applied.status == DecisionStatus.APPLYING
    assert applied.chosen is not None
    chosen = applied.candidates[applied.chosen]
    assert chosen["policy"] == "restart"
    assert applied.plan is not None  # the chosen plan (the candidates' come after the commit)
    used = {d for p in applied.plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}  # the whole world again, the replacement in the lost node's place


def test_a_node_back_while_a_decision_is_open_changes_nothing_and_a_running_job_plans_nothing() -> (
    None
):
    job, _ = create_job(
        "ddp", copy.deepcopy(SCENARIO), approval_mode="manual", enabled_policies=["restart"]
    )
    node = Node.objects.get(job=job, name="node-1")
    _lose_node_1(job)
    # a decision open (here: made to look proposed): it plans around the node's devices,
    # which stay failed
    decisions.RecoveryDecision.objects.filter(job=job).update(status=DecisionStatus.PROPOSED)
    lifecycle.joined(job_id=job.pk, node_id=node.pk)
    assert decisions.node_came_back(job.pk, node.pk) is None
    assert Device.objects.get(job=job, index=1).state == "failed"
    # none open, the job running (say, recovered on a smaller world): the devices come back
    # (outside the plan: spares) and nothing plans
    decisions.RecoveryDecision.objects.filter(job=job).update(status=DecisionStatus.RECOVERED)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING,
        plan={"pipelines": [SCENARIO["plan"]["pipelines"][0]]},
    )
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.FAILED)
    assert lifecycle.joined(job_id=job.pk, node_id=node.pk) is True
    assert decisions.node_came_back(job.pk, node.pk) is None
    assert Device.objects.get(job=job, index=1).state == "spare"
    assert decisions.RecoveryDecision.objects.filter(job=job).count() == 1


def test_a_node_back_while_its_loss_was_planned_is_taken_in_when_planning_fails() -> None:
    job, _ = create_job("ddp", copy.deepcopy(SCENARIO), enabled_policies=["restart"])
    for node in Node.objects.filter(job=job):
        lifecycle.joined(job_id=job.pk, node_id=node.pk)
    node = Node.objects.get(job=job, name="node-1")
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.FAILED)
    _, lost = decisions.record_failure(
        job, kind="node_lost", devices=[1], source=FailureSource.SOCKET,
        occurred_at=timezone.now(), node=node,
    )  # fmt: skip
    # its agent is back before the planner ran: the open decision keeps the device failed
    assert lifecycle.joined(job_id=job.pk, node_id=node.pk) is True
    assert decisions.node_came_back(job.pk, node.pk) is None
    assert Device.objects.get(job=job, index=1).state == "failed"
    # planning fails without it, then takes it in and plans again at once
    assert decisions.plan(lost.pk) == DecisionStatus.APPLYING
    assert decisions.RecoveryDecision.objects.get(pk=lost.pk).status == DecisionStatus.FAILED
    again = decisions.RecoveryDecision.objects.exclude(pk=lost.pk).get(job=job)
    assert again.status == DecisionStatus.APPLYING and again.failure_id == lost.failure_id
    assert Device.objects.get(job=job, index=1).state == "healthy"


def _rerouted_without_node_1(
    failure_rate: float, policies: tuple[str, ...] = ("rerouting", "flashrecovery")
) -> tuple[Job, Node, int]:
    """A job of two replicas that lost node-1 and runs on node-0 alone, rerouted (recovered)."""
    scenario = copy.deepcopy(SCENARIO)
    scenario["cluster"]["failure_rate_per_device_hour"] = failure_rate
    job, _ = create_job("ddp", scenario, enabled_policies=list(policies))
    for node in Node.objects.filter(job=job):
        lifecycle.joined(job_id=job.pk, node_id=node.pk)
    first = _lose_node_1(job)
    rerouted = decisions.RecoveryDecision.objects.get(pk=first)
    assert rerouted.chosen is not None
    assert rerouted.candidates[rerouted.chosen]["policy"] == "rerouting"
    decisions.RecoveryDecision.objects.filter(pk=first).update(status=DecisionStatus.RECOVERED)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
    node = Node.objects.get(job=job, name="node-1")
    assert lifecycle.joined(job_id=job.pk, node_id=node.pk) is True
    return job, node, first


def test_a_job_running_rerouted_grows_back_onto_the_node_that_came_back() -> None:
    job, node, first = _rerouted_without_node_1(failure_rate=0.1)
    grows = decisions.node_came_back(job.pk, node.pk)
    assert grows is not None and grows.grows
    assert Device.objects.get(job=job, index=1).state == "spare"  # until a plan takes it
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING  # it never stopped
    started = grows.events.get(kind=EventKind.PLANNING_STARTED).payload
    assert started == {"replans_after": first, "joined": "node-1", "devices_back": [1],
                       "grows": True}  # fmt: skip
    assert decisions.plan(grows.pk) == DecisionStatus.APPLYING
    applied = decisions.RecoveryDecision.objects.get(pk=grows.pk)
    keep, growth = applied.candidates
    assert keep["policy"] == "keep" and keep["transition"]["total_s"] == 0
    assert applied.chosen == 1 and growth["policy"] == "flashrecovery"
    # eq. 8: the second replica halves the step, worth its transition over ~5 h to a fault
    assert growth["objective"] > keep["objective"]
    assert applied.plan is not None  # the chosen plan (the candidates' come after the commit)
    used = {d for p in applied.plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}
    assert Device.objects.get(job=job, index=1).state == "healthy"
    assert applied.commands.count() == 2  # both nodes are told
    page = client_as("viewer").get(f"/recoveries/{grows.pk}/").content.decode()
    assert "Growing back" in page and "keep" in page and "flashrecovery" in page


def test_a_growth_that_does_not_pay_for_itself_keeps_the_running_plan_and_applies_nothing() -> None:
    # a fault every ~18 s on two devices: the transition would eat what the replica gains
    job, node, _ = _rerouted_without_node_1(failure_rate=100.0)
    grows = decisions.node_came_back(job.pk, node.pk)
    assert grows is not None
    assert decisions.plan(grows.pk) == DecisionStatus.DISMISSED
    kept = decisions.RecoveryDecision.objects.get(pk=grows.pk)
    keep, growth = kept.candidates
    assert keep["objective"] > growth["objective"] > 0
    assert kept.chosen == 0 and kept.chosen_by is None and "running plan is kept" in kept.reason
    assert not kept.commands.exists()
    assert Device.objects.get(job=job, index=1).state == "spare"
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING


def test_a_failure_while_a_growth_is_planned_supersedes_it_and_is_its_own() -> None:
    job, node, _ = _rerouted_without_node_1(failure_rate=0.1)
    grows = decisions.node_came_back(job.pk, node.pk)
    assert grows is not None
    failure, decision = decisions.record_failure(
        job, kind="crash", devices=[0], source=FailureSource.AGENT, occurred_at=timezone.now()
    )
    assert decision.pk != grows.pk and not decision.grows
    assert failure.devices == [0] and failure.pk != grows.failure_id
    assert decisions.RecoveryDecision.objects.get(pk=grows.pk).status == DecisionStatus.SUPERSEDED
    assert Job.objects.get(pk=job.pk).status == JobStatus.RECOVERING


def test_a_job_whose_policies_cannot_grow_takes_the_node_back_as_a_spare_and_plans_nothing() -> (
    None
):
    job, node, _ = _rerouted_without_node_1(failure_rate=0.1, policies=("rerouting", "dynamic"))
    assert decisions.node_came_back(job.pk, node.pk) is None
    assert Device.objects.get(job=job, index=1).state == "spare"
    assert decisions.RecoveryDecision.objects.filter(job=job).count() == 1


def test_a_second_node_back_while_a_growth_waits_for_approval_is_counted_in_a_new_one() -> None:
    scenario = copy.deepcopy(SCENARIO)  # three replicas, a node each
    third = copy.deepcopy(scenario["plan"]["pipelines"][1])
    third["stages"][0]["devices"] = [2]
    scenario["plan"]["pipelines"].append(third)
    scenario["cluster"]["devices"] = 3
    scenario["training"]["global_batch"] = 48
    job, _ = create_job("ddp3", scenario, approval_mode="manual",
                        enabled_policies=["rerouting", "flashrecovery"])  # fmt: skip
    for node in Node.objects.filter(job=job):
        lifecycle.joined(job_id=job.pk, node_id=node.pk)
    nodes = {n.name: n for n in Node.objects.filter(job=job)}
    Node.objects.filter(pk__in=[nodes["node-1"].pk, nodes["node-2"].pk]).update(
        status=NodeStatus.FAILED
    )
    _, lost = decisions.record_failure(
        job, kind="node_lost", devices=[1, 2], source=FailureSource.SOCKET,
        occurred_at=timezone.now(),
    )  # fmt: skip
    decisions.plan(lost.pk)
    rerouted = decisions.RecoveryDecision.objects.get(pk=lost.pk)
    assert rerouted.status == DecisionStatus.PROPOSED and rerouted.chosen is not None
    # (as if the operator approved the reroute and it recovered)
    decisions.RecoveryDecision.objects.filter(pk=lost.pk).update(status=DecisionStatus.RECOVERED)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING, plan=rerouted.candidates[rerouted.chosen]["plan"]
    )
    lifecycle.joined(job_id=job.pk, node_id=nodes["node-1"].pk)
    first = decisions.node_came_back(job.pk, nodes["node-1"].pk)
    assert first is not None and decisions.plan(first.pk) == DecisionStatus.PROPOSED
    # node-2 back while the operator has not chosen: the growth plans again, with both
    lifecycle.joined(job_id=job.pk, node_id=nodes["node-2"].pk)
    second = decisions.node_came_back(job.pk, nodes["node-2"].pk)
    assert second is not None and second.grows and second.pk != first.pk
    assert decisions.RecoveryDecision.objects.get(pk=first.pk).status == DecisionStatus.SUPERSEDED
    assert decisions.plan(second.pk) == DecisionStatus.PROPOSED
    growth = decisions.RecoveryDecision.objects.get(pk=second.pk).candidates[1]
    used = {d for p in growth["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1, 2} and not any(
        s.get("rerouted") for p in growth["plan"]["pipelines"] for s in p["stages"]
    )
