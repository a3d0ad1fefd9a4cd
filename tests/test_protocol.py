"""The agent protocol: the documented examples parse, bad frames get their stable codes."""

from __future__ import annotations

import base64
import copy
import json
import random
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker_agent import protocol
from worker_agent.protocol import ErrorCode, ProtocolError

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
BLOCKS = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
AGENT_TYPES = {"hello", "heartbeat", "fault", "profile", "ack", "goodbye"}


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
    written = json.loads(protocol.encode(frame))
    if isinstance(data.get("plan"), dict):  # shown as an object, written packed
        written["plan"] = protocol.unpack_plan(written["plan"])
    assert written == data, "the example writes no default value"


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


BEAT: dict[str, Any] = {
    "type": "heartbeat",
    "seq": 1,
    "at": 1795000000.0,
    "step": 1,
    "devices": [{"device": 0, "state": "training"}],
}
FAULT: dict[str, Any] = {"type": "fault", "seq": 1, "at": 1.0, "kind": "crash", "devices": [0]}
ACK: dict[str, Any] = {"type": "ack", "command": "c", "ok": True, "at": 1.0}
PROFILE: dict[str, Any] = {
    "type": "profile", "seq": 1, "at": 1.0, "devices": [0], "micro_batches": 4,
    "modules": [{"name": "0", "fwd_s": 0.1, "bwd_s": 0.2, "update_s": 0.0, "m_p": 1.0,
                 "m_o": 2.0, "m_g": 1.0, "m_a": 3.0}],
}  # fmt: skip


