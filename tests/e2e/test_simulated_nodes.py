"""Simulated nodes against the real stack: a killed node is a failure on the timeline, the auto
job's plan reaches the survivor, which applies it and trains on; a stopped one says goodbye."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import SCENARIO, Stack, setup
from tests.processes import REPO_ROOT
from worker_agent import sim

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    stack.manage("migrate", "-v", "0")
    try:
        yield stack
    finally:
        stack.stop_all()


def simulate(stack: Stack, made: dict[str, Any], node: int, scenario: Path) -> Any:
    log = (stack.tmp / f"sim-{node}.log").open("wb")
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "simulate"),
            *("--server", f"ws://127.0.0.1:{stack.port}", "--job", "drill"),
            *("--nodes", "1", "--first-node", str(node)),
            *("--devices-per-node", "4", "--scenario", str(scenario), "--restore-s", "0.1"),
        ],
        env={**stack.env, "PITSTOP_AGENT_TOKEN": made["agent_token"]},
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


@dataclass
class Training:
    """Two simulated nodes of an auto job, training."""

    stack: Stack
    token: str
    job: int
    nodes: list[subprocess.Popen[bytes]]

    def live(self) -> dict[str, Any]:
        found: dict[str, Any] = self.stack.api(f"/api/v1/jobs/{self.job}/live/", self.token)
        return found

    def recovered(self) -> dict[str, Any]:
        def done() -> list[dict[str, Any]]:
            found = self.stack.api(f"/api/v1/recoveries/?job={self.job}", self.token)["results"]
            return found if found and found[0]["status"] == "recovered" else []

        found: dict[str, Any] = self.stack.wait(done, "recovery", 60)[0]
        return found


@pytest.fixture
def training(stack: Stack) -> Iterator[Training]:
    fast = json.loads(json.dumps(SCENARIO))
    for layer in ("fwd_s", "bwd_s"):  # steps of a few hundredths of a second, to see them move
        fast["model"][layer] /= 100
    scenario = stack.tmp / "scenario.json"
    scenario.write_text(json.dumps(fast))
    made = json.loads(stack.manage("shell", "-c", setup(scenario)))
    for name in ("redis", "server", "worker", "detector"):
        stack.start(name)
    nodes = [simulate(stack, made, 0, scenario), simulate(stack, made, 1, scenario)]
    try:
        running = Training(stack, made["api_token"], made["job"], nodes)
        stack.wait(lambda: running.live()["nodes_connected"] == 2 and running.live()["step"] > 0,
                   "training")  # fmt: skip
        yield running
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()


def test_a_killed_simulated_node_is_recovered_from_and_a_stopped_one_leaves(
    training: Training,
) -> None:
    stack, token, job, live = training.stack, training.token, training.job, training.live
    survivor, doomed = training.nodes
    doomed.send_signal(signal.SIGKILL)  # the kernel closes its socket
    doomed.wait(timeout=10)
    decision = training.recovered()
    failures = stack.api(f"/api/v1/failures/?job={job}", token)["results"]
    assert [(f["kind"], f["source"], f["devices"]) for f in failures] == [
        ("node_lost", "socket", [4, 5, 6, 7])
    ]
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used and used.isdisjoint({4, 5, 6, 7})
    timeline = stack.api(f"/api/v1/recoveries/{decision['id']}/timeline/", token)
    phases = {p["phase"]: p["seconds"] for p in timeline["phases"]}
    assert all(seconds is not None for seconds in phases.values()), phases
    assert phases["detect"] < 1, phases  # a socket closed by the kernel is seen at once
    details = stack.api(f"/api/v1/jobs/{job}/", token)
    assert details["status"] == "running" and details["plan"] == decision["plan"]
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=15) == 0, stack.log("sim-0")
    stack.wait(lambda: live()["nodes_connected"] == 0, "the survivor gone")
    again = stack.api(f"/api/v1/failures/?job={job}", token)["results"]
    assert len(again) == 1, "a goodbye is no failure"
    assert "apply_plan done" in stack.log("sim-0")


def test_the_simulator_refuses_what_it_cannot_do(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        ["--job", "j", "--token", "t", "--server", "ws://10.1.2.3:8000"],  # not loopback
        ["--job", "j", "--token", "t", "--nodes", str(sim.MAX_NODES + 1)],
        ["--job", "j", "--token", "t", "--server", "http://127.0.0.1:8000"],
        ["--token", "t"],
    ]
    for argv in cases:
        with pytest.raises(SystemExit) as stopped:
            sim.main(argv)
        assert stopped.value.code == 2, argv
    error = capsys.readouterr().err
    assert "--allow-remote" in error and "4096" in error and "ws://HOST:PORT" in error


def test_a_drill_into_a_simulated_node_is_a_fault_recovered_from(training: Training) -> None:
    stack, token, job = training.stack, training.token, training.job
    code, drill = stack.post(
        f"/api/v1/jobs/{job}/drills/", token, {"node": "node-1", "kind": "kill", "device": 5}
    )
    assert code == 202, drill
    decision = training.recovered()
    failures = stack.api(f"/api/v1/failures/?job={job}", token)["results"]
    assert [(f["kind"], f["source"], f["devices"]) for f in failures] == [
        ("crash", "agent", [5])
    ], (failures, stack.log("sim-1"))
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used and 5 not in used, decision
    # the killed device, out of the plan, idles in the simulated node's heartbeats
    stack.wait(lambda: training.live()["device_states"].get("failed", 0) == 0, "nothing failed")
    drills = stack.api(f"/api/v1/jobs/{job}/drills/", token)["results"]
    assert [(d["id"], d["ok"]) for d in drills] == [(drill["id"], True)]
    kinds = [e["kind"] for e in stack.api(f"/api/v1/jobs/{job}/timeline/", token)["results"]]
    assert kinds.index("drill_sent") < kinds.index("failure_detected"), kinds
