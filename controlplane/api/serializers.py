"""What the REST API shows of jobs, failures, recoveries and the timeline, and what it takes."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.bridge.vocabulary import FailureKind
from controlplane.incidents.models import Drill, Failure, RecoveryDecision, TimelineEvent
from controlplane.jobs.models import ApprovalMode, Device, Job, Node
from controlplane.simulations.models import Sweep
from worker_agent.protocol import MAX_INJECT_SECONDS, InjectKind


class JobSerializer(serializers.ModelSerializer):
    devices = serializers.SerializerMethodField(help_text="devices by state")

    class Meta:
        model = Job
        fields: tuple[str, ...] = (
            "id",
            "name",
            "status",
            "approval_mode",
            "approval_timeout_s",
            "enabled_policies",
            "step",
            "devices",
            "created_at",
            "updated_at",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_devices(self, job: Job) -> dict[str, int]:
        # annotated by the view in one query (JobViewSet.get_queryset); ``unheard``: devices of
        # nodes expected and not yet joined, counted under no other state
        return {
            state: getattr(job, f"devices_{state}", 0)
            for state in ("healthy", "suspect", "failed", "spare", "recovering", "unheard")
        }


class JobDetailSerializer(JobSerializer):
    class Meta(JobSerializer.Meta):
        fields = (*JobSerializer.Meta.fields, "plan", "scenario")
        read_only_fields = fields


class JobCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    scenario = serializers.JSONField(help_text="the core's scenario format (docs/scenario.md)")
    approval_mode = serializers.ChoiceField(ApprovalMode.choices, default=ApprovalMode.AUTO)
    approval_timeout_s = serializers.FloatField(default=300.0, min_value=0.001)
    enabled_policies = serializers.ListField(
        child=serializers.CharField(), default=list, help_text="empty: every policy"
    )


class NodeSerializer(serializers.ModelSerializer):
    devices = serializers.SerializerMethodField(help_text="the node's device ids, in order")

    class Meta:
        model = Node
        fields = ("id", "job", "name", "index", "status", "devices")
        read_only_fields = fields

    def get_devices(self, node: Node) -> list[int]:
        # prefetched by the view (NodeViewSet.get_queryset)
        return [device.index for device in node.devices.all()]


class DeviceSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )

    class Meta:
        model = Device
        fields = ("id", "job", "node", "index", "state")
        read_only_fields = fields


class AgentTokenSerializer(serializers.Serializer):
    node = serializers.CharField(
        max_length=200, required=False, help_text="the one node the token speaks for"
    )


# The most devices one what-if may fail (the largest job the planner is measured on, 16,384
# devices, four times over): a request is bounded before the core sees it.
MAX_WHAT_IF_DEVICES = 65_536


class WhatIfSerializer(serializers.Serializer):
    devices = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=2**31 - 1),
        min_length=1,
        max_length=MAX_WHAT_IF_DEVICES,
    )
    kind = serializers.ChoiceField(choices=[k.value for k in FailureKind], default="crash")


class PolicySerializer(serializers.Serializer):
    """A recovery policy the core knows, as ``GET /api/v1/policies/`` lists it."""

    name = serializers.CharField()
    summary = serializers.CharField()
    options = serializers.DictField(help_text="each option's default")


class ErrorSerializer(serializers.Serializer):
    """Every error the API answers (controlplane.api.errors)."""

    code = serializers.CharField(help_text="stable, e.g. invalid, not_found, infeasible_plan")
    message = serializers.CharField()
    field = serializers.CharField(allow_null=True, help_text="the field at fault, if one is")


class ProcessSerializer(serializers.Serializer):
    """A process an agent blamed for a failure (``Failure.processes``)."""

    device = serializers.IntegerField(allow_null=True, help_text="its device; null: several")
    pid = serializers.IntegerField(allow_null=True)
    exit_code = serializers.IntegerField(
        allow_null=True, help_text="its exit code, or minus the signal that killed it"
    )
    log = serializers.ListField(
        child=serializers.CharField(), help_text="the last lines of its standard error"
    )


class FailureSerializer(serializers.ModelSerializer):
    detection_latency_s = serializers.FloatField(read_only=True)
    processes = ProcessSerializer(many=True, read_only=True)

    class Meta:
        model = Failure
        fields = (
            "id",
            "job",
            "node",
            "kind",
            "devices",
            "source",
            "occurred_at",
            "detected_at",
            "detection_latency_s",
            "step",
            "message",
            "processes",
        )
        read_only_fields = fields


class RecoverySerializer(serializers.ModelSerializer):
    failure = FailureSerializer(read_only=True)
    chosen_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )
    candidates = serializers.SerializerMethodField(
        help_text="every policy's candidate as the core's codec writes it, declines included"
    )
    search_time_s = serializers.SerializerMethodField()

    class Meta:
        model = RecoveryDecision
        fields = (
            "id",
            "job",
            "status",
            "failure",
            "candidates",
            "chosen",
            "plan",
            "search_time_s",
            "chosen_by",
            "reason",
            "deadline_at",
            "resumed_step",
            "superseded_by",
            "grows",
            "created_at",
            "updated_at",
        )
        read_only_fields = fields

    def get_candidates(self, decision: RecoveryDecision) -> list[dict[str, Any]]:
        return decision.candidates

    def get_search_time_s(self, decision: RecoveryDecision) -> float | None:
        return None if decision.decision is None else float(decision.decision["search_time_s"])


class ApproveSerializer(serializers.Serializer):
    reason = serializers.CharField(allow_blank=True, default="", max_length=2000)


class OverrideSerializer(serializers.Serializer):
    candidate = serializers.IntegerField(min_value=0, required=False)
    plan = serializers.JSONField(required=False, help_text="an edited plan (codec format)")
    reason = serializers.CharField(allow_blank=True, default="", max_length=2000)


class DismissSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, help_text="why the failure is a false alarm")


class DrillCreateSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=200, help_text="the node whose agent injects it")
    kind = serializers.ChoiceField(choices=[k.value for k in InjectKind])
    device = serializers.IntegerField(
        min_value=0, required=False, help_text="the rank's device (every kind but drop)"
    )
    seconds = serializers.FloatField(
        required=False,
        min_value=0.001,
        max_value=MAX_INJECT_SECONDS,
        help_text="hang: continue the rank after this long; slow: for this long (default 10)",
    )


class DrillSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True)

    class Meta:
        model = Drill
        fields = ("id", "job", "node", "kind", "device", "seconds", "requested_by",
                  "created_at", "sent_at", "acked_at", "ok", "error")  # fmt: skip


class TimelineEventSerializer(serializers.ModelSerializer):
    step = serializers.SerializerMethodField(
        help_text="the training step the event records (its payload's step): failure_detected, "
        "the job's at the failure; resumed, the agents' as they trained again; first_step and "
        "recovered, the first step under the new plan; null for the others"
    )

    class Meta:
        model = TimelineEvent
        fields = ("id", "at", "kind", "actor", "decision", "failure", "step", "payload")
        read_only_fields = fields

    def get_step(self, event: TimelineEvent) -> int | None:
        step = event.payload.get("step") if isinstance(event.payload, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) else None


class SweepSerializer(serializers.ModelSerializer):
    progress = serializers.FloatField(read_only=True, help_text="share of pieces done, 0 to 1")
    duration_s = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Sweep
        fields: tuple[str, ...] = (
            "id",
            "name",
            "job",
            "status",
            "experiment",
            "pieces_total",
            "pieces_done",
            "progress",
            "workers",
            "error",
            "created_at",
            "started_at",
            "finished_at",
            "duration_s",
        )
        read_only_fields: tuple[str, ...] = fields


class SweepDetailSerializer(SweepSerializer):
    class Meta(SweepSerializer.Meta):
        fields = (*SweepSerializer.Meta.fields, "summary")
        read_only_fields = fields


class SweepCreateSerializer(serializers.Serializer):
    """A sweep of a job's scenario (``job``) or of one given here (``scenario``)."""

    name = serializers.CharField(max_length=200, default="", allow_blank=True)
    job = serializers.PrimaryKeyRelatedField(queryset=Job.objects.all(), required=False)
    scenario = serializers.JSONField(required=False, help_text="the core's scenario format")
    hours = serializers.FloatField(default=9.0, min_value=0.001, max_value=100_000)
    policies = serializers.ListField(child=serializers.CharField(), min_length=1)
    seeds = serializers.IntegerField(default=1, min_value=1, max_value=1000)
    base_seed = serializers.IntegerField(default=0, min_value=0, max_value=2**32 - 1)
    trace = serializers.DictField(
        default=dict, help_text="how to draw failures: the simulator's trace fields (docs)"
    )
    trace_csv = serializers.CharField(
        required=False,
        max_length=4_000_000,
        trim_whitespace=False,
        help_text="instead of trace: a trace to replay, in the simulator's CSV format",
    )
    options = serializers.DictField(child=serializers.DictField(), default=dict)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if ("job" in data) == ("scenario" in data):
            raise serializers.ValidationError({"job": ["give either a job or a scenario"]})
        return data


class PhaseSerializer(serializers.Serializer):
    """One phase of a recovery (``controlplane.incidents.phases``)."""

    phase = serializers.ChoiceField(
        choices=["detect", "plan", "approve", "transfer", "restart", "first_step"]
    )
    start = serializers.DateTimeField(allow_null=True, help_text="null until it started")
    end = serializers.DateTimeField(allow_null=True, help_text="null until it ended")
    seconds = serializers.FloatField(allow_null=True, help_text="end - start; null until both")


class MetricPointSerializer(serializers.Serializer):
    """One point of a job's training history (``controlplane.jobs.history``)."""

    at = serializers.DateTimeField()
    span_s = serializers.FloatField(help_text="the seconds a merged (older) point stands for")
    step = serializers.IntegerField(allow_null=True)
    loss = serializers.FloatField(allow_null=True)
    samples_per_s = serializers.FloatField(allow_null=True)
    step_time_s = serializers.FloatField(allow_null=True)
