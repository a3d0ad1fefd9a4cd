"""A real Celery worker plans a recovery: the failure is committed, the task crosses the broker,
the worker reads the job from the database and proposes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.incidents import decisions
from controlplane.incidents.models import DecisionStatus, FailureSource, RecoveryDecision
from controlplane.incidents.tasks import enqueue_planning
from controlplane.jobs.services import create_job
from tests.processes import REPO_ROOT, clean_environment

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SCENARIO = json.loads((REPO_ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []


def test_a_worker_in_another_process_plans_the_decision(tmp_path: Path) -> None:
    if connection.vendor != "postgresql":
        pytest.skip(
            "a worker in another process cannot open this run's in-memory SQLite test database; "
            "the PostgreSQL pass of CI (DATABASE_URL) runs this test"
        )
    database = connection.settings_dict
    url = (
        f"postgres://{database['USER']}@{database['HOST'] or '127.0.0.1'}:"
        f"{database['PORT'] or 5432}/{database['NAME']}"
    )
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "controlplane", "worker"),
                *("--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"),
            ],
            env=clean_environment(
                DATABASE_URL=url, REDIS_URL=settings.REDIS_URL, PITSTOP_DATA_DIR=str(tmp_path)
            ),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        job, _ = create_job("worked", copy.deepcopy(SCENARIO), approval_mode="manual")
        _, decision = decisions.record_failure(
            job,
            kind="crash",
            devices=[5],
            source=FailureSource.AGENT,
            occurred_at=timezone.now(),
            plan=enqueue_planning,  # outside an atomic block: runs at once, like after a commit
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert worker.poll() is None, log_path.read_text()
            status = RecoveryDecision.objects.get(pk=decision.pk).status
            if status != DecisionStatus.PLANNING:
                break
            time.sleep(0.2)
        assert status == DecisionStatus.PROPOSED, log_path.read_text()
        planned = RecoveryDecision.objects.get(pk=decision.pk)
        assert planned.decision is not None and planned.chosen is not None
    finally:
        worker.terminate()
        worker.wait(timeout=30)
