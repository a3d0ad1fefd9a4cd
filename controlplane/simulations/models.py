"""A simulation sweep: what was asked, how far its pieces got, and the merged summary."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from controlplane.jobs.models import Job


class SweepStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Sweep(models.Model):
    """Every policy of ``experiment`` over its seeds, from ``scenario``, one Celery task a piece
    (one policy, or the ideal, over one seed) and a chord that merges them into ``summary``
    (the simulator's summary.json, with the mean curves the dashboard plots)."""

    name = models.CharField(max_length=200, blank=True)
    job = models.ForeignKey(
        Job,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="sweeps",
        help_text="the job whose scenario was simulated, if any",
    )
    scenario = models.JSONField(help_text="the core's scenario format (docs/scenario.md)")
    experiment = models.JSONField(help_text="hours, policies, seeds, base_seed, trace, options")
    status = models.CharField(
        max_length=16, choices=SweepStatus.choices, default=SweepStatus.QUEUED
    )
    pieces_total = models.PositiveIntegerField()
    pieces_done = models.PositiveIntegerField(default=0)
    summary = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    workers = models.JSONField(default=list, blank=True, help_text="the workers that ran pieces")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"sweep {self.pk} {self.name}".rstrip()

    @property
    def progress(self) -> float:
        """The share of pieces done, 0 to 1 (a piece run twice after a restart counts once)."""
        return min(self.pieces_done, self.pieces_total) / self.pieces_total

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()
