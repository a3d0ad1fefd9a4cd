"""The link between the agent and each trainer process it starts, and the trainer's side of it.

The agent makes a ``socket.socketpair()`` per trainer process (a *rank*) and passes one end to
the child (``pass_fds``), its number in ``PITSTOP_LINK_FD``. Both sides write JSON lines: one
object per line, each with a key ``"t"`` (its type). A line that is not such an object is
logged and skipped; the end of the stream means the other side is gone.

rank → agent::

    {"t": "hello", "device": 3, "pid": 4242}
    {"t": "step", "step": 120, "loss": 2.31, "step_time_s": 0.41, "samples": 8,
     "memory_bytes": 5.2e10}                          # after every optimizer step
    {"t": "state", "state": "training"}               # training | idle | paused | restoring
    {"t": "fault", "kind": "nan", "message": "..."}   # a fault the trainer saw itself
    {"t": "done", "command": "d17-apply", "ok": false,
     "error": {"code": "invalid", "message": "...", "field": "plan"}}  # error: null when ok

agent → rank::

    {"t": "command", "id": "d17-apply", "action": "apply_plan", "plan": {...}, "step": null,
     "generation": "d17/", "restore": null, "holders": [0, 1, 5]}
                                                      # pause | apply_plan | restore | resume | stop
    {"t": "inject", "kind": "nan"}                    # a fault injected for a drill

Every child is also given ``PITSTOP_DEVICE`` (its device, the rank's identity), ``PITSTOP_NODE``,
``PITSTOP_STORE`` (``host:port`` of the job's ``torch.distributed.TCPStore``, when the agent has
one) and ``PITSTOP_GENERATION`` (the key prefix of the current plan's process groups: ``d0/`` at
the start, ``dN/`` once decision N's plan is applied; the agent sets ``<generation>abort`` in
the store when a rank dies or hangs, so the others leave their collectives).

A training loop uses ``TrainerLink``; without an agent (no ``PITSTOP_LINK_FD``) every call does
nothing, so the same script runs alone::

    link = TrainerLink.from_env()
    link.set_state("training")
    for step in range(first, last):
        started = time.monotonic()
        loss = train_one_step()
        if link.injected("nan"):
            loss = float("nan")
        link.report_step(step, loss, time.monotonic() - started, samples=batch)
        command = link.poll_command(0)
        if command is not None:
            ...  # pause, apply command.plan under command.generation, resume at command.step
            link.done(command.id, ok=True)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import queue
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

log = logging.getLogger("worker_agent.link")

FD_VARIABLE = "PITSTOP_LINK_FD"
# A longer line is refused (a plan travels in one line; the server's frames are at most 64 KiB).
MAX_LINE_BYTES = 1024 * 1024

STATES = ("training", "idle", "paused", "restoring")
# Seconds between a rank's ``alive`` pulses (``AliveMessage``).
PULSE_S = 0.25
ACTIONS = ("pause", "apply_plan", "restore", "resume", "stop")
FAULT_KINDS = ("crash", "hang", "straggler", "nan", "link", "node_lost")


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class HelloMessage(_Message):
    t: Literal["hello"] = "hello"
    device: Annotated[int, Field(ge=0)]
    pid: Annotated[int, Field(ge=1)]


class StepMessage(_Message):
    t: Literal["step"] = "step"
    step: Annotated[int, Field(ge=0)]
    loss: float | None = None  # NaN and infinite losses are allowed here: the agent reports them
    step_time_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    samples: Annotated[int, Field(ge=0)] = 0
    memory_bytes: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


class AliveMessage(_Message):
    """Sent by the link's own thread every ``PULSE_S``: the process runs, whatever its training
    loop is waiting for. A rank stopped (SIGSTOP) or frozen holding the interpreter falls
    silent; one waiting in a collective for a stopped peer does not."""

    t: Literal["alive"] = "alive"


class StateMessage(_Message):
    t: Literal["state"] = "state"
    state: Literal["training", "idle", "paused", "restoring"]


class FaultMessage(_Message):
    t: Literal["fault"] = "fault"
    kind: Literal["crash", "hang", "straggler", "nan", "link", "node_lost"]
    message: Annotated[str, Field(max_length=2000)] = ""


class ProfileMessage(_Message):
    """The script's own measurement (``worker_agent.elastic``): the protocol's ``profile``
    frame's fields but its sequence number, time and devices, which the agent adds."""

    t: Literal["profile"] = "profile"
    modules: list[dict[str, Any]]
    micro_batches: Annotated[int, Field(ge=1)]
    boundary_bytes: float | None = None
    sync_bytes: float | None = None
    sync_s: float | None = None
    sync_members: int | None = None


class LinkError(_Message):
    """Why a rank could not carry out a command (the protocol's error codes)."""

    code: str = "invalid"
    message: str = ""
    field: str | None = None


class DoneMessage(_Message):
    t: Literal["done"] = "done"
    command: Annotated[str, Field(min_length=1)]
    ok: bool
    error: LinkError | None = None


# What a rank is asked to do (the agent does ``inject`` itself).
RankAction = Literal["pause", "apply_plan", "restore", "resume", "stop"]


