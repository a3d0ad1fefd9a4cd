"""examples/ddp_under_the_agent.py, the plain DDP loop docs/trainer.md shows: it trains with two
ranks on a shared store, and under a link it reports steps and obeys pause, resume and stop,
refusing a new plan."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist

from tests.processes import REPO_ROOT, clean_environment
from worker_agent import link

EXAMPLE = [sys.executable, "-m", "examples.ddp_under_the_agent"]


def test_two_ranks_train_over_a_shared_store_without_an_agent() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    ranks = [
        subprocess.Popen(
            EXAMPLE,
            cwd=REPO_ROOT,
            env=clean_environment(
                PITSTOP_DEVICE=str(rank),
                PITSTOP_STORE=f"127.0.0.1:{store.port}",
                WORLD_SIZE="2",
                STEPS="3",
                OMP_NUM_THREADS="1",
            ),
        )
        for rank in (0, 1)
    ]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]


def test_under_a_link_it_reports_steps_and_obeys_pause_resume_and_stop() -> None:
    ours, theirs = socket.socketpair()
    env = clean_environment(
        PITSTOP_DEVICE="0", PITSTOP_LINK_FD=str(theirs.fileno()), STEPS="100000"
    )
    rank = subprocess.Popen(EXAMPLE, cwd=REPO_ROOT, env=env, pass_fds=(theirs.fileno(),))
    theirs.close()
    ours.settimeout(60)
    reader = ours.makefile("rb")

    def next_of(kind: type[Any], timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = link.decode_from_rank(reader.readline())
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout} s")

    def send(action: str) -> tuple[link.DoneMessage, list[str]]:
        """The command's outcome, and the states the rank said until then."""
        command = link.CommandMessage(id=action, action=action, generation="d0/")  # type: ignore[arg-type]
        ours.sendall(link.encode(command))
        states: list[str] = []
        while True:
            message = link.decode_from_rank(reader.readline())
            if isinstance(message, link.StateMessage):
                states.append(message.state)
            if isinstance(message, link.DoneMessage):
                assert message.command == action
                return message, states

    try:
        first: link.StepMessage = next_of(link.StepMessage)
        assert first.step == 1 and first.loss is not None and first.samples == 16
        done, states = send("pause")
        assert done.ok and states == ["paused"]
        paused_at = time.monotonic()
        while time.monotonic() - paused_at < 0.5:  # only pulses while paused
            assert not isinstance(link.decode_from_rank(reader.readline()), link.StepMessage)
        done, states = send("resume")
        assert done.ok and states == ["training"]
        assert next_of(link.StepMessage).step > first.step
        refused, _ = send("apply_plan")
        assert not refused.ok and refused.error is not None
        assert send("stop")[0].ok
        assert rank.wait(timeout=60) == 0
    finally:
        if rank.poll() is None:
            rank.kill()
        ours.close()


def test_the_page_shows_the_example_as_it_is() -> None:
    code = (REPO_ROOT / "examples" / "ddp_under_the_agent.py").read_text()
    body = code.split('"""\n', 1)[1].strip()  # the code after the module docstring
    assert body in (REPO_ROOT / "docs" / "trainer.md").read_text()
