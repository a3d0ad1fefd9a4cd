"""Starting a sweep and the work of its tasks: each piece runs on whichever worker takes it, and
a chord merges them, so more workers, on more hosts, finish a sweep sooner.

A piece that fails fails its sweep with the reason; a piece run twice (a worker lost after it
finished, its task redelivered) is counted once and merged once.
"""

from __future__ import annotations

from typing import Any

import structlog
from celery import chord
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from controlplane.bridge import sweeps as bridge
from controlplane.bridge.rows import RecoveryError
from controlplane.jobs.models import Job
from controlplane.simulations.models import Sweep, SweepStatus

log = structlog.get_logger(__name__)


def start(
    *,
    scenario: Any,
    experiment: Any,
    name: str = "",
    job: Job | None = None,
    user: Any = None,
) -> Sweep:
    """Check the scenario and the experiment (``InvalidScenario`` names the field at fault),
    record the sweep and hand its pieces to the workers after the commit."""
    todo = bridge.pieces(scenario, experiment)
    with transaction.atomic():
        sweep = Sweep.objects.create(
            name=name,
            job=job,
            scenario=scenario,
            experiment=experiment,
            pieces_total=len(todo),
            created_by=user if user is not None and user.is_authenticated else None,
        )
        transaction.on_commit(lambda: launch(sweep.pk, todo))
    log.info("sweep.started", sweep=sweep.pk, pieces=len(todo))
    return sweep


def launch(sweep_id: int, todo: list[tuple[int, str]]) -> None:
    from controlplane.simulations import tasks  # the tasks import this module

    header = [tasks.run_piece.s(sweep_id, seed, policy) for seed, policy in todo]
    try:
        chord(header)(tasks.merge.s(sweep_id))
    except (OperationalError, RedisError, OSError) as exc:
        fail(sweep_id, f"the task broker could not be reached: {exc}")


def fail(sweep_id: int, reason: str) -> None:
    Sweep.objects.filter(pk=sweep_id).exclude(status=SweepStatus.DONE).update(
        status=SweepStatus.FAILED, error=reason, finished_at=timezone.now()
    )
    log.warning("sweep.failed", sweep=sweep_id, reason=reason)


def run_piece(sweep_id: int, seed: int, policy: str, *, worker: str) -> dict[str, Any]:
    """One piece's run (None for a sweep that already failed) and the worker that ran it."""
    sweep = Sweep.objects.get(pk=sweep_id)
    if sweep.status in (SweepStatus.FAILED, SweepStatus.DONE):
        return {"run": None, "worker": worker}
    Sweep.objects.filter(pk=sweep_id, status=SweepStatus.QUEUED).update(
        status=SweepStatus.RUNNING, started_at=timezone.now()
    )
    try:
        run = bridge.run_piece(sweep.scenario, sweep.experiment, seed, policy)
    except Exception as exc:
        fail(sweep_id, f"{policy} on seed {seed}: {exc}")
        raise
    Sweep.objects.filter(pk=sweep_id).update(pieces_done=F("pieces_done") + 1)
    return {"run": run, "worker": worker}


def merge(sweep_id: int, results: list[dict[str, Any]]) -> str:
    """Every piece's run into the sweep's summary; the sweep's status afterwards."""
    sweep = Sweep.objects.get(pk=sweep_id)
    if sweep.status != SweepStatus.RUNNING:
        return sweep.status
    runs = [r["run"] for r in results if r["run"] is not None]
    try:
        summary = bridge.merge(sweep.scenario, sweep.experiment, runs, name=sweep.name)
    except RecoveryError as exc:
        fail(sweep_id, f"merging the pieces: {exc}")
        return SweepStatus.FAILED
    Sweep.objects.filter(pk=sweep_id, status=SweepStatus.RUNNING).update(
        status=SweepStatus.DONE,
        summary=summary,
        finished_at=timezone.now(),
        pieces_done=F("pieces_total"),
        workers=sorted({r["worker"] for r in results}),
    )
    log.info("sweep.done", sweep=sweep_id, pieces=len(runs))
    return SweepStatus.DONE
