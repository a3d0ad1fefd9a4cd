"""The agent protocol, version 1: every frame between an agent and the control plane.

One JSON object per websocket text message, with a ``type``. The agent speaks first (``hello``
with its job's token), the server answers ``welcome`` (or an ``error`` and a close), then the
agent streams ``heartbeat`` frames, reports ``fault`` frames the moment it sees one, and
acknowledges each ``command`` by its id with ``ack``; it says ``goodbye`` before it leaves. A
frame the server cannot take gets an ``error`` frame with a stable ``ErrorCode``, and the
connection stays open unless the error is one of ``FATAL`` (then it closes with that code's
``CLOSE_CODES`` entry). docs/protocol.md has an example of every frame.

This module is imported by the agent on training nodes and by the server: plain pydantic, no
Django, nothing of the control plane.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import json
import math
import re
import zlib
from enum import IntEnum, StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

VERSION = 1
# A frame larger than this is refused before it is parsed: an agent's, and the server's, whose
# commands carry a whole plan, deflated (one of 16,384 devices is 45 kB so, 0.7 MB as JSON).
MAX_FRAME_BYTES = 64 * 1024
MAX_SERVER_FRAME_BYTES = 1024 * 1024
# The most bytes a deflated plan may inflate to (a plan of over a million devices).
MAX_PLAN_BYTES = 64 * 1024 * 1024
# The most devices one agent reports on (a node of today's largest hosts, with room to spare).
MAX_DEVICES = 64
# The most devices an ``apply_plan``'s ``holders`` lists (a job's; the frame's size binds first).
MAX_HOLDERS = 1 << 16

# Every number a frame carries has a range, so that what one agent sends is stored, summed and
# shown without overflow and cannot stop another node's failure being recorded.
# A step: exact as a JSON number in a browser (2^53 - 1), with room to count on in a bigint.
MAX_STEP = (1 << 53) - 1
MAX_SEQ = (1 << 63) - 1  # a sequence number: a bigint
MAX_DEVICE_ID = (1 << 31) - 1  # a device id: the database's integer column
MAX_TIMESTAMP_S = 253_402_300_799.0  # 9999-12-31T23:59:59Z, the last second a date can hold
MAX_DURATION_S = 1e6  # a step time: eleven days
MAX_RATE = 1e12  # samples a second
MAX_LOSS = 1e12  # the magnitude of a loss
MAX_MEMORY_BYTES = float(1 << 60)  # 1 EiB
MAX_TEXT = 2000  # characters of a message for people
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_LOG_LINES = 20  # the lines of a rank's output a fault carries
MAX_LOG_LINE = 500  # characters of one of them
MAX_MODULES = 128  # the modules one profile measures (a frame's size binds first)
MAX_MICRO_BATCHES = 1 << 20  # a global batch, in micro-batches


class ErrorCode(StrEnum):
    """Why the server refused a frame; stable, keyed on by agents and tests."""

    MALFORMED = "malformed"  # not JSON, or not an object of a known type
    INVALID = "invalid"  # a known type with a field missing or of the wrong kind
    OVERSIZED = "oversized"  # over MAX_FRAME_BYTES
    UNSUPPORTED_VERSION = "unsupported_version"  # hello with a version the server does not speak
    UNAUTHORISED = "unauthorised"  # the token is unknown, revoked, or of another job
    UNKNOWN_NODE = "unknown_node"  # the job has no such node
    WRONG_DEVICES = "wrong_devices"  # devices that are not the node's
    OUT_OF_ORDER = "out_of_order"  # anything before hello, a second hello, an old sequence number
    UNKNOWN_COMMAND = "unknown_command"  # an ack for a command never sent to this agent
    REPLACED = "replaced"  # another connection took over the same node
    TIMEOUT = "timeout"  # no hello within the server's deadline


class CloseCode(IntEnum):
    """Websocket close codes (the 4000-4999 range is the application's)."""

    UNAUTHORISED = 4001
    PROTOCOL = 4002  # a frame the conversation cannot recover from
    REPLACED = 4003
    # the heartbeat deadline failed the node while this socket stayed open (a partition): its
    # agent connects again and says hello as a new member
    SILENT = 4004
    # "try again later" (IANA's 1013, in the application's range: Daphne's websocket library
    # sends no 1xxx code but 1000, and raised on 1013): the server holds too many sockets that
    # have not said hello; closed before any frame, so an agent connects again after its backoff
    BUSY = 4013


# Errors after which the server closes the socket, with the code to close it with.
FATAL: dict[ErrorCode, CloseCode] = {
    ErrorCode.UNSUPPORTED_VERSION: CloseCode.PROTOCOL,
    ErrorCode.UNAUTHORISED: CloseCode.UNAUTHORISED,
    ErrorCode.UNKNOWN_NODE: CloseCode.UNAUTHORISED,
    ErrorCode.WRONG_DEVICES: CloseCode.PROTOCOL,
    ErrorCode.REPLACED: CloseCode.REPLACED,
    ErrorCode.TIMEOUT: CloseCode.PROTOCOL,
}


class ProtocolError(Exception):
    """A frame refused: its code, a message for people, and the field at fault when known."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code}: {field + ': ' if field else ''}{message}")
        self.code, self.message, self.field = code, message, field

    def frame(self, *, seq: int | None = None) -> Error:
        """The ``error`` frame that tells the agent (a message or field that quotes the refused
        frame is cut to length and has its control characters escaped)."""
        field = None if self.field is None else _quotable(self.field, 200)
        return Error(
            code=self.code, message=_quotable(self.message, MAX_TEXT), field=field, seq=seq
        )


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _printable(text: str) -> str:
    # a database refuses NUL in text, and no name or message needs a control character
    if _CONTROL.search(text):
        raise ValueError("must not contain control characters")
    return text


def _quotable(text: str, limit: int) -> str:
    escaped = _CONTROL.sub(lambda found: ascii(found.group())[1:-1], text)
    return escaped if len(escaped) <= limit else escaped[: limit - 1] + "…"


Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_printable)]
CommandId = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_printable)]
ShortText = Annotated[str, Field(max_length=200), AfterValidator(_printable)]
Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_printable)]
Timestamp = Annotated[float, Field(ge=0, le=MAX_TIMESTAMP_S, allow_inf_nan=False)]  # Unix s
Duration = Annotated[float, Field(ge=0, le=MAX_DURATION_S, allow_inf_nan=False)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]
DeviceId = Annotated[int, Field(ge=0, le=MAX_DEVICE_ID)]
Devices = Annotated[list[DeviceId], Field(min_length=1, max_length=MAX_DEVICES)]
Pid = Annotated[int, Field(ge=1, le=MAX_PID)]
ExitCode = Annotated[int, Field(ge=-255, le=255)]  # negative: killed by that signal, as Popen's
LogLine = Annotated[str, Field(max_length=MAX_LOG_LINE), AfterValidator(_printable)]


def log_line(text: str) -> str:
    """One line of a process's output made fit for a frame's ``log``: its line ending dropped,
    control characters (a colour's escape) escaped, cut to ``MAX_LOG_LINE``."""
    return _quotable(text.rstrip("\r\n"), MAX_LOG_LINE)


# --- agent to server ---


class Hello(_Frame):
    """The first frame: who the agent is, for which job, and the token that proves it."""

    type: Literal["hello"] = "hello"
    version: Annotated[int, Field(ge=0, le=MAX_SEQ)] = VERSION
    job: Name
    node: Name
    token: Name
    devices: Devices
    agent: ShortText = ""  # the agent's version, for the logs

    @field_validator("devices")
    @classmethod
    def _distinct(cls, devices: list[int]) -> list[int]:
        if len(set(devices)) != len(devices):
            raise ValueError("lists a device twice")
        return devices


class DeviceState(StrEnum):
    TRAINING = "training"
    IDLE = "idle"  # a spare, or waiting for a plan
    PAUSED = "paused"  # stopped by a pause command
    RESTORING = "restoring"  # receiving weights for a new plan
    FAILED = "failed"


class DeviceReport(_Frame):
    device: DeviceId
    state: DeviceState
    memory_bytes: Annotated[float, Field(ge=0, le=MAX_MEMORY_BYTES, allow_inf_nan=False)] | None = (
        None
    )
    utilization: Annotated[float, Field(ge=0, le=1)] | None = None
    pid: Pid | None = None  # the process training on it, when there is one


class Heartbeat(_Frame):
    """Once a second: the node's training progress and every device's state."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: Seq
    at: Timestamp  # the agent's clock
    step: Step
    # NaN and infinite losses are faults, reported as such; here they are null.
    loss: Annotated[float, Field(ge=-MAX_LOSS, le=MAX_LOSS)] | None = None
    samples_per_s: Annotated[float, Field(ge=0, le=MAX_RATE, allow_inf_nan=False)] | None = None
    step_time_s: Duration | None = None
    devices: Annotated[list[DeviceReport], Field(min_length=1, max_length=MAX_DEVICES)]

    @field_validator("devices")
    @classmethod
    def _distinct(cls, devices: list[DeviceReport]) -> list[DeviceReport]:
        if len({report.device for report in devices}) != len(devices):
            raise ValueError("reports on a device twice")
        return devices

    @field_validator("loss")
    @classmethod
    def _finite(cls, loss: float | None) -> float | None:
        if loss is not None and not math.isfinite(loss):
            raise ValueError("must be finite (report a NaN or infinite loss as a fault)")
        return loss


class FaultKind(StrEnum):
    """What the agent saw; the same words as the core's failure kinds."""

    CRASH = "crash"  # a trainer process exited or was killed
    HANG = "hang"  # no step progress for k × the expected step time
    STRAGGLER = "straggler"  # step time over k × the median
    NAN = "nan"  # a NaN or infinite loss
    LINK = "link"
    NODE_LOST = "node_lost"


class Fault(_Frame):
    """A fault the agent detected itself, sent at once."""

    type: Literal["fault"] = "fault"
    seq: Seq
    at: Timestamp  # when the agent saw it
    kind: FaultKind
    devices: Devices
    step: Step | None = None
    message: Text = ""
    # the one process at fault, where there is one (the reference agent: a crashed or hung rank)
    pid: Pid | None = None
    exit_code: ExitCode | None = None  # how it exited: its code, or minus the killing signal
    log: Annotated[list[LogLine], Field(max_length=MAX_LOG_LINES)] | None = (
        None  # its stderr's last lines
    )


Bytes = Annotated[float, Field(ge=0, le=MAX_MEMORY_BYTES, allow_inf_nan=False)]


class ModuleCost(_Frame):
    """One top-level module of a training script, measured by its rank (one micro-batch)."""

    name: ShortText
    fwd_s: Duration
    bwd_s: Duration
    update_s: Duration  # its share of the optimizer's step
    m_p: Bytes  # parameters
    m_o: Bytes  # optimizer state
    m_g: Bytes  # gradients
    m_a: Bytes  # what autograd saves for its backward


class Profile(_Frame):
    """A training script's own measurement (``worker_agent.elastic``): each top-level module's
    cost, the global batch and the gradients' synchronisation; the job's scenario is made from
    it (docs/scenario.md, "Measured by the script")."""

    type: Literal["profile"] = "profile"
    seq: Seq
    at: Timestamp
    devices: Devices  # the ranks that measured it
    modules: Annotated[list[ModuleCost], Field(min_length=1, max_length=MAX_MODULES)]
    micro_batches: Annotated[int, Field(ge=1, le=MAX_MICRO_BATCHES)]  # the global batch's
    boundary_bytes: Bytes | None = None  # the largest activation a module hands the next
    # one gradient all-reduce: its bytes, seconds and members (ring: 2(k−1)/k of the bytes)
    sync_bytes: Bytes | None = None
    sync_s: Duration | None = None
    sync_members: Annotated[int, Field(ge=1, le=MAX_HOLDERS)] | None = None


class Ack(_Frame):
    """The outcome of one command, by its id."""

    type: Literal["ack"] = "ack"
    command: CommandId
    ok: bool
    at: Timestamp
    error: Error | None = None


class Goodbye(_Frame):
    """The agent leaves on purpose: no failure is raised for its devices."""

    type: Literal["goodbye"] = "goodbye"
    reason: Annotated[str, Field(max_length=500), AfterValidator(_printable)] = ""


# --- server to agent ---


class Welcome(_Frame):
    type: Literal["welcome"] = "welcome"
    version: int = VERSION
    job: str
    node: str
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=3600)]
    # the server declares a node failed after this many intervals without a heartbeat
    missed_beats: Annotated[int, Field(ge=1, le=1000)]
    server_time: Timestamp


