"""The recovery decision's life: failures open one, planning fills it, operators or the job's
mode choose, ``applying`` sends the plan to the agents, and every move is checked, recorded on
the timeline and committed together (``transitions.transition``, the state machine's one door).
Planning runs in Celery (``tasks.plan_recovery``); everything here is safe to run twice.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import DatabaseError, transaction
from django.utils import timezone

from controlplane.bridge import rows
from controlplane.bridge.vocabulary import PROCESS_FAULTS, FailureKind
from controlplane.incidents import applying, notifications
from controlplane.incidents.models import (
    OPEN,
    DecisionStatus,
    EventKind,
    Failure,
    FailureSource,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.incidents.transitions import IllegalTransition, record, transition
from controlplane.jobs import lifecycle, liveness
from controlplane.jobs.models import (
    ApprovalMode,
    Device,
    DeviceState,
    Job,
    JobStatus,
    Node,
    NodeStatus,
    heavy,
)
from controlplane.jobs.services import failed_devices
from worker_agent.protocol import plan_devices

log = structlog.get_logger(__name__)

# --- failures ------------------------------------------------------------------------------


def record_failure(
    job: Job,
    *,
    kind: str,
    devices: Iterable[int],
    source: str,
    occurred_at: dt.datetime,
    node: Node | None = None,
    message: str = "",
    step: int | None = None,
    process: dict[str, Any] | None = None,
    plan: Callable[[int], None] | None = None,
) -> tuple[Failure, RecoveryDecision]:
    """Record a failure and open the decision that will recover from it.

    ``step`` is the job's last reported step as the caller knows it (the agent's fault frame,
    else the heartbeats: ``snapshot.job_step``), kept on the failure and its timeline event.

    One incident, one failure: when the job's open decision is still planning, the devices
    join its failure (many ranks of one node report the same fault) and planning, which reads
    the devices when it runs, covers them all; devices that are all down already change nothing.
    Otherwise an open decision is superseded and a new one plans for every device down now.
    ``plan(decision_id)`` is called after the commit for a new decision (the Celery task's
    ``delay``). ``process`` is the agent's word on the process at fault (``Failure.processes``),
    kept on whichever failure the report lands in.
    """
    devices = sorted(set(devices))
    if not devices:
        raise rows.InvalidScenario("a failure needs at least one device", field="devices")
    if kind not in FailureKind.__members__.values():
        raise rows.InvalidScenario(
            f"unknown kind {kind!r}; known: {', '.join(FailureKind)}", field="kind"
        )
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().defer(*heavy()).get(pk=job.pk)
        # only the devices named: a failure of one node costs the same on 16,384 devices
        known = dict(
            Device.objects.filter(job=job, index__in=devices).values_list("index", "state")
        )
        unknown = [d for d in devices if d not in known]
        if unknown:
            total = Device.objects.filter(job=job).count()
            raise rows.InvalidScenario(
                f"devices {unknown} do not exist in job {job.name} (ids are 0..{total - 1})",
                field="devices",
            )
        if all(known[d] == DeviceState.FAILED for d in devices):
            latest = (
                RecoveryDecision.objects.select_related("failure")
                .filter(job=job)
                .order_by("-created_at", "-pk")
                .first()
            )
            if latest is not None:
                # reported again (the socket's close and then the deadline, two ranks of one
                # node): these devices are down and handled already, nothing new happened
                _keep_process(latest.failure, process)
                return latest.failure, latest
        Device.objects.filter(job=job, index__in=devices).update(state=DeviceState.FAILED)
        open_decision = (
            RecoveryDecision.objects.select_for_update()
            .select_related("failure")
            .filter(job=job, status__in=OPEN)
            .first()
        )
        if (
            open_decision is not None
            and open_decision.status == DecisionStatus.PLANNING
            and not open_decision.grows  # superseded: its failure is an old one, its devices back
        ):
            failure = open_decision.failure
            _keep_process(failure, process)
            merged = sorted(set(failure.devices) | set(devices))
            if merged != failure.devices:
                failure.devices = merged
                failure.save(update_fields=["devices"])
                record(
                    job,
                    EventKind.FAILURE_DETECTED,
                    actor=source,
                    failure=failure,
                    decision=open_decision,
                    devices=devices,
                    failure_kind=kind,  # its own: ``_restartable`` reads it per device
                    merged_into=failure.pk,
                    detection_latency_s=_latency(occurred_at, now),
                    step=step,
                )
            return failure, open_decision
        failure = _new_failure(
            job,
            kind,
            devices,
            source,
            occurred_at,
            now,
            node=node,
            message=message,
            step=step,
            processes=[process] if process else [],
        )
        if open_decision is not None:
            transition(open_decision.pk, DecisionStatus.SUPERSEDED, actor="system")
        decision = RecoveryDecision.objects.create(job=job, failure=failure)
        _detected(failure, decision)
        record(job, EventKind.PLANNING_STARTED, actor="system", decision=decision, failure=failure)
        if open_decision is not None:
            RecoveryDecision.objects.filter(pk=open_decision.pk).update(superseded_by=decision)
        Job.objects.filter(pk=job.pk).update(status=JobStatus.RECOVERING)
        if plan is not None:
            transaction.on_commit(lambda: plan(decision.pk))
    log.info(
        "failure.recorded",
        job=job.pk,
        failure=failure.pk,
        kind=kind,
        devices=devices,
        source=source,
        detection_latency_s=failure.detection_latency_s,
    )
    return failure, decision


def record_idle_failure(
    job: Job,
    *,
    kind: str,
    devices: Iterable[int],
    source: str,
    occurred_at: dt.datetime,
    node: Node | None = None,
    message: str = "",
    step: int | None = None,
) -> Failure:
    """Record a failure of devices the running plan does not use (spares that never joined):
    they are down and on the timeline, but nothing trains on them, so no decision is opened."""
    devices = sorted(set(devices))
    now = timezone.now()
    with transaction.atomic():
        Device.objects.filter(job=job, index__in=devices).update(state=DeviceState.FAILED)
        failure = _new_failure(
            job, kind, devices, source, occurred_at, now, node=node, message=message, step=step
        )
        _detected(failure, None)
    log.info("failure.recorded_idle", job=job.pk, failure=failure.pk, kind=kind, devices=devices)
    return failure


def _latest_reports(job: Job, down: set[int]) -> dict[int, tuple[str | None, str]]:
    """For each of ``down``, the kind and source of its latest report (its ``failure_detected``
    event), also when it joined a failure of another kind (a node lost, and its peer's rank
    crashing with it)."""
    latest: dict[int, tuple[str | None, str]] = {}
    reports = TimelineEvent.objects.filter(job=job, kind=EventKind.FAILURE_DETECTED)
    for actor, payload in reports.order_by("at", "pk").values_list("actor", "payload"):
        said = (payload.get("failure_kind"), actor)
        latest.update((d, said) for d in payload.get("devices", ()) if d in down)
    return latest


def _on_connected_nodes(job: Job, devices: Iterable[int]) -> set[int]:
    on = Device.objects.filter(job=job, index__in=devices, node__status__in=lifecycle.CONNECTED)
    return set(on.values_list("index", flat=True))


def _restartable(job: Job, down: set[int]) -> set[int]:
    """Those of ``down`` whose latest report was their process's fault (crash, hang, NaN) on a
    node whose agent is connected: a coordinated restart may run on them again (``restart``)."""
    latest = _latest_reports(job, down)
    return _on_connected_nodes(
        job, [d for d, (kind, _) in latest.items() if kind in PROCESS_FAULTS]
    )


# Sources that report a node's silence (its socket closed, its heartbeats or hello missing)
NODE_SILENT = (FailureSource.SOCKET, FailureSource.HEARTBEAT)


def _back_meanwhile(job: Job) -> RecoveryDecision | None:
    """After a decision failed: a node down for its silence that said hello again while it
    planned (``node_came_back`` left its devices failed then) comes back now, and the job
    plans again with it. The new decision, or None."""
    down = failed_devices(job)
    latest = _latest_reports(job, down)
    back = _on_connected_nodes(
        job, [d for d, (_, source) in latest.items() if source in NODE_SILENT]
    )
    nodes = Device.objects.filter(job=job, index__in=back).values_list("node_id", flat=True)
    for node_id in sorted(set(nodes)):
        again = node_came_back(job.pk, node_id)
        if again is not None:
            return again
    return None


def _new_failure(
    job: Job,
    kind: str,
    devices: list[int],
    source: str,
    occurred_at: dt.datetime,
    now: dt.datetime,
    **more: Any,
) -> Failure:
    """A failure detected ``now`` (``occurred_at`` no later); ``more``: node, message, step."""
    return Failure.objects.create(
        job=job,
        kind=kind,
        devices=devices,
        source=source,
        occurred_at=min(occurred_at, now),
        detected_at=now,
        **more,
    )


MAX_PROCESSES = 256  # the reports a failure keeps of the processes at fault


def _keep_process(failure: Failure, process: dict[str, Any] | None) -> None:
    """Add another report's process to a failure that already stands (the first
    ``MAX_PROCESSES``: a failure of a thousand nodes does not grow a row without bound)."""
    if process and process not in failure.processes and len(failure.processes) < MAX_PROCESSES:
        failure.processes = [*failure.processes, process]
        failure.save(update_fields=["processes"])


def _detected(failure: Failure, decision: RecoveryDecision | None) -> None:
    """The failure's ``failure_detected`` event on its job's timeline."""
    record(
        failure.job,
        EventKind.FAILURE_DETECTED,
        actor=failure.source,
        decision=decision,
        failure=failure,
        at=failure.detected_at,
        failure_kind=failure.kind,
        devices=failure.devices,
        detection_latency_s=failure.detection_latency_s,
        step=failure.step,
    )


def _latency(occurred_at: dt.datetime, detected_at: dt.datetime) -> float:
    return max((detected_at - occurred_at).total_seconds(), 0.0)


# --- planning ------------------------------------------------------------------------------


def plan(
    decision_id: int,
    *,
    schedule_timeout: Callable[[int, float], None] | None = None,
    notify: Callable[[int], None] | None = None,
) -> str:
    """Plan an open decision: every enabled policy's candidates, stored, then the job's mode;
    ``notify`` sends a notification (its id) when the decision needs someone: a proposal that
    waits for an operator, or no policy that can recover the job (``notifications``).

    Safe to run twice (a redelivered task): a decision no longer planning is left alone. The
    core runs outside the row lock; if a failure joined meanwhile, planning runs again with it,
    at once if the core has policies left to ask (``rows.Superseded``): a burst of losses
    recorded one after another is planned once it has stopped growing, not once per loss.
    Returns the decision's status afterwards.
    """
    for _ in range(PLAN_TRIES):
        decision = RecoveryDecision.objects.select_related("job", "failure").get(pk=decision_id)
        if decision.status != DecisionStatus.PLANNING:
            return decision.status
        job, failure = decision.job, decision.failure
        seen = list(failure.devices)
        down = failed_devices(job)
        try:
            answer = rows.decide_for(
                job.scenario,
                job.plan,
                down,
                kind=failure.kind,
                devices=seen,
                policies=list(job.enabled_policies),
                restartable=_restartable(job, down),
                grows=decision.grows,
                parsed=scenario_of(job),
                stale=functools.partial(_grown, failure.pk, seen),
            )
        except rows.Superseded as exc:
            log.info("decision.plan_again", decision=decision_id, devices_planned=len(seen),
                     reason=str(exc))  # fmt: skip
            continue
        with transaction.atomic():
            locked = RecoveryDecision.objects.select_for_update().get(pk=decision_id)
            if locked.status != DecisionStatus.PLANNING:
                return locked.status
            if _grown(failure.pk, seen):
                log.info("decision.plan_again", decision=decision_id, devices_planned=len(seen),
                         reason="the failure changed after every policy")  # fmt: skip
                continue
            status = _proposed(decision, answer, schedule_timeout, notify)
        if status == DecisionStatus.FAILED:
            # a lost node that joined again while this planned: plan again, with it
            again = _back_meanwhile(job)
            if again is not None:
                return plan(again.pk, schedule_timeout=schedule_timeout, notify=notify)
        return status
    raise RuntimeError(f"decision {decision_id}: devices kept joining while planning")


# How many times a decision is planned before its task gives up, each try after devices
# joined its failure: a burst of losses recorded one by one over a second takes a few.
PLAN_TRIES = 16


def _grown(failure_id: int, seen: list[int]) -> bool:
    """Whether the failure's devices are other than ``seen`` now (more joined it)."""
    devices = Failure.objects.filter(pk=failure_id).values_list("devices", flat=True).get()
    return bool(devices != seen)


