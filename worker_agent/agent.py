"""The agent beside a node's trainer processes: ``python -m worker_agent run``.

    python -m worker_agent run --server ws://HOST:PORT --job NAME --node NAME --token T
        --devices 0,1 [--store HOST:PORT] [--serve-store] [--seconds S] -- TRAINER COMMAND...

It starts one trainer process (a *rank*) per device, the command run with ``{device}`` replaced
and the link's environment (``worker_agent/link.py``), supervises them, and speaks the agent
protocol (docs/protocol.md) to the control plane through ``connection.Uplink``:

- a heartbeat every interval the welcome gives, made of the ranks' reports: the node's step (the
  lowest of its training ranks', of all when none trains), the last loss, samples/s, step
  time, and each device's state, memory and process id;
- a ``fault`` the moment one is seen: a rank exited or was killed (``crash``, from the process
  table and the link's end), no step progress for ``hang_factor`` × its median step time and at
  least ``hang_floor_s`` while its link's pulses are silent, or for three times that; before its
  first step, no step for ``hang_factor`` × the estimator's step time (``--step-time``) and at
  least ``--first-step-floor`` while silent (``hang``), a NaN or infinite loss (``nan``), a
  rank slower than ``straggler_factor`` × the median of the node's other ranks for
  ``straggler_steps`` steps in a row (``straggler``); a dead or hung rank also sets
  ``<generation>abort`` in the job's store so the other ranks leave their collectives, and a
  hung rank is killed;
- once its ranks carried out an ``apply_plan`` of a new decision, the generation it superseded
  is aborted in the store too (*fenced*): a rank the control plane no longer hears (its node
  cut off) leaves it and idles instead of training on under the old plan;
- every command carried out once per id by the ranks it concerns, acknowledged when they all
  said ``done`` (and again each time it is sent again); refused with an ``invalid`` error when
  its action is unknown, its plan does not hold together, a stage of its plan mixes this
  node's devices with others', or its ``holders`` name a device of this node whose rank is not
  running; an ``apply_plan``'s ``restore`` and ``holders`` go to the ranks with it;
- each rank's standard error passes through to the agent's as it comes; a fault about a rank
  names its pid, its exit status and the last lines of that output;
- SIGTERM or SIGINT: ``goodbye``, then the ranks are stopped (SIGTERM, SIGKILL after a grace
  period) and reaped, and the store is closed.

``--serve-store`` makes this agent host the job's ``torch.distributed.TCPStore`` on ``--store``'s
port: one agent per job does, like torchrun's master; see docs/trainer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import ctypes
import datetime as dt
import importlib
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from worker_agent import faults, link, protocol
from worker_agent.connection import Uplink, server_url

log = logging.getLogger("worker_agent.agent")
AGENT_VERSION = "pitstop-agent 0.1"
RECENT_STEPS = 20  # the step times a rank's median is taken over
MAX_LAYERS = 100_000  # the most layers a plan may name when the model's count is not given
PR_SET_PDEATHSIG = 1  # prctl(2)
# A rank is silent after this many of its link's pulse periods without a message.
SILENT_PULSES = 4
# A rank whose pulses go on is a hang only after this many times the hang limit.
STALL_FACTOR = 3
# A crashed rank's fault waits at most this long for the rest of its standard error: the pipe
# ends with the process, unless a child of its own still holds it.
TAIL_WAIT_S = 0.2


@dataclass
class Settings:
    server: str
    job: str
    node: str
    token: str
    devices: list[int]
    command: list[str]
    store: str | None = None
    serve_store: bool = False
    seconds: float | None = None
    hang_factor: float = 10.0
    hang_floor_s: float = 30.0
    # Before a rank's first step: the estimator's step time (``python -m controlplane.recovery
    # estimate``), if known, and the floor of the first step's limit (None: ``hang_floor_s``).
    step_time_s: float | None = None
    first_step_floor_s: float | None = None
    straggler_factor: float = 2.0
    straggler_steps: int = 3
    grace_s: float = 10.0
    command_timeout_s: float = 300.0
    layers: int | None = None  # the model's layers, when known: plans' ranges are checked too
    control: bool = True  # listen for injections (worker_agent.faults)
    template: bool = True  # ``{device}`` in the command is replaced by the rank's device
    # More of each rank's environment, by its device (the launcher's: torchrun's variables).
    environment: Callable[[int], Mapping[str, str]] | None = None
    # What a failed rank left to say of its exit, by its device (the launcher: the exception
    # torch's ``@record`` wrote), added to its crash's message.
    exit_detail: Callable[[int], str | None] | None = None


class OutputTail:
    """The last lines a rank wrote to its standard error, for the fault that reports its end
    (a traceback, NCCL's last words); a progress bar's redraws count as their last."""

    def __init__(self, lines: int = protocol.MAX_LOG_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._partial = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes) -> None:
        *whole, partial = (self._partial + self._decoder.decode(chunk)).split("\n")
        self._partial = partial[-4 * protocol.MAX_LOG_LINE :]
        for line in whole:
            self._keep(line, self._lines)

    def last(self) -> list[str]:
        lines = deque(self._lines, maxlen=self._lines.maxlen)
        self._keep(self._partial, lines)
        return list(lines)

    @staticmethod
    def _keep(line: str, into: deque[str]) -> None:
        shown = line.rstrip("\r").rsplit("\r", 1)[-1]  # what a terminal would show
        if shown.strip():
            into.append(shown)


def _write_through(chunk: bytes) -> None:
    """A rank's bytes on the agent's standard error, as they came."""
    out = getattr(sys.stderr, "buffer", None)
    if out is None:  # a stderr without bytes (replaced by a test's capture)
        sys.stderr.write(chunk.decode(errors="replace"))
        return
    out.write(chunk)
    out.flush()


@dataclass
class Rank:
    """One trainer process and what it last reported."""

    device: int
    end: link.AgentEnd
    process: asyncio.subprocess.Process
    state: str = "idle"
    step: int | None = None
    loss: float | None = None
    step_time_s: float | None = None
    samples: int = 0
    memory_bytes: float | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    progress_at: float = field(default_factory=time.monotonic)  # the step last advanced
    heard_at: float = field(default_factory=time.monotonic)  # its last message of any kind
    fresh: bool = False  # training again, its first step not reported yet
    slow_steps: int = 0
    straggling: bool = False
    nan: bool = False
    gone: str | None = None  # why it is gone: crash, hang, finished, stopped
    exit_expected: bool = False  # told to stop: its exit is no fault
    output: OutputTail = field(default_factory=OutputTail)
    tee: asyncio.Task[None] | None = None  # passes its standard error through to the agent's

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.gone is None


@dataclass
class Pending:
    """A command the ranks are carrying out: who has yet to say done, and who failed."""

    command: protocol.Command
    waiting: set[int]
    errors: list[tuple[int, link.LinkError]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    superseded: str | None = None  # an apply_plan's previous generation, fenced once applied


class Store:
    """The job's ``torch.distributed.TCPStore``: hosted here (``--serve-store``) or a client."""

    def __init__(self, address: str, *, serve: bool) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.serve = host or "127.0.0.1", int(port), serve
        self._store: Any = None

    def _open(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                self.host,
                self.port,
                is_master=self.serve,
                wait_for_workers=False,
                timeout=dt.timedelta(seconds=10),
            )
        return self._store

    async def start(self) -> None:
        await asyncio.to_thread(self._open)
        log.info("hosting the job's store on port %d", self.port)

    async def set(self, key: str, value: str) -> None:
        def write() -> None:
            self._open().set(key, value)

        try:
            await asyncio.to_thread(write)
        except Exception as exc:  # the store is away: the abort is lost, the fault is not
            log.warning("store %s:%d: %s not set: %s", self.host, self.port, key, exc)

    async def over(self, generation: str) -> bool:
        """Whether ``generation`` was aborted or superseded: the job went on without it (a
        store that cannot be reached says no)."""

        def read() -> bool:
            store = self._open()
            return any(store.check([f"{generation}{key}"]) for key in ("abort", "superseded"))

        try:
            return await asyncio.to_thread(read)
        except Exception as exc:
            log.warning("store %s:%d: %s not read: %s", self.host, self.port, generation, exc)
            return False

    def close(self) -> None:
        self._store = None  # the server (if hosted) stops with its last reference


def check_plan(
    command: protocol.Command, mine: set[int], dead: set[int], layers: int | None
) -> protocol.Error | None:
    """Why this node cannot take ``command``'s plan, or None. The structure, devices and layer
    ranges are the core's codec checks; memory is not checked (the agent has no profile)."""
    from controlplane.recovery.codec import plan_from_dict
    from controlplane.recovery.errors import RecoveryError
    from controlplane.recovery.model import Cluster, ModelProfile

    def refused(message: str, where: str) -> protocol.Error:
        return protocol.Error(code=protocol.ErrorCode.INVALID, message=message, field=where)

    plan = command.plan
    if plan is None:
        return refused("apply_plan carries no plan", "plan")
    ends, devices = [1], [0]
    with contextlib.suppress(TypeError, KeyError, AttributeError, ValueError, IndexError):
        for pipe in plan["pipelines"]:
            for stage in pipe["stages"]:
                ends.append(int(stage["layers"][1]))
                devices.extend(int(d) for d in stage["devices"])
    # without the model's layer count, the plan's own last layer stands for it (every pipeline
    # must end there), bounded: a stage past MAX_LAYERS is refused by the codec's range check
    count = layers or min(max(ends), MAX_LAYERS)
    profile = ModelProfile.uniform(name="plan", layers=count, fwd_s=1, bwd_s=1)
    cluster = Cluster(devices=max(max(devices), max(mine)) + 1)
    try:
        parsed = plan_from_dict(plan, profile=profile, cluster=cluster)
    except RecoveryError as exc:
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        return refused(message, exc.field or "plan")
    for p, s, stage in parsed.stages():
        where = f"plan.pipelines[{p}].stages[{s}].devices"
        here = set(stage.devices) & mine
        if here and not stage.rerouted and here != set(stage.devices):
            other = sorted(set(stage.devices) - mine)[0]
            return refused(f"uses device {other} of another node", where)
        down = sorted(here & dead)
        if down and not stage.rerouted:
            return refused(f"uses device {down[0]}, whose trainer is not running", where)
    return None


def check_holders(command: protocol.Command, dead: set[int]) -> protocol.Error | None:
    """Why this node cannot take ``command``'s holders, or None: a holder is a device that
    must take part in the handover, so one of this node's whose rank is not running cannot be
    (the others would wait for it)."""
    down = sorted(set(command.holders or ()) & dead)
    if not down:
        return None
    return protocol.Error(
        code=protocol.ErrorCode.INVALID,
        message=f"names device {down[0]} as a live holder, whose trainer is not running",
        field="holders",
    )


def _warm_up(store: bool) -> None:
    """Import what a recovery needs, so that it does not pay for it: the first command's
    ``check_plan`` the codec (a quarter of a second), the first fault's store client torch
    (seconds)."""
    importlib.import_module("controlplane.recovery.codec")
    if store:
        importlib.import_module("torch.distributed")


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


class Agent:
    """The node's ranks and its uplink; ``run`` until stopped."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ranks: dict[int, Rank] = {}
        self.generation = "d0/"
        self.plan_devices: set[int] | None = None  # the devices the current plan uses, if known
        self.outcomes: dict[str, protocol.Ack] = {}  # command id -> its ack
        self.pending: dict[str, Pending] = {}
        self.last_loss: float | None = None
        self.last_step = 0
        self.stopping = False
        self.finish = asyncio.Event()  # set: leave (signal, --seconds, stop, training finished)
        self.leave = asyncio.Event()  # set: the uplink says goodbye
        self.exit_code = 0
        self.store = Store(settings.store, serve=settings.serve_store) if settings.store else None
        url = settings.server.rstrip("/") + "/ws/agent/"
        self.uplink = Uplink(
            url,
            job=settings.job,
            node=settings.node,
            token=settings.token,
            devices=settings.devices,
            agent=AGENT_VERSION,
            heartbeat=self.heartbeat,
            on_command=self.on_command,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: asyncio.Server | None = None
        self._uplink: asyncio.Task[None] | None = None

    # --- running ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.finish.set)
        if self.settings.seconds is not None:
            loop.call_later(self.settings.seconds, self.finish.set)
        try:
            # before the ranks and the uplink: an import in a thread later would still hold
            # the event loop up (heartbeats, the abort, a command) for as long as it runs
            await asyncio.to_thread(_warm_up, self.store is not None)
            if self.store is not None and self.settings.serve_store:
                await self.store.start()
            if self.settings.control:
                await self._serve_control()
            for device in await self._first_devices():
                await self._start_rank(device)
            self._uplink = self._spawn(self.uplink.run(self.leave))
            self._uplink.add_done_callback(lambda _: self.finish.set())
            self._spawn(self._watch())
            await self.finish.wait()
            if self.uplink.refused is not None:
                self.exit_code = 1
        finally:
            await self.shutdown()
        return self.exit_code

    async def _first_devices(self) -> list[int]:
        """The devices whose ranks start with the agent: all of them."""
        return list(self.settings.devices)

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        """Goodbye, then the ranks stopped and reaped, the store and control socket closed."""
        self.stopping = True
        self.leave.set()
        if self._uplink is not None:
            await asyncio.wait([self._uplink], timeout=5)
        await self._stop_ranks()
        if self._control is not None:
            self._control.close()
            with contextlib.suppress(OSError):
                faults.control_path(os.getpid()).unlink()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.store is not None:
            self.store.close()
        log.info("agent stopped")

    async def _stop_ranks(self) -> None:
        live = [r for r in self.ranks.values() if r.process.returncode is None]
        for rank in live:
            _signal_group(rank.pid, signal.SIGTERM)
        if live:
            _, late = await asyncio.wait(
                [asyncio.ensure_future(r.process.wait()) for r in live],
                timeout=self.settings.grace_s,
            )
            for rank in live:
                if rank.process.returncode is None:
                    log.warning(
                        "device %d: no exit %g s after SIGTERM: SIGKILL",
                        rank.device,
                        self.settings.grace_s,
                    )
                    _signal_group(rank.pid, signal.SIGKILL)
            await asyncio.gather(*(r.process.wait() for r in live))
            for waiter in late:
                waiter.cancel()
        for rank in self.ranks.values():
            _signal_group(rank.pid, signal.SIGKILL)  # what its process group left behind
            rank.end.close()

    async def _start_rank(self, device: int) -> None:
        end, child = link.AgentEnd.pair()
        settings = self.settings
        command = list(settings.command)
        if settings.template:
            command = [part.replace("{device}", str(device)) for part in command]
        env = dict(os.environ)
        if settings.environment is not None:
            env.update(settings.environment(device))
        env.update(
            link.child_environment(
                fd=child.fileno(),
                device=device,
                node=settings.node,
                generation=self.generation,
                store=settings.store,
            )
        )
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                env=env,
                pass_fds=(child.fileno(),),
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_the_agent,
            )
        finally:
            child.close()
        await end.open()
        rank = Rank(device=device, end=end, process=process)
        self.ranks[device] = rank
        log.info("device %d: rank started, pid %d", device, process.pid)
        rank.tee = self._spawn(self._tee(rank))
        self._spawn(self._read(rank))
        self._spawn(self._reap(rank))

    async def _tee(self, rank: Rank) -> None:
        """The rank's standard error, written through to the agent's as it comes. Read to its
        end whatever happens to the agent's own (closed, a broken pipe): a pipe left full
        would stop the rank at its next write."""
        stream = rank.process.stderr
        if stream is None:
            return
        passing = True
        while chunk := await stream.read(1 << 16):
            rank.output.feed(chunk)
            if passing:
                try:
                    _write_through(chunk)
                except (OSError, ValueError) as exc:  # ValueError: a closed file
                    passing = False
                    log.warning(
                        "device %d: its output no longer reaches ours: %s", rank.device, exc
                    )

    # --- what the ranks say ---

    async def _read(self, rank: Rank) -> None:
        async for message in rank.end.messages():
            rank.heard_at = time.monotonic()
            self._take(rank, message)
        if rank.alive and not self.stopping:
            # the link ended: the exit status is a moment behind, or the rank closed its link
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(rank.process.wait()), 1.0)
                return  # it exited: the reaper reports how
            if rank.alive and not self.stopping:
                self._lost(
                    rank, "crash", f"rank {rank.pid} on device {rank.device} closed its link"
                )
                _signal_group(rank.pid, signal.SIGKILL)

    def _take(self, rank: Rank, message: link.RankMessage) -> None:
        if isinstance(message, link.StepMessage):
            self._stepped(rank, message)
        elif isinstance(message, link.StateMessage):
            if message.state != rank.state:
                rank.progress_at = time.monotonic()  # training (again): the hang clock starts
                rank.slow_steps = 0
                rank.fresh = message.state == "training"
                self.uplink.beat_now()  # a recovery is timed by the beat that shows it
            rank.state = message.state
        elif isinstance(message, link.DoneMessage):
            self._done(rank.device, message.command, message.ok, message.error)
        elif isinstance(message, link.FaultMessage):
            self._report(
                protocol.FaultKind(message.kind),
                [rank.device],
                message.message or f"rank on device {rank.device} reported it",
                pid=rank.pid,
            )
        elif isinstance(message, link.ProfileMessage):
            fields = message.model_dump(exclude={"t"}, exclude_none=True)
            try:
                self.uplink.profile({**fields, "at": time.time(), "devices": [rank.device]})
            except ValueError as exc:  # pydantic's ValidationError: the script's bug, not a fault
                log.warning("device %d: a profile the protocol refuses: %s", rank.device, exc)
        elif isinstance(message, link.HelloMessage) and message.device != rank.device:
            log.warning("device %d: the rank says it is device %d", rank.device, message.device)

    def _stepped(self, rank: Rank, message: link.StepMessage) -> None:
        now = time.monotonic()
        if rank.fresh:  # the first step since it trains again: the recovery's last phase
            rank.fresh = False
            self.uplink.beat_now()
        if rank.step is None or message.step != rank.step:
            rank.progress_at = now
        rank.step, rank.step_time_s = message.step, message.step_time_s
        rank.samples, rank.memory_bytes = message.samples, message.memory_bytes
        rank.recent.append(message.step_time_s)
        loss = message.loss
        if loss is not None and not math.isfinite(loss):
            if not rank.nan:
                rank.nan = True
                self._report(
                    protocol.FaultKind.NAN,
                    [rank.device],
                    f"rank on device {rank.device}: loss {loss} at step {message.step}",
                    step=message.step,
                )
        else:
            rank.nan = False
            if loss is not None:
                rank.loss = self.last_loss = loss
        self._check_straggler(rank)

    def _check_straggler(self, rank: Rank) -> None:
        settings = self.settings
        others = [
            r.step_time_s
            for r in self.ranks.values()
            if r is not rank and r.alive and r.state == "training" and r.step_time_s is not None
        ]
        median = _median(others)
        if median is None or rank.step_time_s is None or median <= 0:
            return
        if rank.step_time_s > settings.straggler_factor * median:
            rank.slow_steps += 1
        else:
            rank.slow_steps, rank.straggling = 0, False
        if rank.slow_steps >= settings.straggler_steps and not rank.straggling:
            rank.straggling = True
            self._report(
                protocol.FaultKind.STRAGGLER,
                [rank.device],
                f"rank on device {rank.device}: {rank.step_time_s:.3g} s a step, the "
                f"others' median {median:.3g} s, for {rank.slow_steps} steps",
                step=rank.step,
            )

    async def _reap(self, rank: Rank) -> None:
        code = await rank.process.wait()
        if not rank.alive or self.stopping:
            return
        if rank.exit_expected or code == 0:
            rank.gone = "stopped" if rank.exit_expected else "finished"
            log.info("device %d: rank exited with code %d", rank.device, code)
            self._abandon(rank)
            if not any(r.alive for r in self.ranks.values()):
                log.info("every rank has finished")
                if self._ends_when_all_exited() and any(
                    r.gone in ("crash", "hang") for r in self.ranks.values()
                ):
                    self.exit_code = 1  # an earlier one failed
                self.finish.set()
            return
        if rank.tee is not None:  # its last words, in the pipe already unless a child holds it
            await asyncio.wait({rank.tee}, timeout=TAIL_WAIT_S)
            if not rank.alive or self.stopping:
                return
        how = f"signal {-code}" if code < 0 else f"code {code}"
        detail = self.settings.exit_detail and self.settings.exit_detail(rank.device)
        if detail:
            how += f": {detail}"
        self._lost(
            rank,
            "crash",
            f"rank {rank.pid} on device {rank.device} exited with {how}",
            exit_code=code,
        )
        if self._ends_when_all_exited() and not any(r.alive for r in self.ranks.values()):
            log.info("every rank has exited, one or more failed")
            self.exit_code = 1
            self.finish.set()

    def _ends_when_all_exited(self) -> bool:
        """Whether the agent leaves, with 1, once every rank has exited and one failed (the
        launcher's, like torchrun's); the agent's own waits for the control plane's plan."""
        return False

    # --- faults ---

    def _report(
        self,
        kind: protocol.FaultKind,
        devices: list[int],
        message: str,
        step: int | None = None,
        **process: Any,
    ) -> None:
        """Send a fault; ``process`` names the process at fault (``pid``, ``exit_code``,
        ``log``: ``Uplink.fault``'s)."""
        log.warning("fault %s on %s: %s", kind.value, devices, message)
        self.uplink.fault(
            kind,
            devices,
            step=step if step is not None else self.last_step,
            message=message,
            **process,
        )

    def _lost(self, rank: Rank, kind: str, message: str, exit_code: int | None = None) -> None:
        """A rank died or hung: report it with its pid, exit status and last lines of output,
        tell every rank of the job to leave its collectives (``<generation>abort`` in the
        store), and give up its part of pending commands."""
        rank.gone = kind
        self._report(
            protocol.FaultKind(kind),
            [rank.device],
            message,
            step=rank.step,
            pid=rank.pid,
            exit_code=exit_code,
            log=rank.output.last(),
        )
        if self.store is not None:
            value = json.dumps(
                {"node": self.settings.node, "device": rank.device, "kind": kind, "at": time.time()}
            )
            self._spawn(self.store.set(f"{self.generation}abort", value))
        self._abandon(rank)

    def _abandon(self, rank: Rank) -> None:
        error = link.LinkError(code="invalid", message=f"the rank on device {rank.device} is gone")
        for command_id in list(self.pending):
            self._done(rank.device, command_id, False, error)

    async def _watch(self) -> None:
        """Hangs: a training rank whose step has not moved for k × its median step time, and
        that has fallen silent too (its link's ``alive`` pulses stopped), or has not moved for
        ``STALL_FACTOR`` times that long.

        A rank waiting in a collective for a stopped peer stalls at the same moment as the
        peer, but its pulses go on: it is not the one to blame, and once the culprit is found
        (and the generation aborted) it leaves the collective. A rank stuck where the pulse
        thread still runs (a device that never answers) is caught by the longer limit. Before a
        rank's first step only the first: see ``_hang_limit``.
        """
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for rank in list(self.ranks.values()):
                limit = self._hang_limit(rank)
                if limit is None:
                    continue
                stalled = now - rank.progress_at
                silent = now - rank.heard_at > SILENT_PULSES * link.PULSE_S
                # before the first step, waiting long is no fault of the one that waits (its
                # peers may still be starting): only silence blames a rank then
                stuck = rank.step is not None and stalled > STALL_FACTOR * limit
                if stalled > limit and (silent or stuck):
                    what = "no first step" if rank.step is None else "no step"
                    after = "" if rank.step is None else f" after step {rank.step}"
                    self._lost(
                        rank,
                        "hang",
                        f"rank {rank.pid} on device {rank.device}: {what} "
                        f"for {stalled:.1f} s{after} (limit {limit:.1f} s)",
                    )
                    _signal_group(rank.pid, signal.SIGKILL)

    def _hang_limit(self, rank: Rank) -> float | None:
        """Seconds without a step after which ``rank`` may be hung, or None when it is not
        watched: k × its median step time with a floor; before its first step (while it says it
        trains or restores), k × the estimator's step time with the first step's floor."""
        settings = self.settings
        if not rank.alive:
            return None
        if rank.step is None:
            if rank.state not in ("training", "restoring"):
                return None  # not started yet, or a standby: nothing is awaited of it
            floor = settings.first_step_floor_s
            expected = settings.step_time_s or 0.0
            floor = settings.hang_floor_s if floor is None else floor
            return max(floor, settings.hang_factor * expected)
        if rank.state != "training":
            return None
        expected = _median(list(rank.recent)) or 0.0
        return max(settings.hang_floor_s, settings.hang_factor * expected)

    # --- the control plane ---

    def heartbeat(self, seq: int) -> protocol.Heartbeat:
        live = [r for r in self.ranks.values() if r.alive and r.step is not None]
        # a rank the plan left out idles at the step it stopped at: only those training count
        counted = [r for r in live if r.state == "training"] or live
        if counted:
            self.last_step = min(r.step for r in counted if r.step is not None)
        training = [r for r in live if r.state == "training" and r.step_time_s]
        samples = sum(r.samples / r.step_time_s for r in training if r.step_time_s)
        step_time = _median([r.step_time_s for r in training if r.step_time_s is not None])
        reports = []
        for device in self.settings.devices:
            rank = self.ranks.get(device)
            state = rank.state if rank is not None else "idle"
            if rank is not None and not rank.alive:
                # a device the current plan leaves out is idle, however its rank ended
                used = self.plan_devices is None or device in self.plan_devices
                state = "failed" if used and rank.gone in ("crash", "hang") else "idle"
            running = rank if rank is not None and rank.alive else None
            reports.append(
                protocol.DeviceReport(
                    device=device,
                    state=protocol.DeviceState(state),
                    memory_bytes=running.memory_bytes if running else None,
                    pid=running.pid if running else None,
                )
            )
        return protocol.Heartbeat(
            seq=seq,
            at=time.time(),
            step=self.last_step,
            loss=self.last_loss,
            samples_per_s=samples if training else 0.0,
            step_time_s=step_time,
            devices=reports,
        )

    async def _carried_out_here(self, command: protocol.Command) -> bool:
        """True when this agent carries out ``command`` itself (and acknowledges it) rather
        than send it to its ranks: none does here; the launcher's restart does."""
        return False

    async def on_command(self, command: protocol.Command) -> None:
        done = self.outcomes.get(command.id)
        if done is not None:
            log.info("command %s sent again: acknowledged again", command.id)
            self.uplink.ack(done)
            return
        if command.id in self.pending:
            return  # under way: acknowledged when the ranks are done
        error = self._refusal(command)
        if error is not None:
            log.warning(
                "command %s (%s) refused: %s", command.id, command.action.value, error.message
            )
            self.uplink.ack(protocol.Ack(command=command.id, ok=False, at=time.time(), error=error))
            return
        if command.inject is not None:  # a drill: done here, at once, and acknowledged
            self._inject_for(command.id, command.inject)
            return
        if await self._carried_out_here(command):
            return
        superseded = None
        if command.action is protocol.Action.APPLY_PLAN:
            if command.decision is not None and f"d{command.decision}/" != self.generation:
                superseded, self.generation = self.generation, f"d{command.decision}/"
            self.plan_devices = protocol.plan_devices(command.plan)
        targets = [r for r in self.ranks.values() if r.alive]
        pending = Pending(command, {r.device for r in targets}, superseded=superseded)
        self.pending[command.id] = pending
        message = link.CommandMessage(
            id=command.id,
            action=cast(link.RankAction, command.action.value),  # inject returned above
            plan=command.plan,
            step=command.step,
            generation=self.generation,
            restore=None if command.restore is None else command.restore.value,
            holders=command.holders,
        )
        log.info(
            "command %s: %s to devices %s",
            command.id,
            command.action.value,
            sorted(pending.waiting),
        )
        for rank in targets:
            if command.action is protocol.Action.STOP:
                rank.exit_expected = True
            if not rank.end.send(message):
                self._done(
                    rank.device,
                    command.id,
                    False,
                    link.LinkError(message=f"the rank on device {rank.device} is gone"),
                )
        if command.id in self.pending:
            pending.timer = asyncio.get_running_loop().call_later(
                self.settings.command_timeout_s, self._timed_out, command.id
            )
            if not pending.waiting:
                self._complete(pending)

    def _refusal(self, command: protocol.Command) -> protocol.Error | None:
        if command.action is protocol.Action.APPLY_PLAN:
            dead = {d for d, r in self.ranks.items() if not r.alive}
            refused = check_plan(command, set(self.settings.devices), dead, self.settings.layers)
            if refused is None:
                refused = check_holders(command, dead)
            return refused
        return None

    def _done(self, device: int, command_id: str, ok: bool, error: link.LinkError | None) -> None:
        pending = self.pending.get(command_id)
        if pending is None or device not in pending.waiting:
            return
        pending.waiting.discard(device)
        if not ok:
            pending.errors.append((device, error or link.LinkError(message="no reason given")))
        if not pending.waiting:
            self._complete(pending)

    def _timed_out(self, command_id: str) -> None:
        pending = self.pending.get(command_id)
        if pending is None:
            return
        limit = self.settings.command_timeout_s
        for device in sorted(pending.waiting):
            pending.errors.append((device, link.LinkError(message=f"no answer in {limit:g} s")))
        pending.waiting.clear()
        self._complete(pending)

    def _complete(self, pending: Pending) -> None:
        command = pending.command
        self.pending.pop(command.id, None)
        if pending.timer is not None:
            pending.timer.cancel()
        error = None
        if pending.errors:
            device, first = min(pending.errors, key=lambda error: error[0])  # the lowest device
            code = first.code if first.code in set(protocol.ErrorCode) else "invalid"
            error = protocol.Error(
                code=protocol.ErrorCode(code),
                field=first.field,
                message=f"device {device}: {first.message}"[:2000],
            )
        ack = protocol.Ack(command=command.id, ok=error is None, at=time.time(), error=error)
        self.outcomes[command.id] = ack
        self.uplink.ack(ack)
        log.info(
            "command %s: %s %s",
            command.id,
            command.action.value,
            "done" if ack.ok else f"failed: {error.message if error else ''}",
        )
        if command.action is protocol.Action.STOP and ack.ok:
            self.finish.set()
        if pending.superseded is not None and ack.ok and self.store is not None:
            self._fence(self.store, pending.superseded)

    def _fence(self, store: Store, superseded: str) -> None:
        """This node's ranks train under the new generation: abort the one it superseded, so
        that any rank still in it leaves and idles, waiting for a plan. Such a rank is one the
        control plane no longer hears (its node was cut off, or failed by the deadline while it
        still reaches the store): it never trains again under the old plan, and when its agent
        says hello again it is a new member, given a plan only by a new decision."""
        value = json.dumps(
            {"node": self.settings.node, "superseded_by": self.generation, "at": time.time()}
        )
        log.info("generation %s superseded by %s: fenced", superseded, self.generation)

        async def fence() -> None:
            # why, where a peer's transport error may overwrite the abort key's value
            await store.set(f"{superseded}superseded", value)
            await store.set(f"{superseded}abort", value)

        self._spawn(fence())

    # --- injections (worker_agent.faults) ---

    async def _serve_control(self) -> None:
        path = faults.control_path(os.getpid())
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old = os.umask(0o077)
        try:
            self._control = await asyncio.start_unix_server(self._on_control, path=str(path))
        finally:
            os.umask(old)

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), 5))
            answer = self.inject(request)
        except (ValueError, TypeError, KeyError, TimeoutError) as exc:
            answer = {"ok": False, "error": f"bad request: {exc}"}
        writer.write(json.dumps(answer).encode() + b"\n")
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    def _inject_for(self, command_id: str, injection: protocol.Injection) -> None:
        """An ``inject`` command: the injection done, its outcome acknowledged (and kept, so that
        the command sent again is acknowledged again, not injected twice)."""
        answer = self.inject(injection.model_dump(mode="json", exclude_none=True))
        error = None
        if not answer["ok"]:
            where = "inject.kind" if injection.kind is protocol.InjectKind.DROP else "inject.device"
            error = protocol.Error(
                code=protocol.ErrorCode.INVALID, message=answer["error"], field=where
            )
        ack = protocol.Ack(command=command_id, ok=error is None, at=time.time(), error=error)
        self.outcomes[command_id] = ack
        self.uplink.ack(ack)

    def inject(self, request: dict[str, Any]) -> dict[str, Any]:
        """Carry out one injection request; the answer for the requester."""
        kind = request["kind"]
        if kind == "drop":
            dropped = self.uplink.drop()
            return {"ok": True} if dropped else {"ok": False, "error": "no socket to drop"}
        if kind not in faults.KINDS:
            return {"ok": False, "error": f"unknown kind {kind!r}"}
        rank = None
        for candidate in self.ranks.values():
            if candidate.pid == request.get("pid") or candidate.device == request.get("device"):
                rank = candidate
        if rank is None or not rank.alive:
            return {"ok": False, "error": "no such rank running here"}
        seconds = request.get("seconds")
        log.warning("injecting %s into device %d (pid %d)", kind, rank.device, rank.pid)
        if kind == "kill":
            faults.kill(rank.pid)
        elif kind == "hang":
            faults.hang(rank.pid)
            if seconds:
                self._spawn(faults.resume_after(rank.pid, float(seconds)))
        elif kind == "slow":
            fraction = float(request.get("stopped_fraction") or 0.75)
            self._spawn(faults.slow(rank.pid, float(seconds or 10), fraction))
        elif kind == "nan":
            rank.end.send(link.InjectMessage(kind="nan"))
        return {"ok": True, "device": rank.device, "pid": rank.pid}