class Action(StrEnum):
    PAUSE = "pause"
    APPLY_PLAN = "apply_plan"  # the plan in the core's codec format
    RESTORE = "restore"  # receive or send layer weights as the plan's transfers say
    RESUME = "resume"
    STOP = "stop"
    INJECT = "inject"  # a drill: inject the fault ``inject`` names into one of the node's ranks


class InjectKind(StrEnum):
    """The faults a drill injects (``worker_agent.faults``)."""

    KILL = "kill"  # SIGKILL the rank: a crash
    HANG = "hang"  # SIGSTOP the rank (continued after ``seconds``, if given)
    SLOW = "slow"  # stop and continue it in a duty cycle for ``seconds``: a straggler
    NAN = "nan"  # its next loss is NaN
    DROP = "drop"  # the agent aborts its websocket (no close frame) and connects again


MAX_INJECT_SECONDS = 600.0


class Injection(_Frame):
    """What an ``inject`` command injects: a kind, the device whose rank takes it (every kind but
    ``drop``, which is the agent's own), how long (``hang``, ``slow``), and for ``slow`` the
    share of each 0.1 s the rank is stopped."""

    kind: InjectKind
    device: DeviceId | None = None
    seconds: Annotated[float, Field(gt=0, le=MAX_INJECT_SECONDS)] | None = None
    stopped_fraction: Annotated[float, Field(gt=0, lt=1)] | None = None

    @model_validator(mode="after")
    def _device_named(self) -> Injection:
        if self.kind is not InjectKind.DROP and self.device is None:
            raise ValueError(f"{self.kind.value} needs the device whose rank takes it")
        return self


