"""Drills: a fault injected on purpose through the control plane.

``POST /api/v1/jobs/{id}/drills/`` (an operator) names a node of the job, a kind (``kill``,
``hang``, ``slow``, ``nan``: into the rank of ``device``; ``drop``: the agent's socket) and,
for ``hang`` and ``slow``, how long. The node must be connected. The drill is written with an
event on the job's timeline, then sent once, after the commit, as an ``inject`` command whose
id is the drill's (``worker_agent.protocol.Injection``). It is never sent again: a kill that
reached an agent minutes late, after a reconnection, would be a surprise, not a drill. The
agent's acknowledgement lands on the drill and on the timeline; the fault the injection causes
is detected and recovered as any other.
"""

from __future__ import annotations

import uuid

import structlog
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError
from redis.exceptions import RedisError

from controlplane.incidents.applying import ack_error
from controlplane.incidents.models import Drill, EventKind
from controlplane.incidents.transitions import record
from controlplane.jobs import liveness
from controlplane.jobs.models import Device, Job, Node, heavy
from controlplane.streaming import hub
from worker_agent import protocol

log = structlog.get_logger(__name__)


class DrillRefused(Exception):
    """Why a drill cannot be sent: a stable ``code``, the ``field`` at fault, an HTTP status."""

    def __init__(self, code: str, message: str, *, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.code, self.field, self.status = code, field, status


def connected(job: Job, node: str) -> bool:
    """Whether the node's agent is connected now (watched by the heartbeat deadline)."""
    return liveness.sync_client().zscore(liveness.seen_key(job.pk), node) is not None


def inject(
    job: Job,
    *,
    node: str,
    kind: str,
    actor: str,
    device: int | None = None,
    seconds: float | None = None,
) -> Drill:
    """Send a drill to the node's agent; ``DrillRefused`` says why not: nothing is written,
    but for a drill Redis would not take, kept as not sent. Called outside a transaction (the
    API's and the page's views are), so that the drill is committed before its agent sees it."""
    try:
        injection = protocol.Injection(kind=kind, device=device, seconds=seconds)  # type: ignore[arg-type]
    except ValidationError as exc:  # the first problem, by field (a kind needing a device: device)
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "device"
        raise DrillRefused("invalid", first["msg"], field=where) from None
    row = Node.objects.filter(job=job, name=node).first()
    if row is None:
        raise DrillRefused("unknown_node", f"job {job.name} has no node {node!r}", field="node")
    owned = sorted(Device.objects.filter(node=row).values_list("index", flat=True))
    if device is not None and device not in owned:
        raise DrillRefused(
            "wrong_devices", f"device {device} is not on {node} (it has {owned})", field="device"
        )
    try:
        if not connected(job, node):
            raise DrillRefused(
                "node_not_connected",
                f"{node}'s agent is not connected: a drill is sent once, to a connected node",
                field="node",
                status=409,
            )
    except RedisError as exc:
        raise DrillRefused("not_sent", f"Redis cannot be reached: {exc}", status=503) from None
    with transaction.atomic():
        drill = Drill.objects.create(
            job=job, node=row, kind=kind, device=device, seconds=seconds, requested_by=actor
        )
        record(job, EventKind.DRILL_SENT, actor=actor, drill=str(drill.pk), node=node,
               inject=kind, device=device, seconds=seconds)  # fmt: skip
    frame = protocol.Command(id=str(drill.pk), action=protocol.Action.INJECT, inject=injection)
    try:
        hub.publish(job.pk, node, {"command": frame.model_dump(mode="json", exclude_none=True)})
    except (RedisError, OSError) as exc:
        Drill.objects.filter(pk=drill.pk).update(ok=False, error=f"not sent: {exc}")
        raise DrillRefused("not_sent", f"Redis cannot be reached: {exc}", status=503) from None
    drill.sent_at = timezone.now()
    drill.save(update_fields=["sent_at"])
    log.info("drill.sent", drill=str(drill.pk), job=job.pk, node=node, kind=kind, device=device)
    return drill


def acked(node_id: int, ack: protocol.Ack) -> Drill | None:
    """Record the agent's acknowledgement of a drill; None when the node was sent no such
    drill. An acknowledgement sent twice counts once."""
    try:
        drill_id = uuid.UUID(ack.command)
    except ValueError:
        return None
    with transaction.atomic():
        drill = (
            Drill.objects.select_for_update(of=("self",))
            .select_related("job", "node")
            .defer(*heavy("job"))
            .filter(pk=drill_id, node_id=node_id)
            .first()
        )
        if drill is None or drill.acked_at is not None:
            return drill
        error = ack_error(ack)
        drill.acked_at, drill.ok, drill.error = timezone.now(), ack.ok, error
        drill.save(update_fields=["acked_at", "ok", "error"])
        record(drill.job, EventKind.DRILL_ACKED, actor=f"agent:{drill.node.name}",
               drill=str(drill.pk), ok=ack.ok, error=error)  # fmt: skip
    return drill
