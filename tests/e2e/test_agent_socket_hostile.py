"""The agent's websocket on a real server (Daphne) under hostile input: frames that arrive after
the server closed the socket, and the websocket fuzz (``benchmarks.ws_fuzz``) in a CI-sized
form: no crash close, no uncaught exception, no hub handler left behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from benchmarks import ws_fuzz

CI_FRAMES = 400


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ws_fuzz.Server]:
    with ws_fuzz.server(Path(tmp_path_factory.mktemp("ws"))) as running:
        yield running


def events(target: ws_fuzz.Server, since: int = 0) -> list[str]:
    return [str(record.get("event")) for record in target.records()[since:]]


def hello(target: ws_fuzz.Server, node: str = "node-0") -> str:
    devices = ws_fuzz.NODES[node]
    frame = {"type": "hello", "job": "fuzz", "node": node, "token": target.token}
    return json.dumps({**frame, "devices": devices})


def test_frames_after_the_servers_close_leave_no_handler_and_each_loss_is_recorded_once(
    target: ws_fuzz.Server,
) -> None:
    """Another node's devices in a fault close the socket (4002); the frames the agent sent
    behind it arrive after the close. Each such session still gives its hub handler back and
    records its node's loss once; a later hello replaces nobody."""
    mark = len(target.records())
    sessions, late_sent = 8, 0
    for seq in range(sessions):
        with connect(target.url, open_timeout=10) as ws:
            ws.send(hello(target))
            assert json.loads(ws.recv(timeout=10))["type"] == "welcome"
            foreign = {"type": "fault", "seq": 1, "at": time.time(), "kind": "crash"}
            ws.send(json.dumps({**foreign, "devices": [5]}))
            for late in ("{not json", json.dumps({"type": "goodbye"}), "\x00" * 10):
                try:
                    ws.send(late)
                except ConnectionClosed:  # the close came first (a slow machine): no more to send
                    break
                late_sent += 1
            codes = []
            try:
                while True:
                    codes.append(json.loads(ws.recv(timeout=10)).get("code"))
            except ConnectionClosed as closed:
                assert closed.rcvd is not None and closed.rcvd.code == 4002, seq
            assert codes == ["wrong_devices"]  # nothing answered after the close
    assert late_sent > 0  # some frames did go out behind the fault, to arrive after the close
    deadline = time.monotonic() + 30
    while events(target, mark).count("agent.lost") < sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert events(target, mark).count("agent.lost") == sessions
    after = len(target.records())
    with connect(target.url, open_timeout=10) as ws:
        ws.send(hello(target))
        assert json.loads(ws.recv(timeout=10))["type"] == "welcome"
        time.sleep(0.5)  # a handler left behind would be told it was replaced meanwhile
        ws.send(json.dumps({"type": "goodbye"}))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    time.sleep(0.3)
    later = target.records()[after:]
    assert not [r for r in later if "replaced" in json.dumps(r)]
    assert events(target, mark).count("agent.lost") == sessions  # once each, not again
    failed = [r for r in target.records() if r.get("level") in {"error", "critical"}]
    assert not failed, failed[:3]


def test_the_websocket_fuzz_finds_no_crash_no_uncaught_exception_and_no_leak(
    target: ws_fuzz.Server,
) -> None:
    counts = ws_fuzz.fuzz(target, CI_FRAMES, seed=26)
    summary = counts.summary()
    assert summary["frames"] >= CI_FRAMES
    assert set(summary["by_class"]) == set(ws_fuzz.CLASSES)  # every class was sent
    # the refusals it must have met, by their codes
    assert {"invalid", "malformed", "oversized", "wrong_devices"} <= set(summary["errors"])
    assert (summary["crash_closes"], summary["dropped"]) == (0, 0), summary
    assert counts.uncaught == [], summary
    assert summary["leaked_handlers"] == 0, summary


def test_a_message_over_the_transport_limit_closes_with_1009_and_the_node_is_lost_once(
    target: ws_fuzz.Server,
) -> None:
    """Over Daphne's 1 MiB the message is not read: a close with 1009 (message too big), where
    the transport used to drop the connection with no code. (The agent beats first: a socket
    closed before a word after its welcome is left to the heartbeat deadline.)"""
    mark = len(target.records())
    with connect(target.url, open_timeout=10, close_timeout=5) as ws:
        ws.send(hello(target, "node-1"))
        assert json.loads(ws.recv(timeout=10))["type"] == "welcome"
        reports = [{"device": d, "state": "training"} for d in ws_fuzz.NODES["node-1"]]
        beat = {"type": "heartbeat", "seq": 1, "at": time.time(), "step": 1, "loss": 1.0}
        ws.send(json.dumps({**beat, "devices": reports}))
        ws.send("x" * (1024 * 1024 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    deadline = time.monotonic() + 10
    while "agent.lost" not in events(target, mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert events(target, mark).count("agent.lost") == 1


def test_a_socket_over_the_cap_of_silent_ones_is_closed_4013_and_the_next_is_welcomed(
    tmp_path: Path,
) -> None:
    """With one silent socket held (``PITSTOP_MAX_WAITING_SOCKETS=1``), the next is closed with
    4013 before any frame, on a real Daphne (whose websocket library refused to send 1013 and
    raised instead: the agent saw 1011, an internal error); once the silent one is gone, a hello
    is welcomed."""
    with ws_fuzz.server(tmp_path, PITSTOP_MAX_WAITING_SOCKETS="1") as running:
        with connect(running.url, open_timeout=10) as silent:
            with (
                connect(running.url, open_timeout=10) as extra,
                pytest.raises(ConnectionClosed) as closed,
            ):
                extra.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4013
            silent.close()
        with connect(running.url, open_timeout=10) as ws:
            ws.send(hello(running))
            assert json.loads(ws.recv(timeout=10))["type"] == "welcome"
        assert "Exception inside application" not in running.log.read_text(errors="replace")
