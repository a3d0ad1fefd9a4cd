"""REST API v1: policies, jobs (with what-if), failures, recoveries (approve, override,
dismiss) and the recovery timeline, exported as JSON or CSV (``?format=csv``)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from typing import Any, ClassVar, TypeVar

from django.db.models import Model, QuerySet
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema, extend_schema_view
from redis.exceptions import RedisError
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action, api_view, permission_classes
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import SAFE_METHODS
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api import errors
from controlplane.api import serializers as s
from controlplane.api.roles import CanAdminister, CanOperate, CanRead, ReadOrAdminister
from controlplane.api.schema import THROTTLED, error, query
from controlplane.bridge.vocabulary import describe_policies
from controlplane.incidents import decisions, drills
from controlplane.incidents.models import (
    DecisionStatus,
    Failure,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.incidents.phases import phases
from controlplane.incidents.tasks import enqueue_planning
from controlplane.jobs import history, lifecycle, liveness, snapshot
from controlplane.jobs.models import Device, DeviceState, Job, Node, NodeStatus, heavy
from controlplane.jobs.services import create_job, issue_agent_token, launch_job
from controlplane.simulations import sweeps
from controlplane.simulations.models import Sweep

_M = TypeVar("_M", bound=Model)

# Ids are 64-bit signed integers (BigAutoField) in every database Pitstop runs on.
MAX_ID = 2**63 - 1

TIMELINE_COLUMNS = ("id", "at", "kind", "actor", "decision", "failure", "step", "payload")
PHASE_COLUMNS = ("phase", "start", "end", "seconds")


class CSVRenderer(BaseRenderer):
    """Timeline rows as CSV, one event a line; ``payload`` as compact JSON."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None
    ) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        if isinstance(data, dict) and "code" in data and "events" not in data:
            writer.writerow(("code", "message", "field"))  # an error, kept readable
            writer.writerow((data.get("code"), data.get("message"), data.get("field")))
            return out.getvalue().encode()
        if isinstance(data, dict) and "phases" in data and "events" not in data:
            writer.writerow(PHASE_COLUMNS)  # a recovery's phases, one a line
            writer.writerows([row[c] for c in PHASE_COLUMNS] for row in data["phases"])
            return out.getvalue().encode()
        if isinstance(data, dict) and "events" not in data:
            writer.writerow(("name", "value"))  # anything else (OPTIONS' description) as pairs
            writer.writerows(
                (k, v if isinstance(v, str) else json.dumps(v)) for k, v in data.items()
            )
            return out.getvalue().encode()
        rows = data if isinstance(data, list) else data["events"]
        writer.writerow(TIMELINE_COLUMNS)
        for row in rows:
            writer.writerow(
                json.dumps(row[c], separators=(",", ":")) if c == "payload" else row[c]
                for c in TIMELINE_COLUMNS
            )
        return out.getvalue().encode()


TIMELINE_RENDERERS = (JSONRenderer, BrowsableAPIRenderer, CSVRenderer)
TIME_FILTERS = [
    query("since", dt.datetime, "events at or after this time (ISO 8601 with its offset)"),
    query("until", dt.datetime, "events before this time (ISO 8601 with its offset)"),
]
JOB = query("job", int, "the job's id")


def _time(request: Request, name: str) -> dt.datetime | None:
    text = request.query_params.get(name)
    if text is None:
        return None
    try:
        value = parse_datetime(text.replace(" ", "+"))
    except ValueError:  # the right shape, an impossible date: February 30, month 13, hour 25
        value = None
    if value is None or value.tzinfo is None:
        raise ValidationError(
            {name: ["expected an ISO 8601 time with its offset, e.g. 2026-11-24T00:00:00Z"]}
        )
    return value


def _events(request: Request, events: QuerySet[TimelineEvent]) -> QuerySet[TimelineEvent]:
    since, until = _time(request, "since"), _time(request, "until")
    if since is not None:
        events = events.filter(at__gte=since)
    if until is not None:
        events = events.filter(at__lt=until)
    return events.order_by("at", "pk")


