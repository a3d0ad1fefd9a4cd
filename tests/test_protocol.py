"""The agent protocol: the documented examples parse, bad frames get their stable codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker_agent import protocol
from worker_agent.protocol import ErrorCode, ProtocolError

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
BLOCKS = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
AGENT_TYPES = {"hello", "heartbeat", "fault", "ack", "goodbye"}


def test_the_doc_shows_every_frame_type() -> None:
    types = {json.loads(block)["type"] for block in BLOCKS}
    assert types == AGENT_TYPES | {"welcome", "command", "error"}


@pytest.mark.parametrize("block", BLOCKS)
def test_every_documented_example_parses_and_survives_a_round_trip(block: str) -> None:
    data = json.loads(block)
    parse = (
        protocol.parse_agent_frame if data["type"] in AGENT_TYPES else protocol.parse_server_frame
    )
    frame = parse(block)
    assert parse(protocol.encode(frame)) == frame
    assert json.loads(protocol.encode(frame)) == data, "the example writes no default value"


def refused(raw: str | bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as error:
        protocol.parse_agent_frame(raw)
    return error.value


HELLO: dict[str, Any] = {"type": "hello", "job": "j", "node": "n", "token": "t", "devices": [0]}


@pytest.mark.parametrize(
    ("raw", "code", "field"),
    [
        ("not json", ErrorCode.MALFORMED, None),
        ("[1, 2]", ErrorCode.MALFORMED, None),
        ('{"type": "teleport"}', ErrorCode.MALFORMED, None),
        ('{"step": 3}', ErrorCode.MALFORMED, None),
        (json.dumps({**HELLO, "devices": []}), ErrorCode.INVALID, "devices"),
        (json.dumps({**HELLO, "devices": [1, 1]}), ErrorCode.INVALID, "devices"),
        (json.dumps({**HELLO, "extra": 1}), ErrorCode.INVALID, "extra"),
        (json.dumps({**HELLO, "devices": ["zero"]}), ErrorCode.INVALID, "devices.0"),
        (
            '{"type": "heartbeat", "seq": 1, "at": 1, "step": 1, "loss": NaN, '
            '"devices": [{"device": 0, "state": "training"}]}',
            ErrorCode.INVALID,
            "loss",
        ),
        (
            '{"type": "heartbeat", "seq": -1, "at": 1, "step": 1, '
            '"devices": [{"device": 0, "state": "training"}]}',
            ErrorCode.INVALID,
            "seq",
        ),
        (
            '{"type": "fault", "seq": 1, "at": 1, "kind": "gremlins", "devices": [0]}',
            ErrorCode.INVALID,
            "kind",
        ),
    ],
)
def test_bad_frames_get_a_stable_code_and_the_field(
    raw: str, code: ErrorCode, field: str | None
) -> None:
    error = refused(raw)
    assert (error.code, error.field) == (code, field)
    frame = json.loads(protocol.encode(error.frame(seq=7)))
    assert frame["type"] == "error" and frame["code"] == code and frame["seq"] == 7


def test_oversized_frames_are_refused_before_parsing() -> None:
    big = json.dumps({**HELLO, "agent": "x" * protocol.MAX_FRAME_BYTES})
    assert refused(big).code is ErrorCode.OVERSIZED
    assert refused(big.encode()).code is ErrorCode.OVERSIZED


@given(st.binary(max_size=300) | st.text(max_size=300))
def test_no_input_escapes_as_anything_but_a_protocol_error(raw: bytes | str) -> None:
    try:
        protocol.parse_agent_frame(raw)
    except ProtocolError as error:
        assert error.code in {ErrorCode.MALFORMED, ErrorCode.INVALID}


def test_fatal_codes_close_with_application_codes() -> None:
    assert all(4000 <= code < 5000 for code in protocol.FATAL.values())
    assert ErrorCode.INVALID not in protocol.FATAL  # a bad frame does not end the conversation


def test_the_protocol_imports_without_django_or_the_control_plane() -> None:
    code = (
        "import sys, worker_agent.protocol; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'controlplane'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=DOC.parents[1]
    )
    assert out.stdout.strip() == "[]"
