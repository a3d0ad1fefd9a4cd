"""Importing the project package or the recovery core loads no web or task framework."""

import json
import subprocess
import sys

import pytest

from tests.processes import REPO_ROOT, clean_environment

FRAMEWORKS = ("django", "celery", "channels", "rest_framework")


@pytest.mark.parametrize("module", ["controlplane", "controlplane.recovery", "worker_agent"])
def test_import_loads_no_framework(module: str) -> None:
    probe = (
        f"import sys, json, {module}; "
        f"print(json.dumps(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        env=clean_environment(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(completed.stdout) == []
