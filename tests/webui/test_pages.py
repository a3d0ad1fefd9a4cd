"""The dashboard's pages through Django's test client: roles, actions, inline errors, what-if
writing nothing, static files, and query budgets that do not grow with the jobs or the nodes."""

from __future__ import annotations

import copy
import datetime as dt
import gzip
import importlib.metadata
import json
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.template.loader import render_to_string
from django.test import Client
from django.utils import timezone

from controlplane.incidents import decisions
from controlplane.incidents.models import (
    AgentCommand,
    DecisionStatus,
    Drill,
    Failure,
    FailureSource,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs import liveness
from controlplane.jobs.models import Device, DeviceState, Job, Node, NodeStatus
from controlplane.jobs.services import create_job
from controlplane.simulations.models import Sweep, SweepStatus
from tests.controlplane.test_api import SCENARIO, client_as, proposed, user
from webui import data
from webui import views as webui_views
from worker_agent import protocol

pytestmark = pytest.mark.django_db


def text(response: Any) -> str:
    return str(response.content.decode())


# --- login, roles, static files ------------------------------------------------------------


def test_landing_page_links_health_schema_and_login(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 200
    page = text(response)
    assert "Pitstop control plane" in page
    assert 'href="/healthz"' in page and 'href="/api/schema/"' in page
    assert 'href="/accounts/login/"' in page


def test_logging_in_shows_the_jobs_and_logging_out_needs_a_post(client: Client) -> None:
    viewer = User.objects.create_user("vic", password="pw-vic-1")
    viewer.groups.add(Group.objects.get_or_create(name="viewer")[0])
    response = client.post("/accounts/login/", {"username": "vic", "password": "pw-vic-1"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert "<h1>Jobs</h1>" in text(client.get("/"))
    assert client.post("/accounts/logout/").status_code == 302
    assert "Log in to the dashboard" in text(client.get("/"))


@pytest.mark.parametrize(
    "url", ["/jobs/", "/jobs/1/", "/jobs/1/what-if/", "/recoveries/1/", "/simulations/"]
)
def test_pages_need_a_login_and_a_role(url: str) -> None:
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert client_as(None).get(url).status_code == 403


def test_plotly_and_the_dashboards_files_are_served_without_collecting_them() -> None:
    client = Client()
    version = importlib.metadata.version("plotly")
    url = f"/static/vendor/plotly-{version}/plotly.min.js"
    assert f'data-plotly="{url}"' in text(client.get("/"))
    plotly = client.get(url)
    assert plotly.status_code == 200 and not plotly.has_header("Content-Encoding")
    raw = b"".join(plotly.streaming_content)  # type: ignore[attr-defined]
    assert b"plotly" in raw[:2000].lower()
    # its address names its version: a browser keeps it for good
    assert plotly["Cache-Control"] == "max-age=315360000, public, immutable"
    for name in ("style.css", "job.js", "recovery.js", "simulation.js", "charts.js"):
        answer = client.get(f"/static/webui/{name}")
        assert answer.status_code == 200, name
        assert answer["Cache-Control"] == "max-age=60, public", name  # ours: revalidated


def test_static_files_are_gzipped_for_a_browser_that_accepts_it_each_once() -> None:
    client = Client()
    url = f"/static/vendor/plotly-{importlib.metadata.version('plotly')}/plotly.min.js"
    raw = b"".join(client.get(url).streaming_content)  # type: ignore[attr-defined]
    for _ in range(2):  # the second from memory
        packed = client.get(url, headers={"Accept-Encoding": "gzip, deflate, br"})
        assert packed["Content-Encoding"] == "gzip" and "Accept-Encoding" in packed["Vary"]
        assert gzip.decompress(packed.content) == raw
        assert int(packed["Content-Length"]) == len(packed.content) < 0.4 * len(raw)
        assert packed["Cache-Control"].endswith("immutable")
    css = client.get("/static/webui/style.css", headers={"Accept-Encoding": "gzip"})
    plain = b"".join(client.get("/static/webui/style.css").streaming_content)  # type: ignore[attr-defined]
    assert css["Content-Encoding"] == "gzip" and gzip.decompress(css.content) == plain
    # a range, and a browser that does not take gzip, get WhiteNoise's own answer
    ranged = client.get(url, headers={"Accept-Encoding": "gzip", "Range": "bytes=0-99"})
    assert ranged.status_code == 206 and not ranged.has_header("Content-Encoding")
    assert b"".join(ranged.streaming_content) == raw[:100]  # type: ignore[attr-defined]
    identity = client.get(url, headers={"Accept-Encoding": "identity"})
    assert not identity.has_header("Content-Encoding")


# --- jobs ----------------------------------------------------------------------------------


def test_the_jobs_list_highlights_decisions_needing_approval() -> None:
    waiting = proposed("manual")
    Node.objects.filter(job=waiting.job).update(status=NodeStatus.HEALTHY)  # every node joined
    create_job("quiet", copy.deepcopy(SCENARIO))  # no node has said hello yet
    page = text(client_as("viewer").get("/jobs/"))
    rows = re.findall(
        r"<tr class=\"([^\"]*)\">\s*<th scope=\"row\"><a href=\"/jobs/(\d+)/\">", page
    )
    assert rows[0] == ("attention", str(waiting.job_id))  # first, highlighted
    assert rows[1][0] == ""
    assert f'href="/recoveries/{waiting.pk}/"' in page and "needs approval" in page
    assert re.search(r"<td>7 / <span class=\"bad\">1</span> \(2\)</td>", page)  # device 5 down
    unheard = r"<td>0 / <span class=\"\">0</span> \(0\), <span class=\"unheard\">10 not yet heard"
    assert re.search(unheard, page)


def test_the_jobs_list_names_the_policy_that_chose_the_running_plan() -> None:
    decision = proposed("manual")
    operator = client_as("operator")
    operator.post(f"/recoveries/{decision.pk}/approve/")
    chosen = RecoveryDecision.objects.get(pk=decision.pk)
    policy = chosen.candidates[chosen.chosen or 0]["policy"]
    row = text(operator.get("/jobs/")).split("<tbody>")[1]
    assert f"<td>{policy}</td>" in row


def many_jobs(count: int) -> None:
    for i in range(count):
        create_job(f"bulk-{i}", copy.deepcopy(SCENARIO))


@pytest.mark.parametrize("jobs", [2, 12])
def test_the_jobs_list_takes_the_same_queries_for_any_number_of_jobs(
    jobs: int, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    many_jobs(jobs)
    proposed("manual")
    viewer = client_as("viewer")
    with django_assert_max_num_queries(5):
        assert viewer.get("/jobs/").status_code == 200


def big_job(nodes: int, per_node: int = 8) -> Job:
    """A job of ``nodes`` × ``per_node`` devices, rows written directly (the page reads rows,
    not the core)."""
    job, _ = create_job(f"big-{nodes}", copy.deepcopy(SCENARIO))
    Device.objects.filter(job=job).delete()
    Node.objects.filter(job=job).delete()
    made = Node.objects.bulk_create(
        Node(job=job, name=f"node-{i}", index=i, status="healthy") for i in range(nodes)
    )
    Device.objects.bulk_create(
        (
            Device(job=job, node=node, index=n * per_node + k, state=DeviceState.HEALTHY)
            for n, node in enumerate(made)
            for k in range(per_node)
        ),
        batch_size=2000,
    )
    Device.objects.filter(job=job, index__in=[3, 9]).update(state=DeviceState.FAILED)
    return job


@pytest.mark.parametrize("nodes", [2, 2048])
def test_the_job_page_takes_the_same_queries_at_2_and_2048_nodes(
    nodes: int, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    job = big_job(nodes)
    viewer = client_as("viewer")
    viewer.get(f"/jobs/{job.pk}/")  # the session and the templates, once
    with django_assert_max_num_queries(8):
        started = time.perf_counter()
        response = viewer.get(f"/jobs/{job.pk}/")
        took = time.perf_counter() - started
    assert response.status_code == 200
    config = json.loads(text(response).split('id="job-config" type="application/json">')[1]
                        .split("</script>")[0])  # fmt: skip
    assert len(config["states"]) == nodes * 8 and config["states"][3] == "f"
    assert len(config["nodes"]) == nodes and config["nodes"][1][1:3] == [8, 8]
    print(f"job page, {nodes} nodes: {took * 1000:.0f} ms")  # -s shows it
    assert took < 1.0  # 300 ms is the aim; a shared CI machine gets slack


def test_the_jobs_list_with_a_2048_node_job_stays_in_budget(
    django_assert_max_num_queries: Callable[..., Any],
) -> None:
    big_job(2048)
    viewer = client_as("viewer")
    viewer.get("/jobs/")
    with django_assert_max_num_queries(5):
        started = time.perf_counter()
        assert viewer.get("/jobs/").status_code == 200
        took = time.perf_counter() - started
    print(f"jobs list with a 2048-node job: {took * 1000:.0f} ms")
    assert took < 1.0


@pytest.mark.parametrize("nodes", [2, 2048])
def test_the_what_if_page_takes_the_same_queries_at_2_and_2048_nodes(
    nodes: int, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    job = big_job(nodes)
    viewer = client_as("viewer")
    viewer.get(f"/jobs/{job.pk}/what-if/")
    with django_assert_max_num_queries(6):
        assert viewer.get(f"/jobs/{job.pk}/what-if/").status_code == 200


# --- recoveries ----------------------------------------------------------------------------


def test_a_viewer_sees_the_candidates_but_no_button_and_cannot_approve() -> None:
    decision = proposed("manual")
    viewer = client_as("viewer")
    page = text(viewer.get(f"/recoveries/{decision.pk}/"))
    assert "odyssey" in page and "checkpoint" in page
    # nobody chose yet: the best is proposed, not chosen
    assert '<span class="mark">proposed</span>' in page and "✔ chosen" not in page
    assert "% of the fastest" in page and " / 59.6\xa0GB" in page  # throughput, capacity
    assert 'id="approve"' not in page and 'id="override"' not in page
    assert "needs the operator role" in page
    assert viewer.post(f"/recoveries/{decision.pk}/approve/").status_code == 403
    assert viewer.post(f"/recoveries/{decision.pk}/override/", {"candidate": 0}).status_code == 403
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.PROPOSED


def test_an_operator_approves_with_the_csrf_token() -> None:
    decision = proposed("manual")
    operator = Client(enforce_csrf_checks=True)
    operator.force_login(user("operator"))
    page = text(operator.get(f"/recoveries/{decision.pk}/"))
    assert 'id="approve"' in page and 'id="override"' in page
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    url = f"/recoveries/{decision.pk}/approve/"
    assert operator.post(url, {"reason": "x"}).status_code == 403  # no token, refused
    response = operator.post(url, {"reason": "looks right", "csrfmiddlewaretoken": token[1]})
    assert response.status_code == 302
    approved = RecoveryDecision.objects.get(pk=decision.pk)
    assert approved.status == DecisionStatus.APPLYING and approved.reason == "looks right"
    again = operator.post(url, {"csrfmiddlewaretoken": token[1]})
    assert again.status_code == 409
    who = approved.chosen_by.get_username()  # type: ignore[union-attr]
    policy = approved.candidates[approved.chosen]["policy"]  # type: ignore[index]
    said = re.search(r'<p class="error" role="alert">(.*?)</p>', text(again), re.S)
    assert said is not None
    assert re.fullmatch(
        rf"Nothing was changed: {who} approved #{approved.chosen} \({policy}\) at "
        r"\d\d:\d\d:\d\d UTC: looks right\.",
        said[1],
    ), said[1]


def test_a_rejected_edited_plan_shows_the_cores_error_beside_the_field() -> None:
    decision = proposed("manual")
    operator = client_as("operator")
    plan = copy.deepcopy(decision.plan)
    assert plan is not None
    plan["pipelines"][0]["stages"][1]["devices"] = [5]  # device 5 is the one that failed
    response = operator.post(
        f"/recoveries/{decision.pk}/override/",
        {"use": "plan", "plan": json.dumps(plan), "reason": "try"},
    )
    assert response.status_code == 200
    page = text(response)
    error = re.search(r'<p class="error" id="plan-error" role="alert">(.*?)</p>', page, re.S)
    assert error is not None and "<code>plan.pipelines[0].stages[1]" in error[1], error
    assert 'aria-invalid="true" aria-describedby="plan-error"' in page
    assert '"devices": [\n      5\n' in page or "[5]" in page.replace(" ", "")  # kept as typed
    assert RecoveryDecision.objects.get(pk=decision.pk).status == DecisionStatus.PROPOSED
    bad = operator.post(f"/recoveries/{decision.pk}/override/", {"use": "plan", "plan": "{"})
    assert bad.status_code == 200 and "not JSON" in text(bad)
    # the line where it breaks is quoted: the editor has no line numbers
    typo = '{\n "pipelines": [\n  {"stages": [], "micro_batches": 2,}\n ]\n}'
    said = text(
        operator.post(f"/recoveries/{decision.pk}/override/", {"use": "plan", "plan": typo})
    )
    assert "at line 3, column 37: {&quot;stages&quot;: [], &quot;micro_batches&quot;: 2,}" in said


def test_an_operator_overrides_with_another_candidate_or_an_edited_plan() -> None:
    decision = proposed("manual")
    operator = client_as("operator")
    other = next(
        i for i, c in enumerate(decision.candidates) if c["code"] == "ok" and i != decision.chosen
    )
    response = operator.post(
        f"/recoveries/{decision.pk}/override/", {"use": "candidate", "candidate": other}
    )
    assert response.status_code == 302
    done = RecoveryDecision.objects.get(pk=decision.pk)
    assert done.chosen == other and done.status == DecisionStatus.APPLYING
    page = text(operator.get(f"/recoveries/{decision.pk}/"))
    assert "overrode the proposal" in page and 'id="approve"' not in page
    second = proposed("manual")
    plan = json.dumps(second.plan)
    edited = operator.post(f"/recoveries/{second.pk}/override/", {"use": "plan", "plan": plan})
    assert edited.status_code == 302
    assert RecoveryDecision.objects.get(pk=second.pk).chosen is None


def test_a_plan_too_large_to_inline_is_loaded_into_the_editor_on_demand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decision = proposed("manual")
    chosen_plan = decision.candidates[decision.chosen]["plan"]  # type: ignore[index]
    small = text(client_as("operator").get(f"/recoveries/{decision.pk}/"))
    assert 'id="load-plan"' not in small and "&quot;pipelines&quot;" in small  # inlined
    monkeypatch.setattr(webui_views, "PREFILL_LIMIT", 100)
    page = text(client_as("operator").get(f"/recoveries/{decision.pk}/"))
    assert 'id="load-plan"' in page and "&quot;pipelines&quot;" not in page
    url = f"/recoveries/{decision.pk}/proposal/"
    assert f'data-url="{url}"' in page
    assert client_as("viewer").get(url).json() == chosen_plan
    assert client_as(None).get(url).status_code == 403


def test_the_recovery_page_shows_the_phases_and_links_the_exports() -> None:
    decision = proposed("auto")
    page = text(client_as("viewer").get(f"/recoveries/{decision.pk}/"))
    phases = json.loads(page.split('id="phases" type="application/json">')[1].split("</script>")[0])
    assert [p["phase"] for p in phases] == [
        "detect", "plan", "approve", "transfer", "restart", "first_step"
    ]  # fmt: skip
    assert phases[1]["seconds"] is not None and phases[0]["start"]
    api = f"/api/v1/recoveries/{decision.pk}/timeline/"
    assert f'href="{api}?format=json"' in page and f'href="{api}?format=csv"' in page


# --- what-if -------------------------------------------------------------------------------


def rows_now(job: Job) -> tuple[Any, ...]:
    return (
        Failure.objects.count(),
        RecoveryDecision.objects.count(),
        TimelineEvent.objects.count(),
        list(Device.objects.filter(job=job).order_by("index").values_list("state", flat=True)),
        Job.objects.filter(pk=job.pk).values_list("status", "plan")[0],
    )


def test_what_if_compares_the_policies_and_writes_nothing() -> None:
    job, _ = create_job(
        "what", copy.deepcopy(SCENARIO), enabled_policies=["dynamic", "checkpoint", "rerouting"]
    )
    before = rows_now(job)
    viewer = client_as("viewer")
    response = viewer.post(f"/jobs/{job.pk}/what-if/", {"devices": "4-5", "kind": "crash"})
    assert response.status_code == 200
    page = text(response)
    assert "If devices 4, 5 failed (crash)" in page and '<span class="mark">proposed</span>' in page
    assert "dynamic" in page and "checkpoint" in page and "rerouting" in page
    assert "The plan" in page and "would apply" in page and '<table class="plan">' in page
    node = viewer.post(f"/jobs/{job.pk}/what-if/", {"node": "1", "kind": "node_lost"})
    assert "If devices 8, 9 failed (node_lost)" in text(node)
    upload = copy.deepcopy(SCENARIO)
    upload["failed"] = [0]
    uploaded = viewer.post(
        f"/jobs/{job.pk}/what-if/",
        {"scenario": SimpleUploadedFile("s.json", json.dumps(upload).encode()), "kind": "crash"},
    )
    assert (
        uploaded.status_code == 200
        and "If device 0 of the uploaded scenario s.json failed (crash)" in text(uploaded)
    )
    assert rows_now(job) == before


def test_what_if_errors_are_shown_beside_the_field() -> None:
    job, _ = create_job("what-bad", copy.deepcopy(SCENARIO))
    viewer = client_as("viewer")
    response = viewer.post(f"/jobs/{job.pk}/what-if/", {"devices": "99"})
    assert response.status_code == 200
    assert "<code>devices</code>" in text(response) and 'aria-invalid="true"' in text(response)
    assert "devices: " not in text(response)  # the field named once, beside its message
    junk = viewer.post(f"/jobs/{job.pk}/what-if/", {"devices": "a-b"})
    assert "not a device id" in text(junk)


@pytest.mark.parametrize(
    ("form", "said"),
    [
        ({"node": "²"}, "is not a node index"),  # "²".isdigit(), int() refuses it
        ({"devices": "0-3000000"}, "<code>devices</code>: at most 65536 devices"),
        ({"devices": "9" * 5000}, "is not a device id or a range"),
    ],
)
def test_what_if_bounds_what_it_reads(form: dict[str, str], said: str) -> None:
    job, _ = create_job("what-bounds", copy.deepcopy(SCENARIO))
    response = client_as("viewer").post(f"/jobs/{job.pk}/what-if/", form)
    assert response.status_code == 200 and said in text(response)  # refused before expanding


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"seeds": "1e400"}, "seeds"), ({"base_seed": "-1e400"}, "base_seed"),
     ({"hours": "nan"}, "hours"), ({"spares": "²"}, "spares")],
)  # fmt: skip
def test_simulation_numbers_beyond_range_are_named(extra: dict[str, str], field: str) -> None:
    job, _ = create_job("sim-range", copy.deepcopy(SCENARIO))
    form = {"job": job.pk, "policies": ["dynamic"], "hours": "1", **extra}
    response = client_as("operator").post("/simulations/", form)
    assert response.status_code == 200 and f"<code>{field}</code>" in text(response)
    assert not Sweep.objects.exists()


# --- simulations ---------------------------------------------------------------------------


def test_an_operator_starts_a_simulation_and_sees_its_summary(
    eager_planning: None, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    job, _ = create_job("sim", copy.deepcopy(SCENARIO))
    operator = client_as("operator")
    form = {
        "job": job.pk, "name": "small", "policies": ["dynamic", "checkpoint"], "hours": "1",
        "seeds": "1", "base_seed": "0", "rate": "0.05", "repair_hours": "1", "spares": "3",
    }  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        response = operator.post("/simulations/", form)
    assert response.status_code == 302
    sweep = Sweep.objects.get()
    assert response["Location"] == f"/simulations/{sweep.pk}/"
    assert sweep.status == SweepStatus.DONE and sweep.scenario["cluster"]["spares"] == 3
    page = text(operator.get(response["Location"]))
    assert 'id="progress"' in page and '"status": "done"' in page
    listed = text(client_as("viewer").get("/simulations/"))
    assert f'href="/simulations/{sweep.pk}/"' in listed and 'id="sweep-form"' not in listed


def test_a_viewer_cannot_start_a_simulation_and_bad_input_is_named() -> None:
    job, _ = create_job("sim-bad", copy.deepcopy(SCENARIO))
    form = {"job": job.pk, "policies": ["dynamic"], "hours": "1", "trace": "[1]"}
    assert client_as("viewer").post("/simulations/", form).status_code == 403
    response = client_as("operator").post("/simulations/", form)
    assert response.status_code == 200 and "<code>trace</code>" in text(response)
    unknown = client_as("operator").post("/simulations/", {**form, "trace": "", "policies": ["x"]})
    assert unknown.status_code == 200 and "policies" in text(unknown)
    assert not Sweep.objects.exists()


def test_a_trace_file_is_replayed_and_a_bad_one_is_named(
    eager_planning: None, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    job, _ = create_job("sim-trace", copy.deepcopy(SCENARIO))
    operator = client_as("operator")
    form = {"job": job.pk, "policies": ["dynamic"], "hours": "1", "seeds": "2"}
    bad = SimpleUploadedFile("t.csv", b"time_s,devices\n60,99\n", content_type="text/csv")
    response = operator.post("/simulations/", {**form, "trace_file": bad})
    assert response.status_code == 200 and "<code>trace_csv:2:devices</code>" in text(response)
    assert not Sweep.objects.exists()
    trace = b"time_s,devices,kind,repair_s\n600,3,crash,1800\n"
    good = SimpleUploadedFile("t.csv", trace, content_type="text/csv")
    with django_capture_on_commit_callbacks(execute=True):
        response = operator.post("/simulations/", {**form, "trace_file": good})
    assert response.status_code == 302
    sweep = Sweep.objects.get()
    assert sweep.status == SweepStatus.DONE and sweep.experiment["trace_csv"] == trace.decode()
    assert sweep.summary is not None
    dynamic = sweep.summary["policies"]["dynamic"]
    assert dynamic["recoveries_mean"] == 1.0, dynamic  # the one failure the file names, each seed


# --- drills --------------------------------------------------------------------------------


def drill_form(client: Client, job: Job, **fields: str) -> Any:
    return client.post(f"/jobs/{job.pk}/drills/", fields)


def test_a_viewer_sees_the_drills_but_no_form_and_cannot_inject() -> None:
    job, _ = create_job("drilled", copy.deepcopy(SCENARIO))
    viewer = client_as("viewer")
    page = text(viewer.get(f"/jobs/{job.pk}/"))
    assert 'id="drills-h"' in page and 'id="drill-form"' not in page
    assert drill_form(viewer, job, node="node-0", kind="kill", device="0").status_code == 403
    assert not Drill.objects.exists()


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"node": "node-0", "kind": "kill", "device": "0"}, "node", "is not connected"),
        ({"node": "node-0", "kind": "kill", "device": "99"}, "device", "is not on node-0"),
        ({"node": "node-0", "kind": "kill", "device": "x"}, "device", "a device number"),
        ({"node": "node-0", "kind": "hang", "device": "0", "seconds": "5s"}, "seconds", "seconds"),
        ({"node": "node-9", "kind": "nan", "device": "0"}, "node", "has no node"),
        ({"node": "node-0", "kind": "melt", "device": "0"}, "kind", "Input should be"),
    ],
)
def test_a_refused_drill_is_shown_beside_its_field_and_nothing_is_sent(
    fields: dict[str, str], field: str, message: str
) -> None:
    job, _ = create_job("drilled", copy.deepcopy(SCENARIO))
    response = drill_form(client_as("operator"), job, **fields)
    assert response.status_code == 200  # the form again, its error beside the field
    page = text(response)
    shown = re.search(r'<p class="error" id="drill-error" role="alert">(.*?)</p>', page, re.S)
    assert shown is not None and f"<code>{field}</code>" in shown[1] and message in shown[1], page
    assert 'aria-invalid="true" aria-describedby="drill-error"' in page or field == "kind"
    assert not Drill.objects.exists()


def test_an_operators_drill_to_a_connected_node_is_sent_and_listed() -> None:
    job, _ = create_job("drilled", copy.deepcopy(SCENARIO))
    redis = liveness.sync_client()
    redis.zadd(liveness.seen_key(job.pk), {"node-0": time.time()})  # as its agent's hello does
    try:
        operator = client_as("operator")
        response = drill_form(operator, job, node="node-0", kind="hang", device="3", seconds="5")
    finally:
        redis.zrem(liveness.seen_key(job.pk), "node-0")
    assert response.status_code == 302 and response["Location"].endswith("#drills-h")
    drill = Drill.objects.get()
    assert (drill.node.name, drill.kind, drill.device, drill.seconds) == ("node-0", "hang", 3, 5.0)
    assert drill.sent_at is not None and drill.requested_by.startswith("user:u-operator")
    row = re.search(r'<table id="drills">.*?<tbody><tr>(.*?)</tr>', text(operator.get(
        f"/jobs/{job.pk}/")), re.S)  # fmt: skip
    assert row is not None and "hang 5 s" in row[1] and "node-0 device 3" in row[1]
    assert "<td>sent</td>" in row[1]


def test_an_unknown_page_is_the_dashboards_own_not_found_page() -> None:
    response = client_as("viewer").get("/recoveries/987654/")
    assert response.status_code == 404
    page = text(response)
    assert "<h1>Not found</h1>" in page and "/recoveries/987654/" in page
    assert 'href="/jobs/"' in page and "Log out" in page  # the dashboard's frame, still logged in


def test_a_wrong_password_keeps_the_user_name_and_asks_for_the_password() -> None:
    user("operator")
    response = Client().post("/accounts/login/", {"username": "operator", "password": "wrong"})
    page = text(response)
    assert "Wrong user name or password." in page
    assert 'name="username"' in page and 'value="operator"' in page
    field = re.search(r'<input id="id_password"[^>]*>', page)
    assert field is not None and "autofocus" in field[0]


def test_the_proposals_waiting_are_counted_for_every_page_and_their_deadline_shown() -> None:
    waiting = proposed("manual_with_timeout")
    proposed("auto")  # applied at once: nobody is waited for
    viewer = client_as("viewer")
    body = viewer.get("/attention/").json()
    assert body["count"] == 1
    (shown,) = body["waiting"]
    assert (shown["id"], shown["url"]) == (waiting.pk, f"/recoveries/{waiting.pk}/")
    assert waiting.deadline_at is not None
    assert shown["deadline_at"] == waiting.deadline_at.isoformat()
    page = text(viewer.get(f"/recoveries/{waiting.pk}/"))
    assert f'data-deadline="{waiting.deadline_at.isoformat()}"' in page
    assert 'data-attention="/attention/"' in page and "webui/attention.js" in page
    assert Client().get("/attention/").status_code == 302  # to the login
    assert client_as(None).get("/attention/").status_code == 403


def test_the_recovery_page_says_what_approve_applies_groups_equal_plans_and_explains_codes() -> (
    None
):
    job, _ = create_job(
        "same", copy.deepcopy(SCENARIO), approval_mode="manual",
        enabled_policies=["dynamic", "odyssey", "checkpoint"],
    )  # fmt: skip
    _, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now()
    )
    decisions.plan(decision.pk)
    stored = RecoveryDecision.objects.get(pk=decision.pk)
    candidates = stored.candidates
    page = text(client_as("operator").get(f"/recoveries/{decision.pk}/"))
    assert stored.chosen is not None
    best = candidates[stored.chosen]
    assert f"Approve: apply #{stored.chosen} ({best['policy']}" in page
    plans = [
        json.dumps(c["plan"], sort_keys=True) if c["code"] == "ok" else None for c in candidates
    ]
    repeats = [(i, plans.index(p)) for i, p in enumerate(plans) if p and plans.index(p) < i]
    assert repeats, "dynamic and odyssey's re-plan propose the same plan here"
    for _, first in repeats:
        assert f"same plan as #{first} ({candidates[first]['policy']})" in page
    assert page.count("same plan as #") == len(repeats)
    assert 'title="the plan applies">ok</code>' in page  # every code explained where it shows


