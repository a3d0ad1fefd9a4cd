"""The demo's server start: migrate, serve ASGI on loopback, answer /healthz, stop cleanly."""

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.processes import (
    REPO_ROOT,
    clean_environment,
    free_port,
    process_exists,
    stop_leftover_redis,
    wait_until,
)

pytestmark = pytest.mark.e2e

DEMO_SERVER = [sys.executable, "-m", "daphne"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _healthz(url: str) -> tuple[int, dict[str, str]] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return None  # not listening yet


def test_demo_server_answers_healthz_and_stops_its_embedded_redis(tmp_path: Path) -> None:
    # The same steps as `./dev demo`, on the embedded defaults in a fresh data directory.
    # PYTHONFAULTHANDLER: a server that does not stop is sent SIGABRT, and its threads'
    # tracebacks land in its log, which the failure shows
    env = clean_environment(PITSTOP_DATA_DIR=str(tmp_path), PYTHONFAULTHANDLER="1")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=120,
        check=True,
    )
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*DEMO_SERVER, "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
            env=env,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            # SIGINT as a terminal's Ctrl-C finds it, whatever this run inherited: a run started
            # in the background (`&`, no job control) ignores SIGINT, its children inherit that,
            # and neither Python nor Twisted installs a handler for a signal ignored at start
            preexec_fn=_default_sigint,
        )
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        answers: list[tuple[int, dict[str, str]]] = []

        def answered() -> bool:
            assert server.poll() is None, log_path.read_text()
            answer = _healthz(url)
            if answer is not None:
                answers.append(answer)
            return answer is not None

        wait_until(answered, timeout_s=60, what=f"{url} to answer")
        assert answers[-1] == (200, {"status": "ok", "database": "ok", "redis": "ok"})
        redis_pid = json.loads((tmp_path / "redis" / "server.json").read_text())["pid"]

        server.send_signal(signal.SIGINT)  # what Ctrl-C on `./dev demo` sends
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGABRT)
            server.wait(timeout=10)
            raise AssertionError(
                "the server did not stop within 30 s of SIGINT; its log, with its threads:\n"
                + log_path.read_text()[-12000:]
            ) from None
        assert code == 0, log_path.read_text()
        assert not process_exists(redis_pid)
        assert not (tmp_path / "redis" / "server.json").exists()
        assert (tmp_path / "pitstop.sqlite3").is_file()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        stop_leftover_redis(tmp_path / "redis" / "server.json")
