"""``python -m worker_agent launch`` in torchrun's place: the same environment for every process
as torchrun's own (torchrun is run beside it, the reference), a plain torchrun DDP script run
unchanged on two nodes, and torchrun's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import ScriptedServer, launch_node, poll

ENV_DUMP = str(REPO_ROOT / "tests" / "worker_agent" / "scripts" / "env_dump.py")
LAUNCH = [sys.executable, "-m", "worker_agent", "launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# Set by torchrun for its own bookkeeping, or different on every run by design.
RUN_SPECIFIC = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
}


def _environments(out: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem): json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def test_every_process_gets_the_environment_torchrun_gives_it(tmp_path: Path) -> None:
    env = clean_environment(PITSTOP_AGENT_TOKEN="t")
    flags = ["--standalone", "--nproc-per-node", "3", "--max-restarts", "2"]
    reference = subprocess.run(
        [*TORCHRUN, *flags, ENV_DUMP, str(tmp_path / "torchrun")],
        env=env, cwd=REPO_ROOT, capture_output=True, timeout=120,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr.decode()
    server = ScriptedServer()
    try:
        ours = subprocess.run(
            [*LAUNCH, *flags, "--server", server.url, "--job", "j",
             ENV_DUMP, str(tmp_path / "launch")],
            env=env, cwd=REPO_ROOT, capture_output=True, timeout=120,
        )  # fmt: skip
    finally:
        server.close()
    assert ours.returncode == 0, ours.stderr.decode()
    theirs, mine = _environments(tmp_path / "torchrun"), _environments(tmp_path / "launch")
    assert sorted(theirs) == sorted(mine) == [0, 1, 2]
    for rank in theirs:
        # what torchrun adds to the environment it was started with, the launcher adds too
        added = {k: v for k, v in theirs[rank].items() if env.get(k) != v}
        assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"} <= set(added)
        missing = sorted(set(added) - set(mine[rank]))
        assert not missing, f"rank {rank}: the launcher does not set {missing}"
        differ = {
            k: (v, mine[rank][k])
            for k, v in added.items()
            if k not in RUN_SPECIFIC and mine[rank][k] != v
        }
        assert not differ, f"rank {rank}: torchrun's value, then the launcher's: {differ}"
        assert mine[rank]["MASTER_ADDR"] == "127.0.0.1" and int(mine[rank]["MASTER_PORT"]) > 0
    # the node said hello with its devices, the global ranks, and goodbye when they finished
    hello = server.of_type("hello")
    assert [(h["node"], h["devices"]) for h in hello] == [("node-0", [0, 1, 2])]
    assert server.of_type("goodbye")


def test_a_flag_torchrun_refuses_is_refused_with_its_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LAUNCH, "--nnodes", "1:2:3", "--job", "j", "--token", "t", ENV_DUMP, str(tmp_path)],
        env=clean_environment(), cwd=REPO_ROOT, capture_output=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert 'nnodes=1:2:3 is not in "MIN:MAX" format' in result.stderr.decode()
    assert not list(tmp_path.glob("*.json"))


def test_a_node_rank_outside_the_job_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LAUNCH, "--nnodes", "2", "--node-rank", "2", "--job", "j", "--token", "t",
         ENV_DUMP, str(tmp_path)],
        env=clean_environment(), cwd=REPO_ROOT, capture_output=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--node-rank 2: expected 0..1" in result.stderr.decode()


def _run(argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=clean_environment(PITSTOP_AGENT_TOKEN="t", OMP_NUM_THREADS="1"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _losses(output: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> loss, from the example's lines."""
    found = {}
    for line in output.splitlines():
        words = line.split()
        if len(words) == 10 and words[0] == "rank" and words[2] == "step":
            found[int(words[1]), int(words[3])] = words[5]
            assert words[9] == "2", line  # the world
    return found


def test_a_plain_ddp_script_runs_unchanged_on_two_nodes_as_under_torchrun() -> None:
    script = [str(REPO_ROOT / "examples" / "torchrun_ddp.py"), "--steps", "4"]
    reference = _run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *script])
    assert reference.returncode == 0, reference.stderr
    server, port = ScriptedServer(), free_port()
    try:
        nodes = [
            launch_node(
                rank, port, server.url, script,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for rank in (0, 1)
        ]  # fmt: skip
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        server.close()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    ours = _losses("".join(out for out, _ in outputs))
    theirs = _losses(reference.stdout)
    assert len(theirs) == 8 and ours == theirs  # the same ranks, steps and losses, bitwise
    hellos = sorted((h["node"], h["devices"]) for h in server.of_type("hello"))
    assert hellos == [("node-0", [0]), ("node-1", [1])]


def test_a_failed_process_is_a_crash_with_its_exception_and_the_launcher_exits_1() -> None:
    script = str(REPO_ROOT / "tests" / "worker_agent" / "scripts" / "fail.py")
    flags = ["--standalone", "--nproc-per-node", "2"]
    reference = _run([*TORCHRUN, *flags, script])
    server = ScriptedServer()
    try:
        ours = _run([*LAUNCH, *flags, "--server", server.url, "--job", "j", script])
        faults = poll(lambda: server.of_type("fault"), "the crash")
    finally:
        server.close()
    assert (reference.returncode, ours.returncode) == (1, 1), ours.stderr
    assert [(f["kind"], f["devices"]) for f in faults] == [("crash", [1])]
    assert faults[0]["message"].endswith(
        "exited with code 1: RuntimeError: the shard of rank 1 is gone"
    )
    # the process at fault: its pid, its exit code and its traceback's last lines
    crash = faults[0]
    assert crash["exit_code"] == 1
    assert crash["message"].startswith(f"rank {crash['pid']} on device 1 ")
    assert crash["log"][-1] == "RuntimeError: the shard of rank 1 is gone"
    assert crash["log"][0] == "Traceback (most recent call last):"
    # and its standard error still reaches the launcher's, as it reaches torchrun's
    for run in (reference, ours):
        assert "RuntimeError: the shard of rank 1 is gone" in run.stderr