def test_a_plan_of_pipelines_with_different_stage_counts_keeps_its_columns() -> None:
    plan = {
        "pipelines": [
            {"stages": [{"devices": [0], "layers": [0, 2]}, {"devices": [1], "layers": [2, 4]},
                        {"devices": [2], "layers": [4, 6]}, {"devices": [3], "layers": [6, 8]}],
             "micro_batches": 4},
            {"stages": [{"devices": [4], "layers": [0, 3]}, {"devices": [5], "layers": [3, 5]},
                        {"devices": [6], "layers": [5, 8]}], "micro_batches": 7},
        ]
    }  # fmt: skip
    html = render_to_string("webui/_plan.html", {"plan": data.plan_rows(plan)})
    rows = re.findall(r"<tr><th scope=\"row\">.*?</tr>", html, re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in rows]
    assert [len(c) for c in cells] == [5, 5]  # four stage columns and the micro-batches
    assert cells[1][3] == "" and cells[1][4] == "7" and cells[0][4] == "4"


# --- live parts, conflicts, ended sessions -------------------------------------------------


def plan_devices(html: str) -> set[int]:
    """The devices a plan table's cells name ("dev 0, 1" under each stage's layers)."""
    cells = re.findall(r"<small>dev ([^<·]*)", html)
    return {int(d) for cell in cells for d in cell.split(",") if d.strip()}


