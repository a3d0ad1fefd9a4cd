"""Simulation sweeps on 1 and on 2 Celery workers: more workers finish the same sweep sooner.

A sweep is cut into one Celery task per piece (one policy, or the ideal, over one seed) and
merged by a chord (controlplane/simulations). This starts N real worker processes (one task at
a time each, as one host's worth of workers would be started per core), starts the same sweep
through the service the REST API calls, and times it from the start to the merged summary. The
ratio is the 1-worker time over the N-worker time, measured in the same run; the summaries must
be identical, since a piece gives the same run wherever it runs.

It needs a Redis (``REDIS_URL``, default redis://127.0.0.1:6379/13); the database is a fresh
SQLite file in a temporary folder, shared by the workers.

    python -m benchmarks.sweep_workers [--seeds 20] [--hours 12] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.heartbeat_load import stop
from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "llama2-7b-pp4-dp8-tp1.json"
POLICIES = ["odyssey", "dynamic", "checkpoint", "rerouting"]


def sqlite(data_dir: Path, redis_url: str) -> dict[str, str]:
    """The environment of a fresh SQLite database in ``data_dir`` and the given Redis."""
    return {
        "DATABASE_URL": f"sqlite:///{data_dir / 'bench.sqlite3'}",
        "REDIS_URL": redis_url,
        "PITSTOP_DATA_DIR": str(data_dir),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }


def configure(env: dict[str, str]) -> dict[str, str]:
    """Point this process (and the workers) at ``env``'s database, migrated, and Redis."""
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return env


# where worker ``i`` runs: (the words its command line begins with, its own environment)
Place = Callable[[int], tuple[list[str], dict[str, str]]]


def start_workers(
    count: int, env: dict[str, str], logs: Path, place: Place = lambda _: ([], {})
) -> list[subprocess.Popen[bytes]]:
    workers = []
    for i in range(count):
        log = (logs / f"worker-{count}-{i}.log").open("wb")
        prefix, own = place(i)
        workers.append(
            subprocess.Popen(
                [
                    *prefix,
                    *(sys.executable, "-m", "celery", "-A", "controlplane", "worker"),
                    *("--pool", "solo", "--hostname", f"bench{i}@%h", "--loglevel", "warning"),
                    *("--without-gossip", "--without-mingle", "--without-heartbeat"),
                ],
                env={**os.environ, **env, **own},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    from controlplane.celery import app

    deadline = time.monotonic() + 60
    while len(app.control.ping(timeout=0.5) or []) < count:
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            stop(workers, wait_s=30)  # a warm shutdown ends the piece in hand
            raise SystemExit(f"the workers did not start; see {logs}")
    return workers


def timed_sweep(experiment: dict[str, Any], label: str) -> tuple[float, dict[str, Any], Any]:
    """Start the sweep, follow it with a progress bar; (seconds, summary, workers seen)."""
    import json

    from controlplane.simulations import sweeps
    from controlplane.simulations.models import SweepStatus

    scenario = json.loads(SCENARIO.read_text())
    began = time.perf_counter()
    sweep = sweeps.start(scenario=scenario, experiment=experiment, name=SCENARIO.name)
    with tqdm(total=sweep.pieces_total, desc=label, unit="piece", file=sys.stderr) as bar:
        while True:
            sweep.refresh_from_db()
            bar.update(min(sweep.pieces_done, sweep.pieces_total) - bar.n)
            if sweep.status in (SweepStatus.DONE, SweepStatus.FAILED):
                break
            time.sleep(0.05)
    seconds = time.perf_counter() - began
    if sweep.status != SweepStatus.DONE:
        raise SystemExit(f"sweep {label} failed: {sweep.error}")
    return seconds, dict(sweep.summary or {}), sweep.workers


def compare(
    counts: list[int],
    experiment: dict[str, Any],
    env: dict[str, str],
    logs: Path,
    place: Place = lambda _: ([], {}),
) -> tuple[list[dict[str, Any]], bool]:
    """The same sweep on each count of workers in turn: a row per count (seconds, the workers
    that ran pieces, the speedup over the first count), and whether every summary is the same."""
    from controlplane.celery import app

    app.control.purge()
    rows, summaries = [], []
    for count in counts:
        workers = start_workers(count, env, logs, place)
        try:
            seconds, summary, seen = timed_sweep(experiment, f"{count} worker(s)")
        finally:
            stop(workers, wait_s=30)  # a warm shutdown ends the piece in hand
        summaries.append(summary)
        rows.append({"workers": count, "seconds": seconds, "workers_seen": len(seen)})
    for row in rows:
        row["speedup"] = rows[0]["seconds"] / row["seconds"]
    return rows, all(s == summaries[0] for s in summaries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds of the sweep (default 20)")
    parser.add_argument("--hours", type=float, default=12.0, help="simulated hours (default 12)")
    parser.add_argument(
        "--workers", default="1,2", help="worker counts to compare, the first is the baseline"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sweep_workers.json")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers: expected counts like 1,2, got {args.workers!r}")
    if not counts or min(counts) < 1 or args.seeds < 1 or not args.hours > 0:
        parser.error("--workers, --seeds and --hours must be positive")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/13")
    experiment = {
        "hours": args.hours,
        "policies": POLICIES,
        "seeds": args.seeds,
        "trace": {"failure_rate_per_device_hour": 0.01, "repair_hours": 4},
    }
    with tempfile.TemporaryDirectory(prefix="pitstop-sweep-") as tmp:
        env = configure(sqlite(Path(tmp), redis_url))
        rows, same = compare(counts, experiment, env, Path(tmp))
    pieces = args.seeds * (len(POLICIES) + 1)
    print(f"\nsweep: {args.seeds} seeds × {len(POLICIES)} policies + ideal = {pieces} pieces, "
          f"{args.hours:g} h each, {SCENARIO.name}")  # fmt: skip
    print(f"{'workers':>8} {'seconds':>9} {'ran pieces':>11} {'speedup':>8}")
    for row in rows:
        print(
            f"{row['workers']:>8} {row['seconds']:>9.2f} {row['workers_seen']:>11} "
            f"{row['speedup']:>7.2f}×"
        )
    print(f"identical summaries on every worker count: {same}")
    write_results(
        args.out,
        {
            "benchmark": "sweep_workers",
            "cpus": os.cpu_count(),
            "experiment": experiment,
            "scenario": SCENARIO.name,
            "pieces": pieces,
            "rows": rows,
            "identical_summaries": same,
        },
    )
    return 0 if same else 1


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the processes it started are stopped (``finally``)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
