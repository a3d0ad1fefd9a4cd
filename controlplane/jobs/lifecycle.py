"""Nodes' and jobs' lifecycles: a node is expected, joins (hello), then is lost or leaves.

A node is *expected* from the moment its job is created, and again from the job's first hello
(``Node.expected_at``); its agent's hello makes it *joined* (``healthy``); it ends *failed*
(its socket lost, its heartbeats stopped, or no hello within the join deadline:
``never_joined``) or *left* (goodbye). A job whose joined nodes all said goodbye is
``stopped``; one none of whose nodes was heard for longer than the join deadline is ``stale``.
The detector's sweep (``jobs.detector``) applies the deadlines; the agent's socket
(``streaming.agent``) reports hellos and goodbyes here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from controlplane.jobs.models import (
    LIVE_JOB,
    Device,
    DeviceState,
    Job,
    JobStatus,
    Node,
    NodeStatus,
)

# A job that is no longer watched comes back to ``running`` when one of its agents says hello.
RESUMABLE = (JobStatus.PENDING, JobStatus.STALE, JobStatus.STOPPED)
# Nodes whose agent is connected now.
CONNECTED = (NodeStatus.HEALTHY, NodeStatus.SUSPECT)


def join_deadline_s() -> float:
    return float(settings.PITSTOP_JOIN_DEADLINE_S)


def joined(
    *,
    job_id: int,
    node_id: int,
    node_status: str | None = None,
    started: Callable[[int], None] | None = None,
) -> bool:
    """The node's agent said hello: the node has joined, and its job runs. The job's first
    hello (after ``pending``, ``stale`` or ``stopped``) starts the join deadline of its nodes
    still expected again: their agents are started with the first one, not with the job, and
    calls ``started`` with the job's id after the commit (the planner readied for it).
    True when the node had failed (lost, or never joined): it comes back as a new member, the
    lost host restarted or a replacement in its place (``decisions.node_came_back``).
    ``node_status``: the node's, when the caller has just read it (the hello has)."""
    now = timezone.now()
    if node_status is None:
        node_status = Node.objects.filter(pk=node_id).values_list("status", flat=True).first()
    Node.objects.filter(pk=node_id).update(status=NodeStatus.HEALTHY, joined_at=now)
    resumable = Job.objects.filter(pk=job_id, status__in=RESUMABLE)
    # read before written: nearly every hello finds its job running, and a write each would
    # queue a thousand agents' hellos behind each other's database locks
    if resumable.exists() and resumable.update(status=JobStatus.RUNNING):
        Node.objects.filter(job_id=job_id, status=NodeStatus.EXPECTED).update(expected_at=now)
        if started is not None:
            transaction.on_commit(lambda: started(job_id))
    return node_status == NodeStatus.FAILED


def left(*, job_id: int, node_id: int) -> bool:
    """The node's agent said goodbye: the node has left; when no node of the job is connected
    or still expected, the job has stopped. True when it did."""
    Node.objects.filter(pk=node_id).update(status=NodeStatus.LEFT)
    others = Node.objects.filter(job_id=job_id, status__in=(*CONNECTED, NodeStatus.EXPECTED))
    if others.exists():
        return False
    return bool(Job.objects.filter(pk=job_id, status__in=LIVE_JOB).update(status=JobStatus.STOPPED))


def overdue_nodes(now: dt.datetime) -> list[tuple[int, int, str]]:
    """(job, node id, node name) of every node of a live job still expected, and expected since
    longer than the join deadline."""
    cutoff = now - dt.timedelta(seconds=join_deadline_s())
    return list(
        Node.objects.filter(
            status=NodeStatus.EXPECTED, expected_at__lt=cutoff, job__status__in=LIVE_JOB
        ).values_list("job_id", "pk", "name")
    )


def unheard_devices(job_id: int, now: dt.datetime | None = None) -> set[int]:
    """The job's devices on nodes expected and not joined within the join deadline: no plan
    may use them, whether or not the detector has recorded their ``never_joined`` yet."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=join_deadline_s())
    return set(
        Device.objects.filter(
            job_id=job_id, node__status=NodeStatus.EXPECTED, node__expected_at__lt=cutoff
        ).values_list("index", flat=True)
    )


# A device not failed on a node still expected has not been heard: it counts as ``unheard``,
# whatever its row's state (a new job's spares included).
UNHEARD = Q(devices__node__status=NodeStatus.EXPECTED) & ~Q(devices__state=DeviceState.FAILED)


def device_counts() -> dict[str, Count]:
    """Annotations for a ``Job`` queryset: ``devices_<state>`` for every device state and
    ``devices_unheard``; each device counts once, an unheard one only as ``unheard``."""
    counts = {
        f"devices_{state}": Count("devices", filter=Q(devices__state=state) & ~UNHEARD)
        for state in DeviceState.values
    }
    return {**counts, "devices_unheard": Count("devices", filter=UNHEARD)}


def live_jobs() -> dict[int, float]:
    """Every live job (``LIVE_JOB``): the last moment it is known to have been heard from or
    to have begun, from the database alone (its creation, its nodes' latest hello)."""
    # grouped by the two columns it reads: annotating the model itself groups by every column
    # on SQLite, the scenario's and plan's megabytes included (0.47 s a pass at 2,048 nodes)
    rows = (
        Job.objects.filter(status__in=LIVE_JOB)
        .order_by()
        .values_list("pk", "created_at")
        .annotate(hello=Max("nodes__joined_at"))
    )
    return {pk: max(created, hello or created).timestamp() for pk, created, hello in rows}


def mark_stale(job_ids: list[int]) -> list[int]:
    """Those of ``job_ids`` still live become ``stale``; the ones that did."""
    live = list(
        Job.objects.filter(pk__in=job_ids, status__in=LIVE_JOB).values_list("pk", flat=True)
    )
    Job.objects.filter(pk__in=live, status__in=LIVE_JOB).update(status=JobStatus.STALE)
    return live