def test_the_job_pages_parts_are_drawn_again_after_a_decision_and_a_drill() -> None:
    job, _ = create_job("parts", copy.deepcopy(SCENARIO), approval_mode="auto",
                        enabled_policies=["dynamic"])  # fmt: skip
    viewer = client_as("viewer")
    url = f"/jobs/{job.pk}/parts/"
    assert f'"parts_url": "{url}"' in text(viewer.get(f"/jobs/{job.pk}/"))
    before = viewer.get(url).json()
    assert set(before) == {"plan", "recent", "drills"}
    assert "None yet" in before["recent"] and "None yet" in before["drills"]
    running = {d for p in job.plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert 5 in running and plan_devices(before["plan"]) == running

    _, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now()
    )
    decisions.plan(decision.pk)  # auto: applied, the job's plan is the new one
    node = Node.objects.get(job=job, name="node-0")
    Drill.objects.create(job=job, node=node, kind="kill", device=2, requested_by="ops")
    after = viewer.get(url).json()
    assert f'href="/recoveries/{decision.pk}/"' in after["recent"]
    status = RecoveryDecision.objects.get(pk=decision.pk).status
    assert f'<span class="badge {status}">{status}</span>' in after["recent"]
    shown = plan_devices(after["plan"])
    assert shown and 5 not in shown, "the plan part still runs on the failed device"
    assert "node-0 device 2" in after["drills"] and "kill" in after["drills"]
    assert Client().get(url).status_code == 302
    assert client_as(None).get(url).status_code == 403


