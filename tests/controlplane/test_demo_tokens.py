"""The demo (and the benchmarks, which start agents through it) hands each agent its token in the
environment: a command line is visible to every user of the host (``ps``), a process's
environment only to its owner."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane import demo
from tests.processes import free_port, wait_until

TOKEN = "pst_" + "a1B2-c3D4_" * 4  # the shape of a real one (AgentToken.issue)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[demo.Demo]:
    """A demo without its control plane: the agents it starts find no server and wait for one."""
    args = argparse.Namespace(data_dir=tmp_path, port=free_port(), scale=0)
    made = demo.Demo(args)
    made.made = {"jobs": {"demo-manual": {"token": TOKEN}}}
    try:
        yield made
    finally:
        made.processes.stop_all()


def seen_by_ps(pid: int) -> str:
    """The process's command line (empty for the moment it takes to start the program)."""
    path = Path(f"/proc/{pid}/cmdline")
    wait_until(lambda: bool(path.read_bytes()), timeout_s=10, what=f"{pid}'s command line")
    return path.read_bytes().replace(b"\0", b" ").decode()


def environment(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")


def test_agents_and_simulators_take_their_token_from_the_environment(plane: demo.Demo) -> None:
    job = demo.TrainerJob("demo-auto", 1, TOKEN, demo.SCENARIO, demo.NODES, plane.plane)
    agent = job.start_agent("node-0", demo.NODES["node-0"])
    seen = {"worker_agent run": (seen_by_ps(agent.pid), environment(agent.pid), agent)}
    plane.start_simulated("demo-manual", "node-0")
    simulator = plane.processes.running["demo-manual-node-0"]
    simulated = (seen_by_ps(simulator.pid), environment(simulator.pid), simulator)
    seen["worker_agent simulate"] = simulated
    for program, (line, variables, process) in seen.items():
        # read as the process started, long before it could give up on the missing server
        assert process.poll() is None, plane.processes.post_mortem(list(plane.processes.running))
        assert program in line, line
        assert TOKEN not in line
        assert f"PITSTOP_AGENT_TOKEN={TOKEN}" in variables
