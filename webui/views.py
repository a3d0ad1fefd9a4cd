"""Dashboard pages: jobs, a job live (and its drills), a recovery (approve, override,
dismiss), what-if, simulations.

Every page needs a role (``controlplane.api.roles``): viewers read, operators also approve,
override, run drills and start simulations. Actions call the same services as the REST API;
the forms carry Django's CSRF token.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import signal
from collections.abc import Callable
from functools import wraps
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.views import redirect_to_login
from django.core.paginator import Paginator
from django.db.models.fields.json import KT, KeyTextTransform, KeyTransform
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST
from redis.exceptions import RedisError

from controlplane.api.roles import Role, role_of
from controlplane.api.serializers import MAX_WHAT_IF_DEVICES
from controlplane.bridge import rows
from controlplane.bridge.vocabulary import COLOURS, FailureKind, describe_policies
from controlplane.incidents import decisions, drills
from controlplane.incidents.models import DecisionStatus, Failure, RecoveryDecision
from controlplane.incidents.phases import phases
from controlplane.incidents.tasks import enqueue_planning
from controlplane.jobs import liveness, snapshot
from controlplane.jobs.models import Device, Job, JobStatus, Node, heavy
from controlplane.simulations import sweeps
from controlplane.simulations.models import Sweep
from webui import data
from worker_agent.protocol import InjectKind

View = Callable[..., HttpResponse]
DRILLS_SHOWN = 10  # the newest drills on a job's page


def role(request: HttpRequest) -> Role:
    """The user's role, read once a request."""
    if not hasattr(request, "_pitstop_role"):
        request._pitstop_role = role_of(request.user)  # type: ignore[attr-defined]
    found: Role = request._pitstop_role  # type: ignore[attr-defined]
    return found


def _asks_json(request: HttpRequest) -> bool:
    accept = request.headers.get("Accept", "")
    return "application/json" in accept and "text/html" not in accept


def needs(minimum: Role) -> Callable[[View], View]:
    """A page for users with at least ``minimum``: others log in, or are refused (403)."""

    def decorate(view: View) -> View:
        @wraps(view)
        def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                if _asks_json(request):  # a page's script: it tells the user the session ended
                    said = {"detail": "not logged in: the session ended", "login": reverse("login")}
                    return JsonResponse(said, status=401)
                return redirect_to_login(request.get_full_path())
            if role(request) < minimum:
                context = {"needed": minimum.name.lower()}
                return render(request, "webui/forbidden.html", context, status=403)
            return view(request, *args, **kwargs)

        return checked

    return decorate


def page(
    request: HttpRequest, template: str, context: dict[str, Any], status: int = 200
) -> HttpResponse:
    context.setdefault("can_operate", role(request) >= Role.OPERATOR)
    context["role_name"] = role(request).name.lower()
    return render(request, template, context, status=status)


# --- jobs ----------------------------------------------------------------------------------


def index(request: HttpRequest) -> HttpResponse:
    """The jobs list for a user with a role; the landing page otherwise."""
    if request.user.is_authenticated and role(request) >= Role.VIEWER:
        return jobs(request)
    return render(request, "webui/index.html")


