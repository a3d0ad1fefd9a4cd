"""Pitstop's data parallelism (``worker_agent.elastic``): the step is DDP's (the global batch's
mean gradient), under plain torchrun and under ``pitstop-run --elastic``, where a lost replica's
micro-batches go to the survivor in memory and the losses stay those of an uninterrupted run.

The reference is written here, without the module: one process, the example's model and data,
every micro-batch of the global batch accumulated, then the optimizer's step."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import ScriptedServer, children_of, launch_node, poll, terminate
from tests.worker_agent.trainer.reference import pipeline, plan, stage
from worker_agent.elastic import share

SCRIPT = str(REPO_ROOT / "examples" / "elastic_ddp.py")
LINE = re.compile(r"^rank (\d+) step (\d+) loss (\S+) world (\d+)$", re.M)
DIGEST = re.compile(r"^rank \d+ step (\d+) digest (\w+)$", re.M)
MICRO_BATCHES = 4
CUDA_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_devices(n: int) -> pytest.MarkDecorator:
    """Skipped unless this machine has ``n`` CUDA devices (an nccl rank needs one of its own)."""
    return pytest.mark.skipif(
        n > CUDA_DEVICES,
        reason=f"{n} nccl ranks need {n} CUDA devices, this machine has {CUDA_DEVICES} "
        f"(torch {torch.__version__})",
    )


TIMEOUT_S = 120.0


def reference(steps: int, optimizer: str = "sgd") -> dict[int, float]:
    """Each step's mean loss over the global batch, trained in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.01)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    return one_process(model, opt, steps, MICRO_BATCHES)


def one_process(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, micro_batches: int
) -> dict[int, float]:
    """``model`` trained by ``opt`` in one process on the examples' data: every micro-batch of
    the global batch accumulated, each loss divided by ``micro_batches``, then the step."""
    losses = {}
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for index in range(micro_batches):
            seed = torch.Generator().manual_seed(step * 1_000_003 + index)
            x = torch.randn(16, 32, generator=seed)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / micro_batches
            torch.autograd.backward(loss)
            total += float(loss.detach())
        opt.step()
        losses[step + 1] = total
    return losses


def close(got: float, expected: float) -> bool:
    """Equal but for the order the micro-batches' gradients are summed in (float32)."""
    return abs(got - expected) <= 1e-5 * max(1.0, abs(expected))