def _int_param(request: Request, name: str) -> int | None:
    text = request.query_params.get(name)
    if text is None:
        return None
    value = parse_id(text)
    if value is None:
        raise ValidationError({name: [f"expected an id from 1 to {MAX_ID}, got {text[:40]!r}"]})
    return value


def parse_id(text: str) -> int | None:
    """A database id written in ASCII digits (``isdigit`` also takes "²"), within the column's
    range; None otherwise."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_ID)):
        return None
    value = int(text)
    return value if 0 < value <= MAX_ID else None


class BoundedIdMixin:
    """A detail route's id that is no id of a row (not digits, beyond the column) is a 404."""

    kwargs: dict[str, Any]

    def get_object(self) -> Any:
        if parse_id(str(self.kwargs.get("pk", ""))) is None:
            raise NotFound("no such id")
        return super().get_object()  # type: ignore[misc]


@extend_schema(responses={200: s.PolicySerializer(many=True)})
@api_view(["GET"])
@permission_classes([CanRead])
def policies(request: Request) -> Response:
    """Every recovery policy the core knows: name, one-line summary, options with defaults."""
    return Response(describe_policies())


class JobViewSet(
    BoundedIdMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    viewsets.GenericViewSet,
):
    """Jobs; an admin creates one from a scenario and gets its agent token, shown once."""

    permission_classes = (ReadOrAdminister,)
    throttle_scopes: ClassVar[dict[str, str]] = {
        "create": "jobs",
        "tokens": "jobs",
        "launch": "launches",
        "what_if": "whatif",
        "drills": "drills",
    }

    def get_queryset(self) -> QuerySet[Job]:
        # counted without the scenario and plan, which SQLite would group by too (seconds for a
        # job of 2,048 nodes); a job shown in full reads them after, by its key
        jobs = Job.objects.defer(*heavy()).annotate(**lifecycle.device_counts())
        return jobs.order_by("-created_at")

    def get_serializer_class(self) -> type[Any]:
        if self.action == "create":
            return s.JobCreateSerializer
        return s.JobDetailSerializer if self.action == "retrieve" else s.JobSerializer

    @extend_schema(request=s.JobCreateSerializer, responses={201: dict, 429: THROTTLED})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        given = s.JobCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        job, token = create_job(**given.validated_data)
        shown = s.JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data
        return Response({"job": shown, "agent_token": token}, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.JobCreateSerializer, responses={200: dict, 201: dict, 429: THROTTLED})
    @action(detail=False, methods=["post"], permission_classes=[CanAdminister])
    def launch(self, request: Request) -> Response:
        """The job for a launcher's node (``pitstop-run`` with an admin's API token): created
        from the scenario when no job has the name (201), else the existing job, which must
        have as many devices (200); either way with a new agent token, shown once."""
        given = s.JobCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        job, token, created = launch_job(**given.validated_data)
        shown = s.JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data
        return Response(
            {"job": shown, "agent_token": token, "created": created},
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    @extend_schema(request=s.AgentTokenSerializer, responses={201: dict, 429: THROTTLED})
    @action(detail=True, methods=["post"], permission_classes=[CanAdminister])
    def tokens(self, request: Request, pk: str | None = None) -> Response:
        """Another agent token for the job, for one node (``node``) or any of its nodes; the
        token is shown once."""
        job = self.get_object()
        given = s.AgentTokenSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        node = given.validated_data.get("node")
        token = issue_agent_token(job, node=node)
        return Response({"job": job.pk, "node": node, "agent_token": token}, status=201)

    @extend_schema(request=s.WhatIfSerializer, responses={200: dict, 429: THROTTLED})
    @action(detail=True, methods=["post"], url_path="what-if", permission_classes=[CanRead])
    def what_if(self, request: Request, pk: str | None = None) -> Response:
        """What every enabled policy would do if these devices failed now; nothing is written."""
        job = self.get_object()
        given = s.WhatIfSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        return Response(decisions.what_if(job, **given.validated_data))

    @extend_schema(
        responses={200: s.MetricPointSerializer(many=True)},
        parameters=[query("since", dt.datetime, "points at or after this time (ISO 8601)")],
    )
    @action(detail=True, permission_classes=[CanRead], pagination_class=None)
    def metrics(self, request: Request, pk: str | None = None) -> Response:
        """The job's training history oldest first (step, loss, samples/s, step time), kept on
        the server and downsampled: at most 2,000 points, older ones each standing for
        ``span_s`` seconds; ``since`` keeps the later ones."""
        job = self.get_object()
        found = history.points(job.pk, _time(request, "since"))
        return Response(s.MetricPointSerializer(found, many=True).data)

    @extend_schema(responses={200: dict, 503: error("Redis cannot be reached")})
    @action(detail=True, permission_classes=[CanRead])
    def live(self, request: Request, pk: str | None = None) -> Response:
        """The job's live picture from its heartbeats (at most half a second old): nodes heard
        from, their steps and device states, the job's step, loss, samples/s and step time."""
        job = self.get_object()
        try:
            return Response(snapshot.latest(liveness.sync_client(), job.pk))
        except RedisError as exc:
            return Response(
                errors.body("live_data_unavailable", f"Redis cannot be reached: {exc}"),
                status=status.HTTP_503_SERVICE_UNAVAILABLE,
            )

    @extend_schema(
        methods=["POST"],
        request=s.DrillCreateSerializer,
        responses={
            202: s.DrillSerializer,
            409: error("node_not_connected: the node's agent is not connected"),
            503: error("not_sent: Redis cannot be reached"),
            429: THROTTLED,
        },
    )
    @extend_schema(methods=["GET"], responses={200: s.DrillSerializer(many=True)})
    @action(detail=True, methods=["get", "post"])
    def drills(self, request: Request, pk: str | None = None) -> Response:
        """Faults injected on purpose (newest first); an operator's POST sends one to a
        connected node's agent, once: ``kill``, ``hang``, ``slow`` or ``nan`` into the rank of
        ``device``, or ``drop`` (the agent's socket). 202: sent; the agent's acknowledgement
        fills ``acked_at`` and ``ok``. 409 ``node_not_connected``."""
        job = self.get_object()
        if request.method == "GET":
            found = job.drills.select_related("node")
            page = self.paginate_queryset(found)
            rows = s.DrillSerializer(page if page is not None else found, many=True).data
            return self.get_paginated_response(rows) if page is not None else Response(rows)
        given = s.DrillCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        try:
            actor = f"user:{request.user.username}"
            drill = drills.inject(job, actor=actor, **given.validated_data)
        except drills.DrillRefused as exc:
            return Response(errors.body(exc.code, str(exc), exc.field), status=exc.status)
        return Response(s.DrillSerializer(drill).data, status=status.HTTP_202_ACCEPTED)

    def get_permissions(self) -> list[Any]:
        if self.action == "drills":
            return [(CanRead if self.request.method in SAFE_METHODS else CanOperate)()]
        return list(super().get_permissions())

    @extend_schema(responses={200: s.TimelineEventSerializer(many=True)}, parameters=TIME_FILTERS)
    @action(detail=True, renderer_classes=TIMELINE_RENDERERS, permission_classes=[CanRead])
    def timeline(self, request: Request, pk: str | None = None) -> Response:
        """The job's timeline, oldest first; ``since``/``until`` filter, CSV exports it all."""
        job = self.get_object()
        events = _events(request, job.timeline.all())
        return _timeline_response(self, request, events, name=f"job-{job.pk}-timeline")


def _timeline_response(
    view: viewsets.GenericViewSet,
    request: Request,
    events: QuerySet[TimelineEvent],
    *,
    name: str,
    **extra: Any,
) -> Response:
    """The events as a page of JSON (with ``extra``), or all of them as CSV, downloaded as
    ``name``.csv."""
    if request.accepted_renderer.format == "csv":
        rows = s.TimelineEventSerializer(events, many=True).data
        response = Response({"events": rows, **extra})
        response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
        return response
    page = view.paginate_queryset(events)
    rows = s.TimelineEventSerializer(page if page is not None else events, many=True).data
    if page is None:
        return Response({"events": rows, **extra})
    response = view.get_paginated_response(rows)
    response.data.update(extra)
    return response


@extend_schema_view(
    list=extend_schema(
        parameters=[JOB, query("status", str, "the nodes' status", NodeStatus.values)]
    )
)
class NodeViewSet(BoundedIdMixin, viewsets.ReadOnlyModelViewSet):
    """Nodes with their status and device ids, by job and index; ``?job=ID`` and
    ``?status=S`` filter."""

    serializer_class = s.NodeSerializer
    permission_classes = (CanRead,)

    def get_queryset(self) -> QuerySet[Node]:
        nodes = Node.objects.prefetch_related("devices").order_by("job_id", "index")
        job = _int_param(self.request, "job")
        nodes = nodes if job is None else nodes.filter(job_id=job)
        return _choice_filter(self.request, nodes, "status", NodeStatus.values)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            JOB,
            query("node", str, "the devices of the node of this name"),
            query("state", str, "the devices' state", DeviceState.values),
        ]
    )
)
class DeviceViewSet(BoundedIdMixin, viewsets.ReadOnlyModelViewSet):
    """Devices (the core's ids) with their state and node, by job and index; ``?job=ID``,
    ``?node=NAME`` and ``?state=S`` filter."""

    serializer_class = s.DeviceSerializer
    permission_classes = (CanRead,)

    def get_queryset(self) -> QuerySet[Device]:
        devices = Device.objects.select_related("node").order_by("job_id", "index")
        job = _int_param(self.request, "job")
        if job is not None:
            devices = devices.filter(job_id=job)
        node = self.request.query_params.get("node")
        if node is not None:
            devices = devices.filter(node__name=node)
        return _choice_filter(self.request, devices, "state", DeviceState.values)


