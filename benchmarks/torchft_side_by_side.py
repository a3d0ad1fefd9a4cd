"""Kill → every survivor trains again: Pitstop's in-memory data parallelism beside torchft 0.2.0.

The same model, data, optimizer and step (examples/elastic_ddp.py's MLP, the micro-batches of a
step addressed by (step, index), SGD, 0.05 s of sleep a step), the same number of data-parallel
replicas (``--replicas``, default 4, one CPU process each, gloo on loopback), the same kills:

- **pitstop**: ``python -m worker_agent launch --elastic`` for each replica (``--nnodes N
  --nproc-per-node 1``, node ranks 0 … N−1) on examples/elastic_ddp.py, reporting to the stack
  the demo runs (Daphne, the embedded Redis, a Celery worker, the detector); the job enables
  ``rerouting`` only, so the survivors take the lost replica's micro-batches in memory (the
  global batch is kept: ``--micro-batches`` defaults to N × (N−1), which N and N−1 divide).
- **pitstop-restore**: the same, the job enabling ``flashrecovery`` on the same devices
  (``{"same_devices": true, "restart_s": 3.0}``): the killed process is started again by its
  launcher and takes a live replica's state as it joins; the time runs until every replica,
  the new process included, has made a step at world N (the goal: ≤ 3 s).
- **torchft-default**: torchft's lighthouse (``torchft_lighthouse --min_replicas 1``) and N
  replica groups of one process (``benchmarks/torchft_replica.py``: ``Manager``,
  ``ProcessGroupGloo``, ``torchft.DistributedDataParallel``, ``torchft.Optimizer``, as torchft's
  ``train_ddp.py``) with torchft's default timeouts: 60 s for gloo, the manager's operations,
  its quorum and connections; a lighthouse join timeout of 60 s, a quorum tick of 100 ms, a
  heartbeat timeout of 5 s, a heartbeat every 100 ms.
- **torchft-aggressive**: the same with every one of those knobs short (``AGGRESSIVE``).

Each repetition starts the arm's N processes afresh (a new job, a new lighthouse), waits for
every replica to have made ``WARMUP_STEPS`` steps at world N, measures the step period on the
victim, then waits for a step line of the victim, sleeps a uniform fraction of the period (the
kill's phase within a step) and SIGKILLs the victim's training process (never its launcher).
The victim and the phase are drawn from ``--seed`` and the repetition's index, so every arm gets
the same kills. The time runs from the kill to the first step line, after the kill, of *every*
survivor at world N−1 (``pitstop-restore``: of the new process, and of every survivor at world N
at that step or a later one); lines are read from each process's output every 10 ms. A run in
which they do not all train again within ``--timeout`` is *not recovered* (the timeout is a
lower bound on its time); a survivor that exits after the kill is a *cascade*; a start in which
the replicas never all trained together (no kill made) is *failed* ("no start"). Pitstop's runs
also record the control plane's recovery: decision and timeline phases. The ratios are each
arm's median over torchft-default's (or torchft-aggressive's, when torchft-default never
recovered). Repetitions interleave the arms (each repetition runs every arm once), so a change
in the machine's load falls on all of them; the control plane runs for the whole benchmark when
a Pitstop arm is chosen.

    python -m benchmarks.torchft_side_by_side [--replicas 4] [--repeats 10] [--arms a,b] \\
        [--timeout 90] [--step-s 0.05] [--seed 0] [--out PATH]

Bounded (every wait has a deadline), loopback only; a fresh data directory per run; every
process started is stopped at the end, on error or on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.launch_restart import ELASTIC_LINE, _ranks, recovery, stack_environment
from benchmarks.results import write_results
from controlplane.demo import ControlPlane, Processes, free_port, listening, wait_for
from worker_agent.launch import World, job_scenario

ROOT = Path(__file__).resolve().parents[1]
ELASTIC_SCRIPT = ROOT / "examples" / "elastic_ddp.py"
REPLICA_SCRIPT = ROOT / "benchmarks" / "torchft_replica.py"
ARMS = ("pitstop", "pitstop-restore", "torchft-default", "torchft-aggressive")
BASELINE = "torchft-default"
WARMUP_STEPS = 10  # steps at world N of every replica before the kill
PERIOD_STEPS = 10  # the victim's steps the step period is measured over
POLL_S = 0.01  # how often the outputs are read after the kill
# torchft's knobs made short (the aggressive arm): the lighthouse's flags (milliseconds) and
# the replica's (benchmarks/torchft_replica.py's flags: Manager's and ProcessGroupGloo's). A
# death is seen by the heartbeat timeout; a survivor stuck in gloo's all-reduce is freed by
# gloo's timeout. A join timeout below the replicas' skew (50 ms) left a late starter out of
# quorum after quorum until its quorum call timed out (1 s) and it exited, on 4 of 10 starts
# here; 200 ms with a 2 s quorum timeout start every time on 2 busy cores.
AGGRESSIVE: dict[str, dict[str, float]] = {
    "lighthouse": {"join_timeout_ms": 200, "quorum_tick_ms": 10, "heartbeat_timeout_ms": 100},
    "replica": {
        "timeout_s": 0.5,  # Manager(timeout=): collectives, should_commit, checkpoints
        "quorum_timeout_s": 2.0,  # Manager(quorum_timeout=)
        "connect_timeout_s": 1.0,  # Manager(connect_timeout=)
        "pg_timeout_s": 0.5,  # ProcessGroupGloo(timeout=): gloo's collectives and store
        "heartbeat_ms": 20,  # Manager(heartbeat_interval=)
    },
}
TORCHFT_DEFAULTS: dict[str, dict[str, float]] = {
    "lighthouse": {"join_timeout_ms": 60000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 5000},
    "replica": {
        "timeout_s": 60,
        "quorum_timeout_s": 60,
        "connect_timeout_s": 60,
        "pg_timeout_s": 60,
        "heartbeat_ms": 100,
    },
}


class Interrupted(Exception):
    """SIGTERM arrived: stop everything."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Tail:
    """The step lines of a growing output file, read from where the last read stopped, each
    with the time it was first read: (step, world, seen)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.lines: list[tuple[int, int, float]] = []

    def read(self) -> list[tuple[int, int, float]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.lines
        self.offset += len(data)
        *complete, self.rest = (self.rest + data).split(b"\n")
        now = time.monotonic()
        for _, step, world in ELASTIC_LINE.findall(b"\n".join(complete)):
            self.lines.append((int(step), int(world), now))
        return self.lines

    def tail(self, lines: int = 4) -> list[str]:
        """The last ``lines`` lines that are not step lines, for a failed run's record."""
        try:
            text = self.path.read_bytes()[-20000:].decode(errors="replace")
        except OSError:
            return []
        other = [line[:300] for line in text.splitlines() if not line.startswith("rank ")]
        return other[-lines:]


