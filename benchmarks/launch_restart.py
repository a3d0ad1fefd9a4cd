"""Kill to training again for an unmodified torchrun script: Pitstop's launcher beside torchrun.

The script is ``examples/torchrun_ddp.py`` (DDP on CPU gloo, a checkpoint every 5 steps, 0.05 s
of sleep a step), two processes on this host, resuming from its checkpoint when started again.

- **torchrun**: ``torchrun --standalone --nproc-per-node 2 --max-restarts 3``; its elastic agent
  sees the killed worker, stops the other and starts both again by itself (the baseline). A
  restart whose processes fail to form their group is retried, up to the limit; the time runs
  to the first step of whichever restart trains (``restart`` in the JSON says which).
- **pitstop**: ``python -m worker_agent launch`` with the same flags, reporting to the stack the
  demo runs (Daphne, the embedded Redis, a Celery worker, the detector); the job asks the
  ``restart`` policy in ``auto`` mode, so the crash is recorded, planned with ``decide()``,
  applied as a coordinated restart, and the recovery's timeline phases are read from the API.
- **elastic**: the same model and data written with ``worker_agent.elastic``
  (``examples/elastic_ddp.py``, four micro-batches a step) under ``--elastic``; the job asks
  ``rerouting``, so rank 1's micro-batches go to rank 0, which goes on in memory.
- **restore**: the same, the job asking ``flashrecovery`` on the same devices: rank 1's process
  is started again and takes rank 0's state over the network as it joins.

Each repetition waits for step 12, SIGKILLs the process of rank 1 and times until the first
step line of a restarted script (``restart`` ≥ 1) is read from the output, for ``elastic`` the
first step of rank 0 alone (``world 1``), for ``restore`` the first step line of rank 1's new
process. The ratios are Pitstop's medians over torchrun's.

    python -m benchmarks.launch_restart [--repeats 3] [--timeout 120] [--out PATH]

Bounded (every wait has a deadline), loopback only; a fresh data directory per run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.results import write_results
from controlplane.demo import ControlPlane, Processes, children_of, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "torchrun_ddp.py"
SCENARIO = ROOT / "examples" / "torchrun-ddp-2x1.json"
ELASTIC_SCRIPT = ROOT / "examples" / "elastic_ddp.py"
LINE = re.compile(rb"^rank (\d+) step (\d+) loss \S+ restart (\d+) world (\d+)$", re.M)
# elastic_ddp.py's lines have no restart count: read as restart 0, or 1 once the world shrank
ELASTIC_LINE = re.compile(rb"^rank (\d+) step (\d+) loss \S+ world (\d+)$", re.M)
WARMUP_STEPS = 12
ARMS = ("torchrun", "pitstop", "elastic", "restore")  # the baseline first
OPEN = ("planning", "proposed", "approved", "overridden", "auto_applied", "applying")


def stack_environment(data: Path, **extra: str) -> dict[str, str]:
    """The environment of a control plane the benchmark runs in ``data`` (its own SQLite file
    and embedded Redis, whatever DATABASE_URL and REDIS_URL say), and of the launchers."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        PITSTOP_DATA_DIR=str(data),
        OMP_NUM_THREADS="1",
        PITSTOP_HEARTBEAT_INTERVAL_S="0.5",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        **extra,
    )
    return env


def _ranks(pid: int) -> dict[int, int]:
    """RANK -> pid of the script's processes under the launcher ``pid`` (torchrun's are one
    level further down: its elastic agent's children)."""
    found: dict[int, int] = {}
    pending = [pid]
    while pending:
        for child in children_of(pending.pop()):
            pending.append(child)
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None and b"-u" in Path(f"/proc/{child}/cmdline").read_bytes():
                found[int(rank)] = child
    return found


def _lines(out: Path) -> list[tuple[int, int, int, int]]:
    """(rank, step, restart, world) of every step line; an elastic line's restart is 1 once
    its world is smaller than the two it began with."""
    text = out.read_bytes() if out.exists() else b""
    found = [(int(r), int(s), int(n), int(w)) for r, s, n, w in LINE.findall(text)]
    shrunk = [(int(r), int(s), int(int(w) < 2), int(w)) for r, s, w in ELASTIC_LINE.findall(text)]
    return found + shrunk


