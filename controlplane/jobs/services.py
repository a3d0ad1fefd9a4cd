"""Creating jobs: a scenario checked by the core becomes a job, its nodes, devices and token;
and a job's scenario made anew from its script's own measurement."""

from __future__ import annotations

from typing import Any

import structlog
from django.db import IntegrityError, connection, transaction

from controlplane.bridge import rows
from controlplane.incidents.models import OPEN, RecoveryDecision
from controlplane.jobs import lifecycle
from controlplane.jobs.models import (
    AgentToken,
    ApprovalMode,
    Device,
    DeviceState,
    Job,
    Node,
    heavy,
)
from worker_agent.protocol import Profile, plan_devices

log = structlog.get_logger(__name__)


@transaction.atomic
def create_job(
    name: str,
    scenario: Any,
    *,
    approval_mode: str = ApprovalMode.AUTO,
    approval_timeout_s: float = 300.0,
    enabled_policies: Any = (),
) -> tuple[Job, str]:
    """The job of a scenario, with a node row per host and a device row per device (spares
    marked spare); returns it and its agent token, which is stored only as a digest.

    The core checks the scenario and the policies (``rows.InvalidScenario`` names the field at
    fault); nothing is written when they fail.
    """
    parsed = rows.parse_scenario(scenario)
    policies = rows.check_policies(list(enabled_policies), parsed)
    if approval_mode not in ApprovalMode.values:
        raise rows.InvalidScenario(
            f"unknown mode {approval_mode!r}; known: {', '.join(ApprovalMode.values)}",
            field="approval_mode",
        )
    if not approval_timeout_s > 0:
        raise rows.InvalidScenario("must be > 0", field="approval_timeout_s")
    if Job.objects.filter(name=name).exists():
        raise rows.InvalidScenario(f"a job named {name!r} exists already", field="name")
    devices, spares, per_node = rows.cluster_layout(parsed)
    plan = scenario["plan"]
    try:
        with transaction.atomic():  # two launchers creating the job at once: one wins
            job = Job.objects.create(
                name=name,
                scenario=scenario,
                plan=plan,
                approval_mode=approval_mode,
                approval_timeout_s=approval_timeout_s,
                enabled_policies=policies,
            )
    except IntegrityError:
        raise rows.InvalidScenario(f"a job named {name!r} exists already", field="name") from None
    total = devices + spares
    nodes = Node.objects.bulk_create(
        Node(job=job, name=f"node-{i}", index=i) for i in range(-(-total // per_node))
    )
    used = plan_devices(plan)
    failed = set(scenario.get("failed", ()))
    Device.objects.bulk_create(
        Device(
            job=job,
            node=nodes[index // per_node],
            index=index,
            state=DeviceState.FAILED
            if index in failed
            else DeviceState.HEALTHY
            if index in used
            else DeviceState.SPARE,
        )
        for index in range(total)
    )
    _analyze(total)
    _, token = AgentToken.issue(job)
    return job, token


# A job of at least this many devices has PostgreSQL's statistics of the node and device tables
# taken as it is made.
ANALYZE_DEVICES = 1024


def _analyze(devices: int) -> None:
    """Until autovacuum analyzes them (a minute or more after), the planner took a new
    16,384-device job's rows for a few dozen, and looked up devices on connected nodes
    (``decisions._restartable``) by joining each of the job's 2,048 nodes in turn: 0.37 s a
    lookup, in every planning of a crash, where it takes 2 ms."""
    if devices >= ANALYZE_DEVICES and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {Node._meta.db_table}, {Device._meta.db_table}")


def launch_job(name: str, scenario: Any, **options: Any) -> tuple[Job, str, bool]:
    """The job ``name`` for a launcher's node (``pitstop-run`` with an admin's API token):
    created from ``scenario`` and ``options`` (as ``create_job``) when it does not exist, else
    the existing one, which must have as many devices as ``scenario``; returns the job, an agent
    token for it and whether it was created. Every node of a job launches with the same
    command, so whichever comes first creates it and the others join it."""
    for _ in range(2):
        job = Job.objects.filter(name=name).defer(*heavy()).first()
        if job is None:
            try:
                created, token = create_job(name, scenario, **options)
            except rows.InvalidScenario as exc:
                if exc.field == "name":
                    continue  # another node created it meanwhile
                raise
            return created, token, True
        devices, spares, _ = rows.cluster_layout(rows.parse_scenario(scenario))
        has = Device.objects.filter(job=job).count()
        if has != devices + spares:
            raise rows.InvalidScenario(
                f"job {name} has {has} devices, this launch {devices + spares}: launch it with"
                " the same --nnodes and --nproc-per-node as its other nodes, or name another job",
                field="scenario",
            )
        return job, AgentToken.issue(job)[1], False
    raise rows.InvalidScenario(f"job {name!r} could not be created or found", field="name")


def issue_agent_token(job: Job, *, node: str | None = None) -> str:
    """Another agent token for ``job``, for any of its nodes or for the node named ``node``
    only; the token is returned once and stored as a digest (``rows.InvalidScenario`` names
    ``node`` when the job has no such node)."""
    bound = None
    if node is not None:
        bound = Node.objects.filter(job=job, name=node).first()
        if bound is None:
            raise rows.InvalidScenario(f"job {job.name} has no node {node!r}", field="node")
    return AgentToken.issue(job, bound)[1]


def failed_devices(job: Job) -> set[int]:
    """The devices of ``job`` that are down now, or were never heard from: those of nodes not
    joined within the join deadline count as failed whether or not their ``never_joined`` is
    recorded yet (``lifecycle.unheard_devices``), so that no plan is put on them."""
    down = Device.objects.filter(job=job, state=DeviceState.FAILED).values_list("index", flat=True)
    return set(down) | lifecycle.unheard_devices(job.pk)


def take_profile(job_id: int, profile: Profile) -> bool:
    """Make the job's scenario and running plan from its script's measurement (a ``profile``
    frame: docs/scenario.md, "Measured by the script"). False, and nothing changed, while a
    recovery is open (its plans were made on the scenario it started with; the script measures
    itself again in the world the recovery makes); ``rows.InvalidScenario`` when it cannot fit."""
    modules = [m.model_dump() for m in profile.modules]
    sync = None
    if profile.sync_bytes is not None and profile.sync_s is not None and profile.sync_members:
        sync = (profile.sync_bytes, profile.sync_s, profile.sync_members)
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if RecoveryDecision.objects.filter(job=job, status__in=OPEN).exists():
            log.info("job.profile_deferred", job=job_id)
            return False
        job.scenario, job.plan = rows.with_measurement(
            job.scenario,
            job.plan,
            modules=modules,
            micro_batches=profile.micro_batches,
            boundary_bytes=profile.boundary_bytes,
            sync=sync,
        )
        job.save(update_fields=["scenario", "plan"])
    step_s = sum(m.fwd_s + m.bwd_s for m in profile.modules)
    log.info("job.profiled", job=job_id, modules=len(modules), micro_batch_s=step_s)
    return True
