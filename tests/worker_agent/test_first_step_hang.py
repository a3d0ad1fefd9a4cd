"""A rank that hangs before its first step is a hang of that rank, not of the peers waiting for
it: the agent over the toy trainer (real child processes) warming up for a long first step,
against a scripted control plane that keeps every frame."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker_agent.helpers import ScriptedServer, children_of, poll, start_agent

FLOOR_S = 1.0  # the first step's floor here; the warm-up lasts far longer
BOUND_S = 3.0  # how long after the floor the fault may come, on a busy 2-core machine


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    try:
        yield server
    finally:
        server.close()


def device_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [v for v in environ if v.startswith(b"PITSTOP_DEVICE=")]
    return int(found[0].split(b"=", 1)[1]) if found else None


def hangs(server: ScriptedServer) -> list[list[int]]:
    return [f["devices"] for f in server.of_type("fault") if f["kind"] == "hang"]


def test_a_rank_stopped_before_its_first_step_is_the_hang_and_its_waiting_peer_is_not(
    server: ScriptedServer, tmp_path: Path
) -> None:
    agent = start_agent(
        tmp_path,
        server=server.url,
        job="warm",
        token="pst_x",
        options=("--hang-floor", "30", "--first-step-floor", str(FLOOR_S), "--hang-factor", "4"),
        trainer=("--warm-up", "60"),
    )
    stopped: int | None = None
    try:

        def ranks() -> dict[int, int] | None:
            assert agent.poll() is None, f"the agent exited with {agent.returncode}"
            found = {device_of(pid): pid for pid in children_of(agent.pid)}
            beat = server.last_beat()
            warming = beat is not None and all(d["state"] == "training" for d in beat["devices"])
            return found if warming and {0, 1} <= set(found) else None  # type: ignore[return-value]

        pids = poll(ranks, "two ranks warming up for their first step", 60)
        assert server.last_beat()["step"] == 0  # type: ignore[index]
        stopped = pids[1]
        since = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        poll(lambda: hangs(server), "a hang fault", FLOOR_S + BOUND_S + 5)
        took = time.monotonic() - since
        print(f"SIGSTOP before the first step -> hang fault: {took:.2f} s (floor {FLOOR_S} s)")
        assert hangs(server) == [[1]]
        # it warmed up longer than the floor already: the silence of its pulses decides
        assert took < FLOOR_S + BOUND_S
        fault = server.of_type("fault")[0]
        assert "no first step for" in fault["message"], fault
        # device 0 waits far past the floor (and three times it) without a step, pulsing: not
        # blamed, and its rank still runs
        time.sleep(4 * FLOOR_S)
        assert hangs(server) == [[1]]
        assert [f["devices"] for f in server.of_type("fault")] == [[1]]
        assert pids[0] in children_of(agent.pid)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
