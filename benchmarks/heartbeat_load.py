"""Heartbeat ingest under load: simulated agents speaking the real protocol to the real server.

For each connection count N, a fresh control plane (the ASGI server and the failure detector,
a temporary SQLite database, Redis) serves one job of N nodes × 8 devices, and two load
processes open N websockets on loopback: ``hello``, then a heartbeat a second per node, with a
random phase and ±50 ms jitter (``--interval``). After a ramp and a settle, during the
measured window:

- ingest lag, from the agent's send to the heartbeat written in Redis, is read from the server's
  own histogram (``pitstop_heartbeat_ingest_lag_seconds``, the one ``/metrics`` exports), with
  the heartbeats ingested against those sent;
- ``--kills`` agents abort their socket (a killed process: the kernel closes it), 20 ms apart;
  each one's detection is the time of its failure on the job's timeline minus the abort;
- ``--hangs`` agents stop sending and keep their socket open (a stopped process); detection is
  measured from the stop, and the deadline is ``PITSTOP_MISSED_BEATS`` × the interval after
  the last heartbeat.

The server runs on CPU 0 and the load on CPU 1 where the machine has two. The knee is the first
N whose p99 is over 100 ms or that ingests under 99 % of what was sent. Bounded: loopback only,
``--seconds`` of window per N. Needs Redis (``REDIS_URL``, default redis://127.0.0.1:6379/12,
which it flushes).

    python -m benchmarks.heartbeat_load [--connections 256,512,1024,2048] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json"
LOGS = ROOT / "benchmarks" / "results" / "heartbeat_load-logs"  # the server's and detector's
DEVICES_PER_NODE = 8
SETTLE_S = 5.0


def ramp_s(connections: int) -> float:
    """Connections open over this long: 10 s for 2,048, at least 1 s."""
    return min(10.0, max(1.0, connections / 200))


P99_GOAL_S, KILL_GOAL_S, HANG_GOAL_S = 0.1, 0.1, 2.0
# what serves the agents: (environment, folder for logs) -> (the agents' url, the servers' pids)
Servers = Callable[[dict[str, str], Path], contextlib.AbstractContextManager[tuple[str, list[int]]]]


def scenario(nodes: int) -> dict[str, Any]:
    """The example's model on ``nodes`` × 8 devices: pipelines of 4 stages, 16 micro-batches."""
    data: dict[str, Any] = json.loads(EXAMPLE.read_text())
    devices = nodes * DEVICES_PER_NODE
    stages = data["plan"]["pipelines"][0]["stages"]
    data["cluster"].update(devices=devices, devices_per_node=DEVICES_PER_NODE)
    data["training"]["global_batch"] = 16 * devices // len(stages)
    data["plan"]["pipelines"] = [
        {
            "stages": [
                {"devices": [p * len(stages) + i], "layers": s["layers"]}
                for i, s in enumerate(stages)
            ],
            "micro_batches": 16,
        }
        for p in range(devices // len(stages))
    ]
    data["failed"] = []
    return data


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the load: one process per half of the nodes -------------------------------------------


async def agent(
    url: str,
    job: str,
    token: str,
    node: int,
    plan: dict[str, Any],
    out: dict[str, Any],
) -> None:
    """One node's agent: hello, then a heartbeat a second until ``plan["end"]``; a kill victim
    aborts its socket at ``plan["kill"]``, a hang victim stops sending at ``plan["hang"]``."""
    import websockets

    devices = list(range(node * DEVICES_PER_NODE, (node + 1) * DEVICES_PER_NODE))
    await asyncio.sleep(random.uniform(0, plan["ramp"]))  # the ramp
    hello = {"type": "hello", "job": job, "node": f"node-{node}", "token": token}
    ws = await _welcomed(url, json.dumps({**hello, "devices": devices}), plan, out)
    if ws is None:
        out["unwelcomed"].append(node)  # never joined: the detector rightly fails it
        return
    reader = asyncio.create_task(_drain(ws))
    await asyncio.sleep(random.uniform(0, 1))  # a random phase
    seq, beat = 0, time.time()
    try:
        while beat < plan["end"]:
            if "kill" in plan and beat >= plan["kill"]:
                ws.transport.abort()  # the kernel closes the socket, as for a killed process
                out["kills"][node] = time.time()
                return
            if "hang" in plan and beat >= plan["hang"]:
                out["hangs"][node] = time.time()
                await asyncio.sleep(plan["end"] - time.time() + 5)  # open, silent
                return
            seq += 1
            sent = time.time()
            frame = {
                "type": "heartbeat", "seq": seq, "at": sent, "step": seq, "loss": 2.0,
                "samples_per_s": 11.0, "step_time_s": 1.0,
                "devices": [{"device": d, "state": "training", "memory_bytes": 5.2e10,
                             "utilization": 0.9} for d in devices],
            }  # fmt: skip
            await ws.send(json.dumps(frame))
            if plan["window"][0] <= sent < plan["window"][1]:
                out["sent_in_window"] += 1
            beat += plan["interval"]
            await asyncio.sleep(max(beat + random.uniform(-0.05, 0.05) - time.time(), 0))
    except websockets.ConnectionClosed as closed:  # the server closed it (silent: 4004)
        out["closed"][str(closed.rcvd.code if closed.rcvd else None)] += 1
    except websockets.WebSocketException:
        out["send_errors"] += 1
    finally:
        reader.cancel()
        if "kill" not in plan and "hang" not in plan:
            with contextlib.suppress(websockets.WebSocketException):
                await ws.send(json.dumps({"type": "goodbye", "reason": "benchmark over"}))
                await ws.close()


async def _welcomed(url: str, hello: str, plan: dict[str, Any], out: dict[str, Any]) -> Any:
    """The socket once the server welcomed the agent, or None. A socket closed before the
    welcome (the server busy with other hellos: ``CloseCode.BUSY``), or one that could not be
    opened (``connect_retries``, by error), is opened again after a random backoff of 0.5 to
    2 s, as the agent does, until the window starts; the time to the welcome counts from the
    first attempt."""
    import websockets

    opening = time.time()
    while time.time() < plan["window"][0]:
        try:
            ws = await websockets.connect(url, open_timeout=30, ping_interval=None, max_queue=None)
            await ws.send(hello)
            welcome = json.loads(await ws.recv())
        except websockets.ConnectionClosed as closed:
            out["refused"][str(closed.rcvd.code if closed.rcvd else None)] += 1
            await asyncio.sleep(random.uniform(0.5, 2.0))
            continue
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            out["connect_retries"][type(exc).__name__] += 1
            await asyncio.sleep(random.uniform(0.5, 2.0))
            continue
        if welcome.get("type") != "welcome":
            break
        out["welcome_s"].append(time.time() - opening)
        return ws
    out["connect_errors"] += 1
    return None


async def _drain(ws: Any) -> None:
    import websockets

    with contextlib.suppress(websockets.ConnectionClosed):  # the sender counts the close
        async for _ in ws:  # commands and errors: none are expected
            pass


def load(
    cpu: int | None,
    url: str,
    job: str,
    token: str,
    nodes: list[int],
    plans: dict[int, dict[str, Any]],
    results: Any,
) -> None:
    if cpu is not None:
        pin(cpu)
    out: dict[str, Any] = {"connect_errors": 0, "send_errors": 0, "sent_in_window": 0,
                           "kills": {}, "hangs": {}, "welcome_s": [], "unwelcomed": [],
                           "connect_retries": collections.Counter(),
                           "refused": collections.Counter(),
                           "closed": collections.Counter()}  # fmt: skip

    async def watch() -> None:
        """How late this process's loop wakes, at worst: a load behind by more than the
        deadline makes its own agents look silent, whatever the server does."""
        loop = asyncio.get_running_loop()
        out["loop_late_max_s"] = 0.0
        while True:
            began = loop.time()
            await asyncio.sleep(0.25)
            out["loop_late_max_s"] = max(out["loop_late_max_s"], loop.time() - began - 0.25)

    async def everyone() -> None:
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(agent(url, job, token, n, plans[n], out) for n in nodes))
        watcher.cancel()

    asyncio.run(everyone())
    results.put(out)