def test_a_second_operator_is_told_who_decided_first_and_the_page_can_see_it() -> None:
    decision = proposed("manual")
    first, second = client_as("operator"), client_as("operator")
    state = f"/recoveries/{decision.pk}/state/"
    waiting = second.get(state).json()
    assert waiting["status"] == "proposed" and waiting["decided"] is None
    other = next(
        i for i, c in enumerate(decision.candidates) if c["code"] == "ok" and i != decision.chosen
    )
    form = {"use": "candidate", "candidate": other, "reason": "faster restart"}
    done = first.post(f"/recoveries/{decision.pk}/override/", form)
    assert done.status_code == 302
    chooser = RecoveryDecision.objects.get(pk=decision.pk).chosen_by
    assert chooser is not None
    overrider = chooser.get_username()
    policy = decision.candidates[other]["policy"]
    now = second.get(state).json()
    assert now["status"] == "applying" and now["events"] > waiting["events"]
    expected = (
        rf"{overrider} overrode the proposal with #{other} \({policy}\) at \d\d:\d\d:\d\d UTC: "
        "faster restart"
    )
    assert re.fullmatch(expected, now["decided"]), now["decided"]
    late = second.post(f"/recoveries/{decision.pk}/approve/")
    assert late.status_code == 409
    assert re.search(f"Nothing was changed: {expected}\\.", text(late))
    also = second.post(f"/recoveries/{decision.pk}/override/", {"use": "candidate", "candidate": 0})
    assert also.status_code == 409 and re.search(f"Nothing was changed: {expected}", text(also))
    assert RecoveryDecision.objects.get(pk=decision.pk).chosen == other