def _proposed(
    decision: RecoveryDecision,
    answer: dict[str, Any],
    schedule_timeout: Callable[[int, float], None] | None,
    notify: Callable[[int], None] | None,
) -> str:
    job = decision.job
    chosen = answer["chosen"]
    summary = {
        "search_time_s": answer["search_time_s"],
        "chosen": chosen,
        "codes": {c["policy"]: c["code"] for c in answer["candidates"]},
    }
    if decision.grows and (chosen is None or chosen == 0):
        # the running plan is kept (candidate 0, ``KEEP``): the devices that came back stay
        # spares, nothing is applied, and the job never stopped
        kept = answer["candidates"][0]
        transition(decision.pk, DecisionStatus.DISMISSED, actor="planner", payload=summary,
                   decision=answer, chosen=0, reason="the running plan is kept: no growth beats"
                   f" its objective ({kept['objective']:.4g})")  # fmt: skip
        return DecisionStatus.DISMISSED
    if chosen is None:
        # until a node joins in a lost one's place (``node_came_back``)
        transition(decision.pk, DecisionStatus.FAILED, actor="planner", payload=summary,
                   decision=answer, reason="no policy can recover the job with the devices it"
                   " has")  # fmt: skip
        Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED)
        if notify is not None:
            notifications.announce(reload(decision), notifications.FAILED, send=notify)
        return DecisionStatus.FAILED
    best_plan = answer["candidates"][chosen]["plan"]
    deadline = None
    if job.approval_mode == ApprovalMode.MANUAL_WITH_TIMEOUT:
        deadline = timezone.now() + dt.timedelta(seconds=job.approval_timeout_s)
    auto = job.approval_mode == ApprovalMode.AUTO
    transition(
        decision.pk,
        DecisionStatus.PROPOSED,
        actor="planner",
        payload=summary,
        decision=_without_plans(answer) if auto else answer,
        chosen=chosen,
        plan=best_plan,
        deadline_at=deadline,
    )
    if auto:
        applied = apply_proposal(decision.pk, actor="auto")
        # after the commands' publication, which the commit hands over first
        transaction.on_commit(lambda: _store_candidates(decision.pk, answer))
        return applied.status
    if deadline is not None and schedule_timeout is not None:
        transaction.on_commit(lambda: schedule_timeout(decision.pk, job.approval_timeout_s))
    if notify is not None:
        notifications.announce(reload(decision), notifications.PROPOSED, send=notify)
    return DecisionStatus.PROPOSED


