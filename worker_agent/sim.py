"""Simulated nodes: agents that speak the real protocol without trainers.

For scale tests and demos: each simulated node says hello, sends a heartbeat every interval the
server asks for (its step advancing at the step time, its devices training), and carries out
the commands it is sent as a node's agent would: an ``apply_plan`` is checked (with a scenario
file, against its model and cluster, by the core's codec), then its devices restore for
``--restore-s`` and train again at the step they stopped at, at the step time the core's
estimator gives the new plan. A command id is carried out once and acknowledged every time it
comes. Sockets reconnect with a jittered back-off; SIGTERM or Ctrl-C says goodbye and stops.

    python -m worker_agent simulate --server ws://127.0.0.1:8000 --job NAME --token TOKEN
        --nodes 4 [--devices-per-node 8] [--first-node 0] [--scenario FILE] [--seconds S]
        [--ramp S]

Bounded: at most 4,096 nodes, and a loopback server unless ``--allow-remote`` (a container
network). ``PITSTOP_SERVER``, ``PITSTOP_JOB`` and ``PITSTOP_AGENT_TOKEN`` give the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker_agent import protocol
from worker_agent.connection import Uplink, server_url

log = logging.getLogger("worker_agent.sim")
MAX_NODES = 4096
# The fault an agent reports for each injected kind (``drop`` is the socket's, not a device's).
SIMULATED_FAULT = {
    protocol.InjectKind.KILL: protocol.FaultKind.CRASH,
    protocol.InjectKind.HANG: protocol.FaultKind.HANG,
    protocol.InjectKind.SLOW: protocol.FaultKind.STRAGGLER,
    protocol.InjectKind.NAN: protocol.FaultKind.NAN,
}


@dataclass
class Node:
    """One simulated node: its devices, its training progress and the commands it carried out."""

    name: str
    devices: list[int]
    step_s: float
    restore_s: float
    check_plan: Callable[[dict[str, Any]], float | None] | None = None
    state: protocol.DeviceState = protocol.DeviceState.TRAINING
    step_at: int = 0  # the step when training (re)started
    since: float = field(default_factory=time.monotonic)
    outcomes: dict[str, protocol.Ack] = field(default_factory=dict)  # command id -> its ack
    stopped: bool = False
    failed: set[int] = field(default_factory=set)  # devices a drill killed or hung
    plan_devices: set[int] | None = None  # the devices the last plan applied uses, if any
    _reports: tuple[tuple[protocol.DeviceState, ...], list[protocol.DeviceReport]] | None = None

    @property
    def step(self) -> int:
        if self.state is not protocol.DeviceState.TRAINING:
            return self.step_at
        return self.step_at + int((time.monotonic() - self.since) / self.step_s)

    def pause(self, state: protocol.DeviceState) -> None:
        self.step_at, self.state = self.step, state

    def train(self) -> None:
        self.since, self.state = time.monotonic(), protocol.DeviceState.TRAINING

    def heartbeat(self, seq: int) -> protocol.Heartbeat:
        step = self.step
        training = self.state is protocol.DeviceState.TRAINING
        return protocol.Heartbeat(
            seq=seq,
            at=time.time(),
            step=step,
            loss=1.5 + 2.5 * math.exp(-step / 500),
            samples_per_s=len(self.devices) / self.step_s if training else 0.0,
            step_time_s=self.step_s,
            devices=self.reports(),
        )

    def reports(self) -> list[protocol.DeviceReport]:
        """Each device's report, made again only when a state changed: eight models a beat were
        a tenth of a thousand simulated agents' time in one process (a frame takes them as
        they are: the models are frozen)."""
        states = tuple(self.state_of(d) for d in self.devices)
        if self._reports is None or self._reports[0] != states:
            pairs = zip(self.devices, states, strict=True)
            self._reports = (states, [protocol.DeviceReport(device=d, state=s) for d, s in pairs])
        return self._reports[1]

    def state_of(self, device: int) -> protocol.DeviceState:
        """As the agent reports it: a killed device is failed while the plan still uses it, and
        idle once a plan leaves it out."""
        if device not in self.failed:
            return self.state
        used = self.plan_devices is None or device in self.plan_devices
        return protocol.DeviceState.FAILED if used else protocol.DeviceState.IDLE

    def inject(
        self, command_id: str, injection: protocol.Injection, uplink: Uplink
    ) -> protocol.Ack:
        """A drill (``inject``), once per id: the fault a rank would have shown reported as the
        agent would report it (a killed or hung device stays failed); ``drop`` drops the socket."""
        done = self.outcomes.get(command_id)
        if done is not None:
            return done
        error = None
        kind = injection.kind
        if kind is protocol.InjectKind.DROP:
            uplink.drop()
        elif injection.device not in self.devices:
            error = protocol.Error(
                code=protocol.ErrorCode.INVALID,
                message=f"device {injection.device} is not on {self.name}",
                field="inject.device",
            )
        else:
            if kind in (protocol.InjectKind.KILL, protocol.InjectKind.HANG):
                self.failed.add(injection.device)
            uplink.fault(
                SIMULATED_FAULT[kind],
                [injection.device],
                step=self.step,
                message=f"{kind.value} injected by a drill (simulated)",
            )
        ack = protocol.Ack(command=command_id, ok=error is None, at=time.time(), error=error)
        self.outcomes[command_id] = ack
        return ack

    async def carry_out(self, command: protocol.Command) -> protocol.Ack:
        """Do what ``command`` asks, once per id; the acknowledgement to send."""
        done = self.outcomes.get(command.id)
        if done is not None:
            return done  # sent again (a reconnection, a restart): not carried out twice
        error = None
        if command.action is protocol.Action.APPLY_PLAN:
            error = await self.apply(command.plan or {})
        elif command.action is protocol.Action.PAUSE:
            self.pause(protocol.DeviceState.PAUSED)
        elif command.action is protocol.Action.RESUME:
            self.train()
        elif command.action is protocol.Action.STOP:
            self.pause(protocol.DeviceState.IDLE)
            self.stopped = True
        ack = protocol.Ack(command=command.id, ok=error is None, at=time.time(), error=error)
        self.outcomes[command.id] = ack
        return ack

    async def apply(self, plan: dict[str, Any]) -> protocol.Error | None:
        step_s = None
        if self.check_plan is not None:
            try:
                step_s = self.check_plan(plan)
            except ValueError as exc:
                return protocol.Error(code=protocol.ErrorCode.INVALID, message=str(exc))
        used = _devices_of(plan)
        self.plan_devices = used
        self.pause(protocol.DeviceState.RESTORING)
        await asyncio.sleep(self.restore_s)  # the weights this node's new stages need
        if step_s is not None:
            self.step_s = step_s
        if used & set(self.devices):
            self.train()
        else:
            self.pause(protocol.DeviceState.IDLE)  # a spare under this plan
        return None


_devices: tuple[object, set[int]] | None = None  # the latest plan's pipelines, and its devices


def _devices_of(plan: dict[str, Any]) -> set[int]:
    """The devices ``plan`` uses: once per plan however many nodes of this process apply it,
    not 16,384 devices a node (each command's plan is a new dict, but its pipelines are the
    same object: ``protocol.unpack_plan``). Not changed."""
    global _devices
    pipelines = plan.get("pipelines")
    if _devices is None or _devices[0] is not pipelines:
        _devices = (pipelines, protocol.plan_devices(plan))
    return _devices[1]


async def keep_connected(
    node: Node, url: str, job: str, token: str, stop: asyncio.Event, after_s: float = 0.0
) -> None:
    """The node's socket (``connection.Uplink``), opened ``after_s`` from now, until ``stop``,
    or a ``stop`` command."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=after_s)
    if stop.is_set():
        return
    leave = asyncio.Event()  # the whole simulation stops, or this node was told to

    async def on_command(frame: protocol.Command) -> None:
        began = time.monotonic()
        if frame.inject is not None:
            ack = node.inject(frame.id, frame.inject, uplink)
        else:
            ack = await node.carry_out(frame)
        uplink.ack(ack)
        if frame.inject is None and ack.ok and node.state is protocol.DeviceState.TRAINING:
            # as a node's agent does: the beats that show it training again, and its first
            # step, go at once, for the control plane times a recovery by them
            uplink.beat_now()
            asyncio.get_running_loop().call_later(node.step_s, uplink.beat_now)
        log.info("%s: %s %s of decision %s in %.2f s", node.name, frame.action.value,
                 "done" if ack.ok else "refused", frame.decision,
                 time.monotonic() - began)  # fmt: skip
        if node.stopped:
            leave.set()

    uplink = Uplink(url, job=job, node=node.name, token=token, devices=node.devices,
                    agent="pitstop-sim", heartbeat=node.heartbeat,
                    on_command=on_command)  # fmt: skip

    async def relay() -> None:
        await stop.wait()
        leave.set()

    relayed = asyncio.create_task(relay())
    try:
        await uplink.run(leave)
    finally:
        relayed.cancel()


