"""``manage.py detect_failures``: declare silent nodes failed (the heartbeat deadline); of several
running, the one holding the detectors' lease does."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.jobs import detector, liveness


class Command(BaseCommand):
    help = "Watch the agents' heartbeats and record a failure for every node silent too long."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--period", type=float, default=None, help="seconds between sweeps (default: 1/4 beat)"
        )
        parser.add_argument(
            "--lease-ttl",
            type=float,
            default=detector.LEASE_TTL_S,
            help="seconds after the active detector's death before another takes over",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        period = options["period"] or liveness.HEARTBEAT_INTERVAL_S / 4
        if not 0.5 <= options["lease_ttl"] <= 60:
            raise CommandError("--lease-ttl: 0.5 to 60 seconds")
        if not 0 < period <= options["lease_ttl"] / 3:  # the holder renews it twice a lease
            raise CommandError("--period: more than 0 and at most a third of --lease-ttl")
        self.stdout.write(
            f"watching heartbeats: a node is failed after {detector.deadline_s():g} s of silence"
            f" (while this detector holds the lease; another takes over {options['lease_ttl']:g} s"
            " after the holder's death)"
        )
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends it quietly
            asyncio.run(detector.run(period, lease_ttl_s=options["lease_ttl"]))
