"""``./dev demo`` (``python -m controlplane.demo``) on free ports and a temporary data directory:
it prints the login, trains, and SIGTERM stops every process it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT, clean_environment, free_port, process_exists
from tests.worker_agent.helpers import children_of

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def test_the_demo_trains_and_sigterm_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "controlplane.demo", "--port", str(free_port()),
             "--data-dir", str(tmp_path / "data"), "--status", "2", "--every", "600"],
            cwd=REPO_ROOT, env=clean_environment(), stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and demo.poll() is None:
            seen |= descendants(demo.pid)
            text = out.read_text()
            if (
                any(
                    line.startswith("[") and "demo-auto step" in line and "step -" not in line
                    for line in text.splitlines()
                )
                and "demo-auto step 0 " not in text.splitlines()[-1]
            ):
                break
            time.sleep(1)
        text = out.read_text()
        assert demo.poll() is None, text
        assert "password: " in text and "user: demo" in text, text
        assert "demo-auto step" in text, text
        seen |= descendants(demo.pid)
        assert len(seen) >= 3 + 4 + 8, f"server, worker, detector, agents, ranks: {seen}"
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=90) == 0, out.read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    time.sleep(0.5)
    assert [pid for pid in seen if process_exists(pid)] == [], out.read_text()
    assert "nothing left running" in out.read_text()
