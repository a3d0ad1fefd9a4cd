"""Applying a chosen plan: a command to every connected agent, then their progress back to a
recovered decision.

``begin`` runs in the transaction that chose the plan (approval, override, the job's mode or
its deadline): the decision becomes ``applying``, the plan becomes the job's, and one command
row per connected node is written; the commands are published only after the commit. An agent
acknowledges its command by id (``acked_each``), then reports training again and completes a step
(``progress_each``); when every agent whose node runs a part of the plan has (a standby only
acknowledges: ``training_commands``), the decision is ``recovered`` and the job runs again.

Nothing is lost to a restart: commands live in the database, a reconnecting agent is sent its
unacknowledged ones (``unfinished``), ``resend`` publishes again what stayed unacknowledged, and
agents drop a command id they have seen, so nothing is applied twice. A decision whose agents
stay silent past ``PITSTOP_APPLY_TIMEOUT_S`` fails, naming them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F, Min, Q, QuerySet
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.incidents.models import (
    AgentCommand,
    DecisionStatus,
    EventKind,
    RecoveryDecision,
)
from controlplane.incidents.transitions import (
    IllegalTransition,
    record,
    record_each,
    transition,
)
from controlplane.jobs import liveness
from controlplane.jobs.models import (
    Device,
    DeviceState,
    Job,
    JobStatus,
    Node,
    NodeStatus,
    heavy,
)
from controlplane.streaming import hub
from worker_agent import protocol
from worker_agent.protocol import plan_devices

log = structlog.get_logger(__name__)

# A command not acknowledged after this many seconds is published again.
RESEND_AFTER_S = 5.0


def begin(decision: RecoveryDecision, *, actor: str) -> RecoveryDecision:
    """Start applying ``decision``'s plan; call inside the transaction that chose it. The plan
    is packed once, on the decision; each node's command row keeps the rest of its frame."""
    job = decision.job
    nodes = list(Node.objects.filter(job=job, status=NodeStatus.HEALTHY).order_by("index"))
    plan = decision.plan
    holders = live_holders(job, plan, nodes)
    used = plan_devices(plan)
    training = {n for n, d in Device.objects.filter(job=job).values_list("node_id", "index")
                if d in used}  # fmt: skip
    restore = restore_mode(decision)
    commands = []
    for node in nodes:
        command_id = uuid.uuid4()
        frame = protocol.Command(
            id=str(command_id),
            action=protocol.Action.APPLY_PLAN,
            decision=decision.pk,
            restore=restore,
            holders=holders,
        )
        commands.append(
            AgentCommand(
                id=command_id,
                decision=decision,
                node=node,
                action=frame.action.value,
                frame=frame.model_dump(mode="json", exclude_none=True),
                trains=node.pk in training,
            )
        )
    ids = [c.id for c in commands]
    sent = [{"node": c.node.name, "command": str(c.id), "action": c.action} for c in commands]
    packed = protocol.pack_plan(plan or {})
    applying = transition(
        decision.pk,
        DecisionStatus.APPLYING,
        actor=actor,
        payload={"nodes": [n.name for n in nodes]},
        after_commit=lambda decision: _send_quietly(ids, decision, sent),
        packed_plan=packed,
    )
    AgentCommand.objects.bulk_create(commands)
    _plan_becomes_the_jobs(job, plan, packed)
    return applying


# Policies whose plans restore layers without a live holder otherwise than from peers; every
# other policy's plan (and an edited plan) takes them from live holders (the default).
RESTORE_BY_POLICY = {
    "checkfree": protocol.RestoreMode.NEIGHBOURS,
    "checkfree_plus": protocol.RestoreMode.NEIGHBOURS_PLUS,
    "checkpoint": protocol.RestoreMode.CHECKPOINT,
    "varuna": protocol.RestoreMode.CHECKPOINT,
    "restart": protocol.RestoreMode.CHECKPOINT,
    "restart_shrink": protocol.RestoreMode.CHECKPOINT,
}