@given(members=st.sets(st.integers(0, 64), min_size=1, max_size=12), total=st.integers(1, 40))
def test_every_micro_batch_is_computed_once_and_the_shares_differ_by_one_at_most(
    members: set[int], total: int
) -> None:
    shares = {d: share(sorted(members), d, total) for d in members}
    everything = sorted(i for r in shares.values() for i in r)
    assert everything == list(range(total))
    sizes = [len(r) for r in shares.values()]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("optimizer", "device"),
    [("sgd", "cpu"), ("adamw", "cpu"), pytest.param("adamw", "cuda", marks=cuda_devices(2))],
)
def test_under_plain_torchrun_a_step_is_the_global_batchs_mean(optimizer: str, device: str) -> None:
    """On CUDA the model is on cuda:LOCAL_RANK and the generation's collectives use nccl."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, "--steps", "6", "--micro-batches", str(MICRO_BATCHES), "--optimizer", optimizer,
         "--device", device],
        env=clean_environment(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = {(int(r), int(s)): float(loss) for r, s, loss, _ in LINE.findall(done.stdout)}
    expected = reference(6, optimizer)
    assert sorted(got) == [(r, s) for r in (0, 1) for s in range(1, 7)]
    assert all(close(loss, expected[s]) for (_, s), loss in got.items()), (got, expected)


def _steps(path: Path) -> list[tuple[int, int, float, int]]:
    text = path.read_text() if path.exists() else ""
    return [(int(r), int(s), float(loss), int(w)) for r, s, loss, w in LINE.findall(text)]


def _two_nodes(
    tmp_path: Path, optimizer: str = "sgd", nodes: int = 2
) -> tuple[list[ScriptedServer], list[subprocess.Popen[bytes]]]:
    """``nodes`` launchers of one process each under --elastic, each with its scripted
    control plane, training the example for ever."""
    port = free_port()
    servers = [ScriptedServer() for _ in range(nodes)]
    script = [SCRIPT, "--steps", "100000", "--step-s", "0.05", "--optimizer", optimizer]
    script += ["--micro-batches", str(MICRO_BATCHES), "--digest"]
    processes = [
        launch_node(
            rank, port, servers[rank].url, script, "--elastic", "--max-restarts", "3",
            "--nnodes", str(nodes), environment={"PYTHONPATH": str(REPO_ROOT)},
            stdout=(tmp_path / f"node-{rank}.out").open("wb"),
            stderr=(tmp_path / f"node-{rank}.err").open("wb"),
        )
        for rank in range(nodes)
    ]  # fmt: skip
    return servers, processes


def _apply(servers: list[ScriptedServer], decision: int, devices: list[int]) -> None:
    """The plan of ``devices`` (a replica each) to every node; each node's ack is ok."""
    name = f"d{decision}-apply"
    command = {
        "type": "command", "id": name, "action": "apply_plan", "decision": decision,
        "restore": "peers",
        "plan": plan(*(pipeline(MICRO_BATCHES // len(devices), stage(d, 0, 1)) for d in devices)),
    }  # fmt: skip
    for server in servers:
        server.send(command)
    for server in servers:
        (ack,) = poll(functools.partial(server.acks, name), "the ack", TIMEOUT_S)
        assert ack["ok"], ack


def test_a_lost_replicas_micro_batches_go_to_the_survivor_in_memory(tmp_path: Path) -> None:
    servers, processes = _two_nodes(tmp_path)
    out = tmp_path / "node-0.out"
    try:
        poll(lambda: len(_steps(out)) >= 6, "steps on node-0", TIMEOUT_S)
        (rank,) = children_of(processes[1].pid)
        survivor = children_of(processes[0].pid)
        os.kill(rank, signal.SIGKILL)
        killed_at = time.monotonic()
        poll(functools.partial(servers[1].of_type, "fault"), "node-1's crash", TIMEOUT_S)
        before = max(s for _, s, _, _ in _steps(out))
        # the survivor left its step (its peer's loss), and waits: the plan of device 0 alone
        servers[0].send(
            {"type": "command", "id": "d1-apply", "action": "apply_plan", "decision": 1,
             "plan": plan(pipeline(MICRO_BATCHES, stage(0, 0, 1))), "restore": "peers"}
        )  # fmt: skip
        (ack,) = poll(functools.partial(servers[0].acks, "d1-apply"), "the ack", TIMEOUT_S)
        assert ack["ok"], ack
        poll(lambda: max(s for _, s, _, _ in _steps(out)) >= before + 5, "steps alone", 60)
        again_s = time.monotonic() - killed_at
        assert children_of(processes[0].pid) == survivor  # no restart: the same process
    finally:
        for process in processes:
            terminate(process)
        for server in servers:
            server.close()
    lines = _steps(out)
    after = [(s, loss) for _, s, loss, w in lines if w == 1]
    # alone, from the step after the last it made with its peer: a step that ended just as the
    # peer died is written after the crash is heard, so the file read then may not show it yet
    together = max(s for _, s, _, w in lines if w == 2)
    assert together in (before, before + 1)
    assert [s for s, _ in after] == list(range(together + 1, together + 1 + len(after)))
    assert not [f for f in servers[0].of_type("fault")]  # the survivor never failed
    expected = reference(max(s for s, _ in after))
    assert all(close(loss, expected[s]) for _, s, loss, _ in lines), (lines, expected)
    print(f"elastic reroute: training alone again {again_s:.1f} s after the kill")


def test_two_ranks_of_one_node_are_no_stragglers_to_their_agent(tmp_path: Path) -> None:
    """The agent compares the step times of a node's ranks: timed from the previous step's
    end, as a torchrun script's are, the rank that waits for the other in the all-reduce does
    not look slow (timed from its own start, one did within a few steps)."""
    server = ScriptedServer()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "worker_agent", "launch", "--standalone", "--nproc-per-node", "2",
         "--server", server.url, "--job", "j", "--elastic", SCRIPT, "--steps", "60",
         "--step-s", "0.02", "--micro-batches", str(MICRO_BATCHES)],
        # rank 0 measures its first steps (its profile built and sent before a step's sync,
        # where rank 1 waits for it: after the sync, its step alone was longer)
        env=clean_environment(PITSTOP_AGENT_TOKEN="t", OMP_NUM_THREADS="1",
                              PYTHONPATH=str(REPO_ROOT)),
        cwd=REPO_ROOT, stdout=(tmp_path / "out").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert launcher.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "out").read_text()[-3000:]
    finally:
        terminate(launcher)
        server.close()
    assert len(_steps(tmp_path / "out")) == 120
    assert server.of_type("fault") == []


def test_a_crashed_replica_starts_again_with_a_live_replicas_state(tmp_path: Path) -> None:
    """The plan keeps both devices (FlashRecovery in place): node-1's launcher starts its
    process again in the new generation, and it takes the model, the AdamW state and the step
    from device 0 over the network as it joins; both go on as if nothing happened."""
    servers, processes = _two_nodes(tmp_path, "adamw")
    out = [tmp_path / "node-0.out", tmp_path / "node-1.out"]
    try:
        poll(lambda: len(_steps(out[1])) >= 6, "steps on node-1", TIMEOUT_S)
        survivor = children_of(processes[0].pid)
        (victim,) = children_of(processes[1].pid)
        os.kill(victim, signal.SIGKILL)
        poll(functools.partial(servers[1].of_type, "fault"), "node-1's crash", TIMEOUT_S)
        before = max(s for _, s, _, _ in _steps(out[0]))
        command = {
            "type": "command", "id": "d1-apply", "action": "apply_plan", "decision": 1,
            "plan": plan(*(pipeline(2, stage(d, 0, 1)) for d in (0, 1))), "restore": "peers",
        }  # fmt: skip
        for server in servers:
            server.send(command)
        for server in servers:
            (ack,) = poll(functools.partial(server.acks, "d1-apply"), "the ack", TIMEOUT_S)
            assert ack["ok"], ack
        poll(
            lambda: sum(1 for _, s, _, _ in _steps(out[1]) if s > before) >= 5,
            "node-1 training again",
            60,
        )
        assert children_of(processes[0].pid) == survivor
        (again,) = children_of(processes[1].pid)
        assert again != victim
    finally:
        for process in processes:
            terminate(process)
        for server in servers:
            server.close()
    lines = _steps(out[0]) + _steps(out[1])
    resumed = sorted(s for r, s, _, _ in _steps(out[1]) if s > before)
    # the new process went on from the survivor's step, not from 1 (read a moment after the
    # kill, node-0's last line may be a step behind it)
    assert resumed[0] in (before + 1, before + 2), (before, resumed)
    assert resumed == list(range(resumed[0], resumed[-1] + 1))
    expected = reference(max(s for _, s, _, _ in lines), "adamw")
    assert all(close(loss, expected[s]) for _, s, loss, _ in lines), (lines, expected)
    # the restored replica holds its peer's weights bit for bit, and every step after too
    digests = [dict(DIGEST.findall(path.read_text())) for path in out]
    shared = sorted(set(digests[0]) & set(digests[1]), key=int)
    assert [int(s) for s in shared if int(s) > before][:3] == resumed[:3], (shared, resumed)
    assert all(digests[0][s] == digests[1][s] for s in shared)


def test_a_kill_during_the_rerouted_steps_and_another_before_the_replacement_arrives(
    tmp_path: Path,
) -> None:
    """Three replicas. Node 2's process killed: the plan of {0, 1} reroutes its micro-batches;
    a few rerouted steps later node 1's process killed too, and the plan of {0, 1, 2} brings
    both back (their launchers start new processes); while they start, node 2's new process is
    killed before it trained a step, and the plan of {0, 1} leaves it out. Every step's loss on
    every rank stays the uninterrupted run's, and node 0 is never restarted."""
    servers, processes = _two_nodes(tmp_path, "adamw", nodes=3)
    out = [tmp_path / f"node-{rank}.out" for rank in range(3)]

    def last(rank: int) -> int:
        return max((s for _, s, _, _ in _steps(out[rank])), default=0)

    def kill(rank: int) -> None:
        (pid,) = children_of(processes[rank].pid)
        os.kill(pid, signal.SIGKILL)
        poll(lambda: len(servers[rank].of_type("fault")) >= 1, f"node-{rank}'s crash", TIMEOUT_S)

    try:
        poll(lambda: last(2) >= 5, "steps on node-2", TIMEOUT_S)
        survivor = children_of(processes[0].pid)
        kill(2)
        _apply(servers, 1, [0, 1])
        rerouted = last(0)
        poll(lambda: last(0) >= rerouted + 3, "rerouted steps", 60)
        kill(1)  # during the rerouted steps
        _apply(servers, 2, [0])
        alone = last(0)
        poll(lambda: last(0) >= alone + 2, "node-0 alone", 60)
        # both come back; node 2's new process is killed as soon as it exists, before it
        # joined the world
        for server in servers:
            server.send(
                {
                    "type": "command",
                    "id": "d3-apply",
                    "action": "apply_plan",
                    "decision": 3,
                    "restore": "peers",
                    "plan": plan(*(pipeline(1, stage(d, 0, 1)) for d in (0, 1, 2))),
                }
            )
        (new,) = poll(lambda: children_of(processes[2].pid), "node-2's new process", TIMEOUT_S)
        os.kill(new, signal.SIGKILL)
        poll(lambda: len(servers[2].of_type("fault")) >= 2, "node-2's second crash", TIMEOUT_S)
        _apply(servers[:2], 4, [0, 1])
        back = last(0)
        poll(lambda: last(1) >= back + 3, "node-1 training again", 60)
        assert children_of(processes[0].pid) == survivor
    finally:
        for process in processes:
            terminate(process)
        for server in servers:
            server.close()
    lines = _steps(out[0]) + _steps(out[1]) + _steps(out[2])
    worlds = [w for _, _, _, w in _steps(out[0])]
    assert {3, 2, 1} <= set(worlds) and worlds[-1] == 2, worlds
    expected = reference(max(s for _, s, _, _ in lines), "adamw")
    assert all(close(loss, expected[s]) for _, s, loss, _ in lines), (lines, expected)