# What a proposal applied at once (``auto``) stores of its candidates before its commands go
# out: the rest, their plans and each device's peak memory, are megabytes at 16,384 devices
# (4 MB of JSON, 0.37 s to write), stored right after the commands are published
# (``_store_candidates``). A worker lost in between leaves them without; the chosen plan is the
# decision's own, stored with it.
PLAN_FIELDS = ("plan", "peak_memory_bytes")


def _without_plans(answer: dict[str, Any]) -> dict[str, Any]:
    """The core's answer with its candidates' ``PLAN_FIELDS`` left out."""
    return {
        **answer,
        "candidates": [
            {k: v for k, v in c.items() if k not in PLAN_FIELDS} for c in answer["candidates"]
        ],
    }


def _store_candidates(decision_id: int, answer: dict[str, Any]) -> None:
    """The whole answer, once the commands are out; logged, not raised, if the database
    refuses (the recovery goes on: only the record of the candidates' plans is missing)."""
    try:
        RecoveryDecision.objects.filter(pk=decision_id).update(decision=answer)
    except DatabaseError as exc:
        log.warning("decision.candidates_not_stored", decision=decision_id, error=str(exc))


# --- choosing ------------------------------------------------------------------------------


def reload(decision: RecoveryDecision) -> RecoveryDecision:
    """The decision as stored now, with its job and failure."""
    return RecoveryDecision.objects.select_related("job", "failure").get(pk=decision.pk)