def _live(job_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Each running job's live snapshot (half a second old at most), or none without Redis."""
    try:
        client = liveness.sync_client()
        return {pk: snapshot.latest(client, pk) for pk in job_ids}
    except RedisError:
        return {}


def _filter_reader(given: Any, errors: list[str]) -> Callable[..., str]:
    """A list page's filter reader: ``pick(field, allowed, default)`` is the given value if it
    is one of ``allowed``; otherwise it names the field in ``errors`` and gives the default."""

    def pick(field: str, allowed: list[str], default: str = "") -> str:
        value = str(given.get(field, default))
        if value not in allowed:
            errors.append(f"{field}: {value[:40]!r} is not one of {', '.join(allowed)}")
            return default
        return value

    return pick


# The jobs list's views of the jobs: those running (and waiting), the archive, or all.
SHOWS = {"running": False, "archived": True, "all": None}


@needs(Role.VIEWER)
def jobs(request: HttpRequest) -> HttpResponse:
    """The jobs, filtered by name and status, sorted, the finished ones in an archive; a
    filter it cannot read is named, and the list shown unfiltered by it."""
    given = request.GET
    errors: list[str] = []

    pick = _filter_reader(given, errors)

    chosen = {
        "name": given.get("name", "").strip()[:200],
        "status": pick("status", ["", *JobStatus.values], ""),
        "sort": pick("sort", list(data.JOB_SORTS), "attention"),
        "show": pick("show", list(SHOWS), "running"),
    }
    found = list(
        data.jobs_overview(
            name=chosen["name"],
            status=chosen["status"],
            sort=chosen["sort"],
            archived=SHOWS[chosen["show"]],
        )
    )
    live = _live([j.pk for j in found if j.status not in (JobStatus.STOPPED, JobStatus.FAILED)])
    for job in found:
        job.live = live.get(job.pk, {})  # type: ignore[attr-defined]
        step = job.live.get("step")  # type: ignore[attr-defined]
        job.shown_step = job.step if step is None else step  # type: ignore[attr-defined]
    context = {
        "jobs": found,
        "chosen": chosen,
        "errors": errors,
        "statuses": JobStatus.values,
        "sorts": list(data.JOB_SORTS),
        "archived_count": Job.objects.filter(status__in=data.FINISHED).count(),
    }
    return page(request, "webui/jobs.html", context)


def _job(pk: int) -> Job:
    return get_object_or_404(Job.objects.defer("scenario"), pk=pk)


@needs(Role.VIEWER)
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return page(request, "webui/job.html", job_context(_job(pk)))


@require_POST
@needs(Role.OPERATOR)
def job_drill(request: HttpRequest, pk: int) -> HttpResponse:
    """A drill (``incidents.drills``): the fault sent to the node's agent; a refusal is shown
    beside the field it names, and nothing is sent."""
    job = _job(pk)
    given = request.POST
    error: dict[str, str | None] | None = None
    device: int | None = None
    seconds: float | None = None
    try:
        device = int(given["device"]) if given.get("device", "").strip() else None
    except ValueError:
        error = {"field": "device", "message": "expected a device number, e.g. 3"}
    try:
        seconds = float(given["seconds"]) if given.get("seconds", "").strip() else None
    except ValueError:
        error = error or {"field": "seconds", "message": "expected a number of seconds, e.g. 5"}
    if error is None:
        try:
            drills.inject(
                job,
                node=given.get("node", ""),
                kind=given.get("kind", ""),
                device=device,
                seconds=seconds,
                actor=f"user:{request.user.get_username()}",
            )
        except drills.DrillRefused as exc:
            error = {"field": exc.field, "message": str(exc)}
        else:
            return redirect(f"{reverse('webui:job', args=[pk])}#drills-h")
    assert error is not None
    # the page again, the error beside its field (Django's way with forms, as override's)
    context = {**job_context(job), "drill_error": error, "drill_given": given}
    return page(request, "webui/job.html", context)


def parts_context(job: Job) -> dict[str, Any]:
    """What the job page's server-drawn parts show: the plan running, the recoveries, the drills
    (the page draws them again from ``job_parts`` when its socket says something changed)."""
    recent = list(
        RecoveryDecision.objects.filter(job=job)
        .select_related("failure")
        .defer("decision", "plan")
        .order_by("-created_at", "-pk")[:20]
    )
    return {
        "job": job,
        "recent": recent,
        "plan": data.plan_rows(job.plan),
        "drills": list(job.drills.select_related("node")[:DRILLS_SHOWN]),
        "model_error": data.model_error(recent),  # the last 20 recoveries' measured ones
    }


# The job page's parts, each a template of its own (job.html includes them).
PARTS = {"plan": "webui/_plan.html", "recent": "webui/_recent.html", "drills": "webui/_drills.html"}


@needs(Role.VIEWER)
def job_parts(request: HttpRequest, pk: int) -> HttpResponse:
    """The job page's plan, recoveries and drills drawn again, as ``{part: html}``."""
    context = parts_context(_job(pk))
    return JsonResponse({name: render_to_string(t, context, request) for name, t in PARTS.items()})


def job_context(job: Job) -> dict[str, Any]:
    grid = data.grid(job)
    parts = parts_context(job)
    recent = parts["recent"]
    markers = [
        {
            "at": d.failure.detected_at.isoformat(),
            "label": f"#{d.pk} {d.failure.kind}",
            "decision": d.pk,
        }
        for d in recent
    ]
    config = {
        "job": job.pk,
        "socket": f"/ws/dashboard/jobs/{job.pk}/",
        "interval_s": liveness.HEARTBEAT_INTERVAL_S,
        "markers": markers,
        "recovery_url": reverse("webui:recovery", args=[0]),
        "parts_url": reverse("webui:parts", args=[job.pk]),
        "metrics_url": f"/api/v1/jobs/{job.pk}/metrics/",
        "node_url": reverse("webui:node", args=[job.pk, "__node__"]),
        **grid,
    }
    return {
        **parts,
        "config": config,
        "counts": data.device_counts(grid["states"]),
        "nodes": len(grid["nodes"]),
        "open": next((d for d in recent if d.status in data.OPEN_STATUSES), None),
        "drill_kinds": [kind.value for kind in InjectKind],
    }


# --- recoveries ----------------------------------------------------------------------------


def _scenario_fact(part: str, name: str) -> KeyTextTransform:
    """One number of the decision's job's scenario, read in the database (KT cannot follow a
    relation)."""
    return KeyTextTransform(name, KeyTransform(part, "job__scenario"))


def _recovery(pk: int) -> RecoveryDecision:
    found: RecoveryDecision = get_object_or_404(
        RecoveryDecision.objects.select_related("failure", "chosen_by", "job")
        .defer(*heavy("job"))
        .annotate(
            capacity=_scenario_fact("cluster", "device_memory_bytes"),
            global_batch=_scenario_fact("training", "global_batch"),
        ),
        pk=pk,
    )
    return found


def _number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


# The most characters of plan JSON the override editor is filled with when the page loads.
PREFILL_LIMIT = 100_000


def _proposal(decision: RecoveryDecision) -> Any:
    """The plan an override starts from: the chosen candidate's, or the decision's."""
    if decision.decision and decision.decision.get("chosen") is not None:
        # an ``auto`` decision's candidates have their plans a moment after it applies
        chosen = decision.decision["candidates"][decision.decision["chosen"]]
        return chosen.get("plan", decision.plan)
    return decision.plan


# A decision whose plan someone (or the job's mode) chose: before, its best is only proposed.
DECIDED = frozenset(
    {
        DecisionStatus.APPROVED,
        DecisionStatus.OVERRIDDEN,
        DecisionStatus.AUTO_APPLIED,
        DecisionStatus.APPLYING,
        DecisionStatus.RECOVERED,
        DecisionStatus.FAILED,
    }
)


def recovery_context(decision: RecoveryDecision) -> dict[str, Any]:
    candidates = data.candidate_rows(
        decision.decision,
        chosen=decision.chosen if decision.status in DECIDED else None,
        capacity=_number(getattr(decision, "capacity", None)),
        global_batch=_number(getattr(decision, "global_batch", None)),
    )
    events = list(decision.events.order_by("at", "pk"))
    shown = [
        {
            **p,
            "start": p["start"] and p["start"].isoformat(),
            "end": p["end"] and p["end"].isoformat(),
        }
        for p in phases(decision, events)
    ]
    proposal = _proposal(decision)
    plan_text = json.dumps(proposal, indent=1) if proposal else ""
    too_big = len(plan_text) > PREFILL_LIMIT
    decided = decision.status in DECIDED
    marked = next((c for c in candidates if c["chosen" if decided else "proposed"]), None)
    after = decision.plan if decided and decision.plan else proposal
    return {
        "changes": data.plan_changes(data.plan_before(decision), after) if after else [],
        "estimates": data.estimate_rows(decision),
        "tradeoff": data.tradeoff(candidates, marked),
        "decision": decision,
        "job": decision.job,
        "failure": decision.failure,
        "candidates": candidates,
        "proposal": next((c for c in candidates if c["proposed"]), None),
        "why": data.why(candidates, decision),
        "events": events,
        "phases": shown,
        "plan": data.plan_rows(decision.plan),
        "open": decision.status == DecisionStatus.PROPOSED,
        # a false alarm is dismissed until a plan is chosen (``decisions.dismiss``)
        "dismissable": decision.status in (DecisionStatus.PLANNING, DecisionStatus.PROPOSED),
        # a plan of thousands of pipelines is megabytes: the editor loads it only when asked
        "plan_text": "" if too_big else plan_text,
        "plan_url": reverse("webui:proposal", args=[decision.pk]) if too_big else "",
        "plan_kb": len(plan_text) // 1000,
        "api": f"/api/v1/recoveries/{decision.pk}/timeline/",
        "phases_api": f"/api/v1/recoveries/{decision.pk}/phases/",
    }


@needs(Role.VIEWER)
def recovery_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return page(request, "webui/recovery.html", recovery_context(_recovery(pk)))


def _json_error(exc: json.JSONDecodeError) -> str:
    """Where the JSON breaks, for a textarea without line numbers: the line's own text and
    the column, beside the parser's words."""
    line = exc.doc.splitlines()[exc.lineno - 1] if exc.doc.strip() else ""
    where = f"line {exc.lineno}, column {exc.colno}"
    if not line.strip():
        return f"not JSON: {exc.msg} ({where})"
    shown = line.strip()
    shown = shown if len(shown) <= 80 else shown[:77] + "…"
    return f"not JSON: {exc.msg} at {where}: {shown}"


# The proposals listed by ``attention`` (the count is of all of them).
ATTENTION_LISTED = 20


@needs(Role.VIEWER)
def attention(request: HttpRequest) -> HttpResponse:
    """The proposals waiting for an operator, newest first: their count, and for the newest
    their id, job and deadline (every page's title counts them; attention.js)."""
    waiting = RecoveryDecision.objects.filter(status=DecisionStatus.PROPOSED)
    listed = waiting.order_by("-created_at", "-pk").values("pk", "job__name", "deadline_at")
    return JsonResponse(
        {
            "count": waiting.count(),
            "waiting": [
                {
                    "id": d["pk"],
                    "job": d["job__name"],
                    "deadline_at": d["deadline_at"].isoformat() if d["deadline_at"] else None,
                    "url": reverse("webui:recovery", args=[d["pk"]]),
                }
                for d in listed[:ATTENTION_LISTED]
            ],
        }
    )


@needs(Role.VIEWER)
def recovery_state(request: HttpRequest, pk: int) -> HttpResponse:
    """What the recovery page watches (recovery.js asks every few seconds): the decision's
    status, how many timeline events it has, whether the cost model was measured against it
    (``incidents.accuracy``), and who ended its wait for an operator."""
    found = get_object_or_404(RecoveryDecision.objects.only("status", "accuracy"), pk=pk)
    return JsonResponse(
        {
            "status": found.status,
            "events": found.events.count(),
            "measured": found.accuracy is not None,
            "decided": data.decided(pk),
        }
    )


def _conflict(pk: int, exc: decisions.IllegalTransition) -> str:
    """What a refused action tells: what happened first (someone else's decision) in words."""
    first = data.decided(pk)
    return f"Nothing was changed: {first}." if first else str(exc)


@needs(Role.VIEWER)
def recovery_proposal(request: HttpRequest, pk: int) -> HttpResponse:
    """The proposed plan as JSON, for the override editor of a plan too large to inline."""
    decision = get_object_or_404(RecoveryDecision.objects.only("plan", "decision"), pk=pk)
    return JsonResponse(_proposal(decision), safe=False)


@require_POST
@needs(Role.OPERATOR)
def recovery_approve(request: HttpRequest, pk: int) -> HttpResponse:
    decision = _recovery(pk)
    try:
        decisions.approve(decision.pk, user=request.user, reason=request.POST.get("reason", ""))  # type: ignore[arg-type]
    except decisions.IllegalTransition as exc:
        context = {**recovery_context(_recovery(pk)), "action_error": _conflict(pk, exc)}
        return page(request, "webui/recovery.html", context, status=409)
    return redirect("webui:recovery", pk=pk)


@require_POST
@needs(Role.OPERATOR)
def recovery_dismiss(request: HttpRequest, pk: int) -> HttpResponse:
    """A false alarm: the reason is required, its error shown beside the field."""
    decision = _recovery(pk)
    reason = request.POST.get("reason", "")
    try:
        decisions.dismiss(
            decision.pk,
            user=request.user,  # type: ignore[arg-type]
            reason=reason,
            plan=enqueue_planning,
        )
    except rows.RecoveryError as exc:
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        context = {**recovery_context(_recovery(pk)), "dismiss_error": message}
        return page(request, "webui/recovery.html", context, status=400)
    except decisions.IllegalTransition as exc:
        context = {**recovery_context(_recovery(pk)), "action_error": _conflict(pk, exc)}
        return page(request, "webui/recovery.html", context, status=409)
    return redirect("webui:recovery", pk=pk)


@require_POST
@needs(Role.OPERATOR)
def recovery_override(request: HttpRequest, pk: int) -> HttpResponse:
    """Another candidate (``candidate``) or an edited plan (``plan``, JSON); the core's errors
    are shown beside the field they name."""
    decision = _recovery(pk)
    given = request.POST
    reason = given.get("reason", "")
    candidate: int | None = None
    edited: Any = None
    error: dict[str, str] | None = None
    if given.get("use") == "plan":
        try:
            edited = json.loads(given.get("plan", ""))
        except json.JSONDecodeError as exc:
            error = {"field": "plan", "message": _json_error(exc), "code": "invalid_json"}
    elif given.get("candidate", "").isdigit():
        candidate = int(given["candidate"])
    else:
        error = {"field": "candidate", "message": "pick a candidate", "code": "required"}
    status = 200  # the form again, its error beside the field (Django's way with forms)
    if error is None:
        try:
            decisions.override(
                decision.pk,
                user=request.user,  # type: ignore[arg-type]
                candidate=candidate,
                edited_plan=edited,
                reason=reason,
            )
            return redirect("webui:recovery", pk=pk)
        except rows.RecoveryError as exc:
            message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
            error = {"field": exc.field or "plan", "message": message, "code": exc.code}
        except decisions.IllegalTransition as exc:
            # not beside a field: the form is gone once someone else decided
            context = {**recovery_context(_recovery(pk)), "action_error": _conflict(pk, exc)}
            return page(request, "webui/recovery.html", context, status=409)
    context = recovery_context(_recovery(pk))
    context.update(override_error=error, reason=reason, use=given.get("use", "candidate"))
    if edited is not None or given.get("use") == "plan":
        context["plan_text"] = given.get("plan", "")
    return page(request, "webui/recovery.html", context, status=status)


# --- what-if -------------------------------------------------------------------------------


def _devices(text: str, limit: int = MAX_WHAT_IF_DEVICES) -> list[int]:
    """``"4, 5, 8-11"`` as device ids, at most ``limit`` of them; ``ValueError`` names what it
    could not read."""
    found: list[int] = []
    for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
        first, _, last = part.partition("-")
        if _whole(first) is None or (last and _whole(last) is None):
            raise ValueError(f"{part[:40]!r} is not a device id or a range like 4-7")
        start, end = int(first), int(last or first)
        if end - start + 1 > limit - len(found):
            raise ValueError(f"at most {limit} devices at once; {part!r} is more")
        found.extend(range(start, end + 1))
    return found


def _whole(text: str, most: int = 2**31 - 1) -> int | None:
    """A whole number written in ASCII digits (``isdigit`` also takes "²"), at most ``most``."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(most)):
        return None
    value = int(text)
    return value if value <= most else None


@needs(Role.VIEWER)
def what_if(request: HttpRequest, pk: int) -> HttpResponse:
    """Fail devices, a node, or an uploaded scenario's failed devices, on paper: what every
    enabled policy would do. Nothing is written."""
    job = get_object_or_404(Job.objects.defer(*heavy()), pk=pk)
    nodes = list(Node.objects.filter(job=job).order_by("index").values_list("index", "name"))
    context: dict[str, Any] = {
        "job": job,
        "nodes": nodes,
        "kinds": [k.value for k in FailureKind],
        "given": request.POST,
    }
    if request.method == "POST":
        answer, error = _what_if(request, job)
        if error is not None:
            context["error"] = error
        else:
            assert answer is not None
            context["answer"] = answer["answer"]
            context["source"] = answer["source"]
            context["candidates"] = data.candidate_rows(
                answer["answer"],
                chosen=None,  # on paper: the best is what would be proposed
                capacity=answer["capacity"],
                global_batch=answer["global_batch"],
            )
            context["why"] = data.why(context["candidates"])
            best = answer["answer"]["chosen"]
            if best is not None:
                context["plan"] = data.plan_rows(answer["answer"]["candidates"][best]["plan"])
                context["proposed_policy"] = answer["answer"]["candidates"][best]["policy"]
    return page(request, "webui/what_if.html", context)


def _listed(devices: list[int]) -> str:
    """``device 3`` or ``devices 2, 3``."""
    return f"device{'s' * (len(devices) != 1)} {', '.join(map(str, devices))}"


def _what_if(request: HttpRequest, job: Job) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    kind = request.POST.get("kind", "crash")
    upload = request.FILES.get("scenario")
    try:
        if upload is not None:
            try:
                scenario = json.loads(upload.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return None, {"field": "scenario", "message": f"not a JSON scenario: {exc}"}
            failed = scenario.get("failed") if isinstance(scenario, dict) else None
            if not failed:
                return None, {"field": "failed", "message": "the scenario fails no device"}
            answer = rows.decide_for(
                scenario, scenario.get("plan"), set(failed), kind=kind, devices=list(failed),
                policies=list(job.enabled_policies),
            )  # fmt: skip
            cluster, training = scenario["cluster"], scenario["training"]
            return {
                "answer": answer,
                "source": f"{_listed(sorted(failed))} of the uploaded scenario {upload.name}"
                f" failed ({kind})",
                "capacity": _number(cluster.get("device_memory_bytes")),
                "global_batch": _number(training.get("global_batch")),
            }, None
        node_text = request.POST.get("node", "").strip()
        node = _whole(node_text)
        if node_text and node is None:
            return None, {"field": "node", "message": f"{node_text[:40]!r} is not a node index"}
        if node is not None:
            devices = list(
                Device.objects.filter(job=job, node__index=node).values_list("index", flat=True)
            )
        else:
            try:
                devices = _devices(request.POST.get("devices", ""))
            except ValueError as exc:
                return None, {"field": "devices", "message": str(exc)}
        answer = decisions.what_if(Job.objects.get(pk=job.pk), devices=devices, kind=kind)
    except rows.RecoveryError as exc:  # the field is shown apart: the message without it
        return None, {"field": exc.field or "devices", "message": exc.message}
    facts = Job.objects.filter(pk=job.pk).values_list(
        KT("scenario__cluster__device_memory_bytes"), KT("scenario__training__global_batch")
    )[0]
    return {
        "answer": answer,
        "source": f"{_listed(devices)} failed ({kind})",
        "capacity": _number(facts[0]),
        "global_batch": _number(facts[1]),
    }, None


# --- simulations ---------------------------------------------------------------------------


@needs(Role.VIEWER)
def simulations(request: HttpRequest) -> HttpResponse:
    """Past sweeps, and (for operators) a form that starts one as Celery tasks."""
    context: dict[str, Any] = {"given": request.POST}
    if request.method == "POST":
        if role(request) < Role.OPERATOR:
            return HttpResponseForbidden("starting a simulation needs the operator role")
        started, error = _start_sweep(request)
        if started is not None:
            return redirect("webui:simulation", pk=started.pk)
        context["error"] = error
    context.update(
        sweeps=Sweep.objects.select_related("job")
        .defer("scenario", "summary", *heavy("job"))
        .order_by("-created_at", "-pk")[:50],
        jobs=Job.objects.defer(*heavy()).order_by("-created_at").values_list("pk", "name"),
        policies=describe_policies(),
        chosen=request.POST.getlist("policies") or ["odyssey", "dynamic", "checkpoint"],
    )
    return page(request, "webui/simulations.html", context)


MAX_TRACE_FILE_BYTES = 4_000_000  # as the REST API's trace_csv


def _start_sweep(request: HttpRequest) -> tuple[Sweep | None, dict[str, str] | None]:
    given = request.POST
    job = Job.objects.filter(pk=given.get("job") or 0).first()
    if job is None:
        return None, {"field": "job", "message": "pick a job whose scenario to simulate"}
    scenario = copy.deepcopy(job.scenario)
    numbers: dict[str, float] = {}
    for name, default in (("hours", 9), ("seeds", 1), ("base_seed", 0), ("rate", 0.05),
                          ("repair_hours", 1)):  # fmt: skip
        try:
            numbers[name] = float(given.get(name) or default)
        except ValueError:
            numbers[name] = math.nan
        if not math.isfinite(numbers[name]) or abs(numbers[name]) > 2**32:
            message = f"expected a number up to {2**32}, got {given.get(name, '')[:40]!r}"
            return None, {"field": name, "message": message}
    trace: dict[str, Any] = {
        "failure_rate_per_device_hour": numbers["rate"],
        "repair_hours": numbers["repair_hours"],
    }
    if given.get("trace", "").strip():
        try:
            extra = json.loads(given["trace"])
        except json.JSONDecodeError as exc:
            return None, {"field": "trace", "message": f"not JSON: {exc}"}
        if not isinstance(extra, dict):
            return None, {"field": "trace", "message": "expected a JSON object of trace fields"}
        trace.update(extra)
    if given.get("spares", "").strip():
        spares = _whole(given["spares"])
        if spares is None:
            return None, {"field": "spares", "message": "expected a whole number of spares"}
        scenario["cluster"]["spares"] = spares
    experiment: dict[str, Any] = {
        "hours": numbers["hours"],
        "policies": given.getlist("policies"),
        "seeds": int(numbers["seeds"]),
        "base_seed": int(numbers["base_seed"]),
        "trace": trace,
    }
    upload = request.FILES.get("trace_file")
    if upload is not None:  # a trace to replay replaces the drawn one
        if upload.size is not None and upload.size > MAX_TRACE_FILE_BYTES:
            message = f"{upload.size} bytes is over the limit of {MAX_TRACE_FILE_BYTES}"
            return None, {"field": "trace_file", "message": message}
        try:
            experiment["trace_csv"] = upload.read().decode()
        except UnicodeDecodeError:
            return None, {"field": "trace_file", "message": "not a text (UTF-8) CSV file"}
        experiment["trace"] = {}
    try:
        sweep = sweeps.start(
            scenario=scenario,
            experiment=experiment,
            name=given.get("name", "")[:200],
            job=job,
            user=request.user,
        )
    except rows.RecoveryError as exc:
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        return None, {"field": exc.field or "", "message": message}
    return sweep, None


@needs(Role.VIEWER)
def simulation_detail(request: HttpRequest, pk: int) -> HttpResponse:
    sweep = get_object_or_404(Sweep.objects.defer("scenario"), pk=pk)
    colours = {str(cause): colour for cause, colour in COLOURS.items()}
    return page(
        request,
        "webui/simulation.html",
        {
            "sweep": sweep,
            "config": {
                "api": f"/api/v1/simulations/{sweep.pk}/",
                "summary": sweep.summary,
                "status": sweep.status,
                "colours": colours,
            },
        },
    )


# --- incidents -----------------------------------------------------------------------------

INCIDENTS_A_PAGE = 50
# The incidents page's time filter: the last hour, day, week, or all of them.
WITHIN = {"hour": dt.timedelta(hours=1), "day": dt.timedelta(days=1),
          "week": dt.timedelta(weeks=1), "all": None}  # fmt: skip


@needs(Role.VIEWER)
def incidents(request: HttpRequest) -> HttpResponse:
    """Every job's failures and what was decided about them, newest first, filtered by job,
    kind, decision status and time; a filter it cannot read is named and left out."""
    given = request.GET
    errors: list[str] = []

    pick = _filter_reader(given, errors)

    jobs_known = list(Job.objects.order_by("name").values_list("pk", "name"))
    chosen = {
        "job": pick("job", ["", *(str(pk) for pk, _ in jobs_known)]),
        "kind": pick("kind", ["", *(k.value for k in FailureKind)]),
        "status": pick("status", ["", *DecisionStatus.values]),
        "within": pick("within", list(WITHIN), "all"),
    }
    found = (
        RecoveryDecision.objects.select_related("failure", "job", "chosen_by")
        .defer("decision", "plan", *heavy("job"))
        .order_by("-failure__detected_at", "-pk")
    )
    if chosen["job"]:
        found = found.filter(job_id=int(chosen["job"]))
    if chosen["kind"]:
        found = found.filter(failure__kind=chosen["kind"])
    if chosen["status"]:
        found = found.filter(status=chosen["status"])
    window = WITHIN[chosen["within"]]
    if window is not None:
        found = found.filter(failure__detected_at__gte=timezone.now() - window)
    pages = Paginator(found, INCIDENTS_A_PAGE)
    shown = pages.get_page(given.get("page"))
    query = {k: v for k, v in chosen.items() if v and not (k == "within" and v == "all")}
    context = {
        "incidents": shown,
        "chosen": chosen,
        "errors": errors,
        "jobs_known": jobs_known,
        "kinds": [k.value for k in FailureKind],
        "statuses": DecisionStatus.values,
        "within": list(WITHIN),
        "query": urlencode(query),
    }
    return page(request, "webui/incidents.html", context)


# --- a node and its devices ----------------------------------------------------------------


def _outcome(ok: bool | None, error: str, done: str) -> str:
    return done if ok else f"refused: {error}" if ok is False else "sent"


def _node_history(node: Node, failures: list[Failure]) -> list[dict[str, Any]]:
    """What happened to a node, newest first: expected, joined, its failures, the commands
    and drills sent to it."""
    said: list[dict[str, Any]] = []
    if node.expected_at:
        said.append({"at": node.expected_at, "what": "expected (named in the job's scenario)"})
    if node.joined_at:
        said.append({"at": node.joined_at, "what": "joined: its agent said hello"})
    for f in failures:
        devices = ", ".join(map(str, f.devices[:8])) + (" …" if len(f.devices) > 8 else "")
        said.append({"at": f.detected_at, "what": f"failed: {f.kind} of {devices}", "failure": f})
    for c in node.commands.order_by("-created_at")[:NODE_EVENTS_SHOWN]:
        what = f"command {c.action}: {_outcome(c.ok, c.error, 'acknowledged')}"
        said.append({"at": c.created_at, "what": what, "decision": c.decision_id})
    for d in node.drills.order_by("-created_at")[:NODE_EVENTS_SHOWN]:
        what = f"drill {d.kind} by {d.requested_by}: {_outcome(d.ok, d.error, 'done')}"
        said.append({"at": d.created_at, "what": what})
    return sorted(said, key=lambda e: e["at"], reverse=True)[:NODE_EVENTS_SHOWN]


NODE_EVENTS_SHOWN = 50  # the newest failures, commands and drills of a node's page


def exit_status(code: int | None) -> str:
    """An exit status as people say it: "code 1", "signal 9 (SIGKILL)"; "" when unknown."""
    if code is None:
        return ""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def _heard_pids(job_id: int, node: str) -> dict[int, int]:
    """Each device's process as the node's last heartbeat names it (none when not heard)."""
    try:
        raw = liveness.sync_client().hget(liveness.frames_key(job_id), node)
    except RedisError:
        return {}
    devices = json.loads(raw)["devices"] if raw else []
    return {d["device"]: d["pid"] for d in devices if d.get("pid")}


def _last_process(device: int, failures: list[Failure]) -> dict[str, Any] | None:
    """The newest report of a process at fault on ``device`` among ``failures`` (newest
    first), with its exit status in words."""
    for failure in failures:
        for process in reversed(failure.processes):
            if process.get("device") == device:
                status = exit_status(process.get("exit_code"))
                log_text = "\n".join(process.get("log") or ())
                return {**process, "status": status, "log_text": log_text, "failure": failure}
    return None


@needs(Role.VIEWER)
def node_detail(request: HttpRequest, pk: int, name: str) -> HttpResponse:
    """One node of a job: its state and history (expected, joined, failures, commands, drills),
    its last heartbeat and every device's stored and heard state, with the failures that
    touched each."""
    job = _job(pk)
    node = get_object_or_404(Node, job=job, name=name)
    devices = list(node.devices.order_by("index").values("index", "state"))
    indices = {d["index"] for d in devices}
    failures = list(node.failures.order_by("-detected_at")[:NODE_EVENTS_SHOWN])
    heard = None
    try:
        found = snapshot.latest(liveness.sync_client(), job.pk)
        heard = next((n for n in found["nodes"] if n["node"] == node.name), None)
    except RedisError:
        pass
    beats = heard["devices"] if heard else {}
    pids = _heard_pids(job.pk, node.name) if heard else {}
    touched: dict[int, list[Failure]] = {}  # a device -> the job's recent failures naming it
    for failure in Failure.objects.filter(job=job).order_by("-detected_at")[:500]:
        for device in set(failure.devices) & indices:
            touched.setdefault(device, []).append(failure)
    history = _node_history(node, failures)
    context = {
        "job": job,
        "node": node,
        "heard": heard,
        "devices": [
            {
                **d,
                "beat": beats.get(str(d["index"])),
                "pid": pids.get(d["index"]),
                "failures": touched.get(d["index"], []),
                "process": _last_process(d["index"], touched.get(d["index"], [])),
            }
            for d in devices
        ],
        "history": history,
    }
    return page(request, "webui/node.html", context)
