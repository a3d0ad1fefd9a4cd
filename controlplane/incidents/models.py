"""Incidents: failures, the recovery decisions they ask for, and the append-only timeline.

A decision moves through ``DecisionStatus`` by ``controlplane.incidents.decisions.transition``
only, which checks the move against ``LEGAL`` and records it on the timeline in the same
transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q

from controlplane.bridge.vocabulary import FailureKind, choices
from controlplane.jobs.models import Job, Node, PlanField


class FailureSource(models.TextChoices):
    AGENT = "agent", "the agent reported a fault"
    SOCKET = "socket", "the agent's socket closed without goodbye"
    HEARTBEAT = "heartbeat", "heartbeats stopped arriving"
    OPERATOR = "operator", "an operator declared it"


class Failure(models.Model):
    """One incident: every device it took, however many reports it came in."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="failures")
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="failures"
    )
    kind = models.CharField(max_length=16, choices=choices(FailureKind))
    devices = models.JSONField(help_text="the core's device ids, sorted")
    source = models.CharField(max_length=16, choices=FailureSource.choices)
    occurred_at = models.DateTimeField(help_text="when it happened, as well as it is known")
    detected_at = models.DateTimeField()
    message = models.TextField(blank=True)
    step = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="the job's last reported step when it was recorded: the step the agent sent "
        "with its fault, else the highest of the nodes' latest heartbeats (null: none known)",
    )
    processes = models.JSONField(
        default=list,
        blank=True,
        help_text="the processes its agents blamed, one entry a report: device, pid, "
        "exit_code (minus the signal that killed it), log (its standard error's last lines)",
    )

    class Meta:
        ordering = ("-detected_at",)
        indexes = (models.Index(fields=["job", "-detected_at"]),)

    def __str__(self) -> str:
        return f"{self.kind} of {self.devices} on {self.job.name}"

    @property
    def detection_latency_s(self) -> float:
        return max((self.detected_at - self.occurred_at).total_seconds(), 0.0)


class DecisionStatus(models.TextChoices):
    PLANNING = "planning"
    PROPOSED = "proposed"
    APPROVED = "approved"
    OVERRIDDEN = "overridden"
    AUTO_APPLIED = "auto_applied"
    APPLYING = "applying"
    RECOVERED = "recovered"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    DISMISSED = "dismissed"  # an operator called the failure a false alarm: nothing applied


S = DecisionStatus
# Every legal move; anything else is refused. A second failure supersedes an open decision; an
# operator dismisses one (a false alarm) until a plan is chosen, not once it is being applied.
LEGAL: dict[str, frozenset[str]] = {
    S.PLANNING: frozenset({S.PROPOSED, S.FAILED, S.SUPERSEDED, S.DISMISSED}),
    S.PROPOSED: frozenset({S.APPROVED, S.OVERRIDDEN, S.AUTO_APPLIED, S.SUPERSEDED, S.DISMISSED}),
    S.APPROVED: frozenset({S.APPLYING, S.SUPERSEDED}),
    S.OVERRIDDEN: frozenset({S.APPLYING, S.SUPERSEDED}),
    S.AUTO_APPLIED: frozenset({S.APPLYING, S.SUPERSEDED}),
    S.APPLYING: frozenset({S.RECOVERED, S.FAILED, S.SUPERSEDED}),
    S.RECOVERED: frozenset(),
    S.FAILED: frozenset(),
    S.SUPERSEDED: frozenset(),
    S.DISMISSED: frozenset(),
}
TERMINAL = frozenset(status for status, moves in LEGAL.items() if not moves)
OPEN = frozenset(DecisionStatus) - TERMINAL


# A decision's large JSON fields: the candidates with their plans, the plan, its packed form
# (megabytes at 16,384 devices); a status change leaves them unread (``transitions.transition``).
DECISION_HEAVY = ("decision", "plan", "packed_plan", "accuracy")


