"""The embedded Redis starts on demand, answers, is shared per data directory, and stops."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from controlplane import embedded_redis, redis_probe
from controlplane.embedded_redis import EmbeddedRedis
from tests.processes import (
    REPO_ROOT,
    clean_environment,
    free_port,
    process_exists,
    wait_until,
)


@pytest.fixture
def started() -> Iterator[list[EmbeddedRedis]]:
    """Servers a test starts; whatever is still running is stopped afterwards."""
    servers: list[EmbeddedRedis] = []
    yield servers
    for server in servers:
        server.stop()


def _client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_connect_timeout=1, socket_timeout=1)


def test_server_starts_answers_ping_and_stops(tmp_path: Path, started: list[EmbeddedRedis]) -> None:
    server = embedded_redis.start(tmp_path)
    started.append(server)
    assert server.owned
    assert _client(server).ping() is True
    assert json.loads((tmp_path / "server.json").read_text())["port"] == server.port

    server.stop()

    assert not process_exists(server.pid)
    assert not (tmp_path / "server.json").exists()
    with pytest.raises(redis.ConnectionError):
        redis_probe.ping(server.url, timeout_s=1)


def test_server_refuses_clients_without_the_password(
    tmp_path: Path, started: list[EmbeddedRedis]
) -> None:
    server = embedded_redis.start(tmp_path)
    started.append(server)
    with pytest.raises(redis.AuthenticationError):
        redis_probe.ping(f"redis://127.0.0.1:{server.port}/0", timeout_s=1)


def test_second_start_in_same_directory_reuses_the_server(
    tmp_path: Path, started: list[EmbeddedRedis]
) -> None:
    first = embedded_redis.start(tmp_path)
    started.append(first)
    second = embedded_redis.start(tmp_path)

    assert (second.port, second.pid) == (first.port, first.pid)
    assert not second.owned
    second.stop()  # only the owner stops it
    assert _client(first).ping() is True


def test_other_process_reuses_the_server_and_leaves_it_running(
    tmp_path: Path, started: list[EmbeddedRedis]
) -> None:
    server = embedded_redis.start(tmp_path)
    started.append(server)
    probe = (
        "import sys; from pathlib import Path; from controlplane import embedded_redis; "
        "other = embedded_redis.start(Path(sys.argv[1])); print(other.port, other.owned)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        env=clean_environment(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # The last line: structlog, unconfigured in this bare process, logs to stdout before it.
    assert completed.stdout.splitlines()[-1].split() == [str(server.port), "False"]
    assert _client(server).ping() is True


def test_stale_state_from_a_dead_server_is_replaced(
    tmp_path: Path, started: list[EmbeddedRedis]
) -> None:
    stale = {"port": free_port(), "password": "gone", "pid": 999_999_999}
    (tmp_path / "server.json").write_text(json.dumps(stale))

    server = embedded_redis.start(tmp_path)
    started.append(server)

    assert server.owned and server.pid != stale["pid"]
    assert _client(server).ping() is True


def test_server_stops_when_its_owner_is_killed(tmp_path: Path) -> None:
    owner_script = (
        "import sys; from pathlib import Path; from controlplane import embedded_redis; "
        "server = embedded_redis.start(Path(sys.argv[1])); "
        "print('owner', server.pid, server.owned, flush=True); sys.stdin.read()"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script, str(tmp_path)],
        env=clean_environment(),
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        line = next(line for line in owner.stdout if line.startswith("owner "))
        _, pid, owned = line.split()
        assert owned == "True" and process_exists(int(pid))
        owner.kill()  # no atexit handler runs
        owner.wait()
        wait_until(lambda: not process_exists(int(pid)), timeout_s=10, what="the server to end")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