def _chosen(decision_id: int, to: str, *, actor: str, **changes: Any) -> RecoveryDecision:
    """The plan is chosen (``to``) and its applying begins, in one transaction."""
    with transaction.atomic():
        decision = transition(decision_id, to, actor=actor, **changes)
        return applying.begin(decision, actor="system")


def apply_proposal(decision_id: int, *, actor: str) -> RecoveryDecision:
    """The job's mode applies the proposal: at once (``auto``) or at the deadline."""
    return _chosen(decision_id, DecisionStatus.AUTO_APPLIED, actor=actor)


def overdue(*, planning_after_s: float) -> tuple[list[int], list[int]]:
    """Decisions planning for longer than ``planning_after_s`` (their task was lost or is slow),
    and proposals whose ``manual_with_timeout`` deadline has passed."""
    now = timezone.now()
    stuck = RecoveryDecision.objects.filter(
        status=DecisionStatus.PLANNING, updated_at__lt=now - dt.timedelta(seconds=planning_after_s)
    )
    late = RecoveryDecision.objects.filter(status=DecisionStatus.PROPOSED, deadline_at__lt=now)
    return list(stuck.values_list("pk", flat=True)), list(late.values_list("pk", flat=True))


def apply_after_deadline(decision_id: int) -> str:
    """``manual_with_timeout``: apply the proposal if nobody chose before the deadline."""
    decision = RecoveryDecision.objects.get(pk=decision_id)
    if decision.status != DecisionStatus.PROPOSED:
        return decision.status  # chosen, superseded or already applied
    if decision.deadline_at is not None and timezone.now() < decision.deadline_at:
        return decision.status  # too early (a clock skew or an early redelivery)
    try:
        return apply_proposal(decision_id, actor="timeout").status
    except IllegalTransition:
        return RecoveryDecision.objects.get(pk=decision_id).status  # an operator won the race


