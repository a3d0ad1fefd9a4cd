"""REST API v1: roles, coded errors naming the field, approve/override, timeline export."""

from __future__ import annotations

import copy
import csv
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from controlplane.incidents import decisions
from controlplane.incidents.models import DecisionStatus, FailureSource, RecoveryDecision
from controlplane.jobs import lifecycle
from controlplane.jobs.models import AgentToken, Device, DeviceState, Job, Node
from controlplane.jobs.services import create_job
from controlplane.recovery import policies
from worker_agent import agent

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["spares"] = 2


def user(role: str | None) -> User:
    person = User.objects.create_user(f"u-{role}-{User.objects.count()}", password="x")
    if role is not None:
        # get_or_create: a transactional test before this one flushed the migration's roles
        person.groups.add(Group.objects.get_or_create(name=role)[0])
    return person


def client_as(role: str | None) -> Client:
    client = Client()
    client.force_login(user(role))
    return client


def post(client: Client, url: str, data: Any) -> Any:
    return client.post(url, json.dumps(data), content_type="application/json")


def proposed(mode: str = "manual") -> RecoveryDecision:
    job, _ = create_job(
        f"job-{Job.objects.count()}",
        copy.deepcopy(SCENARIO),
        approval_mode=mode,
        enabled_policies=["odyssey", "dynamic", "checkpoint"],
    )
    _, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now()
    )
    decisions.plan(decision.pk)
    return RecoveryDecision.objects.get(pk=decision.pk)


# --- roles ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "code"), [(None, 403), ("viewer", 200), ("operator", 200)])
def test_reading_needs_a_role(role: str | None, code: int) -> None:
    response = client_as(role).get("/api/v1/jobs/")
    assert response.status_code == code
    if code == 403:
        assert response.json()["code"] == "permission_denied"


def test_anonymous_callers_are_refused() -> None:
    response = Client().get("/api/v1/recoveries/")
    assert response.status_code == 403 and response.json()["code"] == "not_authenticated"


@pytest.mark.parametrize(("role", "code"), [("viewer", 403), ("operator", 403), ("admin", 201)])
def test_only_admins_create_jobs_and_the_token_is_shown_once(role: str, code: int) -> None:
    client = client_as(role)
    response = post(client, "/api/v1/jobs/", {"name": "llama", "scenario": SCENARIO})
    assert response.status_code == code
    if code == 201:
        body = response.json()
        assert body["agent_token"] and body["job"]["devices"]["spare"] == 0
        # no node has said hello yet: every device, the two spares included, is not yet heard
        devices = SCENARIO["cluster"]["devices"] + SCENARIO["cluster"]["spares"]
        assert body["job"]["devices"]["unheard"] == devices
        assert body["agent_token"] not in json.dumps(client.get("/api/v1/jobs/").json())


def test_device_counts_keep_the_devices_of_nodes_not_yet_heard_apart() -> None:
    job, _ = create_job("counts", copy.deepcopy(SCENARIO))
    nodes = list(Node.objects.filter(job=job).order_by("index"))
    lifecycle.joined(job_id=job.pk, node_id=nodes[0].pk)
    # a device failed on a node never heard counts as failed, not as unheard
    failed = Device.objects.filter(node=nodes[1]).order_by("index").first()
    assert failed is not None
    Device.objects.filter(pk=failed.pk).update(state=DeviceState.FAILED)
    per_node = SCENARIO["cluster"]["devices_per_node"]
    spares = SCENARIO["cluster"]["spares"]
    total = SCENARIO["cluster"]["devices"] + spares
    counts = client_as("viewer").get(f"/api/v1/jobs/{job.pk}/").json()["devices"]
    # node-0 joined: its devices are healthy (the spares sit on the last nodes, never heard)
    assert counts == {
        "healthy": per_node,
        "suspect": 0,
        "failed": 1,
        "spare": 0,
        "recovering": 0,
        "unheard": total - per_node - 1,
    }


@pytest.mark.parametrize(("role", "code"), [("viewer", 403), ("operator", 200)])
def test_only_operators_approve(role: str, code: int) -> None:
    decision = proposed()
    response = post(client_as(role), f"/api/v1/recoveries/{decision.pk}/approve/", {})
    assert response.status_code == code
    expected = DecisionStatus.APPLYING if code == 200 else DecisionStatus.PROPOSED
    assert RecoveryDecision.objects.get(pk=decision.pk).status == expected


