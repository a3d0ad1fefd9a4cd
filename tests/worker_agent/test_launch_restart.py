"""A coordinated restart of an unmodified torchrun DDP script under the launcher (real processes:
two launcher nodes of one rank each, the example script, two scripted control planes).

The script trains, keeping a checkpoint every 5 steps; the rank on node-1 is SIGKILLed. Both
nodes report the crash (node-0's rank dies of its peer's loss, as under torchrun) and, being
under ``--max-restarts``, wait. The control plane sends each node the plan: the same two
devices (a restart in place), or device 0 alone (the world shrunk). The launchers start the
script again with ``TORCHELASTIC_RESTART_COUNT`` 1 and the new world; it resumes from its
checkpoint, and every step after the restart has the loss of an uninterrupted torchrun run's
same step (in place) or of the checkpoint's weights trained on alone (shrunk)."""

from __future__ import annotations

import functools
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

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import (
    ScriptedServer,
    children_of,
    launch_node,
    poll,
    terminate,
)
from tests.worker_agent.trainer.reference import pipeline, plan, stage

SCRIPT = str(REPO_ROOT / "examples" / "torchrun_ddp.py")
FSDP2_SCRIPT = str(REPO_ROOT / "examples" / "torchrun_fsdp2.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LINE = re.compile(r"^rank (\d+) step (\d+) loss (\S+) restart (\d+) world (\d+)$", re.M)
TIMEOUT_S = 120.0


def lines(path: Path) -> list[tuple[int, int, str, int, int]]:
    """(rank, step, loss, restart, world) of every step line the node's ranks printed."""
    text = path.read_text() if path.exists() else ""
    return [(int(r), int(s), loss, int(n), int(w)) for r, s, loss, n, w in LINE.findall(text)]


def uninterrupted(script: str, steps: int) -> dict[tuple[int, int], str]:
    """(rank, step) -> loss of ``script`` under torchrun on two ranks, never stopped.

    Run a second time if the first fails: once in CI, a rank of this plain torchrun run (no
    Pitstop in it) aborted in torch's own teardown after its last step ("terminate called
    without an active exception", SIGABRT). Two failures in a row fail the test."""
    for _ in range(2):
        reference = subprocess.run(
            [*TORCHRUN, "--standalone", "--nproc-per-node", "2", script, "--steps", str(steps)],
            env=clean_environment(OMP_NUM_THREADS="1"), cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        if reference.returncode == 0:
            break
    assert reference.returncode == 0, reference.stderr[-3000:]
    return {(int(r), int(s)): loss for r, s, loss, _, _ in LINE.findall(reference.stdout)}


class Nodes:
    def __init__(self, tmp: Path, program: str = SCRIPT) -> None:
        self.tmp, port = tmp, free_port()
        self.servers = [ScriptedServer(), ScriptedServer()]
        script = [program, "--steps", "100000", "--step-s", "0.05"]
        script += ["--checkpoint-dir", str(tmp / "checkpoint")]
        self.processes = [
            launch_node(
                rank,
                port,
                self.servers[rank].url,
                script,
                *("--max-restarts", "3", "--shutdown-timeout", "5"),
                stdout=(tmp / f"node-{rank}.out").open("wb"),
                stderr=(tmp / f"node-{rank}.err").open("wb"),
            )
            for rank in (0, 1)
        ]

    def out(self, rank: int) -> list[tuple[int, int, str, int, int]]:
        return lines(self.tmp / f"node-{rank}.out")

    def step(self, rank: int) -> int:
        beat = self.servers[rank].last_beat()
        return int(beat["step"]) if beat else -1

    def close(self) -> None:
        for process in self.processes:
            terminate(process)
        for server in self.servers:
            server.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    running = Nodes(tmp_path)
    try:
        yield running
    finally:
        running.close()


def _crash(nodes: Nodes) -> tuple[int, float]:
    """Both nodes training past a checkpoint, then node-1's rank SIGKILLed; the step of the
    last checkpoint before the kill, and when it was killed."""
    poll(lambda: nodes.step(0) >= 12 and nodes.step(1) >= 12, "steps on both nodes", TIMEOUT_S)
    (rank,) = children_of(nodes.processes[1].pid)
    os.kill(rank, signal.SIGKILL)
    killed_at = time.monotonic()
    for server in nodes.servers:
        poll(functools.partial(server.of_type, "fault"), "a node's crash", TIMEOUT_S)
    assert [p.poll() for p in nodes.processes] == [None, None]  # they wait for the plan
    marker = nodes.tmp / "checkpoint" / "latest"  # the FSDP2 script's: its newest complete one
    if marker.exists():
        return int(marker.read_text()), killed_at
    # rank 0 saves after printing a step that is a multiple of 5, before the barrier
    done = max(s for r, s, *_ in nodes.out(0) if r == 0)
    return done - done % 5, killed_at


def _restart(nodes: Nodes, devices: list[int]) -> list[dict[str, Any]]:
    command = {
        "type": "command", "id": "d1-apply", "action": "apply_plan", "decision": 1,
        "plan": plan(*(pipeline(1, stage(d, 0, 1)) for d in devices)), "restore": "checkpoint",
    }  # fmt: skip
    for server in nodes.servers:
        server.send(command)
    return [
        poll(functools.partial(s.acks, "d1-apply"), "the restart's ack", TIMEOUT_S)[0]
        for s in nodes.servers
    ]


def test_a_killed_rank_is_restarted_in_place_and_trains_on_as_if_never_stopped(
    nodes: Nodes, tmp_path: Path
) -> None:
    checkpoint, killed_at = _crash(nodes)
    faults = [f["devices"] for s in nodes.servers for f in s.of_type("fault")]
    assert faults == [[0], [1]] and all(
        f["kind"] == "crash" for s in nodes.servers for f in s.of_type("fault")
    )
    acks = _restart(nodes, [0, 1])
    assert [a["ok"] for a in acks] == [True, True], acks
    poll(
        lambda: (
            all(any(line[3] == 1 for line in nodes.out(r)) for r in (0, 1))
            and min(nodes.step(0), nodes.step(1)) >= 3
        ),
        "training again after the restart",
        TIMEOUT_S,
    )
    again_s = time.monotonic() - killed_at
    after = [line for r in (0, 1) for line in nodes.out(r) if line[3] == 1]
    assert {(r, w) for r, _, _, _, w in after} == {(0, 2), (1, 2)}
    first = min(s for _, s, *_ in after)
    assert first == checkpoint + 1  # resumed from its checkpoint, by the script itself
    # the reference: the same script under torchrun, never stopped, for as many steps as both
    # ranks printed when the output was read (one may have printed a step the other had not)
    last = min(max(s for rank, s, *_ in after if rank == r) for r in (0, 1))
    expected = uninterrupted(SCRIPT, last)
    assert {(r, s): loss for r, s, loss, _, _ in after if s <= last} == {
        key: loss for key, loss in expected.items() if key[1] >= first
    }
    print(f"restart in place: training again {again_s:.1f} s after the kill")


def test_a_shrunk_world_restarts_on_the_surviving_device_alone(nodes: Nodes) -> None:
    checkpoint, _ = _crash(nodes)
    acks = _restart(nodes, [0])
    assert [a["ok"] for a in acks] == [True, True], acks
    poll(lambda: any(line[3] == 1 for line in nodes.out(0)), "node-0 training again", TIMEOUT_S)
    poll(lambda: nodes.step(0) >= 3, "steps on node-0", TIMEOUT_S)
    after = [line for line in nodes.out(0) if line[3] == 1]
    assert {(r, w) for r, _, _, _, w in after} == {(0, 1)}  # rank 0 of a world of one
    assert min(s for _, s, *_ in after) == checkpoint + 1
    assert not [line for line in nodes.out(1) if line[3] == 1]  # node-1 left out: idle
    beat = nodes.servers[1].last_beat()
    assert beat is not None and [d["state"] for d in beat["devices"]] == ["idle"]
    assert [p.poll() for p in nodes.processes] == [None, None]


def test_an_fsdp2_script_resumes_on_fewer_ranks_from_its_resharded_checkpoint(
    tmp_path: Path,
) -> None:
    """examples/torchrun_fsdp2.py: sharded over two ranks, its checkpoint saved asynchronously
    through torch.distributed.checkpoint; node-1's rank killed and the world shrunk to device
    0, the script loads the two ranks' shards onto one and trains on from the checkpoint's step
    with the losses of an uninterrupted two-rank run (the same global batch: float rounding
    apart, the sums are taken in another order)."""
    nodes = Nodes(tmp_path, FSDP2_SCRIPT)
    try:
        checkpoint, _ = _crash(nodes)
        assert checkpoint >= 5
        acks = _restart(nodes, [0])
        assert [a["ok"] for a in acks] == [True, True], acks
        poll(lambda: len([x for x in nodes.out(0) if x[3] == 1]) >= 4, "node-0 alone", TIMEOUT_S)
    finally:
        nodes.close()
    after = [line for line in nodes.out(0) if line[3] == 1]
    assert {(r, w) for r, _, _, _, w in after} == {(0, 1)}
    assert min(s for _, s, *_ in after) == checkpoint + 1
    last = max(s for _, s, *_ in after)
    expected = uninterrupted(FSDP2_SCRIPT, last)
    for rank, step, loss, _, _ in after:
        want = float(expected[(rank, step)])
        assert abs(float(loss) - want) <= 1e-5 * max(1.0, want), step
    blocked = re.findall(
        r"checkpoint step \d+: blocked (\S+) s", (tmp_path / "node-0.err").read_text()
    )
    assert blocked, "the saves' blocking times are reported"