def approve(decision_id: int, *, user: AbstractBaseUser, reason: str = "") -> RecoveryDecision:
    """An operator approves the proposal."""
    return _chosen(
        decision_id,
        DecisionStatus.APPROVED,
        actor=user.get_username(),
        payload={"reason": reason},
        chosen_by=user,
        reason=reason,
    )


def override(
    decision_id: int,
    *,
    user: AbstractBaseUser,
    candidate: int | None = None,
    edited_plan: Any = None,
    reason: str = "",
) -> RecoveryDecision:
    """An operator picks another feasible candidate, or writes a plan the core validates.

    ``rows.InvalidScenario`` names the field at fault (``candidate``, or a path inside
    ``plan``); nothing changes then.
    """
    decision = RecoveryDecision.objects.select_related("job").get(pk=decision_id)
    if (candidate is None) == (edited_plan is None):
        raise rows.InvalidScenario(
            "give either a candidate index or an edited plan", field="candidate"
        )
    if candidate is not None:
        candidates = decision.candidates
        if not 0 <= candidate < len(candidates):
            raise rows.InvalidScenario(
                f"no candidate {candidate}; this decision has {len(candidates)}",
                field="candidate",
            )
        if candidates[candidate]["code"] != "ok":
            raise rows.InvalidScenario(
                f"candidate {candidate} ({candidates[candidate]['policy']}) does not apply: "
                f"[{candidates[candidate]['code']}] {candidates[candidate]['note']}",
                field="candidate",
            )
        plan = candidates[candidate]["plan"]
    else:
        job = decision.job
        plan = rows.validate_override(job.scenario, job.plan, failed_devices(job), edited_plan)
    return _chosen(
        decision_id,
        DecisionStatus.OVERRIDDEN,
        actor=user.get_username(),
        payload={"reason": reason, "candidate": candidate, "edited": candidate is None},
        chosen=candidate,
        plan=plan,
        chosen_by=user,
        reason=reason,
    )