def test_api_clients_authenticate_with_a_token() -> None:
    decision = proposed()
    token = Token.objects.create(user=user("operator"))
    response = Client().post(
        f"/api/v1/recoveries/{decision.pk}/approve/",
        json.dumps({"reason": "from a script"}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {token.key}",
    )
    assert response.status_code == 200 and response.json()["reason"] == "from a script"


# --- bad input gets a coded 400 naming the field -------------------------------------------


def job_with(**changes: Any) -> dict[str, Any]:
    return {"name": "x", "scenario": SCENARIO, **changes}


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        ({"scenario": SCENARIO}, "required", "name"),
        (
            job_with(scenario={**SCENARIO, "plan": {"pipelines": []}}),
            "invalid_scenario",
            "plan.pipelines",
        ),
        (
            job_with(enabled_policies=["odyssey", "nope"]),
            "invalid_scenario",
            "enabled_policies[1]",
        ),
        (job_with(approval_mode="sometimes"), "invalid_choice", "approval_mode"),
        (
            job_with(scenario={**SCENARIO, "policies": {"oobleck": {"g": 1}}}),
            "invalid_option",
            "policies.oobleck.g",
        ),
    ],
)
def test_bad_jobs_are_refused_naming_the_field(data: dict[str, Any], code: str, field: str) -> None:
    response = post(client_as("admin"), "/api/v1/jobs/", data)
    assert response.status_code == 400
    assert (response.json()["code"], response.json()["field"]) == (code, field)
    assert not Job.objects.exists()


def test_decision_errors_are_coded() -> None:
    decision = proposed()
    client = client_as("operator")
    url = f"/api/v1/recoveries/{decision.pk}"
    bad = post(client, f"{url}/override/", {"candidate": 7})
    assert (bad.status_code, bad.json()["code"], bad.json()["field"]) == (
        400,
        "invalid_scenario",
        "candidate",
    )
    edited = copy.deepcopy(decision.plan)
    assert edited is not None
    edited["pipelines"][0]["micro_batches"] += 1
    bad = post(client, f"{url}/override/", {"plan": edited})
    assert bad.status_code == 400 and bad.json()["field"].startswith("plan")
    assert post(client, f"{url}/approve/", {}).status_code == 200
    again = post(client, f"{url}/approve/", {})
    assert (again.status_code, again.json()["code"]) == (409, "illegal_transition")
    missing = post(client, "/api/v1/recoveries/999999/approve/", {})
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")
    assert client.get("/api/v1/recoveries/?job=abc").json()["field"] == "job"


