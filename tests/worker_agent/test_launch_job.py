"""The launcher asks the control plane for its job with an admin's API token: the scenario it
makes from torchrun's flags, the request, and what it does with each answer (a scripted HTTP
server on loopback stands for the control plane; the real one: tests/e2e)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codec import scenario_from_dict
from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.test_launch import LAUNCH
from worker_agent.launch import LaunchRefused, World, ask_for_job, job_scenario


class Answers:
    """A control plane that answers each POST with the next of ``replies`` (status, headers,
    body) and keeps what it was sent."""

    def __init__(self, *replies: tuple[int, dict[str, str], dict[str, Any]]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        answers = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answers.requests.append(
                    {"path": self.path, "auth": self.headers["Authorization"], "body": body}
                )
                status, headers, reply = answers.replies.pop(0)
                data = json.dumps(reply).encode()
                self.send_response(status)
                for name, value in {**headers, "Content-Type": "application/json"}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"ws://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Answers:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def world(nnodes: int, nproc: int, replica_size: int = 1) -> World:
    return World(
        nnodes, nproc, 0, "127.0.0.1", 29500, "run", 3, "SIGTERM", "/tmp",
        replica_size=replica_size,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(nnodes=st.integers(1, 16), nproc=st.integers(1, 8), data=st.data())
def test_the_scenario_has_a_replica_a_group_of_processes_and_shrinks_only_down_to_min(
    nnodes: int, nproc: int, data: st.DataObject
) -> None:
    least = data.draw(st.integers(1, nnodes))
    size = data.draw(st.sampled_from([k for k in range(1, nproc + 1) if nproc % k == 0]))
    made = job_scenario(world(nnodes, nproc, size), least, "/somewhere/train.py")
    scenario_from_dict(made)  # the core takes it
    devices = nnodes * nproc
    assert made["cluster"]["devices"] == devices and made["cluster"]["devices_per_node"] == nproc
    pipelines = made["plan"]["pipelines"]
    groups = [p["stages"][0]["devices"] for p in pipelines]
    assert all(len(p["stages"]) == 1 for p in pipelines)
    # a replica is `size` consecutive devices, all of one node
    assert groups == [list(range(d, d + size)) for d in range(0, devices, size)]
    assert all(len({d // nproc for d in g}) == 1 for g in groups)
    if least == nnodes:
        assert made["policies"] == {"restart": {}}
    else:
        assert made["policies"] == {"restart_shrink": {"min_replicas": least * nproc // size}}


@pytest.fixture
def scenario() -> dict[str, Any]:
    return job_scenario(world(2, 1), 2, "train.py")


def test_the_node_waits_out_a_429_and_takes_its_token(scenario: dict[str, Any]) -> None:
    made = {"agent_token": "pst_x", "created": True, "job": {"id": 1}}
    with Answers((429, {"Retry-After": "0"}, {"code": "throttled"}), (201, {}, made)) as server:
        assert ask_for_job(server.url, "key", "ddp", scenario) == ("pst_x", True)
    assert len(server.requests) == 2
    sent = server.requests[-1]
    assert sent["path"] == "/api/v1/jobs/launch/" and sent["auth"] == "Token key"
    assert sent["body"] == {
        "name": "ddp",
        "scenario": scenario,
        "enabled_policies": ["restart"],
        "approval_mode": "auto",
    }


def test_a_refusal_is_said_with_the_servers_message_and_field(scenario: dict[str, Any]) -> None:
    said = {"code": "invalid_scenario", "message": "job ddp has 4 devices", "field": "scenario"}
    with Answers((400, {}, said)) as server, pytest.raises(LaunchRefused) as refused:
        ask_for_job(server.url, "key", "ddp", scenario)
    assert "400 job ddp has 4 devices (scenario)" in str(refused.value)


def test_a_control_plane_never_reached_is_said_after_the_patience(
    scenario: dict[str, Any],
) -> None:
    with pytest.raises(LaunchRefused, match=r"no answer in 2 s"):
        ask_for_job(f"ws://127.0.0.1:{free_port()}", "key", "ddp", scenario, patience_s=2)


def test_the_command_line_needs_one_token_and_says_a_refusal() -> None:
    neither = subprocess.run(
        [*LAUNCH, "--job", "j", "train.py"],
        env=clean_environment(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert neither.returncode == 2 and "--token (or --api-token) are needed" in neither.stderr
    said = {"code": "permission_denied", "message": "this needs the admin role", "field": None}
    with Answers((403, {}, said)) as server:
        refused = subprocess.run(
            [*LAUNCH, "--job", "j", "--api-token", "key", "--server", server.url, "train.py"],
            env=clean_environment(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert refused.returncode == 2
    assert "refused job 'j': 403 this needs the admin role" in refused.stderr


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Loopback only, whatever proxy the environment names."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield
