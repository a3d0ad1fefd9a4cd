"""Pitstop's HSDP (``worker_agent.elastic.HybridSharded``): FSDP2 within replica groups, the
groups data-parallel replicas. Under plain torchrun its steps are the global batch's mean, as
HSDP's are; under ``pitstop-run --elastic --replica-size 2`` a lost rank takes its group out
(the other group reroutes its micro-batches) or its group comes back as new processes restored
from the live group's shards, and the losses stay those of an uninterrupted run.

The reference is written here, without the module: one process, the examples' model and data,
every micro-batch of the global batch accumulated, then AdamW's step."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import ScriptedServer, launch_node, poll, ranks_of, terminate
from tests.worker_agent.test_elastic import cuda_devices, one_process
from worker_agent.elastic import HybridSharded

EXAMPLES = REPO_ROOT / "examples"
LINE = re.compile(r"^rank (\d+) step (\d+) loss (\S+) world (\d+)$", re.M)
TIMEOUT_S = 180.0


def reference(steps: int, micro_batches: int) -> dict[int, float]:
    """Each step's mean loss over the global batch, trained in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return one_process(model, opt, steps, micro_batches)


def close(got: float, expected: float) -> bool:
    """Equal but for the order the gradients are summed in (float32)."""
    return abs(got - expected) <= 1e-5 * max(1.0, abs(expected))


def passes_of(device: int, shard_size: int, members: list[int], micro_batches: int) -> Any:
    run = object.__new__(HybridSharded)  # the share alone: no store, no group
    run.device, run.shard_size, run.micro_batches = device, shard_size, micro_batches
    return run._passes(members)


@given(
    shard_size=st.integers(1, 4),
    groups=st.sets(st.integers(0, 12), min_size=1, max_size=6),
    micro_batches=st.integers(1, 40),
)
def test_every_micro_batch_counts_once_and_a_groups_ranks_run_as_many_passes(
    shard_size: int, groups: set[int], micro_batches: int
) -> None:
    members = sorted(g * shard_size + i for g in groups for i in range(shard_size))
    passes = {d: passes_of(d, shard_size, members, micro_batches) for d in members}
    counted = sorted(i for p in passes.values() for i, weight in p if weight == 1.0)
    assert counted == list(range(micro_batches))
    assert all(weight in (0.0, 1.0) for p in passes.values() for _, weight in p)
    for group in groups:
        ranks = range(group * shard_size, (group + 1) * shard_size)
        assert len({len(passes[d]) for d in ranks}) == 1  # FSDP's collectives are the group's