def test_an_operator_overrides_with_another_candidate() -> None:
    decision = proposed()
    other = next(
        i for i, c in enumerate(decision.candidates) if c["code"] == "ok" and i != decision.chosen
    )
    response = post(
        client_as("operator"),
        f"/api/v1/recoveries/{decision.pk}/override/",
        {"candidate": other, "reason": "prefer the plain re-plan"},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "applying" and body["chosen"] == other
    assert body["plan"] == decision.candidates[other]["plan"]


# --- reading -------------------------------------------------------------------------------


def test_the_policy_list_comes_from_the_core() -> None:
    listed = client_as("viewer").get("/api/v1/policies/").json()
    assert [p["name"] for p in listed] == policies.names()
    oobleck = next(p for p in listed if p["name"] == "oobleck")
    assert oobleck["options"] == {"f": 1, "regroup_s": 2.0, "replan": False}
    assert all(p["summary"] for p in listed)


def test_job_lists_take_the_same_queries_for_2_and_6_jobs(
    django_assert_max_num_queries: Callable[..., Any],
) -> None:
    client = client_as("viewer")
    for _ in range(2):
        proposed()
    with django_assert_max_num_queries(30) as few:
        for url in LISTS:
            assert client.get(url).status_code == 200
    for _ in range(4):
        proposed()
    with django_assert_max_num_queries(len(few.captured_queries)):
        for url in LISTS:
            assert client.get(url).status_code == 200


LISTS = (
    "/api/v1/jobs/",
    "/api/v1/nodes/",
    "/api/v1/devices/",
    "/api/v1/recoveries/",
    "/api/v1/failures/",
)


@pytest.mark.parametrize(("role", "code"), [("viewer", 403), ("operator", 403), ("admin", 201)])
def test_only_admins_issue_agent_tokens(role: str, code: int) -> None:
    job = proposed().job
    answer = post(client_as(role), f"/api/v1/jobs/{job.pk}/tokens/", {"node": "node-0"})
    assert answer.status_code == code
    if code == 201:
        token = answer.json()["agent_token"]
        assert AgentToken.find(token).node.name == "node-0"  # type: ignore[union-attr]
        assert token not in str(AgentToken.objects.values_list())  # stored as a digest


def test_every_issued_token_passes_as_the_agents_token_argument() -> None:
    # a bare URL-safe token starts with "-" one time in 64: "--token -x..." is then an option to
    # argparse, and the agent refused to start (all of a job's agents at once, they share it)
    job = proposed().job
    tokens = [AgentToken.issue(job)[1] for _ in range(400)]  # P(none with "-") ≈ 0.2 % unfixed
    for token in tokens:
        settings = agent.settings_from(["--job", "j", "--node", "n", "--token", token,
                                        "--devices", "0", "--", "trainer"])  # fmt: skip
        assert settings.token == token
    assert len(set(tokens)) == len(tokens)


def test_a_token_for_an_unknown_node_is_refused_naming_the_field(capsys: Any) -> None:
    job = proposed().job
    answer = post(client_as("admin"), f"/api/v1/jobs/{job.pk}/tokens/", {"node": "node-9"})
    assert (answer.status_code, answer.json()["field"]) == (400, "node")
    with pytest.raises(CommandError, match="no node 'node-9'"):
        call_command("issue_agent_token", job.name, "--node", "node-9")
    call_command("issue_agent_token", job.name)
    printed = capsys.readouterr().out.strip()
    found = AgentToken.find(printed)
    assert found is not None and found.job == job and found.node is None


def test_nodes_and_devices_are_listed_by_job_and_filtered() -> None:
    decision = proposed()
    other = proposed()
    client = client_as("viewer")
    per_node = SCENARIO["cluster"]["devices_per_node"]
    total = SCENARIO["cluster"]["devices"] + SCENARIO["cluster"]["spares"]
    nodes = client.get(f"/api/v1/nodes/?job={decision.job_id}").json()
    assert nodes["count"] == -(-total // per_node)
    first = nodes["results"][0]
    assert (first["job"], first["index"]) == (decision.job_id, 0)
    assert first["devices"] == list(range(per_node))
    devices = client.get(f"/api/v1/devices/?job={decision.job_id}").json()
    assert [d["index"] for d in devices["results"]] == list(range(total))
    failed = client.get(f"/api/v1/devices/?job={decision.job_id}&state=failed").json()
    assert [d["index"] for d in failed["results"]] == [5]  # proposed() fails device 5
    spares = client.get(f"/api/v1/devices/?job={other.job_id}&state=spare").json()
    assert [d["index"] for d in spares["results"]] == list(range(total - 2, total))
    node = first["name"]
    on_node = client.get(f"/api/v1/devices/?job={decision.job_id}&node={node}").json()
    assert [d["index"] for d in on_node["results"]] == list(range(per_node))
    for url, field in (
        ("/api/v1/devices/?state=broken", "state"),
        ("/api/v1/nodes/?status=gone", "status"),
        ("/api/v1/nodes/?job=x", "job"),
        ("/api/v1/recoveries/?status=done", "status"),
    ):
        bad = client.get(url)
        assert (bad.status_code, bad.json()["code"], bad.json()["field"]) == (400, "invalid", field)


def test_what_if_writes_nothing() -> None:
    decision = proposed()
    client = client_as("viewer")
    before = client.get("/api/v1/recoveries/").json()["count"]
    answer = post(client, f"/api/v1/jobs/{decision.job_id}/what-if/", {"devices": [0, 1]})
    assert answer.status_code == 200
    assert [c["policy"] for c in answer.json()["candidates"]] == [
        "odyssey",
        "dynamic",
        "checkpoint",
    ]
    assert client.get("/api/v1/recoveries/").json()["count"] == before
    bad = post(client, f"/api/v1/jobs/{decision.job_id}/what-if/", {"devices": [99]})
    assert (bad.status_code, bad.json()["field"]) == (400, "devices")


# --- timeline export -----------------------------------------------------------------------


def test_the_recovery_timeline_breaks_down_into_phases_and_exports_as_csv() -> None:
    decision = proposed("auto")
    client = client_as("viewer")
    url = f"/api/v1/recoveries/{decision.pk}/timeline/"
    body = client.get(url).json()
    kinds = [e["kind"] for e in body["results"]]
    assert kinds == [
        "failure_detected",
        "planning_started",
        "proposed",
        "auto_applied",
        "applying",
    ]
    assert all(e["at"].endswith("Z") for e in body["results"]), "UTC ISO 8601"
    phases = {p["phase"]: p["seconds"] for p in body["phases"]}
    assert list(phases) == ["detect", "plan", "approve", "transfer", "restart", "first_step"]
    assert phases["plan"] is not None and phases["plan"] >= 0
    assert phases["approve"] is not None and phases["transfer"] is None
    exported = client.get(url, {"format": "csv"})
    assert exported["Content-Type"].startswith("text/csv")
    disposition = f'attachment; filename="recovery-{decision.pk}-timeline.csv"'
    assert exported["Content-Disposition"] == disposition
    rows = list(csv.DictReader(io.StringIO(exported.content.decode())))
    assert [r["kind"] for r in rows] == kinds
    assert json.loads(rows[0]["payload"])["devices"] == [5]
    # the phases on their own, as JSON and as a CSV of one phase a line
    alone = client.get(f"/api/v1/recoveries/{decision.pk}/phases/").json()
    assert alone == body["phases"]
    table = client.get(f"/api/v1/recoveries/{decision.pk}/phases/", {"format": "csv"})
    name = f'attachment; filename="recovery-{decision.pk}-phases.csv"'
    assert table["Content-Disposition"] == name
    lines = list(csv.DictReader(io.StringIO(table.content.decode())))
    assert [r["phase"] for r in lines] == list(phases)
    assert float(lines[1]["seconds"]) == pytest.approx(phases["plan"])
    assert lines[3]["end"] == "" and lines[3]["seconds"] == ""  # transfer: under way
    assert lines[5]["start"] == ""  # first step: not yet
    plan = next(p for p in body["phases"] if p["phase"] == "plan")
    assert lines[1]["start"] == plan["start"] and lines[1]["end"] == plan["end"]


def test_the_step_at_the_failure_is_on_the_failure_and_its_timeline_row() -> None:
    job, _ = create_job("stepped", copy.deepcopy(SCENARIO), enabled_policies=["dynamic"])
    failure, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now(),
        step=41,
    )  # fmt: skip
    client = client_as("viewer")
    assert client.get(f"/api/v1/failures/{failure.pk}/").json()["step"] == 41
    shown = client.get(f"/api/v1/recoveries/{decision.pk}/").json()
    assert (shown["failure"]["step"], shown["resumed_step"]) == (41, None)  # not recovered yet
    url = f"/api/v1/recoveries/{decision.pk}/timeline/"
    body = client.get(url).json()
    assert (body["step_at_failure"], body["resumed_step"]) == (41, None)
    assert [(e["kind"], e["step"]) for e in body["results"]] == [
        ("failure_detected", 41),
        ("planning_started", None),
    ]
    rows = list(csv.DictReader(io.StringIO(client.get(url, {"format": "csv"}).content.decode())))
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("failure_detected", "41"),
        ("planning_started", ""),
    ]


def test_job_timelines_filter_by_time_and_refuse_bad_times() -> None:
    decision = proposed("auto")
    client = client_as("viewer")
    url = f"/api/v1/jobs/{decision.job_id}/timeline/"
    events = client.get(url).json()["results"]
    assert len(events) == 5
    later = client.get(url, {"since": events[2]["at"]}).json()["results"]
    assert [e["kind"] for e in later] == ["proposed", "auto_applied", "applying"]
    bad = client.get(url, {"since": "yesterday"})
    assert (bad.status_code, bad.json()["field"]) == (400, "since")
    assert client.get(url, {"format": "csv", "until": events[1]["at"]}).content.count(b"\n") == 2