def restore_mode(decision: RecoveryDecision) -> protocol.RestoreMode | None:
    """How the chosen candidate's plan restores lost layers; None (peers) for an edited plan.

    A decision whose candidates were left unread (``transition``) has only the chosen one's
    policy read from its row: the candidates with their plans are megabytes at 16,384 devices."""
    if decision.chosen is None:
        return None
    if "decision" in decision.get_deferred_fields():
        policy = (
            RecoveryDecision.objects.filter(pk=decision.pk)
            .values_list(f"decision__candidates__{decision.chosen}__policy", flat=True)
            .first()
        )
    else:
        candidates = (decision.decision or {}).get("candidates") or []
        inside = 0 <= decision.chosen < len(candidates)
        policy = candidates[decision.chosen].get("policy") if inside else None
    return RESTORE_BY_POLICY.get(policy) if isinstance(policy, str) else None


def live_holders(job: Job, plan: Any, nodes: Iterable[Node]) -> list[int] | None:
    """The devices of the job's plan so far that are alive on ``nodes`` (those the command goes
    to), when ``plan`` leaves one of them out; None when it keeps them all.

    A rank takes the layers it lacks from live devices that held them under the previous plan;
    by default it asks the devices of both plans, so a layer whose live holders the new plan all
    leaves out (an operator's edit, a re-plan onto other devices) would have none. Listed here,
    such a device sends what it is asked for and then idles. When the new plan keeps every
    live device, the field is left out and the command is what it was before the field existed.
    """
    before, after = plan_devices(job.plan), plan_devices(plan)
    if before <= after:
        return None
    on_nodes = Device.objects.filter(job=job, node__in=list(nodes)).exclude(
        state=DeviceState.FAILED
    )
    alive = set(on_nodes.values_list("index", flat=True)) & before
    return sorted(alive) if alive - after else None


def _plan_becomes_the_jobs(job: Job, plan: Any, packed: str) -> None:
    """The job runs ``plan`` from now on: its devices used, the others idle (or still down).

    A plan uses a failed device only when it restarts a process's fault in place (the
    ``restart`` policy: the device runs the new process), so every device it uses is healthy."""
    used = plan_devices(plan)
    # the text ``PlanField`` would store for ``plan``, packed once for the commands too
    Job.objects.filter(pk=job.pk).update(plan=plan if plan is None else packed)
    devices = Device.objects.filter(job=job)
    # the shorter list of the two: a plan uses all devices but a few, or a few of them (a
    # query listing 16,384 device numbers was a tenth of a planner's work at 2,048 nodes)
    unused = set(devices.values_list("index", flat=True)) - used
    in_plan = Q(index__in=used) if len(used) <= len(unused) else ~Q(index__in=unused)
    # only the rows that change: a rerouted plan keeps 16,376 devices of 16,384 as they were
    devices.filter(in_plan).exclude(state=DeviceState.HEALTHY).update(state=DeviceState.HEALTHY)
    devices.exclude(in_plan).exclude(state__in=[DeviceState.FAILED, DeviceState.SPARE]).update(
        state=DeviceState.SPARE
    )


def _send_quietly(
    command_ids: list[uuid.UUID], decision: RecoveryDecision, sent: list[dict[str, Any]]
) -> None:
    """The commands published once their decision is committed, then each one's
    ``command_sent`` event: 2,048 rows at 2,048 nodes, 0.1 s that no longer holds the commands
    back (a worker lost in between leaves the timeline without them; the commands are sent
    again by the detector, and acknowledged, all the same)."""
    send(command_ids)
    try:
        record_each(decision.job, EventKind.COMMAND_SENT, sent, actor="system", decision=decision)
    except DatabaseError as exc:
        log.warning("command.sent_not_recorded", decision=decision.pk, error=str(exc))


def send(command_ids: Iterable[uuid.UUID]) -> int:
    """Publish the commands still unacknowledged to their nodes, in one round trip; how many
    went out (with Redis down, none: ``resend`` tries again)."""
    pending = list(
        AgentCommand.objects.filter(pk__in=list(command_ids), acked_at__isnull=True).values_list(
            "pk", "node__job_id", "node__name", "frame"
        )
    )
    # without the plan: 2,048 copies of it overflowed Redis's buffer for the subscribed servers,
    # which then lost them all; each server process adds it (``packed_plan``, read once)
    messages = [(job, node, {"command": frame}) for _, job, node, frame in pending]
    try:
        hub.publish_each(messages)
    except (RedisError, OSError) as exc:
        log.warning("command.send_failed", commands=len(pending), error=str(exc))
        return 0
    sent = [pk for pk, *_ in pending]
    AgentCommand.objects.filter(pk__in=sent).update(sent_at=timezone.now(), sends=F("sends") + 1)
    return len(sent)


