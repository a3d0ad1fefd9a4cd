"""A Celery worker on the embedded defaults gets its own Redis, answers on it, and stops it."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from controlplane import settings
from tests.processes import (
    REPO_ROOT,
    clean_environment,
    process_exists,
    stop_leftover_redis,
    wait_until,
)

pytestmark = pytest.mark.e2e

WORKER = [
    *(sys.executable, "-m", "celery", "-A", "controlplane", "worker"),
    # One process and no cluster chatter: the test only needs the worker to answer a ping.
    *("--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"),
]


def test_worker_starts_the_embedded_redis_answers_on_it_and_stops_it(tmp_path: Path) -> None:
    state_path = tmp_path / "redis" / "server.json"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            WORKER,
            env=clean_environment(PITSTOP_DATA_DIR=str(tmp_path)),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def running() -> bool:
            assert worker.poll() is None, log_path.read_text()
            return state_path.exists()

        wait_until(running, timeout_s=60, what="the worker's embedded Redis")
        state = json.loads(state_path.read_text())
        url = f"redis://:{state['password']}@127.0.0.1:{state['port']}/0"
        # the deployment's prefix (docs/operations.md): a client without it hears no worker
        prefix = f"{settings.redis_prefix('pitstop', url)}:celery:"
        client = Celery("probe", broker=url)
        client.conf.broker_transport_options = {"global_keyprefix": prefix}
        replies: list[dict[str, dict[str, str]]] = []

        def answered() -> bool:
            assert worker.poll() is None, log_path.read_text()
            replies.extend(client.control.ping(timeout=0.5))
            return bool(replies)

        wait_until(answered, timeout_s=60, what="the worker to answer a ping")
        assert [next(iter(reply.values())) for reply in replies] == [{"ok": "pong"}]

        worker.send_signal(signal.SIGTERM)  # Celery's warm shutdown
        assert worker.wait(timeout=30) == 0, log_path.read_text()
        assert not process_exists(state["pid"])
        assert not state_path.exists()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        stop_leftover_redis(state_path)
