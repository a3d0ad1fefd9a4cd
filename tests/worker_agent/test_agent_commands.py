"""The agent carries out the control plane's commands through its ranks (the toy trainer, real
child processes): once per command id, acknowledged again when sent again, and refuses what it
cannot do with a coded error, changing nothing. The server here is scripted: the real one never
sends an unknown action or a broken plan."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.processes import process_exists
from tests.worker_agent.helpers import (
    ScriptedServer,
    carried_out,
    children_of,
    poll,
    start_agent,
)
from worker_agent import faults

PLAN = {
    "pipelines": [
        {
            "stages": [{"devices": [0], "layers": [0, 16]}, {"devices": [1], "layers": [16, 32]}],
            "micro_batches": 8,
        },
        {
            "stages": [{"devices": [4], "layers": [0, 16]}, {"devices": [5], "layers": [16, 32]}],
            "micro_batches": 8,
        },
    ]
}


def command(id: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"type": "command", "id": id, "action": action, **fields}


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    try:
        yield server
    finally:
        server.close()


def states(server: ScriptedServer) -> set[str]:
    beat = server.last_beat()
    return {d["state"] for d in beat["devices"]} if beat else set()


def training(server: ScriptedServer, devices: tuple[int, ...] = (0, 1)) -> bool:
    beat = server.last_beat()
    return (
        beat is not None
        and beat["step"] > 0
        and [d["state"] for d in beat["devices"]] == ["training"] * len(devices)
    )


def test_a_command_is_carried_out_once_and_acknowledged_every_time(
    server: ScriptedServer, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, server=server.url, job="j", token="t")
    try:
        # the rank reports its memory apart from its steps: a beat may carry one before the other
        poll(
            lambda: training(server) and "memory_bytes" in (server.last_beat() or {})["devices"][0],
            "training, with the rank's memory",
        )
        beat = server.last_beat()
        assert beat is not None and beat["loss"] > 0 and beat["samples_per_s"] > 0
        assert beat["devices"][0]["memory_bytes"] == 1e9
        server.send(command("c1", "apply_plan", decision=7, plan=PLAN))
        first = poll(lambda: server.acks("c1"), "the apply_plan's ack")
        assert first[0]["ok"] is True and "error" not in first[0]
        server.send(command("c1", "apply_plan", decision=7, plan=PLAN))  # re-sent: same id
        poll(lambda: len(server.acks("c1")) == 2, "a second ack")
        assert sorted(carried_out(tmp_path)) == [
            ["0", "c1", "apply_plan", "d7/"],
            ["1", "c1", "apply_plan", "d7/"],
        ], "carried out once by each rank, under the decision's generation"
        server.send(command("c2", "pause"))
        poll(lambda: server.acks("c2"), "the pause's ack")
        poll(lambda: states(server) == {"paused"}, "paused")
        server.send(command("c3", "resume", decision=7, step=500))
        poll(lambda: server.acks("c3") and training(server), "training again")
        poll(lambda: (server.last_beat() or {}).get("step", 0) > 500, "the step from the resume")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0
    assert server.of_type("goodbye"), "goodbye said"


@pytest.mark.parametrize(
    ("frame", "field", "message"),
    [
        (command("bad", "explode"), "action", "Input should be"),
        (command("bad", "apply_plan", decision=9), "plan", "carries no plan"),
        (
            command(
                "bad",
                "apply_plan",
                decision=9,
                plan={
                    "pipelines": [
                        {
                            "stages": [
                                {"devices": [0], "layers": [0, 16]},
                                {"devices": [1], "layers": [17, 32]},
                            ],
                            "micro_batches": 8,
                        }
                    ]
                },
            ),
            "plan.pipelines[0].stages[1].layers",
            "do not continue the pipeline",
        ),
        (
            command(
                "bad",
                "apply_plan",
                decision=9,
                plan={
                    "pipelines": [
                        {"stages": [{"devices": [0, 9], "layers": [0, 32]}], "micro_batches": 8}
                    ]
                },
            ),
            "plan.pipelines[0].stages[0].devices",
            "uses device 9 of another node",
        ),
        (
            command(
                "bad",
                "apply_plan",
                decision=9,
                plan={
                    "pipelines": [
                        {
                            "stages": [
                                {"devices": [0], "layers": [0, 32]},
                                {"devices": [0], "layers": [0, 32]},
                            ],
                            "micro_batches": 8,
                        }
                    ]
                },
            ),
            "plan.pipelines[0].stages[1]",
            "",
        ),
        (
            command("bad", "inject", inject={"kind": "kill", "device": 7}),
            "inject.device",
            "no such rank running here",
        ),
        (command("bad", "inject", inject={"kind": "kill"}), "inject", "needs the device"),
        (command("bad", "inject"), "inject", "carries the fault to inject"),
    ],
    ids=[
        "unknown-action",
        "no-plan",
        "layer-gap",
        "another-nodes-device",
        "device-twice",
        "inject-another-device",
        "inject-no-device",
        "inject-nothing",
    ],
)
def test_a_command_it_cannot_carry_out_is_refused_and_changes_nothing(
    server: ScriptedServer, tmp_path: Path, frame: dict[str, Any], field: str, message: str
) -> None:
    agent = start_agent(tmp_path, server=server.url, job="j", token="t")
    try:
        poll(lambda: training(server), "training")
        server.send(frame)
        ack = poll(lambda: server.acks("bad"), "the refusal")[0]
        assert ack["ok"] is False
        assert ack["error"]["code"] == "invalid"
        assert ack["error"]["field"].startswith(field), ack
        assert message in ack["error"]["message"], ack
        # nothing changed: no rank saw it, the generation is the one before, still training
        server.send(command("next", "pause"))
        poll(lambda: server.acks("next"), "the next command's ack")
        assert sorted(carried_out(tmp_path)) == [
            ["0", "next", "pause", "d0/"],
            ["1", "next", "pause", "d0/"],
        ]
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0


def test_an_injection_is_done_once_per_id_and_acknowledged_every_time(
    server: ScriptedServer, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, server=server.url, job="j", token="t")
    try:
        poll(lambda: training(server), "training")
        rank = children_of(agent.pid)
        server.send(command("k1", "inject", inject={"kind": "kill", "device": 1}))
        first = poll(lambda: server.acks("k1"), "the injection's ack")[0]
        assert first["ok"] is True, first
        crash = poll(lambda: server.of_type("fault"), "the crash it caused")
        assert [(f["kind"], f["devices"]) for f in crash] == [("crash", [1])]
        server.send(command("k1", "inject", inject={"kind": "kill", "device": 1}))
        acks = poll(lambda: (found := server.acks("k1")) and len(found) == 2 and found, "again")
        assert acks[1] == first, "the same outcome, not a second injection's refusal"
        assert len(children_of(agent.pid)) == len(rank) - 1
        assert not carried_out(tmp_path), "no rank was sent a command"
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0


def test_a_rank_that_fails_a_command_fails_its_ack(server: ScriptedServer, tmp_path: Path) -> None:
    agent = start_agent(
        tmp_path, server=server.url, job="j", token="t", trainer=("--refuse", "restore")
    )
    try:
        poll(lambda: training(server), "training")
        server.send(command("r1", "restore", decision=3))
        ack = poll(lambda: server.acks("r1"), "the restore's ack")[0]
        assert ack["ok"] is False and ack["error"]["code"] == "invalid"
        assert ack["error"]["message"].startswith("device 0: refused"), ack
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0


def test_a_rank_that_closes_its_link_is_a_crash_and_is_killed(
    server: ScriptedServer, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, server=server.url, job="j", token="t",
                        trainer=("--close-link-after", "5"))  # fmt: skip
    try:
        ranks = sorted(poll(lambda: len(children_of(agent.pid)) == 2 and children_of(agent.pid),
                            "two ranks"))  # fmt: skip
        fault = poll(lambda: server.of_type("fault"), "the fault")[0]
        assert fault["kind"] == "crash" and fault["devices"] == [1], fault
        assert "closed its link" in fault["message"], fault
        poll(lambda: not process_exists(ranks[1]), "the silent rank killed", 5)
        assert process_exists(ranks[0])
        beat = poll(lambda: (b := server.last_beat()) and b["devices"][1]["state"] == "failed"
                    and b, "device 1 failed in the heartbeats")  # fmt: skip
        assert beat["devices"][0]["state"] == "training"
        assert len(server.of_type("fault")) == 1, "its death is not reported again"
        # each process named: the one at fault in the fault, the one training in the heartbeat
        assert fault["pid"] in ranks and "exit_code" not in fault  # alive when it was reported
        assert beat["devices"][0]["pid"] == next(p for p in ranks if p != fault["pid"])
        assert "pid" not in beat["devices"][1]
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0
    assert not faults.control_path(agent.pid).exists(), "the control socket removed"
    assert not [pid for pid in ranks if process_exists(pid)]


def test_ranks_writing_to_stderr_train_on_when_the_agents_own_stderr_is_gone(
    server: ScriptedServer, tmp_path: Path
) -> None:
    """The agent reads each rank's stderr to its end even when it can no longer write it
    anywhere: a pipe left full would stop the rank at its next write (64 KiB here is eight
    steps of chatter)."""
    read, write = os.pipe()
    os.close(read)  # every write to the agent's stdout and stderr now fails (EPIPE)
    try:
        agent = start_agent(tmp_path, server=server.url, job="j", token="t", output=write,
                            trainer=("--step-time", "0.01", "--chatter", "100"))  # fmt: skip
    finally:
        os.close(write)
    try:
        poll(lambda: (server.last_beat() or {}).get("step", 0) > 200, "200 steps of chatter", 30)
        assert not server.of_type("fault")
        ranks = children_of(agent.pid)
        os.kill(max(ranks), signal.SIGKILL)
        fault = poll(lambda: server.of_type("fault"), "the killed rank's fault")[0]
        assert fault["exit_code"] == -9 and fault["pid"] == max(ranks)
        assert fault["log"] and fault["log"][-1].startswith(f"device {fault['devices'][0]} step ")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0