def lacks_plan(frame: dict[str, Any]) -> bool:
    """An ``apply_plan`` frame kept without its plan (one kept whole before ``packed_plan``
    existed has it)."""
    return frame.get("action") == protocol.Action.APPLY_PLAN and "plan" not in frame


def packed_plan(decision_id: int) -> str:
    """The decision's plan as its commands carry it (``RecoveryDecision.packed_plan``)."""
    packed = RecoveryDecision.objects.values_list("packed_plan", flat=True).get(pk=decision_id)
    if packed:
        return packed
    plan = RecoveryDecision.objects.values_list("plan", flat=True).get(pk=decision_id)
    return protocol.pack_plan(plan or {})


@dataclass(frozen=True)
class Unfinished:
    """A command a node's agent has yet to see through: the frame, and how far it got."""

    id: str
    frame: dict[str, object]
    acked: bool
    resumed_step: int | None


def unfinished(node_id: int) -> list[Unfinished]:
    """The node's commands of decisions still applying that it has not completed a step under
    (a reconnecting agent is sent again those it has not acknowledged), without their plan."""
    found = AgentCommand.objects.filter(
        node_id=node_id, decision__status=DecisionStatus.APPLYING, stepped_at__isnull=True
    ).exclude(ok=False)
    return [
        Unfinished(str(c.pk), c.frame, c.acked_at is not None, c.resumed_step)
        for c in found.order_by("created_at")
    ]


def ack_error(ack: protocol.Ack) -> str:
    """An acknowledgement's refusal as stored and shown: ``[code] message``, or ``""``."""
    return "" if ack.error is None else f"[{ack.error.code}] {ack.error.message}"


# What recording acknowledgements and progress reads of a command, and of its node: at 2,048
# nodes, whole rows (the frame's JSON, the node's every field) were most of each batch's reading,
# in the server's threads beside its busy event loop.
ACKED_READS = ("node_id", "decision_id", "acked_at", "ok", "error", "node__name")
PROGRESS_READS = ("decision_id", "resumed_at", "resumed_step", "stepped_at", "stepped_step")


def acked_each(acks: Sequence[tuple[int, protocol.Ack]]) -> list[AgentCommand | None]:
    """Record agents' acknowledgements (node, ack) together, in one transaction; for each, its
    command, or None when its node was sent no such command. A refusal fails the decision with
    the agent's reason (the first refusal's, when several come at once); an acknowledgement
    sent twice counts once. A plan applied on 2,048 nodes is 2,048 acknowledgements: they are
    one read, one update and one insert of their events, not 2,048 transactions."""
    ids = [_uuid(ack.command) for _, ack in acks]
    now = timezone.now()
    with transaction.atomic():
        found = {
            c.pk: c
            for c in AgentCommand.objects.select_for_update(of=("self",))
            .select_related("node")
            .only(*ACKED_READS)
            .filter(pk__in=[i for i in ids if i is not None])
        }
        commands: list[AgentCommand | None] = []
        for command_id, (node_id, _) in zip(ids, acks, strict=True):
            command = found.get(command_id) if command_id is not None else None
            commands.append(command if command is not None and command.node_id == node_id else None)
        fresh: dict[uuid.UUID, AgentCommand] = {}
        for command, (_, ack) in zip(commands, acks, strict=True):
            if command is not None and command.acked_at is None and command.pk not in fresh:
                command.acked_at, command.ok, command.error = now, ack.ok, ack_error(ack)
                fresh[command.pk] = command
        if not fresh:
            return commands
        _update_in_groups(fresh.values(), ("acked_at", "ok", "error"))
        decisions = {
            d.pk: d
            for d in RecoveryDecision.objects.select_for_update(of=("self",))
            .select_related("job")
            .defer(*heavy("job"), "decision", "plan", "packed_plan")
            .filter(pk__in={c.decision_id for c in fresh.values()})
        }
        by_decision = sorted(fresh.values(), key=lambda c: c.decision_id)
        for decision_id, group in itertools.groupby(by_decision, key=lambda c: c.decision_id):
            decision, done = decisions[decision_id], list(group)
            acked = [{"node": c.node.name, "command": str(c.pk), "ok": c.ok, "error": c.error}
                     for c in done]  # fmt: skip
            record_each(decision.job, EventKind.COMMAND_ACKED, acked, decision=decision,
                        actor=lambda payload: f"agent:{payload['node']}")  # fmt: skip
            refusals = [c for c in done if not c.ok]
            if refusals and decision.status == DecisionStatus.APPLYING:
                first = refusals[0]
                reason = f"{first.node.name} refused the plan: {first.error or 'no reason given'}"
                _fail(decision.pk, reason, actor=f"agent:{first.node.name}")
    return commands