def _set(frame: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``frame`` with the field at ``path`` (``devices.0.device``) set to ``value``."""
    out: dict[str, Any] = json.loads(json.dumps(frame))
    *parents, last = path.split(".")
    inner: Any = out
    for part in parents:
        inner = inner[int(part)] if part.isdigit() else inner[part]
    inner[int(last) if last.isdigit() else last] = value
    return out


# (frame, field, lowest allowed, highest allowed): every number an agent sends has a range
BOUNDED: list[tuple[dict[str, Any], str, float, float]] = [
    (BEAT, "seq", 0, protocol.MAX_SEQ),
    (BEAT, "at", 0, protocol.MAX_TIMESTAMP_S),
    (BEAT, "step", 0, protocol.MAX_STEP),
    (BEAT, "loss", -protocol.MAX_LOSS, protocol.MAX_LOSS),
    (BEAT, "samples_per_s", 0, protocol.MAX_RATE),
    (BEAT, "step_time_s", 0, protocol.MAX_DURATION_S),
    (BEAT, "devices.0.device", 0, protocol.MAX_DEVICE_ID),
    (BEAT, "devices.0.memory_bytes", 0, protocol.MAX_MEMORY_BYTES),
    (BEAT, "devices.0.utilization", 0, 1),
    (BEAT, "devices.0.pid", 1, protocol.MAX_PID),
    (FAULT, "seq", 0, protocol.MAX_SEQ),
    (FAULT, "at", 0, protocol.MAX_TIMESTAMP_S),
    (FAULT, "step", 0, protocol.MAX_STEP),
    (FAULT, "devices.0", 0, protocol.MAX_DEVICE_ID),
    (FAULT, "pid", 1, protocol.MAX_PID),
    (FAULT, "exit_code", -255, 255),
    (ACK, "at", 0, protocol.MAX_TIMESTAMP_S),
    (PROFILE, "seq", 0, protocol.MAX_SEQ),
    (PROFILE, "micro_batches", 1, protocol.MAX_MICRO_BATCHES),
    (PROFILE, "modules.0.fwd_s", 0, protocol.MAX_DURATION_S),
    (PROFILE, "modules.0.bwd_s", 0, protocol.MAX_DURATION_S),
    (PROFILE, "modules.0.update_s", 0, protocol.MAX_DURATION_S),
    (PROFILE, "modules.0.m_p", 0, protocol.MAX_MEMORY_BYTES),
    (PROFILE, "modules.0.m_a", 0, protocol.MAX_MEMORY_BYTES),
    (PROFILE, "boundary_bytes", 0, protocol.MAX_MEMORY_BYTES),
    (PROFILE, "sync_s", 0, protocol.MAX_DURATION_S),
    (PROFILE, "sync_members", 1, protocol.MAX_HOLDERS),
    (HELLO, "devices.0", 0, protocol.MAX_DEVICE_ID),
    (HELLO, "version", 0, protocol.MAX_SEQ),
]


def _beyond(low: float, high: float, integral: bool) -> st.SearchStrategy[float]:
    if integral:
        over = st.integers(min_value=int(high) + 1, max_value=10**40)
        return over | st.integers(max_value=int(low) - 1, min_value=-(10**40))
    above = st.floats(min_value=high, exclude_min=True, allow_infinity=False)
    below = st.floats(max_value=low, exclude_max=True, allow_infinity=False)
    return above | below


@pytest.mark.parametrize(("frame", "field", "low", "high"), BOUNDED)
@given(data=st.data())
def test_every_number_out_of_its_range_is_refused_naming_its_field(
    frame: dict[str, Any], field: str, low: float, high: float, data: st.DataObject
) -> None:
    integral = isinstance(high, int)
    inside = data.draw(
        st.integers(int(low), int(high)) if integral else st.floats(low, high), label="inside"
    )
    parsed = protocol.parse_agent_frame(json.dumps(_set(frame, field, inside)))
    assert protocol.parse_agent_frame(protocol.encode(parsed)) == parsed
    outside = data.draw(_beyond(low, high, integral), label="outside")
    error = refused(json.dumps(_set(frame, field, outside)))
    assert (error.code, error.field) == (ErrorCode.INVALID, field)


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (HELLO, "node"),
        (HELLO, "job"),
        (FAULT, "message"),
        ({**FAULT, "log": ["ok", "x"]}, "log.1"),
        (ACK, "command"),
        (HELLO, "agent"),
        (PROFILE, "modules.0.name"),
    ],
)
@given(control=st.characters(max_codepoint=31).filter(lambda c: c not in "\t\n\r"))
def test_text_with_a_control_character_is_refused(
    frame: dict[str, Any], field: str, control: str
) -> None:
    """A database refuses NUL in text: a node name or message carrying one would fail the
    write of a failure; refused where it enters instead."""
    error = refused(json.dumps(_set(frame, field, f"a{control}b")))
    assert (error.code, error.field) == (ErrorCode.INVALID, field)


@given(key=st.text(max_size=300), message=st.text(max_size=5000))
def test_an_error_frame_quoting_any_input_is_itself_valid(key: str, message: str) -> None:
    """The server's error frame names the field at fault, which may be the agent's own key."""
    frame = ProtocolError(ErrorCode.INVALID, message, field=key).frame(seq=3)
    assert protocol.parse_server_frame(protocol.encode(frame)) == frame


def test_a_faults_log_is_bounded_in_lines_and_in_their_length() -> None:
    most = ["x" * protocol.MAX_LOG_LINE] * protocol.MAX_LOG_LINES
    frame = protocol.parse_agent_frame(json.dumps({**FAULT, "log": most}))
    assert isinstance(frame, protocol.Fault) and frame.log == most
    assert refused(json.dumps({**FAULT, "log": [*most, "x"]})).field == "log"
    long = ["y" * (protocol.MAX_LOG_LINE + 1)]
    assert refused(json.dumps({**FAULT, "log": long})).field == "log.0"


@given(line=st.text(max_size=2 * protocol.MAX_LOG_LINE))
def test_any_line_a_process_writes_is_made_fit_for_a_fault(line: str) -> None:
    fitted = protocol.log_line(line)
    frame = protocol.parse_agent_frame(json.dumps({**FAULT, "log": [fitted]}))
    assert isinstance(frame, protocol.Fault) and frame.log == [fitted]
    plain = line.rstrip("\r\n")
    if len(plain) <= protocol.MAX_LOG_LINE and not re.search(
        r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", plain
    ):
        assert fitted == plain  # a printable line that fits is sent as it is


def test_a_heartbeat_reporting_a_device_twice_is_refused() -> None:
    twice = _set(BEAT, "devices", [{"device": 0, "state": "idle"}, {"device": 0, "state": "idle"}])
    assert (refused(json.dumps(twice)).field) == "devices"


PLANS = st.fixed_dictionaries(
    {"pipelines": st.lists(
        st.fixed_dictionaries({
            "stages": st.lists(st.fixed_dictionaries({
                "devices": st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4),
                "layers": st.tuples(st.integers(0, 99), st.integers(100, 200)).map(list),
            }, optional={"rerouted": st.just(True)}), min_size=1, max_size=4),
            "micro_batches": st.integers(1, 64),
        }), max_size=6)},
)  # fmt: skip


@given(PLANS)
def test_a_plan_packed_is_the_plan_and_a_command_carries_it_so(plan: dict[str, Any]) -> None:
    packed = protocol.pack_plan(plan)
    assert protocol.unpack_plan(packed) == plan
    command = protocol.Command(id="c1", action=protocol.Action.APPLY_PLAN, decision=1, plan=plan)
    written = json.loads(protocol.encode(command))
    assert isinstance(written["plan"], str) and written["plan"] == packed
    parsed = protocol.parse_server_frame(protocol.encode(command))
    assert isinstance(parsed, protocol.Command) and parsed.plan == plan


def rerouted_plan(pipelines: int, stages: int, lost: list[tuple[int, int]]) -> dict[str, Any]:
    """``pipelines`` × ``stages`` stages of one device each; each (pipeline, stage) of ``lost``
    rerouted onto its peers, as the rerouting policy writes it: the devices of the same layers'
    stages that are not rerouted, in pipeline order."""
    gone = set(lost)
    plan: dict[str, Any] = {"family": "rerouting", "pipelines": []}
    for p in range(pipelines):
        written = []
        for s in range(stages):
            stage: dict[str, Any] = {"devices": [p * stages + s], "layers": [s, s + 1]}
            if (p, s) in gone:
                peers = [q * stages + s for q in range(pipelines) if (q, s) not in gone]
                stage = {"devices": peers, "layers": [s, s + 1], "rerouted": True}
            written.append(stage)
        plan["pipelines"].append({"stages": written, "micro_batches": 4})
    return plan


def test_a_rerouted_stage_is_packed_without_its_peers_and_comes_back_with_them() -> None:
    plan = rerouted_plan(3, 2, [(1, 0)])
    assert plan["pipelines"][1]["stages"][0]["devices"] == [0, 4]
    inflated = json.loads(zlib.decompress(base64.b64decode(protocol.pack_plan(plan))))
    # in columns: the third stage (pipeline 1, stage 0) is rerouted onto its peers, no device
    assert inflated["rerouted"] == inflated["peers"] == [2]
    assert inflated["sizes"] == [1, 1, 0, 1, 1, 1]
    assert protocol.unpack_plan(protocol.pack_plan(plan)) == plan
    # borrowing other devices than its peers (another order, a subset): written as it is
    for devices in ([4, 0], [0]):
        other = copy.deepcopy(plan)
        other["pipelines"][1]["stages"][0]["devices"] = devices
        inflated = json.loads(zlib.decompress(base64.b64decode(protocol.pack_plan(other))))
        assert (inflated["peers"], inflated["sizes"][2]) == ([], len(devices))
        assert protocol.unpack_plan(protocol.pack_plan(other)) == other


def test_a_16384_device_plan_that_lost_eleven_nodes_fits_in_a_servers_frame() -> None:
    """PP 4 × DP 4,096, eleven nodes of 8 devices lost: 88 rerouted stages, each listing its
    4,000-odd peers. Written out they packed to 1.1 MB, past a server's frame."""
    lost = [(p, s) for p in range(4_096 - 22, 4_096) for s in range(4)]
    plan = rerouted_plan(4_096, 4, lost)
    assert len(lost) == 88
    whole = base64.b64encode(zlib.compress(json.dumps(plan).encode(), 6))
    assert len(whole) > protocol.MAX_SERVER_FRAME_BYTES
    command = protocol.Command(id="c1", action=protocol.Action.APPLY_PLAN, plan=plan)
    text = protocol.encode(command)
    assert len(text) < protocol.MAX_SERVER_FRAME_BYTES // 8
    parsed = protocol.parse_server_frame(text)
    assert isinstance(parsed, protocol.Command) and parsed.plan == plan


def test_a_16384_device_plan_packs_to_a_kilobyte_in_columns() -> None:
    """PP 4 × DP 4,096, one node of 8 devices lost and rerouted: as objects it packed to 60 kB,
    sent to each of 2,048 nodes (120 MB through one server); its columns count up."""
    plan = rerouted_plan(4_096, 4, [(p, s) for p in range(4_096 - 2, 4_096) for s in range(4)])
    packed = protocol.pack_plan(plan)
    assert len(packed) < 1_024
    whole = base64.b64encode(zlib.compress(json.dumps(plan, separators=(",", ":")).encode(), 6))
    assert len(whole) > 40 * len(packed)
    assert protocol.unpack_plan(packed) == plan


@given(PLANS, st.sampled_from(["plan", "pipeline", "stage"]))
def test_a_plan_with_a_field_the_columns_do_not_hold_is_packed_as_it_is(
    plan: dict[str, Any], where: str
) -> None:
    """Columns hold the plan format's fields; a plan with any other (a newer core's, a
    person's) is deflated as it is and comes back the same."""
    plan = copy.deepcopy(plan)
    if where == "plan" or not plan["pipelines"]:
        plan["note"] = "kept"
    elif where == "pipeline":
        plan["pipelines"][0]["note"] = "kept"
    else:
        plan["pipelines"][0]["stages"][0]["note"] = "kept"
    inflated = json.loads(zlib.decompress(base64.b64decode(protocol.pack_plan(plan))))
    assert "columns" not in inflated
    assert protocol.unpack_plan(protocol.pack_plan(plan)) == plan


COLUMN_FIELDS = ["columns", "family", "micro_batches", "stages", "sizes", "layers", "devices",
                 "rerouted", "peers", "other"]  # fmt: skip
COLUMN_VALUES = st.one_of(
    st.lists(st.integers(-3, 3), max_size=8),
    st.lists(st.one_of(st.integers(-3, 3), st.booleans(), st.text(max_size=2)), max_size=4),
    st.integers(-3, 3),
    st.text(max_size=3),
    st.none(),
)


@given(
    st.dictionaries(
        st.sampled_from(COLUMN_FIELDS),
        COLUMN_VALUES,
    )
)
def test_columns_that_do_not_agree_are_refused_as_a_plan_never_a_crash(
    columns: dict[str, Any],
) -> None:
    """Whatever a packed plan's columns say, the agent reads a plan or refuses it (``invalid``,
    field ``plan``); a plan it reads is one whose columns agree."""
    columns = {"columns": 1, **columns}
    text = base64.b64encode(zlib.compress(json.dumps(columns).encode())).decode()
    frame = {"type": "command", "id": "c1", "action": "apply_plan", "plan": text}
    try:
        parsed = protocol.parse_server_frame(json.dumps(frame))
    except ProtocolError as error:
        assert (error.code, error.field) == (ErrorCode.INVALID, "plan")
        return
    assert isinstance(parsed, protocol.Command) and parsed.plan is not None
    stages = [stage for p in parsed.plan["pipelines"] for stage in p["stages"]]
    assert len(stages) == len(columns["sizes"])
    assert [len(stage["devices"]) for stage in stages] == columns["sizes"]


def test_a_stage_borrowing_the_peers_of_layers_nobody_holds_is_refused_naming_the_plan() -> None:
    plan = {"pipelines": [{"stages": [{"devices": [], "layers": [0, 1], "rerouted": True,
                                       "peers": True}], "micro_batches": 1}]}  # fmt: skip
    text = base64.b64encode(zlib.compress(json.dumps(plan).encode())).decode()
    frame = {"type": "command", "id": "c1", "action": "apply_plan", "plan": text}
    error = refused_by_agent(json.dumps(frame))
    assert (error.code, error.field) == (ErrorCode.INVALID, "plan")


def test_a_plan_that_is_not_a_packed_object_is_refused_naming_the_plan() -> None:
    import base64
    import zlib

    def packed(data: bytes) -> str:
        return base64.b64encode(zlib.compress(data)).decode()

    bomb = zlib.compressobj()
    zeros = b'{"pipelines": [], "pad": "' + b"0" * protocol.MAX_PLAN_BYTES + b'"}'  # an object
    bombed = base64.b64encode(bomb.compress(zeros) + bomb.flush()).decode()
    assert len(bombed) < protocol.MAX_SERVER_FRAME_BYTES  # small packed, huge inflated
    junk = [
        "not base64 at all!",
        base64.b64encode(b"not deflated").decode(),
        packed(b"[1, 2]"),  # JSON, but no object
        packed(b"{cut"),
        base64.b64encode(zlib.compress(b'{"pipelines": []}')[:-4]).decode(),  # cut short
        bombed,
    ]
    for plan in junk:
        frame = {"type": "command", "id": "c1", "action": "apply_plan", "plan": plan}
        error = refused_by_agent(json.dumps(frame))
        assert (error.code, error.field) == (ErrorCode.INVALID, "plan"), plan[:40]


def test_a_servers_frame_may_be_a_mebibyte_an_agents_64_kib() -> None:
    # devices in no order: their differences do not deflate as a job's counting up does
    scattered = random.Random(0).sample(range(1 << 20), 50_000)
    plan = {"pipelines": [{"stages": [{"devices": [d], "layers": [0, 1]}], "micro_batches": 1}
                          for d in scattered]}  # fmt: skip
    command = protocol.Command(id="c1", action=protocol.Action.APPLY_PLAN, plan=plan)
    text = protocol.encode(command)
    assert protocol.MAX_FRAME_BYTES < len(text) < protocol.MAX_SERVER_FRAME_BYTES
    parsed = protocol.parse_server_frame(text)
    assert isinstance(parsed, protocol.Command) and parsed.plan == plan
    over = json.dumps(
        {"type": "welcome", "job": "j", "node": "x" * protocol.MAX_SERVER_FRAME_BYTES}
    )
    assert refused_by_agent(over).code == ErrorCode.OVERSIZED


def refused_by_agent(raw: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        protocol.parse_server_frame(raw)
    return caught.value
