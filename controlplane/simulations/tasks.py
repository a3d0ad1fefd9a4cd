"""Celery tasks of a sweep: one per piece, and the chord's merge; thin wrappers of ``sweeps``."""

from __future__ import annotations

from typing import Any

from celery import Task

from controlplane.celery import app
from controlplane.simulations import sweeps


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True, name="simulations.run_piece")
def run_piece(self: Task, sweep_id: int, seed: int, policy: str) -> dict[str, Any]:
    """One policy (or the ideal) over one seed; returns its run and the worker that ran it."""
    return sweeps.run_piece(sweep_id, seed, policy, worker=self.request.hostname or "")


@app.task(acks_late=True, reject_on_worker_lost=True, name="simulations.merge")
def merge(results: list[dict[str, Any]], sweep_id: int) -> str:
    """The chord's end: every piece's run merged into the sweep's summary; its status."""
    return sweeps.merge(sweep_id, results)