def plan_checker(path: str) -> Callable[[dict[str, Any]], float | None]:
    """A plan's step time by the core's estimator, for the scenario's model and cluster; a
    ValueError saying what is wrong with a plan that does not fit it."""
    from controlplane.recovery.codec import plan_from_dict, scenario_from_dict
    from controlplane.recovery.errors import RecoveryError
    from controlplane.recovery.estimator.time import estimate_step_time

    with open(path) as handle:
        state = scenario_from_dict(json.load(handle)).state

    def check(plan: dict[str, Any]) -> float | None:
        try:
            parsed = plan_from_dict(plan, profile=state.profile, cluster=state.cluster)
        except RecoveryError as exc:
            raise ValueError(str(exc)) from None
        return estimate_step_time(state.profile, state.cluster, parsed)

    return check


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m worker_agent simulate", description=__doc__.split("\n\n")[0]
    )
    env = os.environ.get
    p.add_argument("--server", default=env("PITSTOP_SERVER", "ws://127.0.0.1:8000"),
                   help="the control plane's address (ws://HOST:PORT)")  # fmt: skip
    p.add_argument("--job", default=env("PITSTOP_JOB"), help="the job's name")
    p.add_argument("--token", default=env("PITSTOP_AGENT_TOKEN"), help="the job's agent token")
    p.add_argument("--nodes", type=int, default=1, help=f"nodes to simulate (≤ {MAX_NODES})")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--first-node", type=int, default=0, help="index of the first node to play")
    p.add_argument("--step-time", type=float, default=1.0, help="seconds a step (no --scenario)")
    p.add_argument("--scenario", help="the job's scenario file: plans are checked and timed "
                   "by the core's estimator")  # fmt: skip
    p.add_argument("--restore-s", type=float, default=0.2, help="seconds to apply a plan")
    p.add_argument("--seconds", type=float, help="stop after this long (default: when stopped)")
    p.add_argument("--ramp", type=float, default=0.0,
                   help="seconds over which the nodes open their sockets, evenly (default: "
                   "at once; thousands at once outlast an agent's 10 s to open)")  # fmt: skip
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a server that is not on loopback (a container network)")  # fmt: skip
    return p