def test_a_pages_script_is_told_the_session_ended_a_browser_is_sent_to_log_in() -> None:
    for url in ("/attention/", "/jobs/1/parts/", "/recoveries/1/state/"):
        asked = Client().get(url, headers={"Accept": "application/json"})
        assert asked.status_code == 401 and asked.json()["login"] == "/accounts/login/"
        browsed = Client().get(url, headers={"Accept": "text/html,application/json;q=0.9"})
        assert browsed.status_code == 302 and browsed["Location"].startswith("/accounts/login/")


# --- what a plan changes, and what it trades ------------------------------------------------


def pipeline(*stages: tuple[list[int], int, int], micro_batches: int = 8) -> dict[str, Any]:
    return {
        "stages": [{"devices": d, "layers": [a, b]} for d, a, b in stages],
        "micro_batches": micro_batches,
    }


TWO_BY_TWO = {
    "pipelines": [
        pipeline(([0], 0, 16), ([1], 16, 32)),
        pipeline(([2], 0, 16), ([3], 16, 32)),
    ]
}


def test_a_plans_changes_name_the_devices_pipelines_and_layers_that_move() -> None:
    replanned = {"pipelines": [pipeline(([0], 0, 11), ([1], 11, 22), ([2], 22, 32))]}
    assert data.plan_changes(TWO_BY_TWO, replanned) == [
        "Devices dropped: 3; devices added: none.",
        "Pipelines: 2 pipelines (2 of 2 stages) → 1 pipeline (1 of 3 stages).",
        "Of the 3 devices in both, 0 keep their layers and 3 take others (0, 1, 2).",
        "Layers by stage: 0–16 | 16–32; 0–16 | 16–32 → 0–11 | 11–22 | 22–32.",
    ]
    swapped = copy.deepcopy(TWO_BY_TWO)
    swapped["pipelines"][1]["stages"][1]["devices"] = [9]  # a spare in place of device 3
    assert data.plan_changes(TWO_BY_TWO, swapped) == [
        "Devices dropped: 3; devices added: 9.",
        "Pipelines: 2 pipelines (2 of 2 stages) → 2 pipelines (2 of 2 stages).",
        "Of the 3 devices in both, 3 keep their layers and 0 take others.",
    ]
    assert data.plan_changes(None, swapped) == [] and data.plan_changes(TWO_BY_TWO, {}) == []


