"""One node's conversation with the control plane, kept up across reconnections.

Shared by the agent (``worker_agent.agent``) and the simulated nodes (``worker_agent.sim``):
``Uplink.run`` connects, says ``hello``, waits for ``welcome``, then sends a heartbeat every
interval the welcome gives and hands every ``command`` to the node's handler (a command frame
that cannot be read but names its id is refused here, with an ``invalid`` error naming the
field). Faults and acknowledgements are queued (``fault``, ``ack``) and sent as soon as a socket
is up; those not yet sent when it drops are sent after the next ``hello`` (heartbeats are not
kept: the next one says everything). A dropped socket, a refused connection or a restarted
server is tried again with a jittered exponential back-off; when ``stop`` is set, what is queued
is sent and the node says ``goodbye``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

import websockets

from worker_agent import protocol

log = logging.getLogger("worker_agent.connection")

# Faults and acknowledgements kept while the server is away; the oldest go first past this.
MAX_QUEUED = 10_000
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class _QueuedFault:
    kind: protocol.FaultKind
    devices: tuple[int, ...]
    at: float
    step: int | None
    message: str
    pid: int | None = None
    exit_code: int | None = None
    log: tuple[str, ...] = ()


@dataclass(frozen=True)
class _QueuedProfile:
    fields: dict[str, Any]  # the profile frame's, but its sequence number


class Uplink:
    """A node's socket to the control plane: heartbeats, queued faults and acks, commands.

    ``heartbeat(seq)`` makes the node's next heartbeat; ``on_command`` is awaited for every
    command frame, in order (a handler that takes long holds the next frames back: hand long
    work to a task and ``ack`` when it is done).
    """

    def __init__(
        self,
        url: str,
        *,
        job: str,
        node: str,
        token: str,
        devices: Sequence[int],
        agent: str,
        heartbeat: Callable[[int], protocol.Heartbeat],
        on_command: Callable[[protocol.Command], Awaitable[None]],
    ) -> None:
        self.url, self.job, self.node, self.token = url, job, node, token
        self.devices, self.agent = list(devices), agent
        self.heartbeat, self.on_command = heartbeat, on_command
        self.seq = 0
        self.connections = 0  # sockets that were welcomed
        self.interval_s: float | None = None  # from the last welcome
        self.refused: protocol.Error | None = None
        self._queue: deque[_QueuedFault | _QueuedProfile | protocol.Ack] = deque(maxlen=MAX_QUEUED)
        self._wake = asyncio.Event()
        self._beat_now = False
        self._ws: Any = None

    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def fault(
        self,
        kind: protocol.FaultKind,
        devices: Sequence[int],
        *,
        step: int | None = None,
        message: str = "",
        at: float | None = None,
        pid: int | None = None,
        exit_code: int | None = None,
        log: Sequence[str] = (),
    ) -> None:
        """Report a fault now, or as soon as a socket is up (its ``at`` stays the time seen);
        ``pid``, ``exit_code`` and ``log`` (its output's last lines) name the process at fault."""
        at = time.time() if at is None else at
        lines = tuple(protocol.log_line(line) for line in log[-protocol.MAX_LOG_LINES :])
        self._queue.append(
            _QueuedFault(
                kind, tuple(devices), at, step, message[: protocol.MAX_TEXT], pid, exit_code, lines
            )
        )
        self._wake.set()

    def profile(self, fields: dict[str, Any]) -> None:
        """Send a ``profile`` frame of ``fields`` (all but ``seq``) now, or once a socket is up;
        ``ValidationError`` when they do not make one."""
        protocol.Profile(seq=0, **fields)  # refused here, not by the server
        self._queue.append(_QueuedProfile(fields))
        self._wake.set()

    def ack(self, ack: protocol.Ack) -> None:
        """Acknowledge a command now, or as soon as a socket is up."""
        self._queue.append(ack)
        self._wake.set()

    def beat_now(self) -> None:
        """Send the next heartbeat at once rather than at the interval: the node's state
        changed (its ranks train again under a new plan, or made their first step), and the
        control plane times a recovery by those beats."""
        self._beat_now = True
        self._wake.set()

    def drop(self) -> bool:
        """Close the socket abruptly, with no close frame (a drill: the server sees the node
        lost, and the uplink connects again); False when there was no socket."""
        ws = self._ws
        if ws is None:
            return False
        ws.transport.abort()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Stay connected until ``stop`` is set (then say goodbye) or the server refuses this
        node for good (``refused`` says why)."""
        backoff = FIRST_BACKOFF_S
        while not stop.is_set():
            try:
                if not await self._converse(stop):
                    return
                backoff = FIRST_BACKOFF_S  # the server closed a working socket: at once again
            except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                log.info(
                    "%s: %s; again in about %.1f s", self.node, exc.__class__.__name__, backoff
                )
            except protocol.ProtocolError as exc:
                log.warning("%s: the server's answer cannot be read: %s", self.node, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _converse(self, stop: asyncio.Event) -> bool:
        """One connection; True when the node should connect again."""
        # twice the protocol's limit: a frame over it is refused by name (``oversized``), not
        # lost with the socket
        size = 2 * protocol.MAX_SERVER_FRAME_BYTES
        async with websockets.connect(
            self.url, open_timeout=10, ping_interval=20, max_size=size
        ) as ws:
            hello = protocol.Hello(
                job=self.job,
                node=self.node,
                token=self.token,
                devices=self.devices,
                agent=self.agent,
            )
            await ws.send(protocol.encode(hello))
            welcome = protocol.parse_server_frame(await asyncio.wait_for(ws.recv(), 30))
            if isinstance(welcome, protocol.Error) and welcome.code is protocol.ErrorCode.TIMEOUT:
                # sent, but not read within the server's deadline: a server too busy (thousands
                # of agents saying hello at once), not a refusal; this node gave up for good on
                # it, and the job missed it at the join deadline
                raise TimeoutError(f"the server did not read hello in time: {welcome.message}")
            if isinstance(welcome, protocol.Error):
                log.error("%s refused: [%s] %s", self.node, welcome.code, welcome.message)
                self.refused = welcome
                return False
            if not isinstance(welcome, protocol.Welcome):
                raise protocol.ProtocolError(protocol.ErrorCode.OUT_OF_ORDER, "no welcome")
            self.interval_s = welcome.heartbeat_interval_s
            self.connections += 1
            log.info("%s connected to %s", self.node, self.url)
            self._ws = ws
            reader = asyncio.create_task(self._listen(ws))
            # the loop below waits on ``_wake`` alone, which these set too: a wait on three
            # (two tasks made and cancelled a beat) was a fifth of a thousand simulated agents'
            # time in one process
            reader.add_done_callback(lambda _: self._wake.set())
            stopped = asyncio.create_task(_relay(stop, self._wake))
            try:
                next_beat = 0.0
                while not stop.is_set() and not reader.done():
                    await self._flush(ws)
                    now = time.monotonic()
                    if now >= next_beat or self._beat_now:
                        self._beat_now = False
                        self.seq += 1
                        await ws.send(protocol.encode(self.heartbeat(self.seq)))
                        jitter = random.uniform(-0.05, 0.05) * welcome.heartbeat_interval_s
                        next_beat = now + welcome.heartbeat_interval_s + jitter
                    self._wake.clear()  # what set it since is looked at here
                    if self._queue or reader.done() or stop.is_set():
                        continue
                    await _woken(self._wake, timeout=next_beat - time.monotonic())
                if stop.is_set():
                    await self._flush(ws)
                    await ws.send(protocol.encode(protocol.Goodbye(reason="agent stopped")))
                    return False
                return bool(reader.result())
            finally:
                self._ws = None
                stopped.cancel()
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def _flush(self, ws: Any) -> None:
        """Send what is queued, oldest first; each leaves the queue once it was written."""
        while self._queue:
            item = self._queue[0]
            if isinstance(item, protocol.Ack):
                frame: protocol.Ack | protocol.Fault | protocol.Profile = item
            elif isinstance(item, _QueuedProfile):
                frame = protocol.Profile(seq=self.seq + 1, **item.fields)
            else:
                frame = protocol.Fault(
                    seq=self.seq + 1,
                    at=item.at,
                    kind=item.kind,
                    devices=list(item.devices),
                    step=item.step,
                    message=item.message,
                    pid=item.pid,
                    exit_code=item.exit_code,
                    log=list(item.log) or None,
                )
            await ws.send(protocol.encode(frame))
            if not isinstance(frame, protocol.Ack):
                self.seq += 1
            self._queue.popleft()

    def _refuse_command(self, text: str | bytes, error: protocol.ProtocolError) -> None:
        ack = _unreadable_command(text, error)
        if ack is not None:
            log.warning("%s: command %s refused: %s", self.node, ack.command, error)
            self.ack(ack)

    async def _listen(self, ws: Any) -> bool:
        """Hand the server's commands over; False when it refused this node for good."""
        async for text in ws:
            try:
                frame = protocol.parse_server_frame(text)
            except protocol.ProtocolError as error:
                log.warning("%s: a frame it cannot read: %s", self.node, error)
                self._refuse_command(text, error)
                continue
            if isinstance(frame, protocol.Error):
                log.warning("%s: [%s] %s", self.node, frame.code, frame.message)
                if frame.code in protocol.FATAL:
                    self.refused = frame
                    return False
            elif isinstance(frame, protocol.Command):
                try:
                    await self.on_command(frame)
                except Exception:  # a handler's bug loses that command, not the connection
                    log.exception("%s: command %s failed", self.node, frame.id)
        return True  # the server closed the socket: connect again


def server_url(p: argparse.ArgumentParser, given: str) -> SplitResult:
    """``--server`` parsed, or the command line refused: a ws:// or wss:// URL with a host."""
    url = urlsplit(given)
    if url.scheme not in ("ws", "wss") or not url.hostname:
        p.error(f"--server: expected ws://HOST:PORT, got {given!r}")
    return url


def _unreadable_command(text: str | bytes, error: protocol.ProtocolError) -> protocol.Ack | None:
    """The refusal of a command frame that cannot be read (an unknown action, a field of the
    wrong kind) but names its id; None for any other frame."""
    try:
        frame = json.loads(text)
    except ValueError:
        return None
    if not isinstance(frame, dict) or frame.get("type") != "command":
        return None
    command = frame.get("id")
    if not isinstance(command, str) or not 0 < len(command) <= 100:
        return None
    refusal = protocol.Error(
        code=protocol.ErrorCode.INVALID,
        message=error.message,
        field=error.field if error.code is protocol.ErrorCode.INVALID else None,
    )
    return protocol.Ack(command=command, ok=False, at=time.time(), error=refusal)


async def _relay(stop: asyncio.Event, wake: asyncio.Event) -> None:
    await stop.wait()
    wake.set()


async def _woken(wake: asyncio.Event, timeout: float) -> None:
    """Wait until ``wake`` is set, at most ``timeout`` seconds."""
    timer = asyncio.get_running_loop().call_later(max(timeout, 0), wake.set)
    try:
        await wake.wait()
    finally:
        timer.cancel()
