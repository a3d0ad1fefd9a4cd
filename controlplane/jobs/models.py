"""Jobs and what they run on: the job (its scenario and current plan), nodes, devices, tokens.

A job's ``scenario`` is the core's scenario format (docs/scenario.md): model profile, cluster,
batch, initial plan, assumptions and policy options; ``plan`` is the plan running now, in the
codec's plan format. Devices are numbered as the core numbers them: ``0 … devices−1``, then the
spares. Live heartbeat data (last seen, latest metrics) is kept in Redis, not here.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from typing import Any

from django.db import models
from django.utils import timezone

from worker_agent import protocol


class ApprovalMode(models.TextChoices):
    AUTO = "auto", "apply the best plan at once"
    MANUAL = "manual", "wait for an operator"
    MANUAL_WITH_TIMEOUT = "manual_with_timeout", "wait for an operator, then apply the proposal"


class JobStatus(models.TextChoices):
    PENDING = "pending"  # created, no agent has said hello yet
    RUNNING = "running"
    RECOVERING = "recovering"  # a failure is being handled
    STOPPED = "stopped"  # every agent that joined said goodbye
    STALE = "stale"  # no node heard for longer than the join deadline
    FAILED = "failed"  # no policy could recover it (until a node joins in a lost one's place)


# Statuses of a job whose nodes are watched: the detector's sweep looks at these only.
LIVE_JOB = (JobStatus.PENDING, JobStatus.RUNNING, JobStatus.RECOVERING)


# A job's large JSON fields: its scenario and plan, megabytes at 16,384 devices. The hot paths
# (an agent's hello, a failure) need only the job's id and name, and leave them unread.
HEAVY = ("scenario", "plan")


def heavy(relation: str = "") -> list[str]:
    """``HEAVY`` for ``defer()``, through ``relation`` (e.g. ``"job"``) when given."""
    return [f"{relation}__{name}" if relation else name for name in HEAVY]


class PlanField(models.JSONField):
    """An execution plan, stored packed as its commands carry it (``protocol.pack_plan``, a
    JSON string) and read back as the plan's object. A plan of 16,384 devices is 0.7 MB of JSON,
    3 MB once ten nodes are rerouted, written as a decision is made and applied: 0.07 and 0.22 s
    each on PostgreSQL, against 0.03 and 0.04 s packed. A row written before holds the object,
    read as it is; a string that is not a packed plan is read as the string, and an object that
    cannot be packed (not in the plan format) is stored as it is."""

    def get_prep_value(self, value: Any) -> Any:
        if isinstance(value, dict):
            with contextlib.suppress(TypeError, AttributeError, KeyError, ValueError):
                value = protocol.pack_plan(value)
        return super().get_prep_value(value)

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        value = super().from_db_value(value, expression, connection)
        if isinstance(value, str):
            try:
                # not the cached ``unpack_plan``: each row its own object, free to change
                return protocol.unpack_plan.__wrapped__(value)
            except ValueError:
                return value
        return value


class Job(models.Model):
    name = models.CharField(max_length=200, unique=True)
    scenario = models.JSONField(help_text="the core's scenario format (docs/scenario.md)")
    plan = PlanField(help_text="the execution plan running now (codec plan format)")
    approval_mode = models.CharField(
        max_length=32, choices=ApprovalMode.choices, default=ApprovalMode.AUTO
    )
    approval_timeout_s = models.FloatField(
        default=300.0, help_text="manual_with_timeout: seconds before the proposal is applied"
    )
    enabled_policies = models.JSONField(
        default=list, help_text="registry names of the policies asked at a failure, in order"
    )
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    step = models.BigIntegerField(default=0, help_text="the last training step reported")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.name


class NodeStatus(models.TextChoices):
    """A node's lifecycle: expected (in the job's scenario) -> joined (its agent's hello:
    healthy, suspect while a heartbeat is late) -> failed (lost, or never joined) or left."""

    EXPECTED = "expected", "expected, not yet heard"
    HEALTHY = "healthy"  # joined: its agent is connected
    SUSPECT = "suspect"  # a heartbeat is late
    FAILED = "failed"  # lost, or not joined within the join deadline (never_joined)
    LEFT = "left"  # said goodbye


class Node(models.Model):
    """A host running one agent; it holds a contiguous block of the job's devices."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=200)
    index = models.PositiveIntegerField(help_text="node number in the cluster (device // per node)")
    status = models.CharField(
        max_length=16, choices=NodeStatus.choices, default=NodeStatus.EXPECTED
    )
    expected_at = models.DateTimeField(
        default=timezone.now,
        help_text="when its hello began to be awaited (the join deadline runs from it)",
    )
    joined_at = models.DateTimeField(null=True, blank=True, help_text="its agent's latest hello")

    class Meta:
        ordering = ("job", "index")
        indexes = (models.Index(fields=["status", "expected_at"]),)
        constraints = (
            models.UniqueConstraint(fields=["job", "name"], name="node_name_unique_per_job"),
            models.UniqueConstraint(fields=["job", "index"], name="node_index_unique_per_job"),
        )

    def __str__(self) -> str:
        return f"{self.job.name}/{self.name}"