@pytest.mark.parametrize(
    ("example", "micro_batches", "flags"),
    # the torchrun script deals 4 micro-batches to 4 ranks; Pitstop's also 6, which leaves a
    # rank of each group a pass of weight 0
    [("torchrun_hsdp", 4, ()), ("elastic_hsdp", 4, ()), ("elastic_hsdp", 6, ()),
     pytest.param("elastic_hsdp", 4, ("--accelerator", "cuda"), marks=cuda_devices(4))],
)  # fmt: skip
def test_under_plain_torchrun_a_step_is_the_global_batchs_mean(
    example: str, micro_batches: int, flags: tuple[str, ...]
) -> None:
    """``--accelerator cuda``: the groups' FSDP over nccl on a CUDA mesh, the generation's
    collectives over nccl."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(EXAMPLES / f"{example}.py"), "--steps", "5", "--micro-batches", str(micro_batches),
         "--shard-size", "2", *flags],
        env=clean_environment(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    got = {(int(r), int(s)): float(loss) for r, s, loss, _ in LINE.findall(done.stdout)}
    assert sorted(got) == [(r, s) for r in range(4) for s in range(1, 6)], done.stderr[-3000:]
    expected = reference(5, micro_batches)
    assert all(close(loss, expected[s]) for (_, s), loss in got.items()), (got, expected)


# --- under the launcher, a scripted control plane -------------------------------------------


def _steps(path: Path) -> list[tuple[int, int, float, int]]:
    text = path.read_text() if path.exists() else ""
    return [(int(r), int(s), float(loss), int(w)) for r, s, loss, w in LINE.findall(text)]


def _groups(*groups: list[int]) -> dict[str, Any]:
    return {
        "family": "dynamic",
        "pipelines": [
            {"stages": [{"devices": g, "layers": [0, 1]}], "micro_batches": 2} for g in groups
        ],
    }


@pytest.fixture
def two_groups(tmp_path: Path) -> Any:
    """Two launchers of two processes each (a replica group a node) under --elastic, each with
    its scripted control plane, training the HSDP example for ever."""
    port = free_port()
    servers = [ScriptedServer(), ScriptedServer()]
    script = [str(EXAMPLES / "elastic_hsdp.py"), "--steps", "100000", "--step-s", "0.05"]
    processes = [
        launch_node(
            rank, port, servers[rank].url, script, "--nproc-per-node", "2", "--elastic",
            "--replica-size", "2", "--max-restarts", "3",
            environment={"PYTHONPATH": str(REPO_ROOT)},
            stdout=(tmp_path / f"node-{rank}.out").open("wb"),
            stderr=(tmp_path / f"node-{rank}.err").open("wb"),
        )
        for rank in (0, 1)
    ]  # fmt: skip
    out = [tmp_path / "node-0.out", tmp_path / "node-1.out"]
    try:
        poll(lambda: len(_steps(out[1])) >= 8, "steps on node-1", TIMEOUT_S)
        yield servers, processes, out
    finally:
        for process in processes:
            terminate(process)
        for server in servers:
            server.close()


def _kill_device_3(servers: list[ScriptedServer], processes: list[Any]) -> dict[int, int]:
    before = ranks_of(processes[1])
    os.kill(before[3], signal.SIGKILL)
    poll(functools.partial(servers[1].of_type, "fault"), "node-1's crash", TIMEOUT_S)
    return before


def _apply(
    servers: list[ScriptedServer],
    plan: dict[str, Any],
    decision: int = 1,
    stagger: float = 0,
    within: float = TIMEOUT_S,
) -> None:
    """The plan to every node, ``stagger`` seconds apart, and their acks ``within`` seconds."""
    command = {"type": "command", "id": f"d{decision}-apply", "action": "apply_plan",
               "decision": decision, "plan": plan, "restore": "peers"}  # fmt: skip
    for server in servers:
        server.send(command)
        time.sleep(stagger)
    for server in servers:
        (ack,) = poll(functools.partial(server.acks, f"d{decision}-apply"), "the ack", within)
        assert ack["ok"], ack


def _past(path: Path, step: int) -> bool:
    return max(s for _, s, _, _ in _steps(path)) > step


def _all_close(lines: list[tuple[int, int, float, int]]) -> None:
    expected = reference(max(s for _, s, _, _ in lines), 4)
    wrong = [(r, s, got, w, expected[s]) for r, s, got, w in lines if not close(got, expected[s])]
    assert not wrong, wrong


def test_a_lost_ranks_group_is_out_and_the_other_takes_its_micro_batches(two_groups: Any) -> None:
    servers, processes, out = two_groups
    survivors = ranks_of(processes[0])
    _kill_device_3(servers, processes)
    before = max(s for _, s, _, _ in _steps(out[0]))
    _apply(servers, _groups([0, 1]))  # rerouting: group {0, 1} alone
    poll(lambda: max(s for _, s, _, _ in _steps(out[0])) >= before + 5, "steps alone", 60)
    assert ranks_of(processes[0]) == survivors  # no restart: the same processes
    assert not servers[0].of_type("fault"), servers[0].of_type("fault")
    lines = _steps(out[0])
    after = sorted({s for _, s, _, w in lines if w == 2})
    assert after == list(range(after[0], after[-1] + 1)), after
    # the killed rank may have given its part of a step or two before it died: those steps
    # completed in the world of four, and printed after the fault was read
    assert before <= after[0] <= before + 2, (before, after)
    _all_close(lines)


def test_a_group_comes_back_from_the_live_groups_shards(two_groups: Any) -> None:
    """The plan keeps both groups (FlashRecovery in place): node-1's launcher starts device 3
    again, device 2 (its group's collectives broken) starts itself again in place, and both
    take their shards of the model, the AdamW state and the step from devices 0 and 1."""
    servers, processes, out = two_groups
    survivors = ranks_of(processes[0])
    before = _kill_device_3(servers, processes)
    last = max(s for _, s, _, _ in _steps(out[0]))
    _apply(servers, _groups([0, 1], [2, 3]))
    poll(
        lambda: sum(1 for _, s, _, _ in _steps(out[1]) if s > last + 1) >= 8,
        "node-1 training again",
        60,
    )
    assert ranks_of(processes[0]) == survivors
    again = ranks_of(processes[1])
    assert again[2] == before[2]  # the same process, started again in place
    assert again[3] != before[3]
    resumed = sorted({s for _, s, _, _ in _steps(out[1]) if s > last})
    assert resumed == list(range(resumed[0], resumed[-1] + 1))
    _all_close(_steps(out[0]) + _steps(out[1]))


def test_plans_no_fault_preceded_move_every_rank_to_the_new_world_at_one_step(
    two_groups: Any,
) -> None:
    """Plans that keep every rank (a growth, an operator's choice) and come while the groups
    train: a rank that takes a plan aborts the world it supersedes, and a group's ranks vote
    on taking it at a step boundary, so no rank enters the new world while its peer waits for
    it in the old one. Each plan reaches node-1 half a second after node-0
    (node-0's group takes it at once, node-1's is steps on and waits for it in the old
    world's all-reduce; without the abort it stays there until the store's 30 s timeout).
    Five such plans in a row, each acknowledged within 15 s: nobody restarts, no fault, and
    the losses stay those of the uninterrupted run."""
    servers, processes, out = two_groups
    ranks = [ranks_of(p) for p in processes]
    for decision in range(1, 6):
        _apply(servers, _groups([0, 1], [2, 3]), decision, stagger=0.5, within=15)
        poll(functools.partial(_past, out[1], max(s for _, s, _, _ in _steps(out[1])) + 1),
             "steps", 60)  # fmt: skip
    assert [ranks_of(p) for p in processes] == ranks
    assert not servers[0].of_type("fault") and not servers[1].of_type("fault")
    lines = _steps(out[0]) + _steps(out[1])
    for rank in range(4):
        steps = [s for r, s, _, _ in lines if r == rank]
        assert steps == sorted(set(steps)), steps  # no step twice, none lost
    _all_close(lines)