def _update_in_groups(commands: Iterable[AgentCommand], fields: Sequence[str]) -> None:
    """Write ``fields`` of each command: one UPDATE for the commands that have the same values
    (2,048 nodes acknowledging, or resuming at the same step, are one), where ``bulk_update``
    builds a CASE of every row for every field."""
    groups: dict[tuple[Any, ...], list[uuid.UUID]] = {}
    for command in commands:
        groups.setdefault(tuple(getattr(command, f) for f in fields), []).append(command.pk)
    for values, pks in groups.items():
        AgentCommand.objects.filter(pk__in=pks).update(**dict(zip(fields, values, strict=True)))


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def progress_each(reports: Sequence[tuple[str, int]]) -> list[int | None]:
    """Agents acknowledged their commands and their devices report training: (command, step)
    each, recorded together in one transaction, in order.

    A command's first report marks it resumed (at that step); a later one past that step marks
    its first step done (at that step). When every agent of the decision has resumed, the
    timeline says so; when every one has completed a step, the decision is recovered, resumed
    from the step before the lowest of those first steps (``resumed_step``), and the job runs
    at the step. For each report, the step its agent resumed at while a step is still awaited,
    else None (done, or the decision moved on)."""
    ids = [_uuid(command_id) for command_id, _ in reports]
    now = timezone.now()
    with transaction.atomic():
        commands = {
            c.pk: c
            for c in AgentCommand.objects.select_for_update(of=("self",))
            .only(*PROGRESS_READS)
            .filter(pk__in=[i for i in ids if i is not None])
        }
        applying = {
            d.pk: d
            for d in RecoveryDecision.objects.select_for_update(of=("self",))
            .select_related("job")
            .defer(*heavy("job"), "decision", "plan", "packed_plan")
            .filter(
                pk__in={c.decision_id for c in commands.values()}, status=DecisionStatus.APPLYING
            )
        }
        changed: dict[uuid.UUID, AgentCommand] = {}
        latest: dict[int, int] = {}  # each decision's step as its latest report here says
        for command_id, (_, step) in zip(ids, reports, strict=True):
            command = commands.get(command_id) if command_id is not None else None
            if command is None or command.decision_id not in applying:
                continue
            latest[command.decision_id] = step
            if command.resumed_at is None:
                command.resumed_at, command.resumed_step = now, step
            elif command.stepped_at is None and step > (command.resumed_step or 0):
                command.stepped_at, command.stepped_step = now, step
            else:
                continue
            changed[command.pk] = command
        _update_in_groups(
            changed.values(), ("resumed_at", "resumed_step", "stepped_at", "stepped_step")
        )
        recovered = {pk for pk, step in latest.items() if _moved_on(applying[pk], step)}
    return [
        None
        if command is None or command.decision_id not in applying
        or command.decision_id in recovered or command.stepped_at is not None
        else command.resumed_step
        for command in (commands.get(i) if i is not None else None for i in ids)
    ]  # fmt: skip


