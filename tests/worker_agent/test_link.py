"""The link between the agent and its ranks: JSON lines over a socket pair, both ends."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time

import pytest

from worker_agent import link


def test_every_message_is_one_line_and_reads_back() -> None:
    messages: list[link.RankMessage] = [
        link.HelloMessage(device=3, pid=42),
        link.StepMessage(step=7, loss=2.5, step_time_s=0.4, samples=8, memory_bytes=1e9),
        link.StateMessage(state="paused"),
        link.FaultMessage(kind="nan", message="loss went away"),
        link.DoneMessage(command="c1", ok=False, error=link.LinkError(message="no", field="plan")),
    ]
    for message in messages:
        line = link.encode(message)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert link.decode_from_rank(line) == message
    nan = link.decode_from_rank(
        link.encode(link.StepMessage(step=1, loss=math.nan, step_time_s=0.1))
    )
    assert isinstance(nan, link.StepMessage) and nan.loss is not None and math.isnan(nan.loss)
    command = link.CommandMessage(id="c", action="resume", step=5, generation="d3/")
    assert link.decode_from_agent(link.encode(command)) == command


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[1, 2]\n",
        b'{"no": "type"}\n',
        b'{"t": "step", "step": -1}\n',
        b'{"t": "state", "state": "dancing"}\n',
        b'{"t": "unknown"}\n',
    ],
)
def test_a_broken_line_is_skipped_with_a_log(line: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker_agent.link"):
        assert link.decode_from_rank(line) is None
    assert "broken line" in caplog.text


def test_the_agents_end_reads_messages_skips_broken_lines_and_ends_with_the_child(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def read() -> list[link.RankMessage]:
        end, child = link.AgentEnd.pair()
        await end.open()
        child.sendall(b'{"t": "hello", "device": 1, "pid": 9}\n{broken\n')
        child.sendall(link.encode(link.StateMessage(state="training")) + b'{"t": "st')
        child.close()  # the process is gone: its end of the pair closes, mid-line
        got = [m async for m in end.messages()]
        assert end.send(link.InjectMessage(kind="nan")) in (True, False)  # never raises
        end.close()
        return got

    with caplog.at_level(logging.WARNING, logger="worker_agent.link"):
        got = asyncio.run(read())
    assert got == [link.HelloMessage(device=1, pid=9), link.StateMessage(state="training")]
    assert "broken line" in caplog.text and "unfinished line" in caplog.text


def test_without_an_agent_the_trainer_link_does_nothing() -> None:
    quiet = link.TrainerLink.from_env({})
    assert not quiet.active and quiet.generation == "d0/"
    quiet.report_step(1, 2.0, 0.1, samples=4)
    quiet.set_state("training")
    quiet.fault("nan", "x")
    quiet.done("c1")
    assert quiet.poll_command(0.01) is None and list(quiet.commands()) == []
    assert not quiet.injected("nan")


def test_the_trainer_link_reports_takes_commands_and_sees_the_agent_go() -> None:
    agent, child = socket.socketpair()
    env = {
        link.FD_VARIABLE: str(child.fileno()),
        "PITSTOP_DEVICE": "3",
        "PITSTOP_NODE": "n",
        "PITSTOP_STORE": "h:1",
        "PITSTOP_GENERATION": "d2/",
    }
    trainer = link.TrainerLink.from_env(env)
    assert trainer.active and (trainer.device, trainer.node, trainer.store) == (3, "n", "h:1")
    reader = agent.makefile("rb")
    hello = link.decode_from_rank(reader.readline())
    assert isinstance(hello, link.HelloMessage) and hello.device == 3
    trainer.report_step(4, 1.5, 0.2, samples=8)
    assert link.decode_from_rank(reader.readline()) == link.StepMessage(
        step=4, loss=1.5, step_time_s=0.2, samples=8
    )
    with pytest.raises(ValueError):
        trainer.set_state("dancing")
    with pytest.raises(ValueError):
        trainer.fault("gremlins")
    assert trainer.poll_command(0) is None
    command = link.CommandMessage(id="c1", action="apply_plan", plan={"p": 1}, generation="d5/")
    agent.sendall(b"garbage\n" + link.encode(command) + link.encode(link.InjectMessage(kind="nan")))
    assert trainer.poll_command(5) == command
    assert trainer.generation == "d5/"
    deadline = time.monotonic() + 5
    while not trainer.injected("nan"):
        assert time.monotonic() < deadline, "the injection never surfaced"
        time.sleep(0.01)
    assert not trainer.injected("nan"), "an injection surfaces once"
    trainer.done("c1", ok=False, error=link.LinkError(message="no room", field="plan"))
    done = link.decode_from_rank(reader.readline())
    assert isinstance(done, link.DoneMessage) and not done.ok and done.error is not None
    assert done.error.message == "no room"
    reader.close()
    agent.close()  # the agent is gone
    assert trainer.poll_command(5) is None
    assert trainer.agent_gone and not trainer.active
    assert list(trainer.commands()) == []
    trainer.report_step(5, 1.4, 0.2)  # and training goes on alone, quietly
    trainer.close()


def test_an_active_link_pulses_while_the_loop_is_busy_and_stops_with_the_process() -> None:
    ours, theirs = socket.socketpair()
    trainer = link.TrainerLink(theirs, device=0)
    try:
        ours.settimeout(5)
        reader = ours.makefile("rb")
        began = time.monotonic()
        pulses = 0
        while pulses < 3:  # nothing else is sent: the loop "computes" meanwhile
            message = link.decode_from_rank(reader.readline())
            assert isinstance(message, link.AliveMessage), message
            pulses += 1
        took = time.monotonic() - began
        assert 2 * link.PULSE_S <= took < 3 * link.PULSE_S + 1.0, took
    finally:
        trainer.close()
        ours.close()