class CommandMessage(_Message):
    """A command for the rank: what the control plane asked of its node."""

    t: Literal["command"] = "command"
    id: Annotated[str, Field(min_length=1)]
    action: RankAction
    plan: dict[str, Any] | None = None
    step: Annotated[int, Field(ge=0)] | None = None
    generation: str
    # where layers no device holds come from (``protocol.RestoreMode``); None: from peers. Any
    # string passes here so that the rank, not the link, refuses a mode it does not know.
    restore: str | None = None
    # the previous plan's live devices that may send layers (``protocol.Command.holders``);
    # None: the devices of both plans
    holders: list[int] | None = None


class InjectMessage(_Message):
    t: Literal["inject"] = "inject"
    kind: Literal["nan"]


RankMessage = (
    HelloMessage
    | StepMessage
    | StateMessage
    | FaultMessage
    | ProfileMessage
    | DoneMessage
    | AliveMessage
)
AgentMessage = CommandMessage | InjectMessage
_RANK = TypeAdapter[RankMessage](Annotated[RankMessage, Field(discriminator="t")])
_AGENT = TypeAdapter[AgentMessage](Annotated[AgentMessage, Field(discriminator="t")])


def encode(message: _Message) -> bytes:
    """One message as its line (NaN and infinities written as JSON's common extension)."""
    return json.dumps(message.model_dump(mode="python"), separators=(",", ":")).encode() + b"\n"


def _decode(adapter: TypeAdapter[Any], line: bytes, side: str) -> Any:
    if len(line) > MAX_LINE_BYTES:
        log.warning("link: a %d-byte line from the %s skipped (over the limit)", len(line), side)
        return None
    try:
        return adapter.validate_python(json.loads(line))
    except (ValueError, ValidationError) as exc:  # not JSON, or not a message we know
        log.warning("link: a broken line from the %s skipped: %.200r (%s)", side, line, exc)
        return None


def decode_from_rank(line: bytes) -> RankMessage | None:
    """A rank's line as its message; None (and a log line) for a line that is not one."""
    message: RankMessage | None = _decode(_RANK, line, "rank")
    return message


def decode_from_agent(line: bytes) -> AgentMessage | None:
    """The agent's line as its message; None (and a log line) for a line that is not one."""
    message: AgentMessage | None = _decode(_AGENT, line, "agent")
    return message


class AgentEnd:
    """The agent's end of one rank's link: an asyncio stream over its half of the pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    def pair(cls) -> tuple[AgentEnd, socket.socket]:
        """A new link: the agent's end, and the child's socket to pass to the rank."""
        parent, child = socket.socketpair()
        return cls(parent), child

    async def open(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=self.sock, limit=MAX_LINE_BYTES + 1
        )

    async def messages(self) -> AsyncIterator[RankMessage]:
        """The rank's messages as they come; the iteration ends when the rank's end closes
        (the process exited, or closed its link)."""
        assert self._reader is not None, "open() first"
        while True:
            try:
                line = await self._reader.readline()
            except ValueError:  # over the limit: the line is dropped from the buffer
                log.warning("link: a line from the rank over %d bytes skipped", MAX_LINE_BYTES)
                continue
            except OSError:
                return
            if not line:
                return
            if not line.endswith(b"\n"):  # the rank's last words, cut short by its end
                log.warning("link: an unfinished line from the rank skipped: %.200r", line)
                return
            message = decode_from_rank(line)
            if message is not None:
                yield message

    def send(self, message: _Message) -> bool:
        """Write one message (buffered, never blocking); False when the rank's end is gone."""
        if self._writer is None or self._writer.is_closing():
            return False
        try:
            self._writer.write(encode(message))
        except (OSError, RuntimeError):
            return False
        return True

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self.sock.close()


def child_environment(
    *, fd: int, device: int, node: str, generation: str, store: str | None
) -> dict[str, str]:
    """The variables a rank is started with (on top of the agent's own environment)."""
    env = {
        FD_VARIABLE: str(fd),
        "PITSTOP_DEVICE": str(device),
        "PITSTOP_NODE": node,
        "PITSTOP_GENERATION": generation,
    }
    if store:
        env["PITSTOP_STORE"] = store
    return env


