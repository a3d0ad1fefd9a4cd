"""A plan that leaves out a live device holding layers, under the agent, with the reference
trainer's ranks (real processes: the agent, three ranks, a scripted control plane).

Devices 0 and 1 train PP2 (layers 0-3 and 4-7), device 2 is a spare. The operator's plan is DP2
on devices 0 and 2, each holding the whole model: device 1, alive, holds layers 4-7 and is left
out. Without ``holders`` (what the server sent before the field existed) the ranks ask only the
devices of both plans, device 0, and refuse the plan: ``layer 4 has no live holder``, the demo's
failure. With ``holders`` [0, 1] device 1 sends layers 4-7 to devices 0 and 2 and stays up,
idle, a spare; both replicas then train on with identical weights, the single-process
reference's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.processes import REPO_ROOT, clean_environment, free_port
from tests.worker_agent.helpers import ScriptedServer, poll
from tests.worker_agent.trainer.reference import (
    assert_weights_close,
    pipeline,
    plan,
    stage,
    train_reference,
)
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.model import ModelConfig, build_layer

PP2 = plan(pipeline(4, stage(0, 0, 4), stage(1, 4, 8)))
DP2 = plan(pipeline(2, stage(0, 0, 8)), pipeline(2, stage(2, 0, 8)))
TIMEOUT_S = 120.0


def _command(id: str, **fields: Any) -> dict[str, Any]:
    return {"type": "command", "id": id, "action": "apply_plan", "plan": DP2, **fields}


def _states(server: ScriptedServer) -> dict[int, str]:
    beat = server.last_beat()
    return {d["device"]: d["state"] for d in beat["devices"]} if beat else {}


def _step(server: ScriptedServer) -> int:
    beat = server.last_beat()
    return int(beat["step"]) if beat else -1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("holders")
    (tmp / "plan.json").write_text(json.dumps(PP2))
    server = ScriptedServer()
    log = (tmp / "agent.log").open("ab")
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "run", "--server", server.url),
            *("--job", "j", "--node", "node-0", "--devices", "0,1,2"),
            *("--store", f"127.0.0.1:{free_port()}", "--serve-store", "--layers", "8"),
            *("--grace", "3", "--no-control", "--"),
            *(sys.executable, "-m", "worker_agent.trainer", "rank"),
            *("--plan", str(tmp / "plan.json"), "--dump", str(tmp / "dump")),
        ],
        env=clean_environment(OMP_NUM_THREADS="1", PITSTOP_AGENT_TOKEN="t"),
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        poll(
            lambda: (
                _step(server) >= 2 and _states(server) == {0: "training", 1: "training", 2: "idle"}
            ),
            "two steps of PP2",
            TIMEOUT_S,
        )
        server.send(_command("old", decision=1))
        old = poll(lambda: server.acks("old"), "the ack of the command without holders", TIMEOUT_S)
        resumed = poll(lambda: _step(server) >= 4 and _step(server), "PP2 training on", TIMEOUT_S)
        server.send(_command("new", decision=2, holders=[0, 1]))
        new = poll(lambda: server.acks("new"), "the ack of the command with holders", TIMEOUT_S)
        after = _step(server)
        poll(
            lambda: (
                _step(server) >= after + 3
                and _states(server) == {0: "training", 1: "idle", 2: "training"}
            ),
            "three steps of DP2, device 1 idle",
            TIMEOUT_S,
        )
        alive_before_stop = agent.poll() is None
        states = _states(server)
        server.send({"type": "command", "id": "stop", "action": "stop"})
        poll(lambda: server.acks("stop"), "the stop's ack", TIMEOUT_S)
        code = agent.wait(timeout=60)
        yield {
            "old": old[0],
            "new": new[0],
            "resumed": resumed,
            "states": states,
            "alive": alive_before_stop,
            "code": code,
            "dump": tmp / "dump",
        }
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)
        server.close()
        log.close()


def _dump(run: dict[str, Any], device: int, tag: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(run["dump"] / f"{device}-{tag}.pt")
    return state


def test_without_holders_a_layer_only_a_left_out_device_holds_is_refused(
    run: dict[str, Any],
) -> None:
    ack = run["old"]
    assert ack["ok"] is False
    assert "layer 4 has no live holder" in ack["error"]["message"]
    assert run["resumed"] >= 4  # nothing changed: PP2 trained on
    assert not (run["dump"] / "0-old.pt").exists()


def test_with_holders_the_left_out_device_sends_and_stays_up_as_a_spare(
    run: dict[str, Any],
) -> None:
    assert run["new"]["ok"] is True, run["new"]
    assert run["states"] == {0: "training", 1: "idle", 2: "training"}
    assert run["alive"] and run["code"] == 0
    sender = _dump(run, 1, "new")
    assert sender["layers"] == {}  # it sent layers 4-7 and dropped them
    got = {d: _dump(run, d, "new") for d in (0, 2)}
    assert sorted(got[0]["layers"]) == sorted(got[2]["layers"]) == list(range(8))
    assert got[0]["step"] == got[2]["step"] == sender["step"]
    for k in range(8):  # weights and optimizer state: bitwise the same on both replicas
        assert torch.equal(got[0]["layers"][k], got[2]["layers"][k]), k


def _params(flat: torch.Tensor, index: int) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    for name, p in build_layer(ModelConfig(), index).named_parameters():
        out[name] = flat[offset : offset + p.numel()].numpy().reshape(p.shape)
        offset += p.numel()
    return out


def test_both_replicas_end_with_the_same_weights_the_references(run: dict[str, Any]) -> None:
    end = {d: _dump(run, d, "end") for d in (0, 2)}
    assert end[0]["step"] == end[2]["step"] >= 5
    for k in range(8):
        assert torch.equal(end[0]["layers"][k], end[2]["layers"][k]), k
    reference = train_reference(TrainConfig(), 8, range(end[0]["step"]))
    weights = {d: {k: _params(end[d]["layers"][k], k) for k in range(8)} for d in (0, 2)}
    assert_weights_close(weights, reference.weights, rtol=1e-4, atol=1e-4)