def _seen(out: Path, check: Callable[[list[tuple[int, int, int, int]]], bool]) -> bool:
    return check(_lines(out))


Lines = list[tuple[int, int, int, int]]


def restarted(before: Lines, now: Lines) -> bool:
    """A step of a restarted script, or of rank 0 alone (an elastic world made smaller)."""
    return any(n >= 1 for _, _, n, _ in now)


def rank_1_again(before: Lines, now: Lines) -> bool:
    """A step line of rank 1 since the kill: its new process stepped (the killed one cannot)."""
    return sum(1 for r, *_ in now if r == 1) > sum(1 for r, *_ in before if r == 1)


def one_run(
    argv: list[str],
    out: Path,
    env: dict[str, str],
    then: Callable[[], dict[str, Any]] | None = None,
    *,
    timeout: float,
    again: Callable[[Lines, Lines], bool] = restarted,
) -> dict[str, Any]:
    """Start ``argv``, kill rank 1 once trained, time until ``again`` sees it train again (the
    lines at the kill and now); what ``then`` adds, read while it still runs."""
    process = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        wait_for(
            lambda: _seen(out, lambda ls: sum(1 for r, *_ in ls if r == 1) >= WARMUP_STEPS),
            "training",
            timeout,
        )
        victim = wait_for(lambda: _ranks(process.pid).get(1), "rank 1's process", 10)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        at_kill = _lines(out)
        wait_for(
            lambda: again(at_kill, _lines(out)),
            "a step after a restart",
            timeout,
            interval=0.01,  # the time is read to a hundredth of a second
        )
        seconds = time.monotonic() - killed_at
        restarts = max(n for *_, n, _ in _lines(out))
        run = {"kill_to_training_s": seconds, "status": "recovered", "restart": restarts}
        return run | (then() if then is not None else {})
    except TimeoutError as exc:
        return {"status": "failed", "reason": str(exc)}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def recovery(plane: ControlPlane, job: int, timeout: float) -> dict[str, Any]:
    """The job's recovery once it ended (its first step under the plan seen), with its
    timeline's phases."""

    def ended() -> list[dict[str, Any]]:
        found = plane.api(f"/api/v1/recoveries/?job={job}")["results"]
        return found if found and found[0]["status"] not in OPEN else []

    try:
        found = wait_for(ended, "the recovery's end", timeout)
    except TimeoutError:
        found = plane.api(f"/api/v1/recoveries/?job={job}")["results"]
    if not found:
        return {"decision": None}
    timeline = plane.api(f"/api/v1/recoveries/{found[0]['id']}/timeline/")
    return {"decision": found[0]["status"], "phases": timeline.get("phases")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="kills per launcher")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds each wait may take (training, "
        "training again, the recovery's end); a run past it counts as failed",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/launch_restart.json")
    args = parser.parse_args(argv)
    if args.repeats < 1 or not args.timeout > 0:
        parser.error("--repeats must be ≥ 1 and --timeout > 0")
    scenario = json.loads(SCENARIO.read_text())
    scenario["cluster"]["devices_per_node"] = 2  # both processes on this one node
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    restore = json.loads(json.dumps(scenario))
    restore.setdefault("policies", {})["flashrecovery"] = {"same_devices": True, "restart_s": 3.0}
    with tempfile.TemporaryDirectory(prefix="pitstop-launch-restart-") as tmp:
        data = Path(tmp)
        env = stack_environment(data)
        processes = Processes(data / "logs", env)
        (data / "logs").mkdir()
        plane = ControlPlane(data, free_port(), processes)
        try:
            plane.start()
            jobs = [
                {"name": f"{kind}-{i}", "scenario": shape, "mode": "auto", "policies": [policy]}
                for i in range(args.repeats)
                for kind, policy, shape in (
                    ("ddp", "restart", scenario),
                    ("elastic", "rerouting", scenario),
                    ("restore", "flashrecovery", restore),
                )
            ]
            made = plane.setup("bench", "bench", jobs)["jobs"]
            progress = tqdm(total=len(ARMS) * args.repeats, desc="kills", unit="run")
            for i in range(args.repeats):
                script = [
                    str(SCRIPT), "--steps", "100000", "--step-s", "0.05",
                    "--checkpoint-dir", str(data / f"checkpoint-{i}"),
                ]  # fmt: skip
                flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
                base = [sys.executable, "-m", "torch.distributed.run", *flags, *script[:1]]
                torchrun = one_run(
                    [*base, *script[1:]], data / f"torchrun-{i}.out", env, timeout=args.timeout
                )
                rows["torchrun"].append(torchrun)
                progress.update()
                (data / f"checkpoint-{i}" / "checkpoint.pt").unlink(missing_ok=True)
                launch = [
                    sys.executable, "-m", "worker_agent", "launch", *flags,
                    "--server", f"ws://127.0.0.1:{plane.port}", "--job", f"ddp-{i}",
                ]  # fmt: skip
                pitstop = one_run(
                    [*launch, *script],
                    data / f"pitstop-{i}.out",
                    {**env, "PITSTOP_AGENT_TOKEN": made[f"ddp-{i}"]["token"]},
                    then=functools.partial(recovery, plane, made[f"ddp-{i}"]["id"], args.timeout),
                    timeout=args.timeout,
                )
                rows["pitstop"].append(pitstop)
                progress.update()
                elastic = [str(ELASTIC_SCRIPT), "--steps", "100000", "--step-s", "0.05"]
                for kind, again in (("elastic", restarted), ("restore", rank_1_again)):
                    launch[-1] = f"{kind}-{i}"
                    rows[kind].append(
                        one_run(
                            [*launch, "--elastic", *elastic, "--micro-batches", "4"],
                            data / f"{kind}-{i}.out",
                            {
                                **env,
                                "PITSTOP_AGENT_TOKEN": made[f"{kind}-{i}"]["token"],
                                "PYTHONPATH": str(ROOT),
                            },
                            then=functools.partial(
                                recovery, plane, made[f"{kind}-{i}"]["id"], args.timeout
                            ),
                            timeout=args.timeout,
                            again=again,
                        )
                    )
                    progress.update()
            progress.close()
        finally:
            processes.stop_all()
    summary: dict[str, dict[str, Any]] = {}
    for name, runs in rows.items():
        times = [r["kill_to_training_s"] for r in runs if r["status"] == "recovered"]
        summary[name] = {
            "recovered": len(times),
            "runs": len(runs),
            "median_s": statistics.median(times) if times else None,
            "range_s": [min(times), max(times)] if times else None,
        }
    theirs = summary["torchrun"]["median_s"]
    ratios = {
        name: summary[name]["median_s"] / theirs if theirs and summary[name]["median_s"] else None
        for name in ARMS[1:]
    }
    print(f"{'launcher':<10} {'recovered':>9} {'median s':>9} {'range s':>15}")
    for name, row in summary.items():
        span = row["range_s"]
        shown = f"{span[0]:.2f}-{span[1]:.2f}" if span else "-"
        median = f"{row['median_s']:.2f}" if row["median_s"] is not None else "-"
        print(f"{name:<10} {row['recovered']:>4}/{row['runs']:<4} {median:>9} {shown:>15}")
    for name, ratio in ratios.items():
        print(f"{name} / torchrun: {ratio:.2f}" if ratio else f"{name} / torchrun: -")
    write_results(
        args.out,
        {"summary": summary, "ratio": ratios["pitstop"], "ratios": ratios, "rows": rows},
    )
    # torchrun's own failures are measured, not this benchmark's: only Pitstop's fail it
    ours = [summary[name] for name in ARMS[1:]]
    return 0 if all(row["recovered"] == row["runs"] for row in ours) else 1


if __name__ == "__main__":
    raise SystemExit(main())