class DeviceState(models.TextChoices):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    FAILED = "failed"
    SPARE = "spare"  # healthy and idle, outside the plan
    RECOVERING = "recovering"  # receiving weights or restarting for a new plan


class Device(models.Model):
    """One accelerator; ``index`` is the core's device id."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="devices")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    index = models.PositiveIntegerField()
    state = models.CharField(
        max_length=16, choices=DeviceState.choices, default=DeviceState.HEALTHY
    )

    class Meta:
        ordering = ("job", "index")
        constraints = (
            models.UniqueConstraint(fields=["job", "index"], name="device_index_unique_per_job"),
        )

    def __str__(self) -> str:
        return f"{self.job.name}#{self.index}"


TOKEN_PREFIX = "pst_"  # an agent token's first characters (``AgentToken.issue``)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AgentToken(models.Model):
    """What an agent presents in its hello; only the SHA-256 of the token is stored.

    A token speaks for its job's nodes, or, when it names a node, for that node only: a host
    holding it cannot say hello, report faults or acknowledge commands as another node.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="agent_tokens")
    node = models.ForeignKey(
        Node,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="agent_tokens",
        help_text="the one node this token speaks for; empty: any node of the job",
    )
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        scope = self.job.name if self.node_id is None else f"{self.job.name}/{self.node}"
        return f"token of {scope} ({self.digest[:8]}…)"

    @classmethod
    def issue(cls, job: Job, node: Node | None = None) -> tuple[AgentToken, str]:
        """A new token for ``job`` (or one of its nodes): the row, and the token itself, shown
        once and never stored. ``TOKEN_PREFIX`` first: a bare URL-safe token starts with ``-``
        one time in 64, and ``--token -x...`` is then an option, not a value, to every command
        line (the agent's refused to start); the prefix also makes a leaked token recognisable."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        return cls.objects.create(job=job, node=node, digest=token_digest(token)), token

    def revoke(self) -> None:
        """Revoke the token now: no hello with it is accepted from now on, and once this
        commits, every open agent socket that said hello with it closes (``unauthorised``)
        and its node is lost, as for any socket that closes without goodbye."""
        from django.db import transaction
        from django.utils import timezone as tz
        from redis.exceptions import RedisError

        from controlplane.streaming import hub

        if self.revoked_at is None:
            self.revoked_at = tz.now()
            self.save(update_fields=["revoked_at"])
        nodes = Node.objects.filter(job_id=self.job_id)
        if self.node_id is not None:
            nodes = nodes.filter(pk=self.node_id)
        names = list(nodes.values_list("name", flat=True))

        def tell() -> None:
            for name in names:
                try:
                    hub.publish(self.job_id, name, {"revoked_token": self.pk})
                except RedisError:  # its sockets still fail at their next fault or ack
                    return

        transaction.on_commit(tell)

    @classmethod
    def find(cls, token: str, **filters: Any) -> AgentToken | None:
        """The live token row for ``token``, or None (looked up by its digest)."""
        return (
            cls.objects.select_related("job")
            .defer(*heavy("job"))
            .filter(digest=token_digest(token), revoked_at__isnull=True, **filters)
            .first()
        )


class MetricPoint(models.Model):
    """One point of a job's training history, kept on the server so that a page loaded later
    (or again) draws the run, not only what it saw live (``jobs/history.py``). Old points are
    merged two into one as the job's history grows: at most ``history.MAX_POINTS`` a job."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="history")
    at = models.DateTimeField(help_text="the point's time (the first, for merged points)")
    span_s = models.FloatField(default=0.0, help_text="the seconds a merged point stands for")
    step = models.BigIntegerField(null=True, blank=True)
    loss = models.FloatField(null=True, blank=True)
    samples_per_s = models.FloatField(null=True, blank=True)
    step_time_s = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ("at",)
        indexes = (models.Index(fields=("job", "at")),)
