"""Scale-out, measured: two ASGI servers and two Celery workers, each on a test host of its own
(network namespaces, ``benchmarks/netns.py``), against one of each, in the same run.

**Heartbeat capacity.** The same load as ``benchmarks.heartbeat_load`` (``--connections`` nodes
of 8 devices, a heartbeat a second each, ``--kills`` agents killed and ``--hangs`` hung in the
window) reaches the servers through Debian's nginx on loopback (websockets proxied,
``least_conn``), first with one server behind it, then with two. Each layout gets a fresh
database and an emptied Redis; the detector runs beside them. Per layout: heartbeats sent and
ingested, ingest lag p50/p99 (from the agent's send to the heartbeat written in Redis, the
servers' shared histogram), each server's CPU, kills and hangs detected, hellos welcomed.

**Sweep throughput.** The simulation sweep of ``benchmarks.sweep_workers`` on one Celery worker
(on host w0), then on two (w0 and w1): seconds, pieces each worker ran, the speedup, and whether
both summaries are identical.

Shared parts, as a deployment has them: PostgreSQL, reached over its unix socket (namespaces
share the filesystem; a fresh database per part, dropped at the end), and a Redis server of the
run's own, listening on loopback and on each host's gateway (the machine's Redis listens on
loopback alone, which a namespace cannot reach), emptied at the start. Everything shares this
machine's cores: what two hosts would give is reasoned from each server's CPU per heartbeat
(docs/operations.md). Needs root (namespaces), /usr/sbin/nginx (``./dev test`` installs it) and
redis-server. Bounded: loopback and the test hosts' addresses only, ``--seconds`` of window per
layout.

    python -m benchmarks.scale_out [--connections 2048] [--seconds 30] [--settle 25] [--seeds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import heartbeat_load, netns, sweep_workers
from benchmarks.heartbeat_load import Servers, cell, free_port, stop, wait_for
from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "benchmarks" / "results" / "scale_out-logs"
NGINX = Path("/usr/sbin/nginx")
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
SOCKET = "/var/run/postgresql"  # PostgreSQL's unix socket folder
SERVER_HOSTS, WORKER_HOSTS = (170, 171), (172, 173)  # the test hosts' indices (10.213.N.0/24)
PORT = 8000  # each server's, on its host's address
SETTLE_S = 25.0  # 2,048 hellos take 10 to 14 s to be answered: the window opens after them

NGINX_CONF = """
worker_processes 1;
worker_rlimit_nofile 40000;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 20000; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fastcgi;
  uwsgi_temp_path {tmp}/nginx-uwsgi;
  scgi_temp_path {tmp}/nginx-scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  upstream pitstop {{ least_conn; {servers} }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://pitstop;
      proxy_http_version 1.1;
      proxy_set_header Host $host;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_read_timeout 1h;
    }}
  }}
}}
"""


def unavailable() -> str | None:
    """Why this cannot run here, or None."""
    if not NGINX.exists():
        return f"no {NGINX} (./dev test installs Debian's nginx-light as root)"
    return netns.unavailable()


@contextlib.contextmanager
def test_hosts(indices: Sequence[int]) -> Iterator[list[netns.Host]]:
    with contextlib.ExitStack() as made:
        yield [made.enter_context(netns.host(i)) for i in indices]


@contextlib.contextmanager
def redis_server(hosts: Sequence[netns.Host], tmp: Path) -> Iterator[int]:
    """A Redis server on loopback and each host's gateway, keeping nothing on disk: its port."""
    port = free_port()
    conf = tmp / "redis.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1 {' '.join(h.gateway for h in hosts)}\n"
        f'protected-mode no\nsave ""\nappendonly no\nmaxclients 20000\ndir {tmp}\n'
    )
    server = subprocess.Popen(
        ["redis-server", str(conf)],
        stdout=(tmp / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for("127.0.0.1", port, server)
        yield port
    finally:
        stop([server])


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards: its URL over the unix socket."""
    name = f"pitstop_scaleout_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@/{name}?host={SOCKET}"
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_url(port: int, host: netns.Host | None = None) -> str:
    """The run's Redis as ``host`` reaches it (its gateway), or as this machine does."""
    return f"redis://{host.gateway if host else '127.0.0.1'}:{port}/0"


def behind_nginx(hosts: Sequence[netns.Host], redis_port: int) -> Servers:
    """A server on each of ``hosts`` (on its address, port 8000) and nginx on loopback."""

    @contextlib.contextmanager
    def servers(env: dict[str, str], logs: Path) -> Iterator[tuple[str, list[int]]]:
        serve = [sys.executable, "-m", "daphne", "-p", str(PORT), "controlplane.asgi:application"]
        started = [
            subprocess.Popen(
                host.command([*serve, "-b", host.address]),
                env={**env, "REDIS_URL": redis_url(redis_port, host)},
                cwd=ROOT,
                stdout=(logs / f"server-{i}.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
            for i, host in enumerate(hosts)
        ]
        port = free_port()
        upstreams = " ".join(f"server {h.address}:{PORT};" for h in hosts)
        (logs / "nginx.conf").write_text(NGINX_CONF.format(tmp=logs, servers=upstreams, port=port))
        balancer = subprocess.Popen(
            [str(NGINX), "-p", str(logs), "-e", str(logs / "nginx-error.log"),
             "-c", str(logs / "nginx.conf")],
            stdout=(logs / "nginx.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            for host, server in zip(hosts, started, strict=True):
                wait_for(host.address, PORT, server)
            wait_for("127.0.0.1", port, balancer)
            yield f"ws://127.0.0.1:{port}/ws/agent/", [s.pid for s in started]
        finally:
            stop([balancer, *started])

    return servers


def heartbeats(
    args: argparse.Namespace, hosts: list[netns.Host], port: int
) -> list[dict[str, Any]]:
    rows = []
    for count in (1, 2):
        print(f"{count} server(s), {args.connections} nodes, window {args.seconds:g} s …")
        with database() as url:
            row = heartbeat_load.measure(
                args.connections, args.seconds, args.kills, args.hangs, redis_url(port),
                args.settle, servers=behind_nginx(hosts[:count], port), database_url=url,
                pinned=False, keep=LOGS / f"{count}-servers",
            )  # fmt: skip
        row["servers"] = count
        # what a core of one server ingests: the reasoned capacity per server, at 1 Hz, in nodes
        busy = row["server_cpu_pct"] / 100
        row["hb_per_core_s"] = row["ingested_hb_s"] / busy if busy else None
        rows.append(row)
        print(
            "  "
            + ", ".join(
                f"{k} {cell(v)}"
                for k, v in row.items()
                if k not in ("kill_each_s", "ingest_p99_each_s_ms")
            )
        )
    return rows


def sweeps(
    args: argparse.Namespace, hosts: list[netns.Host], port: int, tmp: Path
) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
    experiment = {
        "hours": args.hours,
        "policies": sweep_workers.POLICIES,
        "seeds": args.seeds,
        "trace": {"failure_rate_per_device_hour": 0.01, "repair_hours": 4},
    }
    with database() as url:
        env = sweep_workers.configure(
            {"DATABASE_URL": url, "REDIS_URL": redis_url(port), "PITSTOP_DATA_DIR": str(tmp),
             "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        )  # fmt: skip
        logs = LOGS / "sweeps"
        logs.mkdir(parents=True, exist_ok=True)
        rows, same = sweep_workers.compare(
            [1, 2], experiment, env, logs,
            place=lambda i: (hosts[i].command([]), {"REDIS_URL": redis_url(port, hosts[i])}),
        )  # fmt: skip
        from django.db import connections

        connections.close_all()  # before the database is dropped
    return rows, same, experiment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2048, help="nodes (default 2048)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per layout")
    parser.add_argument("--kills", type=int, default=16, help="agents killed per layout")
    parser.add_argument("--hangs", type=int, default=4, help="agents hung per layout")
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help="seconds between the ramp and the window, for the hellos to be "
                             f"answered (default {SETTLE_S:g})")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=20, help="seeds of the sweep (default 20)")
    parser.add_argument("--hours", type=float, default=12.0, help="simulated hours (default 12)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scale_out.json")
    args = parser.parse_args(argv)
    if args.connections < max(1, args.kills + args.hangs):
        parser.error("--connections must be ≥ 1 and cover --kills + --hangs")
    if not 5 <= args.seconds <= 600:
        parser.error("--seconds must be within 5..600")
    if args.seeds < 1 or not args.hours > 0:
        parser.error("--seeds and --hours must be positive")
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"scale_out: cannot run here: {reason}")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    with (
        tempfile.TemporaryDirectory(prefix="pitstop-scale-out-") as tmp,
        test_hosts([*SERVER_HOSTS, *WORKER_HOSTS]) as hosts,
        redis_server(hosts, Path(tmp)) as port,
    ):
        os.environ["REDIS_URL"] = redis_url(port)  # ours: the lag histogram's keys, the sweeps
        # the sweeps first: they set this process's Django up, on their database
        swept, same, experiment = sweeps(args, hosts[len(SERVER_HOSTS) :], port, Path(tmp))
        beats = heartbeats(args, hosts[: len(SERVER_HOSTS)], port)
    report(beats, swept, same)
    write_results(
        args.out,
        {
            "benchmark": "scale_out",
            "cpus": os.cpu_count(),
            "window_s": args.seconds,
            "rows": beats,
            "sweeps": swept,
            "experiment": experiment,
            "identical_summaries": same,
        },
    )
    return 0 if same else 1


def report(beats: list[dict[str, Any]], swept: list[dict[str, Any]], same: bool) -> None:
    columns = (
        *("servers", "connections", "sent_hb_s", "ingested_hb_s", "ingest_p50_ms"),
        *("ingest_p99_ms", "server_cpu_pct", "hb_per_core_s", "kill_p99_s", "welcome_p50_s"),
        "false_failures",
    )
    print("\nheartbeats, behind nginx")
    print(" ".join(f"{c:>14}" for c in columns))
    for row in beats:
        print(" ".join(f"{cell(row[c]):>14}" for c in columns))
    for row in beats:
        each = ", ".join(f"{c:.0f} %" for c in row["server_cpu_each_pct"])
        print(f"  {row['servers']} server(s): CPU of each {each}")
    print(f"\nsweep: {'workers':>8} {'seconds':>9} {'ran pieces':>11} {'speedup':>8}")
    for row in swept:
        print(
            f"       {row['workers']:>8} {row['seconds']:>9.2f} {row['workers_seen']:>11} "
            f"{row['speedup']:>7.2f}×"
        )
    print(f"identical summaries on 1 and 2 workers: {same}")


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the hosts, servers and databases it made are removed (``finally``)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
