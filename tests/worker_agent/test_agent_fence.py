"""A node the control plane no longer hears is fenced by generation, even while its ranks still
reach the job's store (real processes: two agents, a rank each, two scripted control planes).

Devices 0 (node-0, which hosts the store) and 1 (node-1) train DP2 in generation ``d0/``. Then
node-1 is cut off from the control plane: its server sends it nothing more, as a partitioned
node hears nothing, while its rank still reaches the store and its peer. The control plane plans
around node-1 (decision 1: the whole model on device 0) and sends node-0 the plan. Once node-0's
rank trains under ``d1/``, the superseded generation is aborted in the store: node-1's rank,
stuck in ``d0/``'s all-reduce, leaves it at once and idles, waiting for a plan that never comes;
it never trains again under ``d0/``, and its agent reports no hang for the wait."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import ScriptedServer, poll, terminate
from tests.worker_agent.trainer.reference import pipeline, plan, stage

DP2 = plan(pipeline(2, stage(0, 0, 8)), pipeline(2, stage(1, 0, 8)))
ALONE = plan(pipeline(4, stage(0, 0, 8)))
TIMEOUT_S = 120.0


def _agent(
    tmp: Path, server: ScriptedServer, node: str, device: int, store: int
) -> subprocess.Popen[bytes]:
    serve = ("--serve-store",) if device == 0 else ()
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "run", "--server", server.url),
            *("--job", "j", "--node", node, "--devices", str(device)),
            *("--store", f"127.0.0.1:{store}", *serve, "--layers", "8"),
            *("--grace", "3", "--no-control", "--"),
            *(sys.executable, "-m", "worker_agent.trainer", "rank"),
            *("--plan", str(tmp / "plan.json")),
        ],
        env=clean_environment(OMP_NUM_THREADS="1", PITSTOP_AGENT_TOKEN="t"),
        cwd=REPO_ROOT,
        stdout=(tmp / f"agent-{node}.log").open("ab"),
        stderr=subprocess.STDOUT,
    )


def _beat(server: ScriptedServer) -> tuple[int, str]:
    """The node's step and its one device's state, from its last heartbeat."""
    beat = server.last_beat()
    if beat is None or not beat["devices"]:
        return -1, ""
    return int(beat["step"]), str(beat["devices"][0]["state"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fence")
    (tmp / "plan.json").write_text(json.dumps(DP2))
    port = free_port()
    servers = {"node-0": ScriptedServer(), "node-1": ScriptedServer()}
    agents = {
        name: _agent(tmp, servers[name], name, device, port) for device, name in enumerate(servers)
    }
    try:
        poll(
            lambda: all(_beat(s)[0] >= 2 and _beat(s)[1] == "training" for s in servers.values()),
            "two steps of DP2 on both nodes",
            TIMEOUT_S,
        )
        # node-1 is cut off: from here on its server sends nothing; node-0 gets the new plan
        servers["node-0"].send(
            {
                "type": "command",
                "id": "d1-apply",
                "action": "apply_plan",
                "plan": ALONE,
                "decision": 1,
                "holders": [0],
            }
        )
        ack = poll(lambda: servers["node-0"].acks("d1-apply"), "node-0's ack", TIMEOUT_S)[0]
        applied = _beat(servers["node-0"])[0]
        poll(lambda: _beat(servers["node-0"])[0] >= applied + 3, "node-0 training on", TIMEOUT_S)
        fenced_at = time.monotonic()
        state = poll(
            lambda: _beat(servers["node-1"])[1] != "training" and _beat(servers["node-1"]),
            "node-1's rank out of d0/",
            30,
        )
        left_s = time.monotonic() - fenced_at
        time.sleep(5)  # longer than node-1's grace and a few of its heartbeats
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        aborted = client.check(["d0/abort"])
        abort = client.get("d0/superseded").decode() if client.check(["d0/superseded"]) else None
        yield {
            "ack": ack,
            "state": state,
            "left_s": left_s,
            "later": _beat(servers["node-1"]),
            "faults": servers["node-1"].of_type("fault"),
            "abort": abort,
            "aborted": aborted,
            "node-1 alive": agents["node-1"].poll() is None,
        }
    finally:
        for agent in agents.values():
            terminate(agent)
        for server in servers.values():
            server.close()


def test_the_new_plan_is_applied_on_the_nodes_the_control_plane_hears(
    run: dict[str, Any],
) -> None:
    assert run["ack"]["ok"] is True, run["ack"]


def test_the_superseded_generation_is_aborted_in_the_store(run: dict[str, Any]) -> None:
    assert run["aborted"] and run["abort"] is not None, "the old generation is not fenced"
    reason = json.loads(run["abort"])
    assert reason["superseded_by"] == "d1/" and reason["node"] == "node-0"


def test_the_cut_off_rank_leaves_the_old_generation_and_never_trains_in_it_again(
    run: dict[str, Any],
) -> None:
    step, state = run["state"]
    assert state == "idle" and run["left_s"] < 10, run
    assert run["later"] == (step, "idle")  # no step since: it waits for a plan
    assert run["faults"] == [] and run["node-1 alive"]  # waiting is no hang
