"""Helpers for the agent's tests: the agent as a real process over the toy trainer, and a
scripted control plane for what the real one never sends (unknown actions, broken plans)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.server import ServerConnection

from controlplane.demo import children_of as children_of  # re-exported for the tests
from tests.processes import REPO_ROOT, clean_environment, free_port

TOY = [sys.executable, "-m", "tests.worker_agent.toy_trainer"]


def start_agent(
    tmp: Path,
    *,
    server: str,
    job: str,
    token: str,
    node: str = "node-0",
    devices: str = "0,1",
    options: tuple[str, ...] = (),
    trainer: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    output: int | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m worker_agent run`` over the toy trainer; its log in ``tmp/agent-<node>.log``
    (or ``output``, a file descriptor), the commands its ranks carried out in
    ``tmp/toy-<node>.log``."""
    log = (tmp / f"agent-{node}.log").open("ab") if output is None else output
    environment = clean_environment(
        TOY_LOG=str(tmp / f"toy-{node}.log"), PITSTOP_AGENT_TOKEN=token, **(env or {})
    )
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "run", "--server", server),
            *("--job", job, "--node", node, "--devices", devices),
            *("--grace", "3", *options, "--", *TOY, *trainer),
        ],
        env=environment,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def launch_node(
    rank: int,
    port: int,
    server: str,
    script: list[str],
    *flags: str,
    environment: dict[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """``python -m worker_agent launch`` as node ``rank`` of two, one process each, the master
    on 127.0.0.1:``port``, reporting to ``server`` for job ``j`` (token ``t``); ``flags`` go
    before the script, ``environment`` into its environment, ``popen`` to
    ``subprocess.Popen``."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "launch", "--nnodes", "2"),
            *("--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", "127.0.0.1"),
            *("--master-port", str(port), "--server", server, "--job", "j", *flags, *script),
        ],
        env=clean_environment(PITSTOP_AGENT_TOKEN="t", OMP_NUM_THREADS="1", **(environment or {})),
        cwd=REPO_ROOT,
        **popen,
    )


def ranks_of(launcher: subprocess.Popen[Any]) -> dict[int, int]:
    """A launcher's processes by device (``PITSTOP_DEVICE`` in each one's environment)."""
    found = {}
    for pid in children_of(launcher.pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        (device,) = [v for v in environ if v.startswith(b"PITSTOP_DEVICE=")]
        found[int(device.split(b"=")[1])] = pid
    return found


def terminate(process: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM ``process`` if it runs, then SIGKILL if it is still there after ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def carried_out(tmp: Path, node: str = "node-0") -> list[list[str]]:
    """The commands the toy ranks carried out: [device, id, action, generation] each."""
    path = tmp / f"toy-{node}.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def poll(check: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    """Poll ``check`` until it returns something true; that, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


class ScriptedServer:
    """A control plane reduced to a script: it welcomes agents, keeps every frame they send,
    and sends them what the test says. Runs its own event loop in a thread."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.port, self.interval_s = free_port(), interval_s
        self.frames: list[dict[str, Any]] = []
        self.connections = 0
        self._ws: ServerConnection | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with websockets.serve(self._converse, "127.0.0.1", self.port):
            self._ready.set()
            await self._stop.wait()

    async def _converse(self, ws: ServerConnection) -> None:
        hello = json.loads(await ws.recv())
        self.frames.append(hello)
        await ws.send(
            json.dumps(
                {
                    "type": "welcome",
                    "job": hello["job"],
                    "node": hello["node"],
                    "heartbeat_interval_s": self.interval_s,
                    "missed_beats": 3,
                    "server_time": time.time(),
                }
            )
        )
        self.connections += 1
        self._ws = ws
        with contextlib.suppress(websockets.ConnectionClosed):
            async for text in ws:
                self.frames.append(json.loads(text))

    def send(self, frame: dict[str, Any]) -> None:
        async def send() -> None:
            assert self._ws is not None, "no agent connected"
            await self._ws.send(json.dumps(frame))

        asyncio.run_coroutine_threadsafe(send(), self._loop).result(5)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in list(self.frames) if f["type"] == kind]

    def acks(self, command: str) -> list[dict[str, Any]]:
        return [f for f in self.of_type("ack") if f["command"] == command]

    def last_beat(self) -> dict[str, Any] | None:
        beats = self.of_type("heartbeat")
        return beats[-1] if beats else None

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)