class TrainerLink:
    """The trainer's side: report steps, states and faults; take commands; say when done.

    Synchronous and thread-safe. A background thread reads the agent's lines into a queue, so
    ``poll_command`` never blocks a training step longer than its timeout. Without an agent
    (``PITSTOP_LINK_FD`` unset) the link is inactive and every call does nothing.
    """

    def __init__(
        self,
        sock: socket.socket | None,
        *,
        device: int | None = None,
        node: str | None = None,
        store: str | None = None,
        generation: str = "d0/",
    ) -> None:
        self.device, self.node, self.store, self.generation = device, node, store, generation
        self._sock = sock
        self._write_lock = threading.Lock()
        self._injected_lock = threading.Lock()
        self._commands: queue.Queue[CommandMessage | None] = queue.Queue()
        self._injected: set[str] = set()
        self._gone = threading.Event()
        self._reader: threading.Thread | None = None
        if sock is not None:
            self._reader = threading.Thread(target=self._read, name="pitstop-link", daemon=True)
            self._reader.start()
            pulse = threading.Thread(target=self._pulse, name="pitstop-pulse", daemon=True)
            pulse.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainerLink:
        """The link the agent gave this process (and ``hello`` sent on it), or an inactive one
        when it was started without an agent."""
        env = os.environ if environ is None else environ
        device = int(env["PITSTOP_DEVICE"]) if env.get("PITSTOP_DEVICE") else None
        node, store = env.get("PITSTOP_NODE"), env.get("PITSTOP_STORE") or None
        generation = env.get("PITSTOP_GENERATION", "d0/")
        fd = env.get(FD_VARIABLE)
        if not fd:
            return cls(None, device=device, node=node, store=store, generation=generation)
        sock = socket.socket(fileno=int(fd))
        link = cls(sock, device=device, node=node, store=store, generation=generation)
        link._send(HelloMessage(device=device or 0, pid=os.getpid()))
        return link

    @property
    def active(self) -> bool:
        """Whether an agent is at the other end (and still there)."""
        return self._sock is not None and not self._gone.is_set()

    @property
    def agent_gone(self) -> bool:
        """The agent closed its end (it stopped or died)."""
        return self._gone.is_set()

    def report_step(
        self,
        step: int,
        loss: float | None,
        step_time_s: float,
        *,
        samples: int = 0,
        memory_bytes: float | None = None,
    ) -> None:
        """After every optimizer step: its number, loss (NaN included), seconds and samples."""
        if memory_bytes is not None and not math.isfinite(memory_bytes):
            memory_bytes = None
        self._send(
            StepMessage(
                step=step,
                loss=loss,
                step_time_s=max(step_time_s, 0.0),
                samples=samples,
                memory_bytes=memory_bytes,
            )
        )

    def set_state(self, state: str) -> None:
        """``training``, ``idle``, ``paused`` or ``restoring``."""
        if state not in STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(STATES)}")
        self._send(StateMessage.model_validate({"state": state}))

    def fault(self, kind: str, message: str = "") -> None:
        """A fault the trainer saw itself (a kind of ``FAULT_KINDS``, e.g. ``nan``)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
        self._send(FaultMessage.model_validate({"kind": kind, "message": message[:2000]}))

    def profile(self, measured: ProfileMessage) -> None:
        """The script's measurement of itself, for the job's scenario."""
        self._send(measured)

    def done(self, command_id: str, ok: bool = True, error: LinkError | None = None) -> None:
        """A command carried out (``ok``), or not, with the error saying why."""
        self._send(DoneMessage(command=command_id, ok=ok, error=None if ok else error))

    def poll_command(self, timeout: float | None = 0) -> CommandMessage | None:
        """The next command, waiting up to ``timeout`` seconds (None: until one comes or the
        agent is gone); None when there is none."""
        if self._sock is None:
            return None
        try:
            command = (
                self._commands.get(timeout=timeout)
                if timeout != 0
                else (self._commands.get_nowait())
            )
        except queue.Empty:
            return None
        if command is None:
            self._commands.put(None)  # the end stays the end for every later call
        return command

    def commands(self) -> Iterator[CommandMessage]:
        """Every command, as it comes, until the agent is gone."""
        while self._sock is not None:
            command = self.poll_command(None)
            if command is None:
                return
            yield command

    def injected(self, kind: str) -> bool:
        """Whether a fault of ``kind`` was injected since the last call (a drill): the trainer
        makes it happen, e.g. a NaN loss at its next step."""
        with self._injected_lock:
            if kind in self._injected:
                self._injected.discard(kind)
                return True
            return False

    def exec_again(self, environ: Mapping[str, str]) -> NoReturn:
        """Replace this process by a fresh run of the same command line, with ``environ``, on
        the same link: the agent sees the same process and link, and the new image says hello
        again. The write lock is held to the end, so that no line is cut in half."""
        self._write_lock.acquire()
        try:
            if self._sock is not None:
                os.set_inheritable(self._sock.fileno(), True)
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(environ))
        finally:  # reached only when the exec failed
            self._write_lock.release()

    def close(self) -> None:
        if self._sock is not None:
            self._gone.set()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _send(self, message: _Message) -> None:
        if self._sock is None or self._gone.is_set():
            return
        line = encode(message)
        with self._write_lock:
            try:
                self._sock.sendall(line)
            except OSError as exc:
                log.warning("link: the agent is gone (%s); training goes on alone", exc)
                self._gone.set()

    def _pulse(self) -> None:
        while not self._gone.wait(PULSE_S):
            self._send(AliveMessage())

    def _read(self) -> None:
        assert self._sock is not None
        reader = self._sock.makefile("rb")
        try:
            while True:
                line = reader.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                message = decode_from_agent(line)
                if isinstance(message, CommandMessage):
                    self.generation = message.generation
                    self._commands.put(message)
                elif isinstance(message, InjectMessage):
                    with self._injected_lock:
                        self._injected.add(message.kind)
        except (OSError, ValueError):
            pass
        finally:
            self._gone.set()
            self._commands.put(None)