def _moved_on(decision: RecoveryDecision, step: int) -> bool:
    """The timeline's word once every agent of the applying decision has resumed, then made a
    step (``step``: the latest report's): then the decision is recovered and the job runs again
    (True)."""
    waited = training_commands(decision)
    if waited.filter(stepped_at__isnull=True).exists():
        if (
            not waited.filter(resumed_at__isnull=True).exists()
            and not decision.events.filter(kind=EventKind.RESUMED).exists()
        ):
            record(decision.job, EventKind.RESUMED, actor="system", decision=decision, step=step)
        return False
    record(decision.job, EventKind.FIRST_STEP, actor="system", decision=decision, step=step)
    # the job's first step under the plan is the lowest an agent reported (one whose first beat
    # after the ack came a step late reports the step after); training resumed from the step
    # completed before it
    lowest = waited.aggregate(lowest=Min("stepped_step"))["lowest"]
    resumed_from = None if lowest is None else max(lowest - 1, 0)
    transition(decision.pk, DecisionStatus.RECOVERED, actor="system",
               payload={"step": step, "resumed_step": resumed_from},
               resumed_step=resumed_from)  # fmt: skip
    Job.objects.filter(pk=decision.job_id).update(status=JobStatus.RUNNING, step=step)
    return True


def training_commands(decision: RecoveryDecision) -> QuerySet[AgentCommand]:
    """The decision's commands to nodes that run a part of its plan: those waited for to train
    again and make a step. A node whose devices the plan leaves out (a standby, a spare nobody
    took) is sent the plan and acknowledges it, but has nothing to train."""
    return AgentCommand.objects.filter(decision=decision, trains=True)


def _fail(decision_id: int, reason: str, *, actor: str) -> None:
    decision = transition(
        decision_id, DecisionStatus.FAILED, actor=actor, payload={"reason": reason}, reason=reason
    )
    Job.objects.filter(pk=decision.job_id).update(status=JobStatus.FAILED)
    log.warning("decision.apply_failed", decision=decision_id, reason=reason)


def resend(*, after_s: float = RESEND_AFTER_S) -> int:
    """Publish again every command of an applying decision unacknowledged for ``after_s`` and
    never handed to its agent's socket (lost to a Redis restart, or sent while its agent was
    reconnecting). One handed over is not: its agent applies it, or its socket closes and the
    agent's next hello is sent it again. At 2,048 nodes, whose acknowledgements took longer than
    ``after_s``, every command went twice, the plan's 60 kB each time.

    A command never sent waits as long, from when it was written: between the commit that writes
    a decision's commands and their first publication (``send`` stamps ``sent_at`` after it), a
    pass took all 2,047 of a 2,048-node recovery for lost and published them a second time."""
    before = timezone.now() - dt.timedelta(seconds=after_s)
    stale = [
        str(pk)
        for pk in AgentCommand.objects.filter(
            Q(sent_at__lt=before) | Q(sent_at__isnull=True, created_at__lt=before),
            decision__status=DecisionStatus.APPLYING,
            acked_at__isnull=True,
        ).values_list("pk", flat=True)
    ]
    try:
        handed = liveness.handed_of(stale)
    except RedisError:  # Redis down: nothing is sent either (``send``)
        handed = set()
    return send(uuid.UUID(pk) for pk in stale if pk not in handed)


def expire(*, timeout_s: float | None = None) -> list[int]:
    """Fail every decision applying for longer than ``timeout_s`` (``PITSTOP_APPLY_TIMEOUT_S``),
    naming the agents it still waits for; returns their ids."""
    timeout_s = settings.PITSTOP_APPLY_TIMEOUT_S if timeout_s is None else timeout_s
    before = timezone.now() - dt.timedelta(seconds=timeout_s)
    failed = []
    late = RecoveryDecision.objects.filter(status=DecisionStatus.APPLYING, updated_at__lt=before)
    for decision in late:
        waiting = sorted(
            training_commands(decision)
            .filter(stepped_at__isnull=True)
            .values_list("node__name", flat=True)
        )
        reason = (
            f"no step from {', '.join(waiting)} within {timeout_s:g} s"
            if waiting
            else "no agent was connected to apply the plan"
        )
        try:
            _fail(decision.pk, reason, actor="timeout")
        except IllegalTransition:
            continue  # it recovered or was superseded meanwhile
        failed.append(decision.pk)
    return failed