def dismiss(
    decision_id: int,
    *,
    user: AbstractBaseUser,
    reason: str,
    plan: Callable[[int], None] | None = None,
) -> RecoveryDecision:
    """An operator calls the failure a false alarm (a stalled control plane, a slow node): the
    decision ends ``dismissed`` with no plan applied, and the failure's devices are back in
    service (in the plan: healthy, else spare), each with its node healthy again, where that
    node's agent is heard now; the devices of a node not heard within the heartbeat deadline
    stay failed. ``reason`` is required (``rows.InvalidScenario`` naming it).

    Only the dismissed failure is undone: a failure the decision took over (it superseded an
    earlier decision) is not a false alarm for that. When devices of the plan are still down
    after it, a new decision for the latest such failure plans around them (``plan`` is called
    with its id after the commit), so the job never waits in ``recovering`` with nothing
    planning."""
    if not reason.strip():
        raise rows.InvalidScenario("say why the failure is a false alarm", field="reason")
    job_id = RecoveryDecision.objects.values_list("job_id", flat=True).get(pk=decision_id)
    heard = _heard_nodes(job_id)
    with transaction.atomic():
        # locked first: a failure joining this decision meanwhile waits, so no device is missed
        locked = RecoveryDecision.objects.select_for_update().select_related("failure")
        failure = locked.get(pk=decision_id).failure
        on_node = dict(
            Device.objects.filter(job_id=job_id, index__in=failure.devices).values_list(
                "index", "node__name"
            )
        )
        back = sorted(d for d, node in on_node.items() if node in heard)
        down = sorted(set(failure.devices) - set(back))
        decision = transition(
            decision_id,
            DecisionStatus.DISMISSED,
            actor=user.get_username(),
            payload={"reason": reason, "devices_back": back, "devices_down": down},
            chosen_by=user,
            reason=reason,
        )
        job = decision.job
        used = plan_devices(job.plan)
        devices = Device.objects.filter(job_id=job_id, index__in=back)
        devices.filter(index__in=used).update(state=DeviceState.HEALTHY)
        devices.exclude(index__in=used).update(state=DeviceState.SPARE)
        Node.objects.filter(
            job_id=job_id, name__in={on_node[d] for d in back}, status=NodeStatus.FAILED
        ).update(status=NodeStatus.HEALTHY)
        still_down = Device.objects.filter(
            job_id=job_id, index__in=used, state=DeviceState.FAILED
        ).exists()
        if not still_down:
            Job.objects.filter(pk=job_id, status=JobStatus.RECOVERING).update(
                status=JobStatus.RUNNING
            )
        else:
            _replan_taken_over(decision, plan)
    log.info("decision.dismissed", decision=decision_id, job=job_id, back=back, down=down)
    return decision


def _replan_taken_over(dismissed: RecoveryDecision, plan: Callable[[int], None] | None) -> None:
    """Open a decision for the latest failure ``dismissed`` took over, if any (it superseded
    that failure's decision); planning reads every device down when it runs."""
    earlier = (
        RecoveryDecision.objects.select_related("failure")
        .filter(superseded_by=dismissed)
        .order_by("-created_at", "-pk")
        .first()
    )
    if earlier is not None:
        _plan_again(dismissed.job, earlier.failure, plan, replans_after=dismissed.pk)