def row(index: int, policy: str, rate: float, down: float, **more: Any) -> dict[str, Any]:
    return {"index": index, "policy": policy, "ok": True, "throughput": rate,
            "transition": {"total_s": down}, "objective": rate * 3600 / (3600 + down),
            "same_as": None, **more}  # fmt: skip


def test_the_trade_is_told_in_seconds_down_against_throughput_after() -> None:
    mine = row(0, "dynamic", 100.0, 2.0)
    slower_start = row(1, "odyssey", 110.0, 12.0)
    # the other plan has trained as many samples at x: 100 (x - 2) = 110 (x - 12), x = 112 s
    told = data.tradeoff([mine, slower_start], mine)
    assert told == (
        "#0 (dynamic) stops training for about 2.00 s, then trains at 100.00 samples/s. "
        "#1 (odyssey) would stop it 10.00 s longer for 10% more throughput after: it has "
        "trained more only 112 s after the failure. The objective (eq. 8) weighs that against "
        "the expected time to the next fault."
    )
    quicker = row(1, "checkpoint", 80.0, 1.0)
    assert "would stop it 1.00 s less but train 20% slower after" in data.tradeoff(
        [mine, quicker], mine
    )
    # a candidate with the same plan is the same choice, not an alternative
    twin = row(2, "odyssey", 130.0, 0.5, same_as=0)
    assert data.tradeoff([mine, twin], mine).endswith("No other policy's plan applies.")
    assert data.tradeoff([mine, twin, quicker], mine).count("#2") == 0
    assert data.tradeoff([mine], None) == ""


