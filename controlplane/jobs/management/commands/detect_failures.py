"""``manage.py detect_failures``: declare silent nodes failed (the heartbeat deadline)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from controlplane.jobs import detector


class Command(BaseCommand):
    help = "Watch the agents' heartbeats and record a failure for every node silent too long."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--period", type=float, default=None, help="seconds between sweeps (default: 1/4 beat)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(
            f"watching heartbeats: a node is failed after {detector.deadline_s():g} s of silence"
        )
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends it quietly
            asyncio.run(detector.run(options["period"]))
