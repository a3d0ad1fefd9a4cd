"""``manage.py issue_agent_token JOB [--node NAME]``: another agent token, printed once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.bridge.rows import InvalidScenario
from controlplane.jobs.models import Job
from controlplane.jobs.services import issue_agent_token


class Command(BaseCommand):
    help = (
        "Issue another agent token for a job, for one of its nodes (--node) or any of them. "
        "The token is printed once; only its digest is stored."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job", help="the job's name")
        parser.add_argument("--node", help="the one node the token speaks for (e.g. node-3)")

    def handle(self, *args: Any, **options: Any) -> None:
        job = Job.objects.defer("scenario", "plan").filter(name=options["job"]).first()
        if job is None:
            raise CommandError(f"no job named {options['job']!r}")
        try:
            token = issue_agent_token(job, node=options["node"])
        except InvalidScenario as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(token)