@dataclass
class Member:
    """One replica: its output, and the pid of its training process (None while there is
    none)."""

    tail: Tail
    pid: Callable[[], int | None]


@dataclass
class Kill:
    """Repetition ``repeat``'s kill: the replica and the phase within a step."""

    repeat: int
    victim: int
    fraction: float


def one_kill(
    members: list[Member], kill: Kill, *, restore: bool, timeout: float, start_timeout: float
) -> dict[str, Any]:
    """Wait for training, kill ``kill.victim``'s process at its phase, time until every
    survivor (``restore``: every replica) trains again."""
    n = len(members)
    run: dict[str, Any] = {"repeat": kill.repeat, "victim": kill.victim, "phase": kill.fraction}
    victim = members[kill.victim].tail

    def pids() -> list[int] | None:
        found = [m.pid() for m in members]
        return [p for p in found if p is not None] if all(found) else None

    try:
        wait_for(
            lambda: all(
                sum(1 for _, w, _ in m.tail.read() if w == n) >= WARMUP_STEPS for m in members
            ),
            f"{WARMUP_STEPS} steps of every replica at world {n}",
            start_timeout,
        )
        running: list[int] = wait_for(pids, "the processes' pids", 10)
        first = len(victim.read())
        wait_for(
            lambda: len(victim.read()) >= first + PERIOD_STEPS,
            "the victim's steps",
            30,
            interval=0.005,
        )
        lines = victim.lines
        period = (lines[first + PERIOD_STEPS - 1][2] - lines[first][2]) / (PERIOD_STEPS - 1)
        seen = len(victim.read())
        wait_for(lambda: len(victim.read()) > seen, "a step of the victim", 30, interval=0.002)
    except TimeoutError as exc:
        logs = {str(j): m.tail.tail() for j, m in enumerate(members)}
        return run | {"status": "failed", "reason": str(exc), "logs": logs}
    delay = kill.fraction * period
    time.sleep(delay)
    os.kill(running[kill.victim], signal.SIGKILL)
    killed_at = time.monotonic()
    at = [len(m.tail.read()) for m in members]
    last_step = max((m.tail.lines[-1][0] for m in members if m.tail.lines), default=0)
    survivors = [j for j in range(n) if j != kill.victim]
    wanted = list(range(n)) if restore else survivors
    world = n if restore else n - 1
    run |= {"period_s": period, "delay_s": delay, "step_at_kill": last_step}
    trained: dict[int, float] = {}
    cascade: dict[int, float] = {}
    # restore: the survivors' step that counts is the new process's first (a step line of a
    # survivor at world N before it may be the end of a step the victim had finished)
    since = 0
    deadline = killed_at + timeout
    while time.monotonic() < deadline and len(trained) < len(wanted) and not cascade:
        if restore and kill.victim not in trained:
            for step, w, t in members[kill.victim].tail.read()[at[kill.victim] :]:
                if w == world:  # the killed process prints no more: its replacement's
                    trained[kill.victim], since = t - killed_at, step
                    break
        for j in survivors:
            if j in trained or (restore and kill.victim not in trained):
                continue
            for step, w, t in members[j].tail.read()[at[j] :]:
                if w == world and step >= since:
                    trained[j] = t - killed_at
                    break
        for j in survivors:
            if not alive(running[j]):
                cascade[j] = time.monotonic() - killed_at
        time.sleep(POLL_S)
    run["trained_s"] = {str(j): round(s, 4) for j, s in sorted(trained.items())}
    if restore and kill.victim in trained:
        run["replacement_s"] = trained[kill.victim]
    if cascade:
        run |= {"status": "cascade", "cascade_s": {str(j): s for j, s in cascade.items()}}
    elif len(trained) == len(wanted):
        return run | {"status": "recovered", "kill_to_training_s": max(trained.values())}
    else:
        run |= {"status": "not recovered", "lower_bound_s": timeout}
    run["never_trained"] = [j for j in wanted if j not in trained]
    run["logs"] = {str(j): members[j].tail.tail() for j in range(n)}
    return run


