"""An unmodified torchrun DDP script under the launcher and a real control plane: a SIGKILLed
rank is a crash, the control plane decides with ``decide()`` (the job asks the launcher's
policy, ``restart``), and the launchers restart every rank in place; the script resumes from its
own checkpoint and the recovery ends ``recovered`` with every phase on its timeline."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack, setup
from tests.processes import REPO_ROOT, free_port
from tests.worker_agent.helpers import children_of

pytestmark = pytest.mark.e2e

SCENARIO = REPO_ROOT / "examples" / "torchrun-ddp-2x1.json"
SCRIPT = str(REPO_ROOT / "examples" / "torchrun_ddp.py")
LINE = re.compile(r"^rank (\d+) step (\d+) loss \S+ restart (\d+) world (\d+)$", re.M)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = Stack(tmp_path)
    running.manage("migrate", "-v", "0")
    try:
        yield running
    finally:
        running.stop_all()


def launch(stack: Stack, token: str, rank: int, port: int) -> None:
    stack.processes[f"agent-node-{rank}"] = subprocess.Popen(
        [sys.executable, "-m", "worker_agent", "launch",
         "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "3",
         "--server", f"ws://127.0.0.1:{stack.port}", "--job", "drill",
         SCRIPT, "--steps", "100000", "--step-s", "0.05",
         "--checkpoint-dir", str(stack.tmp / "checkpoint")],
        env={**stack.env, "OMP_NUM_THREADS": "1", "PITSTOP_AGENT_TOKEN": token},
        cwd=REPO_ROOT, stdout=(stack.tmp / f"node-{rank}.out").open("wb"),
        stderr=(stack.tmp / f"agent-node-{rank}.log").open("wb"),
    )  # fmt: skip


def steps(stack: Stack, rank: int) -> list[tuple[int, int, int, int]]:
    path = stack.tmp / f"node-{rank}.out"
    found = LINE.findall(path.read_text()) if path.exists() else []
    return [(int(r), int(s), int(n), int(w)) for r, s, n, w in found]


def test_a_killed_rank_of_an_unmodified_script_is_restarted_from_its_checkpoint(
    stack: Stack,
) -> None:
    made = json.loads(stack.manage("shell", "-c", setup(SCENARIO, ("restart",))))
    for name in ("redis", "server", "worker"):
        stack.start(name)
    token, job = made["api_token"], made["job"]
    port = free_port()
    for rank in (0, 1):
        launch(stack, made["agent_token"], rank, port)
    live = f"/api/v1/jobs/{job}/live/"
    stack.wait(
        lambda: (
            stack.api(live, token)["nodes_connected"] == 2 and stack.api(live, token)["step"] >= 12
        ),
        "both nodes training",
        150,
    )
    (rank,) = children_of(stack.processes["agent-node-1"].pid)
    os.kill(rank, signal.SIGKILL)
    killed_at = time.monotonic()

    def recovered() -> list[dict[str, Any]]:
        found = stack.api(f"/api/v1/recoveries/?job={job}", token)["results"]
        return found if found and found[0]["status"] in ("recovered", "failed") else []

    decision = stack.wait(recovered, "the recovery", 120)[0]
    recovered_s = time.monotonic() - killed_at
    assert decision["status"] == "recovered", decision
    assert decision["candidates"][decision["chosen"]]["policy"] == "restart"
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}  # in place: the killed rank's device runs the new process
    failures = stack.api(f"/api/v1/failures/?job={job}", token)["results"]
    assert {d for f in failures for d in f["devices"]} <= {0, 1}
    assert all(f["kind"] == "crash" for f in failures)
    # the script itself resumed from its checkpoint, in a world of two, once restarted
    again = [line for r in (0, 1) for line in steps(stack, r) if line[2] == 1]
    assert {(r, w) for r, _, _, w in again} == {(0, 2), (1, 2)}
    before = max(s for r, s, n, _ in steps(stack, 0) if n == 0)
    assert min(s for _, s, _, _ in again) == before - before % 5 + 1
    timeline = stack.api(f"/api/v1/recoveries/{decision['id']}/timeline/?format=json", token)
    kinds = [event["kind"] for event in timeline["results"]]
    for kind in ("failure_detected", "planning_started", "recovered"):
        assert kind in kinds, kinds
    devices = stack.api(f"/api/v1/jobs/{job}/", token)["devices"]
    assert devices["healthy"] == 2 and devices["failed"] == 0
    print(f"launcher restart: kill to recovered {recovered_s:.1f} s")
