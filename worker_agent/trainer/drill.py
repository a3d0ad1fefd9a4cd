"""A scripted agent for recovery drills: rank processes on this machine, driven over their links.

``Drill`` plays the agent (and the control plane's part of a recovery) for tests and the
benchmark ``benchmarks/trainer_recovery.py``: it hosts the job's TCPStore on loopback, starts
``python -m worker_agent.trainer rank`` processes with a ``TrainerLink`` each, as the agent
does (``link.child_environment``), reads their lines, sees a rank die through ``waitpid``, sets
the generation's abort key and sends commands. Every event is stamped with ``time.monotonic()``
when the drill saw it.

```python
with Drill(plan, workdir) as drill:
    drill.start(range(8))
    drill.wait_steps(range(8), 3)
    killed_at = drill.kill(5)                        # SIGKILL; the waiter sees the exit
    drill.abort("d0/", 5)                           # as the agent does
    drill.apply(survivors, "d1-apply", new_plan, "d1/", restore="peers")
    first = drill.first_step_after(survivors, killed_at)
```
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from controlplane.recovery.codec import plan_from_dict, plan_to_dict
from controlplane.recovery.decision import decide
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Cluster,
    ClusterState,
    Failure,
    FailureKind,
    ModelProfile,
    Training,
)
from worker_agent.link import (
    CommandMessage,
    DoneMessage,
    StateMessage,
    StepMessage,
    child_environment,
    decode_from_rank,
    encode,
)

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Seen:
    """A line from a rank, and when the drill read it."""

    device: int
    at: float
    message: Any


class DrillError(RuntimeError):
    """A rank exited unexpectedly, or something awaited did not come in time."""


class Drill:
    """Rank processes of one job under a scripted agent."""

    def __init__(
        self,
        plan: dict[str, Any],
        workdir: Path,
        *,
        args: Sequence[str] = (),
        timeout_s: float = 120.0,
    ) -> None:
        self.workdir = workdir
        self.plan_file = workdir / "plan.json"
        workdir.mkdir(parents=True, exist_ok=True)
        self.plan_file.write_text(json.dumps(plan))
        self.args = list(args)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.socks: dict[int, socket.socket] = {}
        self.started: dict[int, float] = {}
        self.exited: dict[int, float] = {}  # when waitpid returned
        self.expected: set[int] = set()  # devices whose exit is no error (killed, stopped)
        self.seen: list[Seen] = []
        self._lines: queue.Queue[Seen] = queue.Queue()

    def __enter__(self) -> Drill:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # --- the ranks ---

    def start(
        self,
        devices: Iterable[int],
        *,
        generation: str = "d0/",
        args: Sequence[str] = (),
        plan: dict[str, Any] | None = None,
    ) -> float:
        """Start a rank per device (replacing any earlier process of that device), training
        ``plan`` (default: the drill's first plan) under ``generation``; when."""
        at = time.monotonic()
        plan_file = self.plan_file
        if plan is not None:
            plan_file = self.workdir / f"plan-{generation.strip('/')}.json"
            plan_file.write_text(json.dumps(plan))
        for device in devices:
            ours, theirs = socket.socketpair()
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                **child_environment(
                    fd=theirs.fileno(),
                    device=device,
                    node="n0",
                    generation=generation,
                    store=f"{HOST}:{self.store.port}",
                ),
            }
            command = [sys.executable, "-m", "worker_agent.trainer", "rank"]
            command += ["--plan", str(plan_file), *self.args, *args]
            self.procs[device] = subprocess.Popen(
                command, cwd=ROOT, env=env, pass_fds=(theirs.fileno(),)
            )
            theirs.close()
            self.socks[device] = ours
            self.started[device] = time.monotonic()
            self.exited.pop(device, None)
            self.expected.discard(device)
            proc = self.procs[device]
            threading.Thread(target=self._read, args=(device, ours), daemon=True).start()
            threading.Thread(target=self._wait, args=(device, proc), daemon=True).start()
        return at

    def _read(self, device: int, sock: socket.socket) -> None:
        try:
            for line in sock.makefile("rb"):
                message = decode_from_rank(line)
                if message is not None:
                    self._lines.put(Seen(device, time.monotonic(), message))
        except OSError:
            return

    def _wait(self, device: int, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        if self.procs.get(device) is proc:
            self.exited[device] = time.monotonic()

    def kill(self, device: int) -> float:
        """SIGKILL a rank; the time just before."""
        self.expected.add(device)
        at = time.monotonic()
        os.kill(self.procs[device].pid, signal.SIGKILL)
        return at

    def stop_all(self) -> None:
        """SIGKILL every rank still running and reap it (a restart's first half)."""
        for device, proc in self.procs.items():
            self.expected.add(device)
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=30)
        for sock in self.socks.values():
            sock.close()

    def abort(self, generation: str, device: int) -> None:
        """Set ``<generation>abort`` as the agent does when a rank dies."""
        value = {"node": "n0", "device": device, "kind": "crash", "at": time.time()}
        self.store.set(f"{generation}abort", json.dumps(value))

    def send(self, devices: Iterable[int], **fields: Any) -> None:
        message = encode(CommandMessage(**fields))
        for device in devices:
            self.socks[device].sendall(message)

    def apply(
        self,
        devices: Iterable[int],
        command: str,
        plan: dict[str, Any],
        generation: str,
        *,
        restore: str | None = None,
        step: int | None = None,
        holders: Sequence[int] | None = None,
    ) -> float:
        """Send ``apply_plan`` to ``devices``; when."""
        at = time.monotonic()
        self.send(
            devices,
            id=command,
            action="apply_plan",
            plan=plan,
            generation=generation,
            restore=restore,
            step=step,
            holders=None if holders is None else list(holders),
        )
        return at

    def timing(self, generation: str, device: int) -> dict[str, float]:
        """The timings a rank put in the store after applying a plan under ``generation``."""
        key = f"{generation}timing/{device}"
        if not self.store.check([key]):
            return {}
        value: dict[str, float] = json.loads(self.store.get(key))
        return value

    # --- waiting ---

    def pump(self, timeout: float = 0.05) -> None:
        """Take the lines read so far; fail if a rank exited that should not have."""
        try:
            self.seen.append(self._lines.get(timeout=timeout))
            while True:
                self.seen.append(self._lines.get_nowait())
        except queue.Empty:
            pass
        for device, proc in self.procs.items():
            code = proc.poll()
            if code is not None and code != 0 and device not in self.expected:
                raise DrillError(f"rank {device} exited with {code}")

    def wait(self, predicate: Any, what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not predicate():
            if time.monotonic() > deadline:
                raise DrillError(f"timed out waiting for {what}")
            self.pump()

    def steps(self, device: int, after: float = 0.0) -> list[Seen]:
        return [
            s
            for s in self.seen
            if s.device == device and s.at > after and isinstance(s.message, StepMessage)
        ]

    def wait_steps(self, devices: Iterable[int], n: int, after: float = 0.0) -> None:
        """Until every device reported ``n`` steps after ``after``."""
        devices = list(devices)
        self.wait(
            lambda: all(len(self.steps(d, after)) >= n for d in devices),
            f"{n} steps of {devices}",
        )

    def done(self, command: str) -> dict[int, Seen]:
        return {
            s.device: s
            for s in self.seen
            if isinstance(s.message, DoneMessage) and s.message.command == command
        }

    def wait_done(self, devices: Iterable[int], command: str) -> dict[int, Seen]:
        devices = list(devices)
        self.wait(lambda: set(devices) <= set(self.done(command)), f"{command} done")
        return self.done(command)

    def first_step_after(self, devices: Iterable[int], after: float) -> float:
        """When the slowest of ``devices`` reported its first step after ``after``."""
        devices = list(devices)
        self.wait_steps(devices, 1, after)
        return max(self.steps(d, after)[0].at for d in devices)

    def states(self, device: int) -> list[str]:
        return [
            s.message.state
            for s in self.seen
            if s.device == device and isinstance(s.message, StateMessage)
        ]

    def losses(self, device: int) -> dict[int, float]:
        """The loss of every step ``device`` reported (a step redone: its last report)."""
        out: dict[int, float] = {}
        for s in self.steps(device):
            out[s.message.step] = float("nan") if s.message.loss is None else s.message.loss
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for sock in self.socks.values():
            sock.close()


def core_decision(
    plan: dict[str, Any],
    failed: Iterable[int],
    policy: str,
    *,
    spares: int = 0,
    micro_batch: int = 2,
) -> tuple[dict[str, Any], float, float]:
    """The core's plan for ``failed`` devices of ``plan`` by ``policy`` alone (``decide``), and
    the estimator's step time of the old plan and of the new one (a uniform profile: every
    layer's forward 1 unit, backward 2). Raises ``DrillError`` if the policy declines."""
    layers = max(s["layers"][1] for p in plan["pipelines"] for s in p["stages"])
    used = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    profile = ModelProfile.uniform(name="trainer", layers=layers, fwd_s=1e-3, bwd_s=2e-3)
    cluster = Cluster(devices=max(used) + 1, spares=spares)
    old = plan_from_dict(plan, profile=profile, cluster=cluster)
    micro = sum(p.micro_batches for p in old.pipelines)
    training = Training(global_batch=micro * micro_batch, micro_batch=micro_batch)
    lost = frozenset(failed)
    state = ClusterState(profile=profile, cluster=cluster, training=training, plan=old)
    decision = decide(
        state.with_failure(Failure(FailureKind.CRASH, lost)),
        Failure(FailureKind.CRASH, lost),
        policies=[policy],
    )
    best = decision.best
    if best is None or best.plan is None:
        notes = "; ".join(f"{c.policy}: {c.note}" for c in decision.candidates)
        raise DrillError(f"{policy} has no plan: {notes}")
    before = estimate_step_time(profile, cluster, old)
    after = estimate_step_time(profile, cluster, best.plan)
    return plan_to_dict(best.plan), before, after