class RecoveryDecision(models.Model):
    """What to do about a failure: every policy's candidates, the choice, who made it and why.

    ``decision`` is the core's decision as the codec writes it (failure, candidates with their
    codes, the eq. 8 best, search time); ``chosen`` indexes the candidate to apply (the proposal
    until an operator overrides it, None for an edited plan), and ``plan`` is the plan applied.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="decisions")
    failure = models.ForeignKey(Failure, on_delete=models.PROTECT, related_name="decisions")
    status = models.CharField(
        max_length=16, choices=DecisionStatus.choices, default=DecisionStatus.PLANNING
    )
    decision = models.JSONField(null=True, blank=True)
    chosen = models.PositiveIntegerField(null=True, blank=True)
    plan = PlanField(null=True, blank=True)
    packed_plan = models.TextField(
        blank=True,
        editable=False,
        help_text="the plan as every node's command carries it (the protocol's pack_plan), kept "
        "once when applying begins: the commands do not each keep a copy",
    )
    chosen_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    reason = models.TextField(blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    resumed_step = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="recovered: the step training resumed from, the last step completed before "
        "the first one under the new plan (the failure's step when only the step in progress "
        "was lost)",
    )
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="supersedes"
    )
    grows = models.BooleanField(
        default=False,
        help_text="opened when a node came back to a job running without its devices: the "
        "candidates keep the running plan or take the devices back (the core's grow), and the "
        "failure is the one the job lost them to",
    )
    accuracy = models.JSONField(
        null=True,
        blank=True,
        help_text="recovered: the cost model's estimates beside what was measured "
        "(incidents.accuracy)",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("-created_at",)
        constraints = (
            # at most one decision in flight per job: no failure is planned, or applied, twice
            models.UniqueConstraint(
                fields=["job"],
                condition=Q(status__in=sorted(OPEN)),
                name="one_open_decision_per_job",
            ),
        )

    def __str__(self) -> str:
        return f"decision {self.pk} ({self.status}) for {self.job.name}"

    @property
    def candidates(self) -> list[dict[str, Any]]:
        return [] if self.decision is None else list(self.decision["candidates"])


class EventKind(models.TextChoices):
    FAILURE_DETECTED = "failure_detected"
    PLANNING_STARTED = "planning_started"
    PROPOSED = "proposed"
    APPROVED = "approved"
    OVERRIDDEN = "overridden"
    AUTO_APPLIED = "auto_applied"
    APPLYING = "applying"
    COMMAND_SENT = "command_sent"
    COMMAND_ACKED = "command_acked"
    RESUMED = "resumed"  # every agent's devices report training again
    FIRST_STEP = "first_step"
    RECOVERED = "recovered"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    DISMISSED = "dismissed"  # an operator's false alarm: the devices are back, nothing applied
    DRILL_SENT = "drill_sent"  # an operator injected a fault for a drill (``Drill``)
    DRILL_ACKED = "drill_acked"  # the agent did it, or refused it


class AgentCommand(models.Model):
    """One command to one node's agent for a decision, sent until the agent acknowledges it.

    The agent reports back in stages: ``acked_at`` (it applied the command, or refused it:
    ``ok``), ``resumed_at`` (its devices report training again, at ``resumed_step``) and
    ``stepped_at`` (a step completed after that, ``stepped_step``: the first step the node
    reported under the new plan). ``frame`` is the protocol's ``command`` frame without its
    plan, which is the decision's (``RecoveryDecision.packed_plan``) and added as it is sent.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    decision = models.ForeignKey(
        RecoveryDecision, on_delete=models.CASCADE, related_name="commands"
    )
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    action = models.CharField(max_length=16)
    frame = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True, help_text="the last time it was sent")
    sends = models.PositiveIntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)
    ok = models.BooleanField(null=True, blank=True)
    error = models.TextField(blank=True)
    resumed_at = models.DateTimeField(null=True, blank=True)
    resumed_step = models.BigIntegerField(null=True, blank=True)
    stepped_at = models.DateTimeField(null=True, blank=True)
    stepped_step = models.BigIntegerField(null=True, blank=True)
    trains = models.BooleanField(
        default=True,
        help_text="the node runs a part of the plan: its agent is waited for to train again and "
        "make a step (a standby, or a spare nobody took, only acknowledges)",
    )

    class Meta:
        ordering = ("created_at", "node")
        constraints = (
            models.UniqueConstraint(
                fields=["decision", "node", "action"], name="one_command_per_node_and_action"
            ),
        )

    def __str__(self) -> str:
        return f"{self.action} to {self.node} for decision {self.decision_id}"


class Drill(models.Model):
    """A fault injected on purpose into one node's rank (or its socket), for a drill.

    Sent once, to a connected node's agent, as an ``inject`` command with this row's id; never
    sent again (a kill that arrived late would be a surprise, not a drill). ``acked_at`` and
    ``ok`` say what the agent made of it; the failure it causes is recorded as any other.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="drills")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="drills")
    kind = models.CharField(max_length=8)  # worker_agent.protocol.InjectKind
    device = models.PositiveIntegerField(null=True, blank=True)
    seconds = models.FloatField(null=True, blank=True)
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    ok = models.BooleanField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ("-created_at",)

    def __str__(self) -> str:
        target = "its socket" if self.device is None else f"device {self.device}"
        return f"{self.kind} into {self.node} ({target})"


class AppendOnly(Exception):
    """A timeline event cannot be changed or deleted once written."""


class TimelineEvent(models.Model):
    """One thing that happened to a job, at a time, by an actor; never updated or deleted."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="timeline")
    decision = models.ForeignKey(
        RecoveryDecision, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    failure = models.ForeignKey(
        Failure, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    at = models.DateTimeField(db_index=True)
    actor = models.CharField(max_length=150, blank=True, help_text="user, agent or system part")
    payload = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ("at", "pk")
        indexes = (models.Index(fields=["job", "at"]),)

    def __str__(self) -> str:
        return f"{self.at.isoformat()} {self.kind}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnly(f"timeline event {self.pk} is append-only")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnly(f"timeline event {self.pk} is append-only")


class Notification(models.Model):
    """A decision that needs someone, announced to one webhook (``notifications``): one row a
    decision, event and address, so it is delivered once however often its task runs."""

    decision = models.ForeignKey(
        RecoveryDecision, on_delete=models.CASCADE, related_name="notifications"
    )
    event = models.CharField(max_length=16, help_text="proposed (waits for an operator), failed")
    url = models.URLField(max_length=2000)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ("created_at", "pk")
        constraints = (
            models.UniqueConstraint(
                fields=["decision", "event", "url"], name="one_notification_per_event_and_url"
            ),
        )

    def __str__(self) -> str:
        return f"decision {self.decision_id} {self.event} → {self.url}"