def _choice_filter(
    request: Request, rows: QuerySet[_M], name: str, allowed: list[str]
) -> QuerySet[_M]:
    value = request.query_params.get(name)
    if value is None:
        return rows
    if value not in allowed:
        raise ValidationError({name: [f"expected one of {', '.join(allowed)}, got {value!r}"]})
    return rows.filter(**{name: value})


@extend_schema_view(list=extend_schema(parameters=[JOB]))
class FailureViewSet(BoundedIdMixin, viewsets.ReadOnlyModelViewSet):
    """Failures, newest first; ``?job=ID`` filters."""

    serializer_class = s.FailureSerializer
    permission_classes = (CanRead,)

    def get_queryset(self) -> QuerySet[Failure]:
        failures = Failure.objects.order_by("-detected_at", "-pk")
        job = _int_param(self.request, "job")
        return failures if job is None else failures.filter(job_id=job)


@extend_schema_view(
    list=extend_schema(
        parameters=[JOB, query("status", str, "the decisions' status", DecisionStatus.values)]
    )
)
class RecoveryViewSet(BoundedIdMixin, viewsets.ReadOnlyModelViewSet):
    """Recovery decisions, newest first; ``?job=ID`` and ``?status=`` filter."""

    serializer_class = s.RecoverySerializer
    permission_classes = (CanRead,)

    def get_queryset(self) -> QuerySet[RecoveryDecision]:
        found = RecoveryDecision.objects.select_related("failure", "chosen_by").order_by(
            "-created_at", "-pk"
        )
        job = _int_param(self.request, "job")
        if job is not None:
            found = found.filter(job_id=job)
        return _choice_filter(self.request, found, "status", DecisionStatus.values)

    @extend_schema(
        request=s.ApproveSerializer,
        responses={200: s.RecoverySerializer, 409: error("the decision is not proposed")},
    )
    @action(detail=True, methods=["post"], permission_classes=[CanOperate])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        decision = self.get_object()
        given = s.ApproveSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        decisions.approve(decision.pk, user=request.user, **given.validated_data)  # type: ignore[arg-type]
        return Response(s.RecoverySerializer(self.get_queryset().get(pk=decision.pk)).data)

    @extend_schema(
        request=s.OverrideSerializer,
        responses={200: s.RecoverySerializer, 409: error("the decision is not proposed")},
    )
    @action(detail=True, methods=["post"], permission_classes=[CanOperate])
    def override(self, request: Request, pk: str | None = None) -> Response:
        decision = self.get_object()
        given = s.OverrideSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        data = given.validated_data
        decisions.override(
            decision.pk,
            user=request.user,  # type: ignore[arg-type]
            candidate=data.get("candidate"),
            edited_plan=data.get("plan"),
            reason=data["reason"],
        )
        return Response(s.RecoverySerializer(self.get_queryset().get(pk=decision.pk)).data)

    @extend_schema(
        request=s.DismissSerializer,
        responses={
            200: s.RecoverySerializer,
            400: error("no reason given"),
            409: error("the decision is not planning or proposed"),
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[CanOperate])
    def dismiss(self, request: Request, pk: str | None = None) -> Response:
        """A false alarm: the decision ends ``dismissed`` with no plan applied and the failure's
        devices whose agents are heard are back in service."""
        decision = self.get_object()
        given = s.DismissSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        decisions.dismiss(
            decision.pk,
            user=request.user,  # type: ignore[arg-type]
            plan=enqueue_planning,
            **given.validated_data,
        )
        return Response(s.RecoverySerializer(self.get_queryset().get(pk=decision.pk)).data)

    @extend_schema(responses={200: s.TimelineEventSerializer(many=True)}, parameters=TIME_FILTERS)
    @action(detail=True, renderer_classes=TIMELINE_RENDERERS, permission_classes=[CanRead])
    def timeline(self, request: Request, pk: str | None = None) -> Response:
        """This recovery's events, its phases (detect, plan, approve, transfer, restart, first
        step), the job's step at the failure and the step training resumed from (null until
        it recovered)."""
        decision = self.get_object()
        events = _events(request, decision.events.all())
        return _timeline_response(
            self,
            request,
            events,
            name=f"recovery-{decision.pk}-timeline",
            phases=phases(decision, list(events)),
            step_at_failure=decision.failure.step,
            resumed_step=decision.resumed_step,
        )

    @extend_schema(responses={200: s.PhaseSerializer(many=True)})
    @action(
        detail=True,
        renderer_classes=TIMELINE_RENDERERS,
        permission_classes=[CanRead],
        pagination_class=None,  # six rows
    )
    def phases(self, request: Request, pk: str | None = None) -> Response:
        """This recovery's phases (detect, plan, approve, transfer, restart, first step), each
        its start, end and seconds; ``?format=csv`` downloads them, one a line."""
        decision = self.get_object()
        rows = s.PhaseSerializer(phases(decision, list(decision.events.all())), many=True).data
        if request.accepted_renderer.format != "csv":
            return Response(rows)
        response = Response({"phases": rows})
        name = f"recovery-{decision.pk}-phases.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


class SweepViewSet(
    BoundedIdMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    viewsets.GenericViewSet,
):
    """Simulation sweeps, newest first: every policy over many seeds, run as parallel Celery
    tasks; operators start one and watch ``progress``, the summary comes when it is done."""

    queryset = Sweep.objects.order_by("-created_at", "-pk")
    throttle_scopes: ClassVar[dict[str, str]] = {"create": "simulations"}

    def get_permissions(self) -> list[Any]:
        return [CanOperate() if self.action == "create" else CanRead()]

    def get_serializer_class(self) -> type[Any]:
        if self.action == "create":
            return s.SweepCreateSerializer
        return s.SweepDetailSerializer if self.action == "retrieve" else s.SweepSerializer

    @extend_schema(
        request=s.SweepCreateSerializer, responses={202: s.SweepDetailSerializer, 429: THROTTLED}
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        given = s.SweepCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        data = dict(given.validated_data)
        job = data.pop("job", None)
        name = data.pop("name")
        scenario = job.scenario if job is not None else data.pop("scenario")
        sweep = sweeps.start(
            scenario=scenario, experiment=data, name=name, job=job, user=request.user
        )
        shown = s.SweepDetailSerializer(Sweep.objects.get(pk=sweep.pk)).data
        return Response(shown, status=status.HTTP_202_ACCEPTED)


__all__ = ["FailureViewSet", "JobViewSet", "RecoveryViewSet", "SweepViewSet", "policies"]