def _die_with_the_agent() -> None:
    """In a rank, before it runs: the kernel kills it when the agent dies, even by SIGKILL.

    A rank without its agent trains under a generation the control plane has planned away (the
    agent's socket closed: its node failed), and nothing would ever stop it. Linux only; a rank
    elsewhere is left to notice ``TrainerLink.agent_gone``.
    """
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal a rank and every process it started (each rank leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m worker_agent run", description=__doc__.split("\n\n")[0]
    )
    env = os.environ.get
    p.add_argument(
        "--server",
        default=env("PITSTOP_SERVER", "ws://127.0.0.1:8000"),
        help="the control plane's address (ws://HOST:PORT)",
    )
    p.add_argument("--job", default=env("PITSTOP_JOB"), help="the job's name")
    p.add_argument("--node", default=env("PITSTOP_NODE"), help="this node's name in the job")
    p.add_argument("--token", default=env("PITSTOP_AGENT_TOKEN"), help="the job's agent token")
    p.add_argument("--devices", required=True, help="this node's devices, e.g. 0,1,2,3")
    p.add_argument("--store", help="HOST:PORT of the job's torch TCPStore")
    p.add_argument(
        "--serve-store",
        action="store_true",
        help="host the job's TCPStore on --store's port (one agent per job)",
    )
    p.add_argument("--seconds", type=float, help="stop after this long (default: when stopped)")
    p.add_argument(
        "--hang-factor",
        type=float,
        default=10.0,
        help="a hang: no step for this many median step times",
    )
    p.add_argument(
        "--hang-floor", type=float, default=30.0, help="... and for at least this many seconds"
    )
    p.add_argument(
        "--step-time",
        type=float,
        help="the estimator's step time (python -m controlplane.recovery estimate): before a "
        "rank's first step, a hang is no step for --hang-factor times this",
    )
    p.add_argument(
        "--first-step-floor",
        type=float,
        help="... and for at least this many seconds (default: --hang-floor)",
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=2.0,
        help="a straggler: steps this many times the other ranks' median",
    )
    p.add_argument(
        "--straggler-steps", type=int, default=3, help="... for this many steps in a row"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL for the ranks at shutdown",
    )
    p.add_argument(
        "--command-timeout",
        type=float,
        default=300.0,
        help="seconds the ranks have to carry out a command",
    )
    p.add_argument("--layers", type=int, help="the model's layers: plans' ranges are checked")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="do not listen for injected faults (worker_agent.faults)",
    )
    p.add_argument(
        "trainer",
        nargs=argparse.REMAINDER,
        help="-- then the trainer command ({device} is replaced)",
    )
    return p