def node_came_back(
    job_id: int, node_id: int, *, plan: Callable[[int], None] | None = None
) -> RecoveryDecision | None:
    """A failed node (lost, or never joined) said hello again, the lost host restarted or a
    replacement in its place (``lifecycle.joined``). Unless a decision is open (it plans around
    the node's devices, which stay failed), the node's failed devices are back in service: in
    the running plan healthy, else spares. A job that no policy could recover with the devices
    it had (``failed``, its latest decision failed) then plans again for that decision's
    failure, now with them: the job waits for a replacement as long as its surviving agents
    do. A job that runs on with stages rerouted, one of its policies able to grow it, decides
    whether to grow back onto them (``grows``: the core's ``grow``, the running plan kept
    unless a growth beats it); a growth still planning or proposed is superseded by one that
    counts this node too, and one already chosen leaves its devices spares. The new decision,
    or None."""
    with transaction.atomic():
        # not the scenario (megabytes at 16,384 devices, read while the job is locked): agents
        # coming back after a failed start each take this lock in turn
        job = Job.objects.select_for_update().defer("scenario").get(pk=job_id)
        decided = RecoveryDecision.objects.select_related("failure").filter(job=job)
        growth = decided.filter(status__in=OPEN, grows=True).first()
        if growth is None and decided.filter(status__in=OPEN).exists():
            return None
        used = plan_devices(job.plan)
        devices = Device.objects.filter(node_id=node_id, state=DeviceState.FAILED)
        back = sorted(devices.values_list("index", flat=True))
        devices.filter(index__in=used).update(state=DeviceState.HEALTHY)
        devices.exclude(index__in=used).update(state=DeviceState.SPARE)
        unchosen = (DecisionStatus.PLANNING, DecisionStatus.PROPOSED)
        if growth is not None and back and growth.status in unchosen:
            # a growth not chosen yet was planned without this node: plan again, with it
            transition(growth.pk, DecisionStatus.SUPERSEDED, actor="system")
            growth = None
        latest = decided.order_by("-created_at", "-pk").first()
        log.info("node.came_back", job=job_id, node=node_id, devices=back)
        if latest is None or growth is not None:
            return None  # (a growth chosen and being applied: this node's devices are spares)
        name = Node.objects.values_list("name", flat=True).get(pk=node_id)
        why: dict[str, Any] = {"replans_after": latest.pk, "joined": name, "devices_back": back}
        if job.status == JobStatus.FAILED and latest.status == DecisionStatus.FAILED:
            Job.objects.filter(pk=job.pk).update(status=JobStatus.RECOVERING)
            return _plan_again(job, latest.failure, plan, **why)
        growing = back and job.status == JobStatus.RUNNING and _rerouted(job.plan)
        if growing and rows.grows_with(list(job.enabled_policies)):
            return _plan_again(job, latest.failure, plan, grows=True, **why)
        return None


def _rerouted(plan: Any) -> bool:
    """Whether a stage of ``plan`` (the codec's dict) borrows its replicas' devices."""
    pipelines = (plan or {}).get("pipelines", ())
    return any(stage.get("rerouted") for p in pipelines for stage in p.get("stages", ()))


def _plan_again(
    job: Job,
    failure: Failure,
    plan: Callable[[int], None] | None,
    *,
    grows: bool = False,
    **why: Any,
) -> RecoveryDecision:
    """A new decision for ``failure`` (an earlier one's), handed to the planners after the
    commit; ``why`` goes on its ``planning_started`` event (with ``grows``, when set)."""
    decision = RecoveryDecision.objects.create(job=job, failure=failure, grows=grows)
    if grows:
        why["grows"] = True
    record(job, EventKind.PLANNING_STARTED, actor="system", decision=decision, failure=failure,
           **why)  # fmt: skip
    log.info("decision.replanned", decision=decision.pk, failure=failure.pk, **why)
    if plan is not None:
        transaction.on_commit(lambda: plan(decision.pk))
    return decision