class RestoreMode(StrEnum):
    """Where an ``apply_plan``'s layers that no live device holds come from."""

    PEERS = "peers"  # a live holder under the previous plan (the default)
    NEIGHBOURS = "neighbours"  # CheckFree: the neighbouring stages' weighted average
    NEIGHBOURS_PLUS = "neighbours_plus"  # CheckFree+: edge stages from their swap partners
    CHECKPOINT = "checkpoint"  # every device reloads the newest complete checkpoint


def pack_plan(plan: dict[str, Any]) -> str:
    """A plan as a command carries it: its JSON deflated (zlib), in base64, each rerouted stage
    that borrows exactly its peers (``_peers``) written ``"devices": [], "peers": true``, and
    the plan in columns (``_columns``) when it has only the plan format's fields.

    A rerouted stage lists every live replica it borrows: after ten nodes of a 16,384-device job
    were lost, 88 rerouted stages listed 358,512 devices, and the plan packed to 1.1 MB, past a
    server frame, where it packs to 60 kB without them; in columns, to 0.6 kB."""
    text = json.dumps(_columns(_peers_left_out(plan)), separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(text, 6)).decode("ascii")


COLUMNS = 1  # the columns' format, in the field that marks a plan packed in columns
_STAGE_FIELDS = frozenset({"devices", "layers", "rerouted", "peers"})
_COLUMN_FIELDS = frozenset(
    {"columns", "family", "micro_batches", "stages", "sizes", "layers", "devices", "rerouted",
     "peers"}
)  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _columns(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as columns: each pipeline's micro-batches and number of stages, each stage's
    number of devices, its layers and its devices as differences from the number before, and
    which stages are rerouted or borrow their peers. Stages are alike and their devices count
    up, so the columns deflate to a hundredth of the plan's objects (16,384 devices: 0.6 kB
    against 60 kB). A plan with any other field, or a value of another type, is kept as it is."""
    pipelines = plan.get("pipelines")
    if not set(plan) <= {"family", "pipelines"} or not isinstance(pipelines, list):
        return plan
    micro, counts, sizes, layers, devices, rerouted, peers = [], [], [], [], [], [], []
    index = 0
    for pipeline in pipelines:
        if not isinstance(pipeline, dict) or set(pipeline) != {"stages", "micro_batches"}:
            return plan
        stages = pipeline["stages"]
        if not _is_int(pipeline["micro_batches"]) or not isinstance(stages, list):
            return plan
        micro.append(pipeline["micro_batches"])
        counts.append(len(stages))
        for stage in stages:
            if (
                not isinstance(stage, dict)
                or not {"devices", "layers"} <= set(stage) <= _STAGE_FIELDS
                or not isinstance(stage["devices"], list)
                or not all(map(_is_int, stage["devices"]))
                or not isinstance(stage["layers"], list)
                or len(stage["layers"]) != 2
                or not all(map(_is_int, stage["layers"]))
                or stage.get("rerouted", True) is not True
                or stage.get("peers", True) is not True
            ):
                return plan
            sizes.append(len(stage["devices"]))
            layers.extend(stage["layers"])
            devices.extend(stage["devices"])
            if "rerouted" in stage:
                rerouted.append(index)
            if "peers" in stage:
                peers.append(index)
            index += 1
    out: dict[str, Any] = {"columns": COLUMNS}
    if "family" in plan:
        out["family"] = plan["family"]
    out.update(micro_batches=micro, stages=counts, sizes=sizes, layers=_differences(layers),
               devices=_differences(devices), rerouted=rerouted, peers=peers)  # fmt: skip
    return out


def _differences(values: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise([0, *values])]


def _from_columns(packed: dict[str, Any]) -> dict[str, Any]:
    """``_columns`` undone; ValueError for columns that do not agree with each other."""
    try:
        micro, counts, sizes = packed["micro_batches"], packed["stages"], packed["sizes"]
        layers = list(itertools.accumulate(packed["layers"]))
        devices = list(itertools.accumulate(packed["devices"]))
        rerouted, peers = set(packed["rerouted"]), set(packed["peers"])
        if (
            packed["columns"] != COLUMNS
            or not set(packed) <= _COLUMN_FIELDS
            or len(micro) != len(counts)
            or sum(counts) != len(sizes)
            or len(layers) != 2 * len(sizes)
            or sum(sizes) != len(devices)
            or min(counts, default=0) < 0
            or min(sizes, default=0) < 0
            or not all(map(_is_int, [*micro, *counts, *sizes, *layers, *devices]))
            or not (rerouted | peers) <= set(range(len(sizes)))
        ):
            raise ValueError("its columns do not agree")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"its columns do not agree: {exc}") from None
    pipelines, stage, first = [], 0, 0
    for micro_batches, count in zip(micro, counts, strict=True):
        stages = []
        for index in range(stage, stage + count):
            built: dict[str, Any] = {
                "devices": devices[first : first + sizes[index]],
                "layers": layers[2 * index : 2 * index + 2],
            }
            if index in rerouted:
                built["rerouted"] = True
            if index in peers:
                built["peers"] = True
            stages.append(built)
            first += sizes[index]
        stage += count
        pipelines.append({"stages": stages, "micro_batches": micro_batches})
    plan: dict[str, Any] = {"pipelines": pipelines}
    if "family" in packed:
        plan = {"family": packed["family"], **plan}
    return plan


def _peers(pipelines: list[Any]) -> dict[tuple[Any, ...], list[Any]]:
    """Each layer range's peers: the devices of the stages of that range that are not rerouted,
    in pipeline order; what the rerouting policy gives a rerouted stage of that range."""
    peers: dict[tuple[Any, ...], list[Any]] = {}
    for pipeline in pipelines:
        for stage in pipeline.get("stages", ()):
            if not stage.get("rerouted"):
                peers.setdefault(tuple(stage["layers"]), []).extend(stage["devices"])
    return peers


def _peers_left_out(plan: dict[str, Any]) -> dict[str, Any]:
    pipelines = plan.get("pipelines")
    if not isinstance(pipelines, list) or not any(
        stage.get("rerouted") for p in pipelines for stage in p.get("stages", ())
    ):
        return plan
    peers = _peers(pipelines)

    def packed(stage: dict[str, Any]) -> dict[str, Any]:
        if stage.get("rerouted") and stage["devices"] == peers.get(tuple(stage["layers"])):
            return {**stage, "devices": [], "peers": True}
        return stage

    return {
        **plan,
        "pipelines": [
            {**p, "stages": [packed(stage) for stage in p.get("stages", ())]} for p in pipelines
        ],
    }


def _peers_put_back(plan: dict[str, Any]) -> dict[str, Any]:
    """``_peers_left_out`` undone; ValueError for a stage marked so whose layers no stage that is
    not rerouted holds."""
    pipelines = plan.get("pipelines")
    if not isinstance(pipelines, list):
        return plan
    marked = [
        stage
        for p in pipelines
        if isinstance(p, dict) and isinstance(p.get("stages"), list)
        for stage in p["stages"]
        if isinstance(stage, dict) and stage.get("peers") is True
    ]
    if not marked:
        return plan
    try:
        peers = _peers(pipelines)
        for stage in marked:
            del stage["peers"]
            stage["devices"] = list(peers[tuple(stage["layers"])])
    except (KeyError, TypeError, AttributeError):
        raise ValueError(
            "a stage marked to borrow its peers: no stage that is not rerouted holds its layers"
        ) from None
    return plan


@functools.lru_cache(maxsize=8)
def unpack_plan(packed: str) -> dict[str, Any]:
    """The plan ``pack_plan`` packed; ValueError if it is not one. The same text gives the same
    object (a process simulating a thousand nodes inflates each plan once): never change it."""
    try:
        inflater = zlib.decompressobj()
        text = inflater.decompress(base64.b64decode(packed, validate=True), MAX_PLAN_BYTES)
        if not inflater.eof:
            raise ValueError(f"it inflates to over {MAX_PLAN_BYTES} bytes, or is cut short")
        plan = json.loads(text)
    except (binascii.Error, zlib.error, UnicodeDecodeError) as exc:
        raise ValueError(f"not a deflated plan: {exc}") from None
    if not isinstance(plan, dict):
        raise ValueError("a plan is a JSON object")
    if "columns" in plan:
        plan = _from_columns(plan)
    return _peers_put_back(plan)


# A plan: a JSON object on the wire from an older server or a person, else ``pack_plan``'s text.
Plan = Annotated[
    dict[str, Any],
    BeforeValidator(lambda value: unpack_plan(value) if isinstance(value, str) else value),
    PlainSerializer(pack_plan, when_used="json"),
]


class Command(_Frame):
    type: Literal["command"] = "command"
    id: CommandId
    action: Action
    decision: Annotated[int, Field(ge=1, le=MAX_SEQ)] | None = None
    plan: Plan | None = None
    step: Step | None = None  # resume from this step
    restore: RestoreMode | None = None  # apply_plan only; None: from peers
    # apply_plan only: the previous plan's devices that are alive, when the new plan leaves
    # some of them out; each may send the layers it holds (then it idles). None: the devices
    # of both plans are the holders asked.
    holders: Annotated[list[DeviceId], Field(min_length=1, max_length=MAX_HOLDERS)] | None = None
    inject: Annotated[Injection | None, Field(validate_default=True)] = None  # inject only

    @field_validator("inject")
    @classmethod
    def _inject_carries_its_fault(
        cls, inject: Injection | None, info: ValidationInfo
    ) -> Injection | None:
        if (info.data.get("action") is Action.INJECT) != (inject is not None):
            raise ValueError("inject, and only inject, carries the fault to inject")
        return inject

    @field_validator("holders")
    @classmethod
    def _distinct_holders(cls, holders: list[int] | None) -> list[int] | None:
        if holders is not None and len(set(holders)) != len(holders):
            raise ValueError("lists a device twice")
        return holders


class Error(_Frame):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: Text
    field: ShortText | None = None
    seq: Seq | None = None  # the refused frame's sequence number, when it had one


Ack.model_rebuild()

AgentFrame = Annotated[
    Hello | Heartbeat | Fault | Profile | Ack | Goodbye, Field(discriminator="type")
]
ServerFrame = Annotated[Welcome | Command | Error, Field(discriminator="type")]
_AGENT = TypeAdapter[Hello | Heartbeat | Fault | Profile | Ack | Goodbye](AgentFrame)
_SERVER = TypeAdapter[Welcome | Command | Error](ServerFrame)


def _check_size(raw: str | bytes, limit: int = MAX_FRAME_BYTES) -> None:
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > limit:
        raise ProtocolError(ErrorCode.OVERSIZED, f"{size} bytes is over the limit of {limit}")


def _refused(exc: ValidationError) -> ProtocolError:
    first = exc.errors()[0]
    location = [str(part) for part in first["loc"]]
    if not first["loc"]:  # not JSON, not an object, or no known type: nothing to name
        return ProtocolError(ErrorCode.MALFORMED, first["msg"])
    # the first part is the frame type the union chose; the rest is the field inside it
    field = ".".join(location[1:]) or None
    return ProtocolError(ErrorCode.INVALID, first["msg"], field=field)


def parse_agent_frame(raw: str | bytes) -> Hello | Heartbeat | Fault | Profile | Ack | Goodbye:
    """An agent's frame, validated; ``ProtocolError`` says why not."""
    _check_size(raw)
    try:
        return _AGENT.validate_json(raw)
    except ValidationError as exc:
        raise _refused(exc) from None


def parse_server_frame(raw: str | bytes) -> Welcome | Command | Error:
    """A server's frame, validated (the agent's side); ``ProtocolError`` says why not."""
    _check_size(raw, MAX_SERVER_FRAME_BYTES)
    try:
        return _SERVER.validate_json(raw)
    except ValidationError as exc:
        raise _refused(exc) from None


def plan_devices(plan: Any) -> set[int]:
    """Every device a plan (the core's plan dict, as ``apply_plan`` carries it and a job keeps
    it) runs a stage on; none for anything that is not a plan."""
    if not isinstance(plan, dict):
        return set()
    return {d for p in plan.get("pipelines", ()) for s in p["stages"] for d in s["devices"]}


def encode(frame: _Frame) -> str:
    """A frame as the JSON text sent on the socket (fields left at None are left out)."""
    return frame.model_dump_json(exclude_none=True)