# --- one connection count --------------------------------------------------------------------


def percentile(buckets: list[tuple[float, int]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear inside its bucket (None: empty)."""
    total = buckets[-1][1]
    if total == 0:
        return None
    rank, lower, below = q * total, 0.0, 0
    for bound, count in buckets:
        if count >= rank:
            inside = count - below
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _each_second(
    client: Any, last: list[tuple[float, int]], until: float, out: list[float | None]
) -> None:
    """Each second's ingest p99 until ``until`` (Unix time) into ``out``, from reading ``last``."""
    while time.time() < until:
        time.sleep(max(min(1.0, until - time.time()), 0))
        now = lag_buckets(client)[0]
        out.append(percentile(_minus(now, last), 0.99))
        last = now


def _minus(
    after: list[tuple[float, int]], before: list[tuple[float, int]]
) -> list[tuple[float, int]]:
    """The cumulative histogram of what came between two readings."""
    return [(bound, n - old) for (bound, n), (_, old) in zip(after, before, strict=True)]


def lag_buckets(redis: Any) -> tuple[list[tuple[float, int]], float, int]:
    from controlplane.jobs import liveness

    cumulative, total = liveness.lag_histogram(redis)
    beats = int(redis.get(liveness.BEATS_KEY) or 0)
    return [(float(b), n) for b, n in cumulative], total, beats


@contextlib.contextmanager
def one_server(env: dict[str, str], logs: Path) -> Iterator[tuple[str, list[int]]]:
    """The ASGI server on loopback, on CPU 0: (the agents' url, [its pid])."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
         "controlplane.asgi:application"],
        env=env, cwd=ROOT, preexec_fn=lambda: pin(0),
        stdout=(logs / "server.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for("127.0.0.1", port, server)
        yield f"ws://127.0.0.1:{port}/ws/agent/", [server.pid]
    finally:
        stop([server])


def stop(processes: list[subprocess.Popen[bytes]], wait_s: float = 20) -> None:
    """SIGTERM, ``wait_s`` to exit, then SIGKILL."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()


def measure(
    n: int,
    seconds: float,
    kills: int,
    hangs: int,
    redis_url: str,
    settle_s: float = SETTLE_S,
    servers: Servers = one_server,
    database_url: str | None = None,
    pinned: bool = True,
    keep: Path | None = None,
) -> dict[str, Any]:
    """One run of ``n`` nodes against ``servers`` (started once the database is ready, with its
    environment and the folder for logs), the detector beside them; ``database_url`` (default
    a fresh SQLite file) must name an empty database. ``pinned``: the detector on CPU 0 and the
    load on CPU 1, as ``one_server`` pins the server on CPU 0; otherwise nothing is pinned.
    The processes' logs are kept in ``keep`` (default ``LOGS``/``n``)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    with tempfile.TemporaryDirectory(prefix="pitstop-hb-") as tmp:
        env = {
            **os.environ,
            "DATABASE_URL": database_url or f"sqlite:///{tmp}/hb.sqlite3",
            "REDIS_URL": redis_url,
            "PITSTOP_DATA_DIR": tmp,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        }
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
        (Path(tmp) / "scenario.json").write_text(json.dumps(scenario(n)))
        made = subprocess.run(
            [*manage, "shell", "-c", _CREATE_JOB.format(path=Path(tmp) / "scenario.json")],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        token = made.stdout.strip().splitlines()[-1]
        logs = Path(tmp)
        detector = subprocess.Popen(
            [*manage, "detect_failures"], env=env, cwd=ROOT,
            preexec_fn=(lambda: pin(0)) if pinned else None,
            stdout=(logs / "detector.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with servers(env, logs) as (url, pids):
                row = _run_load(n, seconds, kills, hangs, settle_s, url, pids, token, env,
                                client, detector.pid, 1 if pinned else None)  # fmt: skip
        finally:
            stop([detector])
            kept = keep or LOGS / str(n)
            kept.mkdir(parents=True, exist_ok=True)
            for log in logs.glob("*.log"):
                (kept / log.name).write_bytes(log.read_bytes())
    return row


def _run_load(
    n: int,
    seconds: float,
    kills: int,
    hangs: int,
    settle_s: float,
    url: str,
    pids: list[int],
    token: str,
    env: dict[str, str],
    client: Any,
    detector: int,
    load_cpu: int | None,
) -> dict[str, Any]:
    start = time.time() + 2
    opened = start + ramp_s(n) + 1 + settle_s
    window = (opened, opened + seconds)
    end = window[1] + 3
    chosen = random.Random(n).sample(range(n), min(n, kills + hangs))
    plans: dict[int, dict[str, Any]] = {
        i: {"end": end, "window": window, "ramp": ramp_s(n), "interval": interval()}
        for i in range(n)
    }
    for k, node in enumerate(chosen[:kills]):
        plans[node]["kill"] = window[1] - 2.5 + 0.02 * k
    for node in chosen[kills:]:
        plans[node]["hang"] = window[0] + seconds / 2
    # spawned, not forked: a fork of a process with threads (a caller's Celery or tqdm) can
    # inherit a lock held by one of them, and hang
    spawn = mp.get_context("spawn")
    results: Any = spawn.Queue()
    procs = [
        spawn.Process(
            target=load, args=(load_cpu, url, "bench", token, list(range(i, n, 2)), plans, results)
        )
        for i in range(2)
    ]
    for proc in procs:
        proc.start()
    # each second's p99 from the first hello, to tell a stall from a steady lag and to see the
    # start (the hellos) as well as the window
    p99_each_s: list[float | None] = []
    # the first reading imports and connects now, not at the window's start
    _each_second(client, lag_buckets(client)[0], window[0], p99_each_s)
    before, cpu0 = lag_buckets(client), [cpu_seconds(pid) for pid in pids]
    detector0 = cpu_seconds(detector)
    opened_at = len(p99_each_s)  # the window's first second in the list
    _each_second(client, before[0], window[1], p99_each_s)
    after, cpu1 = lag_buckets(client), [cpu_seconds(pid) for pid in pids]
    detector1 = cpu_seconds(detector)
    outs = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    time.sleep(liveness_deadline() + 1.5)  # the hangs' deadline, and a sweep
    failures = _failures(env)
    unwelcomed = {int(n_) for o in outs for n_ in o["unwelcomed"]}
    detected = {node: at for node, (at, _) in failures.items()}
    # failed once the agents had stopped (a goodbye lost as the load ended): not while they beat
    after_end = {n_ for n_, at in detected.items() if at > end + liveness_deadline()}
    # welcomed after the join deadline, which had failed them: the deadline is too short
    late = {n_ for n_, (_, kind) in failures.items() if kind == "never_joined"} - unwelcomed
    window_buckets = _minus(after[0], before[0])
    sent = sum(o["sent_in_window"] for o in outs)
    ingested = after[2] - before[2]
    killed = {int(k): v for o in outs for k, v in o["kills"].items()}
    hung = {int(k): v for o in outs for k, v in o["hangs"].items()}
    # in the order the kills came, so that a slow one can be told from a queue behind it
    kill_order = [detected[n_] - t for n_, t in sorted(killed.items(), key=lambda kv: kv[1])
                  if n_ in detected]  # fmt: skip
    kill_s = sorted(kill_order)
    hang_s = sorted(detected[n_] - t for n_, t in hung.items() if n_ in detected)
    p50, p99 = percentile(window_buckets, 0.5), percentile(window_buckets, 0.99)
    welcomes = sorted(w for o in outs for w in o["welcome_s"])
    return {
        "connections": n,
        "devices": n * DEVICES_PER_NODE,
        "sent_hb_s": sent / seconds,
        "ingested_hb_s": ingested / seconds,
        "ingest_p50_ms": None if p50 is None else p50 * 1000,
        "ingest_p99_ms": None if p99 is None else p99 * 1000,
        "server_cpu_pct": 100 * (sum(cpu1) - sum(cpu0)) / seconds,
        "server_cpu_each_pct": [
            100 * (c1 - c0) / seconds for c0, c1 in zip(cpu0, cpu1, strict=True)
        ],
        "detector_cpu_pct": 100 * (detector1 - detector0) / seconds,
        "welcome_p50_s": _quantile(welcomes, 0.5),
        "welcome_max_s": welcomes[-1] if welcomes else None,
        "connect_errors": sum(o["connect_errors"] for o in outs),
        "connect_retries": dict(sum((o["connect_retries"] for o in outs), collections.Counter())),
        "hellos_refused": dict(sum((o["refused"] for o in outs), collections.Counter())),
        "closed_by_server": dict(sum((o["closed"] for o in outs), collections.Counter())),
        "send_errors": sum(o["send_errors"] for o in outs),
        "load_late_max_s": max(o["loop_late_max_s"] for o in outs),
        "kills": len(killed),
        "kills_detected": len(kill_s),
        "kill_p50_s": _quantile(kill_s, 0.5),
        "kill_p99_s": _quantile(kill_s, 0.99),
        "kill_each_s": kill_order,
        "ingest_p99_each_s_ms": [None if v is None else v * 1000 for v in p99_each_s],
        "window_opens_at": opened_at,
        # nodes the detector failed while they beat: not killed, not hung, welcomed before the
        # join deadline (which rightly fails the others), failed before the load stopped
        "false_failures": len(
            set(detected) - set(killed) - set(hung) - unwelcomed - after_end - late
        ),
        "never_joined_welcomed_later": len(late),
        "failed_after_end": len(after_end - set(killed) - set(hung)),
        "hangs": len(hung),
        "hangs_detected": len(hang_s),
        "hang_max_s": max(hang_s) if hang_s else None,
    }


_CREATE_JOB = """
import json
from controlplane.jobs.services import create_job
job, token = create_job("bench", json.loads(open("{path}").read()), approval_mode="manual",
                        enabled_policies=["rerouting"])
print(token)
"""


def interval() -> float:
    """Seconds between an agent's heartbeats (the server's setting, which main sets)."""
    return float(os.environ.get("PITSTOP_HEARTBEAT_INTERVAL_S", 1.0))


def liveness_deadline() -> float:
    return interval() * int(os.environ.get("PITSTOP_MISSED_BEATS", 3))


def wait_for(address: str, port: int, server: subprocess.Popen[bytes]) -> None:
    """Until ``server`` listens on ``address:port`` (SystemExit past 60 s, or if it exits)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited; see its log")
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not start within 60 s")


def _failures(env: dict[str, str]) -> dict[int, tuple[float, str]]:
    """Each node's first failure on the timeline (its devices' node): Unix seconds, kind."""
    script = (
        "import json\n"
        "from controlplane.incidents.models import TimelineEvent\n"
        "out = {}\n"
        "for e in TimelineEvent.objects.filter(kind='failure_detected').order_by('at'):\n"
        f"    for d in e.payload.get('devices', []): out.setdefault(d // {DEVICES_PER_NODE},"
        " (e.at.timestamp(), e.payload.get('failure_kind')))\n"
        "print(json.dumps(out))\n"
    )
    found = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    parsed = json.loads(found.stdout.strip().splitlines()[-1])
    return {int(k): (at, kind) for k, (at, kind) in parsed.items()}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="256,512,1024,2048",
                        help="node connections per run, comma-separated")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per run")
    parser.add_argument("--kills", type=int, default=32, help="agents killed per run")
    parser.add_argument("--hangs", type=int, default=8, help="agents hung per run")
    parser.add_argument("--interval", type=float, default=interval(),
                        help="seconds between heartbeats (default: PITSTOP_HEARTBEAT_INTERVAL_S "
                             "or 1); the hang deadline is this × PITSTOP_MISSED_BEATS")  # fmt: skip
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help="seconds between the ramp and the window (default 5)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/heartbeat_load.json")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.connections.split(",")]
    except ValueError:
        parser.error(f"--connections: expected counts like 256,512, got {args.connections!r}")
    if not counts or min(counts) < 1 or min(counts) < args.kills + args.hangs:
        parser.error("each connection count must be ≥ 1 and cover --kills + --hangs")
    if not 5 <= args.seconds <= 600:
        parser.error("--seconds must be within 5..600")
    if not 0.1 <= args.interval <= 10:
        parser.error("--interval must be within 0.1..10 seconds")
    os.environ["PITSTOP_HEARTBEAT_INTERVAL_S"] = str(args.interval)  # the server's and ours
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    # ours too: the server's keys are read here, under the prefix its database number gives
    redis_url = os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/12")
    rows = []
    for n in counts:
        print(f"{n} connections: ramp {ramp_s(n):g} s, window {args.seconds:g} s …", flush=True)
        rows.append(measure(n, args.seconds, args.kills, args.hangs, redis_url, args.settle))
        print("  " + ", ".join(f"{k} {cell(v)}" for k, v in rows[-1].items()), flush=True)
    knee = next(
        (r["connections"] for r in rows
         if r["ingest_p99_ms"] is None or r["ingest_p99_ms"] > P99_GOAL_S * 1000
         or r["ingested_hb_s"] < 0.99 * r["sent_hb_s"]),
        None,
    )  # fmt: skip
    columns = (
        *("connections", "sent_hb_s", "ingested_hb_s", "ingest_p50_ms", "ingest_p99_ms"),
        *("server_cpu_pct", "kill_p50_s", "kill_p99_s", "hang_max_s", "send_errors"),
        "false_failures",
    )
    print(" ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print(" ".join(f"{cell(row[c]):>14}" for c in columns))
    print(
        f"goals: ingest p99 < {P99_GOAL_S * 1000:g} ms, kill ≤ {KILL_GOAL_S:g} s p99, "
        f"hang ≤ {HANG_GOAL_S:g} s (deadline here {liveness_deadline():g} s); "
        f"knee: {knee if knee is not None else f'beyond {counts[-1]}'}"
    )
    write_results(
        args.out,
        {
            "benchmark": "heartbeat_load",
            "cpus": os.cpu_count(),
            "window_s": args.seconds,
            "interval_s": args.interval,
            "deadline_s": liveness_deadline(),
            "rows": rows,
            "knee": knee,
        },
    )
    return 0


def cell(value: Any) -> str:
    """A table's cell: three significant digits, '-' for none."""
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the processes it started are stopped (``finally``)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