def test_the_recovery_page_says_what_the_proposal_changes_and_trades() -> None:
    decision = proposed("manual")  # device 5 of 8 crashed
    page = text(client_as("viewer").get(f"/recoveries/{decision.pk}/"))
    assert "What the proposal changes" in page
    changes = re.search(r'<ul class="changes" id="changes">(.*?)</ul>', page, re.S)
    assert changes is not None and "<li>Devices dropped: 5" in changes[1]
    assert re.search(r'id="tradeoff">#\d+ \(\w+\) stops training for about [\d.]+ s', page)


# --- the jobs list's filters and archive, the incidents page -----------------------------------


def names_listed(page: str) -> list[str]:
    return re.findall(r'<th scope="row"><a href="/jobs/\d+/">([^<]+)</a>', page)


def test_the_jobs_list_filters_sorts_and_keeps_finished_jobs_in_an_archive() -> None:
    for name, status in (("alpha", "running"), ("beta", "stopped"), ("gamma", "failed"),
                         ("delta", "pending")):  # fmt: skip
        job, _ = create_job(name, copy.deepcopy(SCENARIO))
        Job.objects.filter(pk=job.pk).update(status=status)
    viewer = client_as("viewer")

    def listed(**query: str) -> list[str]:
        return names_listed(text(viewer.get("/jobs/", query)))

    assert sorted(listed()) == ["alpha", "delta"]  # running and waiting: not the finished
    assert sorted(listed(show="archived")) == ["beta", "gamma"]
    assert "Archive of finished jobs (2)" in text(viewer.get("/jobs/"))
    assert listed(show="all", sort="name") == ["alpha", "beta", "delta", "gamma"]
    assert listed(show="all", sort="oldest") == ["alpha", "beta", "gamma", "delta"]
    assert listed(show="all", sort="newest") == ["delta", "gamma", "beta", "alpha"]
    assert listed(name="AL") == ["alpha"] and listed(show="all", status="stopped") == ["beta"]
    refused = text(viewer.get("/jobs/", {"sort": "size", "status": "asleep"}))
    assert "sort: &#x27;size&#x27; is not one of attention, newest" in refused
    assert "status: &#x27;asleep&#x27; is not one of" in refused
    assert sorted(names_listed(refused)) == ["alpha", "delta"]  # the defaults, not nothing
    assert "No job matches." in text(viewer.get("/jobs/", {"name": "zeta"}))


def test_the_incidents_page_lists_every_jobs_failures_with_filters_and_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = proposed("manual")  # crash of device 5
    second = proposed("auto")
    old_job, _ = create_job("old-one", copy.deepcopy(SCENARIO))
    _, old = decisions.record_failure(
        old_job, kind="node_lost", devices=[0, 1, 2, 3], source=FailureSource.SOCKET,
        occurred_at=timezone.now(),
    )  # fmt: skip
    Failure.objects.filter(pk=old.failure_id).update(
        detected_at=timezone.now() - dt.timedelta(days=2)
    )
    viewer = client_as("viewer")

    def shown(**query: str) -> list[int]:
        page = text(viewer.get("/incidents/", query))
        return [int(n) for n in re.findall(r'<a href="/recoveries/(\d+)/">#', page)]

    assert shown() == [second.pk, first.pk, old.pk]  # newest detected first
    assert shown(job=str(first.job_id)) == [first.pk]
    assert shown(kind="node_lost") == [old.pk] and shown(kind="crash") == [second.pk, first.pk]
    assert shown(status="proposed") == [first.pk]
    assert shown(within="day") == [second.pk, first.pk]
    refused = text(viewer.get("/incidents/", {"kind": "meteor"}))
    assert "kind: &#x27;meteor&#x27; is not one of" in refused and len(shown(kind="meteor")) == 3
    monkeypatch.setattr(webui_views, "INCIDENTS_A_PAGE", 2)
    paged = text(viewer.get("/incidents/", {"kind": "crash", "within": "all"}))
    assert "page 1 of 1 " not in paged
    both = text(viewer.get("/incidents/"))
    assert "page 1 of 2 (3 incidents)" in both and 'href="?page=2" rel="next"' in both
    crashes = text(viewer.get("/incidents/", {"kind": "crash", "within": "week"}))
    assert "page 1 of 2" not in crashes  # two crashes: one page
    filtered = text(viewer.get("/incidents/", {"status": "", "within": "week"}))
    assert 'href="?within=week&amp;page=2" rel="next"' in filtered  # the filter kept
    assert shown(page="2") == [old.pk]
    RecoveryDecision.objects.filter(pk=second.pk).update(
        accuracy={"transition_s": {"estimated": 2.0, "measured": 1.25}}
    )
    cells = re.findall(r"<td>([^<]*)</td>\s*</tr>", text(viewer.get("/incidents/")))
    assert cells == ["1.25 s", "—"]  # the newest two: measured, and not yet
    assert Client().get("/incidents/").status_code == 302
    assert client_as(None).get("/incidents/").status_code == 403