@dataclass
class Bench:
    """What every arm shares: the processes, the data directory, the settings."""

    args: argparse.Namespace
    data: Path
    processes: Processes
    plane: ControlPlane | None = None
    jobs: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.args.replicas)

    def script_args(self) -> list[str]:
        return [
            "--steps", "100000", "--step-s", str(self.args.step_s),
            "--micro-batches", str(self.args.micro_batches),
        ]  # fmt: skip

    def stop(self, names: list[str], pids: list[int]) -> None:
        """Stop ``names`` (SIGTERM, then their process groups SIGKILLed) and whatever of
        ``pids`` (their training processes, each its session's leader) is left."""
        self.processes.stop_together(names)
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

    def pitstop(self, arm: str, kill: Kill) -> dict[str, Any]:
        assert self.plane is not None
        name = f"{arm}-{kill.repeat}"
        job = self.jobs[name]
        port = free_port()
        names = [f"{name}-node-{r}" for r in range(self.n)]
        launchers = [
            self.processes.start(
                names[r],
                [sys.executable, "-m", "worker_agent", "launch",
                 "--nnodes", str(self.n), "--nproc-per-node", "1", "--node-rank", str(r),
                 "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "3",
                 "--server", f"ws://127.0.0.1:{self.plane.port}", "--job", name, "--elastic",
                 str(ELASTIC_SCRIPT), *self.script_args()],
                {"PITSTOP_AGENT_TOKEN": job["token"], "PYTHONPATH": str(ROOT)},
            )
            for r in range(self.n)
        ]  # fmt: skip
        seen: set[int] = set()

        def pid_of(r: int) -> Callable[[], int | None]:
            def pid() -> int | None:
                found = _ranks(launchers[r].pid).get(r)
                if found is not None:
                    seen.add(found)
                return found

            return pid

        logs = self.processes.logs
        members = [Member(Tail(logs / f"{node}.log"), pid_of(r)) for r, node in enumerate(names)]
        try:
            run = one_kill(
                members,
                kill,
                restore=arm == "pitstop-restore",
                timeout=self.args.timeout,
                start_timeout=self.start_timeout,
            )
            if run["status"] != "failed":
                run |= recovery(self.plane, job["id"], min(self.args.timeout, 20.0))
            return run
        finally:
            for m in members:
                m.pid()
            self.stop(names, sorted(seen))

    def torchft(self, arm: str, kill: Kill) -> dict[str, Any]:
        knobs: dict[str, dict[str, float]] = {"lighthouse": {}, "replica": {}}  # torchft's defaults
        if arm == "torchft-aggressive":
            knobs = AGGRESSIVE
        name = f"{arm}-{kill.repeat}"
        port = free_port()
        lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse")]
        if not Path(lighthouse[0]).exists():
            lighthouse = [
                sys.executable,
                "-c",
                "from torchft._torchft import lighthouse_main as m; m()",
            ]
        lighthouse += ["--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
        for knob, value in knobs["lighthouse"].items():
            lighthouse += [f"--{knob}", str(value)]
        flags = [
            word
            for knob, value in knobs["replica"].items()
            for word in (f"--{knob.replace('_', '-')}", str(value))
        ]
        names = [f"{name}-lighthouse", *(f"{name}-replica-{r}" for r in range(self.n))]
        self.processes.start(names[0], lighthouse)
        try:
            wait_for(lambda: listening(port), "the lighthouse", 30)
            replicas = [
                self.processes.start(
                    names[1 + r],
                    [sys.executable, "-u", str(REPLICA_SCRIPT), *self.script_args(), *flags],
                    {
                        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                        "REPLICA_GROUP_ID": str(r),
                        "NUM_REPLICA_GROUPS": str(self.n),
                        "GLOO_SOCKET_IFNAME": "lo",
                        "PYTHONPATH": str(ROOT),
                    },
                )
                for r in range(self.n)
            ]
            members = [
                Member(
                    Tail(self.processes.logs / f"{names[1 + r]}.log"), functools.partial(int, p.pid)
                )
                for r, p in enumerate(replicas)
            ]
            return one_kill(
                members,
                kill,
                restore=False,
                timeout=self.args.timeout,
                start_timeout=self.start_timeout,
            )
        finally:
            self.stop(names[1:], [])
            self.stop(names[:1], [])

    @property
    def start_timeout(self) -> float:
        return max(float(self.args.timeout), 60.0)

    def run(self, arm: str, kill: Kill) -> dict[str, Any]:
        return self.pitstop(arm, kill) if arm.startswith("pitstop") else self.torchft(arm, kill)


def pitstop_jobs(n: int, repeats: int, arms: list[str]) -> list[dict[str, Any]]:
    """One job per Pitstop arm and repetition: the launcher's own scenario for N nodes of one
    device under ``--elastic`` (``worker_agent.launch.job_scenario``), one policy enabled."""
    world = World(
        nnodes=n,
        nproc_per_node=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=0,
        run_id="bench",
        max_restarts=3,
        signals_to_handle="",
        error_dir="",
        elastic=True,
    )
    scenario = job_scenario(world, n, str(ELASTIC_SCRIPT))
    policy = {"pitstop": "rerouting", "pitstop-restore": "flashrecovery"}
    return [
        {"name": f"{arm}-{i}", "scenario": scenario, "mode": "auto", "policies": [policy[arm]]}
        for arm in arms
        if arm in policy
        for i in range(repeats)
    ]


def summarize(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for arm, runs in rows.items():
        times = [r["kill_to_training_s"] for r in runs if r["status"] == "recovered"]
        replaced = [r["replacement_s"] for r in runs if "replacement_s" in r]
        summary[arm] = {
            "runs": len(runs),
            "recovered": len(times),
            "not_recovered": sum(1 for r in runs if r["status"] == "not recovered"),
            "cascades": sum(1 for r in runs if r["status"] == "cascade"),
            "failed_to_start": sum(1 for r in runs if r["status"] == "failed"),
            "median_s": statistics.median(times) if times else None,
            "min_s": min(times) if times else None,
            "max_s": max(times) if times else None,
        }
        if replaced:
            summary[arm]["replacement_median_s"] = statistics.median(replaced)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4, help="data-parallel replicas, ≥ 2")
    parser.add_argument("--repeats", type=int, default=10, help="kills per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument(
        "--timeout",
        type=float,
        default=90.0,
        help="seconds from a kill for every survivor to train again; past it the run is"
        " 'not recovered' (the start may take this long, at least 60 s)",
    )
    parser.add_argument("--step-s", type=float, default=0.05, help="sleep in every step")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="the global batch's micro-batches (default N × (N−1): N and N−1 divide it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws each kill's victim and phase")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/torchft_side_by_side.json"
    )
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        parser.error(f"--arms: unknown {', '.join(unknown) or 'none chosen'}; of {', '.join(ARMS)}")
    arms = [a for a in ARMS if a in arms]
    if args.replicas < 2 or args.repeats < 1 or not args.timeout > 0 or args.step_s < 0:
        parser.error("--replicas ≥ 2, --repeats ≥ 1, --timeout > 0 and --step-s ≥ 0")
    if args.micro_batches is None:
        args.micro_batches = args.replicas * (args.replicas - 1)
    if args.micro_batches < args.replicas:
        parser.error("--micro-batches: at least one per replica")
    signal.signal(signal.SIGTERM, _raise_interrupted)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    kills = []
    for i in range(args.repeats):
        draw = random.Random(f"{args.seed}:{i}")
        kills.append(Kill(i, draw.randrange(args.replicas), draw.random()))
    with tempfile.TemporaryDirectory(prefix="pitstop-torchft-") as tmp:
        data = Path(tmp)
        env = stack_environment(data)
        (data / "logs").mkdir()
        bench = Bench(args, data, Processes(data / "logs", env))
        try:
            if any(arm.startswith("pitstop") for arm in arms):
                bench.plane = ControlPlane(data, free_port(), bench.processes)
                bench.plane.start()
                made = bench.plane.setup(
                    "bench", "bench", pitstop_jobs(args.replicas, args.repeats, arms)
                )
                bench.jobs = made["jobs"]
            progress = tqdm(total=len(arms) * args.repeats, desc="kills", unit="run")
            for kill in kills:
                for arm in arms:
                    run = bench.run(arm, kill)
                    rows[arm].append(run)
                    shown = run.get("kill_to_training_s")
                    progress.set_postfix_str(
                        f"{arm} {shown:.2f} s" if shown is not None else f"{arm} {run['status']}"
                    )
                    progress.update()
            progress.close()
        finally:
            bench.processes.stop_all()
    summary = summarize(rows)
    base = BASELINE if summary.get(BASELINE, {}).get("median_s") else None
    note = None
    if base is None:
        fallback = summary.get("torchft-aggressive", {}).get("median_s")
        base = "torchft-aggressive" if fallback else None
        if BASELINE in summary:
            note = f"{BASELINE} never recovered within {args.timeout:g} s"
    ratios = {
        arm: (row["median_s"] / summary[base]["median_s"] if base and row["median_s"] else None)
        for arm, row in summary.items()
    }
    print(
        f"{'arm':<19} {'recovered':>9} {'median s':>9} {'max s':>8} {'min s':>8} "
        f"{'not rec.':>8} {'cascades':>8} {'no start':>8}"
    )

    def seconds(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for arm, row in summary.items():
        lost = f"{row['not_recovered']} (>{args.timeout:g})" if row["not_recovered"] else "0"
        print(
            f"{arm:<19} {row['recovered']:>4}/{row['runs']:<4} {seconds(row['median_s']):>9} "
            f"{seconds(row['max_s']):>8} {seconds(row['min_s']):>8} {lost:>8} "
            f"{row['cascades']:>8} {row['failed_to_start']:>8}"
        )
    if "replacement_median_s" in summary.get("pitstop-restore", {}):
        replaced = summary["pitstop-restore"]["replacement_median_s"]
        print(f"pitstop-restore: the new process's first step, median {replaced:.2f} s")
    if note:
        print(f"{note}: ratios against {base or 'nothing'}")
    if base:
        for arm, ratio in ratios.items():
            print(f"{arm} / {base} median: {ratio:.3f}" if ratio else f"{arm} / {base}: -")
    write_results(
        args.out,
        {
            "started": started,
            "config": {
                "replicas": args.replicas,
                "repeats": args.repeats,
                "arms": arms,
                "timeout_s": args.timeout,
                "step_s": args.step_s,
                "micro_batches": args.micro_batches,
                "seed": args.seed,
                "torchft": _version("torchft"),
                "torch": _version("torch"),
                "torchft_default": TORCHFT_DEFAULTS,
                "torchft_aggressive": AGGRESSIVE,
                "cpus": os.cpu_count(),
            },
            "summary": summary,
            "ratio_base": base,
            "ratio_note": note,
            "ratios": ratios,
            "rows": rows,
        },
    )
    # torchft's failures are measured, not this benchmark's: only Pitstop's fail it
    ours = [summary[arm] for arm in arms if arm.startswith("pitstop")]
    return 0 if all(row["recovered"] == row["runs"] for row in ours) else 1


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