def check_arguments(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not args.job or not args.token:
        p.error("--job and --token are needed (or PITSTOP_JOB and PITSTOP_AGENT_TOKEN)")
    if not 1 <= args.nodes <= MAX_NODES:
        p.error(f"--nodes must be within 1..{MAX_NODES}")
    if args.devices_per_node < 1 or args.first_node < 0:
        p.error("--devices-per-node must be ≥ 1 and --first-node ≥ 0")
    if not args.step_time > 0 or args.restore_s < 0 or not 0 <= args.ramp <= 3600:
        p.error("--step-time must be > 0, --restore-s ≥ 0 and --ramp within 0..3600")
    url = server_url(p, args.server)
    if not args.allow_remote and not _loopback(url.hostname or ""):
        p.error(f"--server {url.hostname} is not on loopback; add --allow-remote to mean it")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def simulate(args: argparse.Namespace) -> None:
    check = plan_checker(args.scenario) if args.scenario else None
    step_s = args.step_time
    if check is not None:
        with open(args.scenario) as handle:
            step_s = check(json.load(handle)["plan"]) or step_s
    per = args.devices_per_node
    nodes = [
        Node(f"node-{i}", list(range(i * per, (i + 1) * per)), step_s, args.restore_s, check)
        for i in range(args.first_node, args.first_node + args.nodes)
    ]
    url = args.server.rstrip("/") + "/ws/agent/"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.seconds is not None:
        loop.call_later(args.seconds, stop.set)
    log.info("simulating %d nodes of %s at %.3g s a step", len(nodes), args.job, step_s)
    await asyncio.gather(
        *(
            keep_connected(n, url, args.job, args.token, stop, after_s=args.ramp * i / len(nodes))
            for i, n in enumerate(nodes)
        )
    )


# One process plays a thousand agents: its sockets and the plans it was sent are a few million
# objects that live as long as it does, and a full collection walked them all, 185 and 380 ms
# in which none of its nodes beat, each time a recovery's plan arrived (2,048 nodes). Young
# objects are collected every 50,000 allocations (Python's default: 700), the middle generation
# every 20 of those (10), and the old generation every 1,000 of the middle's (10).
GC_THRESHOLDS = (50_000, 20, 1_000)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_arguments(args, p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gc.set_threshold(*GC_THRESHOLDS)
    asyncio.run(simulate(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
