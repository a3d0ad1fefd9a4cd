"""Ranks of ``python -m worker_agent.trainer rank`` under a scripted agent: a peer killed, a new
plan applied, training on as if nothing had failed.

The test plays the agent: it hosts the store, starts three rank processes with their link
(``worker_agent.link.child_environment``), reads their lines and sends commands. Device 1 is
SIGKILLed after the first steps; the test sets ``d0/abort`` as the agent does and sends the new
plan, in which device 0 takes layers 4-7 from device 2. The losses of every step, before and
after, are those of one process training the whole model on the whole batch.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from tests.worker_agent.trainer.reference import pipeline, plan, stage, train_reference
from worker_agent.link import (
    CommandMessage,
    DoneMessage,
    StateMessage,
    StepMessage,
    child_environment,
    decode_from_rank,
    encode,
)
from worker_agent.trainer.engine import TrainConfig

ROOT = Path(__file__).resolve().parents[3]
PLAN0 = plan(pipeline(2, stage(0, 0, 4), stage(1, 4, 8)), pipeline(2, stage(2, 0, 8)))
PLAN1 = plan(pipeline(4, stage(2, 0, 4), stage(0, 4, 8)))
TP2 = plan(pipeline(4, {"devices": [0, 2], "layers": [0, 8]}))
TIMEOUT_S = 90.0


class FakeAgent:
    """The agent's end of three ranks' links."""

    def __init__(self, plan_file: Path, port: int) -> None:
        self.messages: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.socks: dict[int, socket.socket] = {}
        for device in (0, 1, 2):
            ours, theirs = socket.socketpair()
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                **child_environment(
                    fd=theirs.fileno(),
                    device=device,
                    node="n0",
                    generation="d0/",
                    store=f"127.0.0.1:{port}",
                ),
            }
            command = [sys.executable, "-m", "worker_agent.trainer", "rank"]
            command += ["--plan", str(plan_file), "--steps", "200"]
            self.procs[device] = subprocess.Popen(
                command, cwd=ROOT, env=env, pass_fds=(theirs.fileno(),)
            )
            theirs.close()
            self.socks[device] = ours
            threading.Thread(target=self._read, args=(device, ours), daemon=True).start()

    def _read(self, device: int, sock: socket.socket) -> None:
        for line in sock.makefile("rb"):
            message = decode_from_rank(line)
            if message is not None:
                self.messages.put((device, message))

    def send(self, device: int, **fields: Any) -> None:
        self.socks[device].sendall(encode(CommandMessage(**fields)))

    def wait_for(self, predicate: Any, seen: list[tuple[int, Any]]) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not predicate(seen):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no such message; the last seen: {seen[-5:]}")
            exited = {d: p.returncode for d, p in self.procs.items() if p.poll() is not None}
            if any(code not in (0, -signal.SIGKILL) for code in exited.values()):
                raise RuntimeError(f"ranks exited: {exited}")
            try:
                seen.append(self.messages.get(timeout=0.2))
            except queue.Empty:
                continue

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for sock in self.socks.values():
            sock.close()


def _steps(seen: list[tuple[int, Any]], device: int) -> list[StepMessage]:
    return [m for d, m in seen if d == device and isinstance(m, StepMessage)]


def _done(seen: list[tuple[int, Any]], command: str) -> dict[int, DoneMessage]:
    return {d: m for d, m in seen if isinstance(m, DoneMessage) and m.command == command}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeAgent, list[Any]]]:
    plan_file = tmp_path_factory.mktemp("serve") / "plan.json"
    plan_file.write_text(json.dumps(PLAN0))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = FakeAgent(plan_file, store.port)
    seen: list[tuple[int, Any]] = []
    try:
        agent.wait_for(lambda s: all(len(_steps(s, d)) >= 2 for d in (0, 1, 2)), seen)
        # a plan the trainer cannot run is refused, and training goes on
        for d in (0, 1, 2):
            agent.send(d, id="d1-apply", action="apply_plan", plan=TP2, generation="d1/")
        agent.wait_for(lambda s: len(_done(s, "d1-apply")) == 3, seen)
        agent.wait_for(lambda s: all(len(_steps(s, d)) >= 4 for d in (0, 2)), seen)
        # device 1 dies; the agent aborts its generation and the control plane's plan comes
        os.kill(agent.procs[1].pid, signal.SIGKILL)
        store.set("d0/abort", json.dumps({"device": 1, "kind": "crash"}))
        for d in (0, 2):
            agent.send(d, id="d2-apply", action="apply_plan", plan=PLAN1, generation="d2/")
        agent.wait_for(lambda s: len(_done(s, "d2-apply")) == 2, seen)
        marks = {d: len(_steps(seen, d)) for d in (0, 2)}
        agent.wait_for(lambda s: all(len(_steps(s, d)) >= marks[d] + 3 for d in (0, 2)), seen)
        for d in (0, 2):
            agent.send(d, id="d2-stop", action="stop", generation="d2/")
        agent.wait_for(lambda s: len(_done(s, "d2-stop")) == 2, seen)
        for d in (0, 2):
            assert agent.procs[d].wait(timeout=30) == 0
        yield agent, seen
    finally:
        agent.close()


def test_a_plan_with_tensor_parallelism_is_refused_naming_the_field(
    agent: tuple[FakeAgent, list[Any]],
) -> None:
    _, seen = agent
    done = _done(seen, "d1-apply")
    assert not any(m.ok for m in done.values())
    assert {m.error.field for m in done.values() if m.error} == {
        "plan.pipelines[0].stages[0].devices"
    }


def test_the_new_plan_is_applied_and_training_goes_on(agent: tuple[FakeAgent, list[Any]]) -> None:
    _, seen = agent
    assert all(m.ok for m in _done(seen, "d2-apply").values())
    states = [m.state for d, m in seen if d == 0 and isinstance(m, StateMessage)]
    assert states[:2] == ["restoring", "training"]
    assert "idle" in states  # left the aborted step, waiting for the plan
    assert states[-1] == "idle"  # stopped


def test_every_step_counts_once_and_the_losses_are_the_references(
    agent: tuple[FakeAgent, list[Any]],
) -> None:
    _, seen = agent
    for device in (0, 2):
        steps = [m.step for m in _steps(seen, device)]
        assert steps == list(range(len(steps))), steps
    losses = [float("nan") if m.loss is None else m.loss for m in _steps(seen, 0)]
    # the command's defaults are TrainConfig's
    reference = train_reference(TrainConfig(), 8, range(len(losses)))
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-5)