def _heard_nodes(job_id: int) -> set[str]:
    """The job's nodes heard within the heartbeat deadline: their agents are connected."""
    since = timezone.now().timestamp() - liveness.HEARTBEAT_INTERVAL_S * liveness.MISSED_BEATS
    names = liveness.sync_client().zrangebyscore(liveness.seen_key(job_id), since, "+inf")
    return {n.decode() if isinstance(n, bytes) else str(n) for n in names}


# --- what-if -------------------------------------------------------------------------------


def what_if(job: Job, *, devices: Iterable[int], kind: str = "crash") -> dict[str, Any]:
    """What every enabled policy would do if ``devices`` failed now; nothing is written."""
    devices = sorted(set(devices))
    total = Device.objects.filter(job=job).count()
    unknown = [d for d in devices if not 0 <= d < total]
    if not devices or unknown:
        raise rows.InvalidScenario(
            f"name devices of the job (ids 0..{total - 1}); got {devices}", field="devices"
        )
    return rows.decide_for(
        job.scenario,
        job.plan,
        failed_devices(job) | set(devices),
        kind=kind,
        devices=devices,
        policies=list(job.enabled_policies),
        parsed=scenario_of(job),
    )


# Each job's scenario as this process parsed it last, beside the JSON it came from: a
# 16,384-device scenario takes 0.07-0.15 s to parse and a few milliseconds to compare, and
# readying (``ready``) leaves it parsed for the job's first failure. A few jobs' worth.
_parsed: dict[int, tuple[Any, rows.Scenario]] = {}
PARSED_KEPT = 8


def scenario_of(job: Job) -> rows.Scenario:
    """The job's scenario parsed by the core, parsed again only when its JSON changed (a
    profile's measurement); ``InvalidScenario`` as ``rows.parse_scenario``."""
    found = _parsed.get(job.pk)
    if found is not None and found[0] == job.scenario:
        return found[1]
    parsed = rows.parse_scenario(job.scenario)
    _parsed.pop(job.pk, None)
    while len(_parsed) >= PARSED_KEPT:
        _parsed.pop(next(iter(_parsed)))  # the one parsed longest ago
    _parsed[job.pk] = (job.scenario, parsed)  # a row's own JSON, which nothing changes in place
    return parsed


# --- readying ------------------------------------------------------------------------------


def ready(job_id: int) -> bool:
    """Ready this process's planner for the job before its first failure: the loss of its
    first node with no device down, planned and dropped (``what_if``). The core remembers the
    pipelines it timed for the job's model and the shapes it searched for one node fewer
    (``recovery.planner``), as Oobleck makes its pipeline templates when a job starts, so the
    first real failure is planned as fast as later ones: the demo's three policies decide a
    16,384-device job's first loss in 1.2 s cold and 0.6 s readied, whichever node is lost
    (docs/operations.md). False when there is nothing to ready: no such job, one that is not
    running, one whose decision is open (its planning readies it), or one the core cannot plan
    for (logged)."""
    job = Job.objects.filter(pk=job_id, status=JobStatus.RUNNING).first()
    if job is None or RecoveryDecision.objects.filter(job=job, status__in=OPEN).exists():
        return False
    down = failed_devices(job)
    by_node: dict[int, list[int]] = {}
    for node, device in Device.objects.filter(job=job).values_list("node__index", "index"):
        by_node.setdefault(node, []).append(device)
    up = [devices for _, devices in sorted(by_node.items()) if not down & set(devices)]
    if not up:
        return False
    try:
        what_if(job, devices=up[0], kind=FailureKind.NODE_LOST)
    except rows.RecoveryError as exc:
        log.info("planner.not_readied", job=job_id, error=str(exc))
        return False
    log.info("planner.readied", job=job_id)
    return True


__all__ = [
    "FailureSource",
    "IllegalTransition",
    "apply_after_deadline",
    "approve",
    "dismiss",
    "override",
    "plan",
    "ready",
    "record_failure",
    "transition",
    "what_if",
]
