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

import math
from enum import IntEnum, StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

VERSION = 1
# A frame larger than this is refused before it is parsed.
MAX_FRAME_BYTES = 64 * 1024
# The most devices one agent reports on (a node of today's largest hosts, with room to spare).
MAX_DEVICES = 64
# The most devices an ``apply_plan``'s ``holders`` lists (a job's; the frame's size binds first).
MAX_HOLDERS = 1 << 16


class ErrorCode(StrEnum):
    """Why the server refused a frame; stable, keyed on by agents and tests."""

    MALFORMED = "malformed"  # not JSON, or not an object of a known type
    INVALID = "invalid"  # a known type with a field missing or of the wrong kind
    OVERSIZED = "oversized"  # over MAX_FRAME_BYTES
    UNSUPPORTED_VERSION = "unsupported_version"  # hello with a version the server does not speak
    UNAUTHORISED = "unauthorised"  # the token is unknown, revoked, or of another job
    UNKNOWN_JOB = "unknown_job"
    UNKNOWN_NODE = "unknown_node"  # the job has no such node
    WRONG_DEVICES = "wrong_devices"  # devices that are not the node's
    OUT_OF_ORDER = "out_of_order"  # anything before hello, a second hello, an old sequence number
    UNKNOWN_COMMAND = "unknown_command"  # an ack for a command never sent to this agent
    REPLACED = "replaced"  # another connection took over the same node


class CloseCode(IntEnum):
    """Websocket close codes (the 4000-4999 range is the application's)."""

    UNAUTHORISED = 4001
    PROTOCOL = 4002  # a frame the conversation cannot recover from
    REPLACED = 4003


# Errors after which the server closes the socket, with the code to close it with.
FATAL: dict[ErrorCode, CloseCode] = {
    ErrorCode.UNSUPPORTED_VERSION: CloseCode.PROTOCOL,
    ErrorCode.UNAUTHORISED: CloseCode.UNAUTHORISED,
    ErrorCode.UNKNOWN_JOB: CloseCode.UNAUTHORISED,
    ErrorCode.UNKNOWN_NODE: CloseCode.UNAUTHORISED,
    ErrorCode.WRONG_DEVICES: CloseCode.PROTOCOL,
    ErrorCode.REPLACED: CloseCode.REPLACED,
}


class ProtocolError(Exception):
    """A frame refused: its code, a message for people, and the field at fault when known."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code}: {field + ': ' if field else ''}{message}")
        self.code, self.message, self.field = code, message, field

    def frame(self, *, seq: int | None = None) -> Error:
        """The ``error`` frame that tells the agent."""
        return Error(code=self.code, message=self.message, field=self.field, seq=seq)


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
DeviceId = Annotated[int, Field(ge=0)]
Devices = Annotated[list[DeviceId], Field(min_length=1, max_length=MAX_DEVICES)]


# --- agent to server ---


class Hello(_Frame):
    """The first frame: who the agent is, for which job, and the token that proves it."""

    type: Literal["hello"] = "hello"
    version: int = VERSION
    job: Annotated[str, Field(min_length=1, max_length=200)]
    node: Annotated[str, Field(min_length=1, max_length=200)]
    token: Annotated[str, Field(min_length=1, max_length=200)]
    devices: Devices
    agent: str = ""  # the agent's version, for the logs

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
    memory_bytes: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    utilization: Annotated[float, Field(ge=0, le=1)] | None = None


class Heartbeat(_Frame):
    """Once a second: the node's training progress and every device's state."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: Annotated[int, Field(ge=0)]
    at: Seconds  # the agent's clock, Unix seconds
    step: Annotated[int, Field(ge=0)]
    # NaN and infinite losses are faults, reported as such; here they are null.
    loss: float | None = None
    samples_per_s: Seconds | None = None
    step_time_s: Seconds | None = None
    devices: Annotated[list[DeviceReport], Field(min_length=1, max_length=MAX_DEVICES)]

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
    seq: Annotated[int, Field(ge=0)]
    at: Seconds  # when the agent saw it
    kind: FaultKind
    devices: Devices
    step: Annotated[int, Field(ge=0)] | None = None
    message: Annotated[str, Field(max_length=2000)] = ""


class Ack(_Frame):
    """The outcome of one command, by its id."""

    type: Literal["ack"] = "ack"
    command: Annotated[str, Field(min_length=1, max_length=100)]
    ok: bool
    at: Seconds
    error: Error | None = None


class Goodbye(_Frame):
    """The agent leaves on purpose: no failure is raised for its devices."""

    type: Literal["goodbye"] = "goodbye"
    reason: Annotated[str, Field(max_length=500)] = ""


# --- server to agent ---


class Welcome(_Frame):
    type: Literal["welcome"] = "welcome"
    version: int = VERSION
    job: str
    node: str
    heartbeat_interval_s: Annotated[float, Field(gt=0)]
    # the server declares a node failed after this many intervals without a heartbeat
    missed_beats: Annotated[int, Field(ge=1)]
    server_time: Seconds


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


class Command(_Frame):
    type: Literal["command"] = "command"
    id: Annotated[str, Field(min_length=1, max_length=100)]
    action: Action
    decision: int | None = None
    plan: dict[str, Any] | None = None
    step: Annotated[int, Field(ge=0)] | None = None  # resume from this step
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
    message: str
    field: str | None = None
    seq: int | None = None  # the refused frame's sequence number, when it had one


Ack.model_rebuild()

AgentFrame = Annotated[Hello | Heartbeat | Fault | Ack | Goodbye, Field(discriminator="type")]
ServerFrame = Annotated[Welcome | Command | Error, Field(discriminator="type")]
_AGENT = TypeAdapter[Hello | Heartbeat | Fault | Ack | Goodbye](AgentFrame)
_SERVER = TypeAdapter[Welcome | Command | Error](ServerFrame)


def _check_size(raw: str | bytes) -> None:
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(
            ErrorCode.OVERSIZED, f"{size} bytes is over the limit of {MAX_FRAME_BYTES}"
        )


def _refused(exc: ValidationError) -> ProtocolError:
    first = exc.errors()[0]
    location = [str(part) for part in first["loc"]]
    if not first["loc"]:  # not JSON, not an object, or no known type: nothing to name
        return ProtocolError(ErrorCode.MALFORMED, first["msg"])
    # the first part is the frame type the union chose; the rest is the field inside it
    field = ".".join(location[1:]) or None
    return ProtocolError(ErrorCode.INVALID, first["msg"], field=field)


def parse_agent_frame(raw: str | bytes) -> Hello | Heartbeat | Fault | Ack | Goodbye:
    """An agent's frame, validated; ``ProtocolError`` says why not."""
    _check_size(raw)
    try:
        return _AGENT.validate_json(raw)
    except ValidationError as exc:
        raise _refused(exc) from None


def parse_server_frame(raw: str | bytes) -> Welcome | Command | Error:
    """A server's frame, validated (the agent's side); ``ProtocolError`` says why not."""
    _check_size(raw)
    try:
        return _SERVER.validate_json(raw)
    except ValidationError as exc:
        raise _refused(exc) from None


def encode(frame: _Frame) -> str:
    """A frame as the JSON text sent on the socket (fields left at None are left out)."""
    return frame.model_dump_json(exclude_none=True)