def test_a_nodes_page_shows_its_devices_failures_and_commands() -> None:
    job, _ = create_job("nodes-page", copy.deepcopy(SCENARIO), approval_mode="auto")
    node = Node.objects.get(job=job, devices__index=5)
    _, decision = decisions.record_failure(
        job, kind="crash", devices=[5], source=FailureSource.AGENT, occurred_at=timezone.now(),
        node=node, message="rank 5 exited with code -9",
    )  # fmt: skip
    decisions.plan(decision.pk)
    AgentCommand.objects.create(decision=decision, node=node, action="apply_plan", frame={},
                                ok=True)  # fmt: skip
    viewer = client_as("viewer")
    url = f"/jobs/{job.pk}/nodes/{node.name}/"
    page = text(viewer.get(url))
    row = re.search(r'<tr id="device-5">(.*?)</tr>', page, re.S)
    assert row is not None and '<span class="badge failed">failed</span>' in row[1]
    assert "crash at" in row[1]
    others = [int(i) for i in re.findall(r'<tr id="device-(\d+)">', page)]
    assert others == sorted(Device.objects.filter(node=node).values_list("index", flat=True))
    history = re.search(r'<ol class="events" id="node-history">(.*?)</ol>', page, re.S)
    assert history is not None and "failed: crash of 5" in history[1]
    assert "rank 5 exited with code -9" in history[1] and "(rank 5 exited" in row[1]
    assert history[1].count("command apply_plan: acknowledged") == 1
    assert f'href="/recoveries/{decision.pk}/"' in history[1]
    assert viewer.get(f"/jobs/{job.pk}/nodes/node-99/").status_code == 404
    assert client_as(None).get(url).status_code == 403
    assert f'"node_url": "/jobs/{job.pk}/nodes/__node__/"' in text(viewer.get(f"/jobs/{job.pk}/"))
    assert re.search(r'<td class="process">—</td>', row[1])  # that report named no process


def test_a_nodes_page_shows_the_last_process_its_agent_blamed_with_its_output() -> None:
    job, _ = create_job("processes-page", copy.deepcopy(SCENARIO), approval_mode="auto")
    node = Node.objects.get(job=job, devices__index=5)
    log = ["Traceback (most recent call last):", "<b>RuntimeError</b>: out of memory"]
    for pid, code in ((4242, -9), (4343, 1)):  # the second report lands on the same failure
        decisions.record_failure(
            job, kind="crash", devices=[5], source=FailureSource.AGENT,
            occurred_at=timezone.now(), node=node,
            process={"device": 5, "pid": pid, "exit_code": code, "log": log},
        )  # fmt: skip
    (failure,) = Failure.objects.filter(job=job)
    assert [p["pid"] for p in failure.processes] == [4242, 4343]
    page = text(client_as("viewer").get(f"/jobs/{job.pk}/nodes/{node.name}/"))
    row = re.search(r'<tr id="device-5">(.*?)</tr>', page, re.S)
    assert row is not None
    cell = re.search(r'<td class="process">(.*?)</td>', row[1], re.S)
    assert cell is not None and cell[1].startswith("pid 4343, exited with code 1 ")
    assert "its last 2 lines of standard error" in cell[1]
    # the lines as the process wrote them, escaped, one a line
    assert (
        "(most recent call last):\n&lt;b&gt;RuntimeError&lt;/b&gt;: out of memory</pre>" in cell[1]
    )
    other = re.search(r'<tr id="device-4">.*?<td class="process">(.*?)</td>', page, re.S)
    assert other is not None and other[1] == "—"
    api = client_as("viewer").get("/api/v1/failures/", {"job": job.pk}).json()
    (listed,) = api["results"] if isinstance(api, dict) else api
    assert listed["processes"][-1] == {"device": 5, "pid": 4343, "exit_code": 1, "log": log}


def test_a_nodes_page_shows_each_devices_process_as_its_last_heartbeat_names_it() -> None:
    job, _ = create_job("pids-page", copy.deepcopy(SCENARIO), approval_mode="auto")
    node = Node.objects.get(job=job, devices__index=5)
    indices = sorted(Device.objects.filter(node=node).values_list("index", flat=True))
    beat = protocol.Heartbeat(
        seq=1, at=time.time(), step=7,
        devices=[protocol.DeviceReport(device=d, state=protocol.DeviceState.TRAINING,
                                       pid=9000 + d if d != 5 else None) for d in indices],
    )  # fmt: skip
    redis = liveness.sync_client()
    redis.zadd(liveness.seen_key(job.pk), {node.name: time.time()})
    redis.hset(liveness.frames_key(job.pk), node.name, protocol.encode(beat))
    try:
        page = text(client_as("viewer").get(f"/jobs/{job.pk}/nodes/{node.name}/"))
    finally:
        redis.zrem(liveness.seen_key(job.pk), node.name)
        redis.hdel(liveness.frames_key(job.pk), node.name)
    said = dict(re.findall(r'<tr id="device-(\d+)">.*?</td>\s*<td>(.*?)</td>', page, re.S))
    assert said == {
        str(d): "training" if d == 5 else f"training <small>(pid {9000 + d})</small>"
        for d in indices
    }


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (None, ""),
        (0, "code 0"),
        (1, "code 1"),
        (-9, "signal 9 (SIGKILL)"),
        (-15, "signal 15 (SIGTERM)"),
        (-99, "signal 99"),
    ],
)
def test_an_exit_status_is_said_as_people_say_it(code: int | None, said: str) -> None:
    assert webui_views.exit_status(code) == said