def settings_from(argv: Sequence[str] | None) -> Settings:
    p = parser()
    args = p.parse_args(argv)
    command = args.trainer[1:] if args.trainer[:1] == ["--"] else args.trainer
    if not command:
        p.error("the trainer command is missing (after --)")
    if not args.job or not args.token or not args.node:
        p.error(
            "--job, --node and --token are needed (or PITSTOP_JOB, PITSTOP_NODE and "
            "PITSTOP_AGENT_TOKEN)"
        )
    try:
        devices = [int(d) for d in args.devices.split(",") if d.strip()]
    except ValueError:
        p.error(f"--devices: expected numbers like 0,1,2, got {args.devices!r}")
    if not devices or len(set(devices)) != len(devices) or min(devices) < 0:
        p.error("--devices: distinct device numbers ≥ 0, at least one")
    if len(devices) > protocol.MAX_DEVICES:
        p.error(f"--devices: at most {protocol.MAX_DEVICES}")
    server_url(p, args.server)
    if args.store is not None:
        host, _, port = args.store.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--store: expected HOST:PORT, got {args.store!r}")
    elif args.serve_store:
        p.error("--serve-store needs --store HOST:PORT (the port to serve on)")
    if args.hang_factor <= 0 or args.hang_floor < 0 or args.straggler_factor <= 1:
        p.error("--hang-factor must be > 0, --hang-floor ≥ 0, --straggler-factor > 1")
    if (args.step_time is not None and not args.step_time > 0) or (
        args.first_step_floor is not None and not args.first_step_floor >= 0
    ):
        p.error("--step-time must be > 0, --first-step-floor ≥ 0")
    if args.straggler_steps < 1 or args.grace < 0 or args.command_timeout <= 0:
        p.error("--straggler-steps ≥ 1, --grace ≥ 0, --command-timeout > 0")
    return Settings(
        server=args.server,
        job=args.job,
        node=args.node,
        token=args.token,
        devices=devices,
        command=command,
        store=args.store,
        serve_store=args.serve_store,
        seconds=args.seconds,
        hang_factor=args.hang_factor,
        hang_floor_s=args.hang_floor,
        step_time_s=args.step_time,
        first_step_floor_s=args.first_step_floor,
        straggler_factor=args.straggler_factor,
        straggler_steps=args.straggler_steps,
        grace_s=args.grace,
        command_timeout_s=args.command_timeout,
        layers=args.layers,
        control=not args.no_control,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(Agent(settings).run())
