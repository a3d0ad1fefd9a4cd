"""Run the trainer on this machine: one process per device, a TCPStore hosted here, loopback only.

``run_local(devices, phases, config)`` is what the tests and the benchmark command use. A run is
a list of ``Phase``s, each a plan and a number of steps under a generation of its own (prefix
``gen{i}/``); a phase can carry the weights over from the previous one (moving layers between
devices as ``handover.transfers`` says) and can inject a fault: a device hangs before a given
step, the launcher SIGKILLs it (or leaves it hung) and sets the generation's abort key, as an
agent that saw a peer die would. Survivors of an aborted phase go on to the next one with the
step they lost.

Every rank sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``. Ranks compute where
``TrainConfig.accelerator`` says (``device.select``; on CUDA or an NPU, device d's rank takes
device index d modulo the devices here, so a run needs as many of them as ranks).
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from worker_agent.trainer.comm import Aborted, request_abort
from worker_agent.trainer.device import check_ranks, resolve
from worker_agent.trainer.engine import StepResult, TrainConfig, TrainPlan, Worker
from worker_agent.trainer.rank import Rank

HOST = "127.0.0.1"
HANG_S = 3600.0


@dataclass(frozen=True, slots=True)
class Fault:
    """``device`` hangs before step ``before_step`` of its phase (counted from 0 in the phase).

    Once it hangs the launcher waits ``settle_s`` (the others block on it), SIGKILLs it if
    ``kill``, and sets the phase's abort key.
    """

    device: int
    before_step: int = 0
    kill: bool = True
    settle_s: float = 0.3


@dataclass(frozen=True, slots=True)
class Phase:
    """A plan (the core's plan dict) run for ``steps`` steps under a generation of its own."""

    plan: dict[str, Any]
    steps: int
    carry: bool = False  # keep the weights of the previous phase, moving layers as needed
    fault: Fault | None = None
    first_step: int | None = None  # the data's step number to start at; None: go on counting


@dataclass
class RunResult:
    """What the ranks reported: steps, aborts and (when asked) the weights after each phase."""

    # steps[phase]: every rank's report of every step of the phase
    steps: dict[int, list[StepResult]] = field(default_factory=dict)
    # (phase, device, step, time.time() when the rank left the aborted step)
    aborts: list[tuple[int, int, int, float]] = field(default_factory=list)
    # (phase, device, killed, time.time() just before the kill, or before the abort key was set)
    faults: list[tuple[int, int, bool, float]] = field(default_factory=list)
    # weights[phase][device][layer][parameter name]
    weights: dict[int, dict[int, dict[int, dict[str, np.ndarray]]]] = field(default_factory=dict)
    # generation build times: (phase, device, seconds)
    builds: list[tuple[int, int, float]] = field(default_factory=list)

    def losses(self, phase: int = 0) -> dict[int, float]:
        """The loss of every step of a phase (all ranks report the same; the lowest device's)."""
        out: dict[int, float] = {}
        for r in sorted(self.steps.get(phase, []), key=lambda r: r.device):
            out.setdefault(r.step, r.loss)
        return out

    def step_times(self, phase: int = 0) -> dict[int, float]:
        """Every step's time in a phase: the slowest rank's."""
        out: dict[int, float] = {}
        for r in self.steps.get(phase, []):
            out[r.step] = max(out.get(r.step, 0.0), r.step_time_s)
        return out


def _weights(worker: Worker) -> dict[int, dict[str, np.ndarray]]:
    return {
        k: {name: p.detach().cpu().numpy().copy() for name, p in layer.named_parameters()}
        for k, layer in worker.layers.items()
    }


def rank_main(
    device: int,
    port: int,
    phases: list[Phase],
    config: TrainConfig,
    out: Any,
    collect_weights: bool,
    cpus: set[int] | None = None,
) -> None:
    """One rank: every phase it takes part in, reporting to ``out`` (a multiprocessing queue)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    try:
        _rank_phases(device, port, phases, config, out, collect_weights)
        out.put(("done", device))
    except BaseException:  # reported to the launcher
        out.put(("error", device, traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)  # never wait on the threads of abandoned groups


def _rank_phases(
    device: int,
    port: int,
    phases: list[Phase],
    config: TrainConfig,
    out: Any,
    collect_weights: bool,
) -> None:
    rank = Rank(device, HOST, port, config)
    live: set[int] = set()  # devices that ran the previous phase and did not fail
    for i, phase in enumerate(phases):
        if phase.first_step is not None:
            rank.step = phase.first_step
        prefix = f"gen{i}/"
        rank.apply(phase.plan, prefix, live=live, fresh=not phase.carry)
        live = set(TrainPlan.parse(phase.plan, config.model.layers).held) | set(live)
        if phase.fault is not None:
            live.discard(phase.fault.device)
        if rank.generation is None:
            continue
        out.put(("build", i, device, rank.generation.build_s))
        for j in range(phase.steps if rank.training else 0):
            if phase.fault is not None and (phase.fault.device, phase.fault.before_step) == (
                device,
                j,
            ):
                rank.store.set(prefix + "hanging", str(device))
                time.sleep(HANG_S)
            try:
                result = rank.train_step()
            except Aborted:
                out.put(("aborted", i, device, rank.step, time.time()))
                break
            out.put(("step", i, result))
        if collect_weights:
            out.put(("weights", i, device, _weights(rank.worker)))
        rank.leave()


def run_local(
    devices: int,
    phases: list[Phase],
    config: TrainConfig | None = None,
    *,
    collect_weights: bool = False,
    timeout_s: float = 120.0,
    cpus: dict[int, set[int]] | None = None,
) -> RunResult:
    """Start ``devices`` rank processes (device ids 0..devices-1), run the phases, collect.

    The ranks are spawned processes with ``OMP_NUM_THREADS=1``; the caller's module must be
    importable again (the usual ``if __name__ == "__main__"`` guard for a script). ``cpus``
    pins device d's rank to the CPUs ``cpus[d]`` (``os.sched_setaffinity``; for measurements).
    """
    config = config or TrainConfig()
    for i, phase in enumerate(phases):  # refuse a bad plan here, not in every rank
        TrainPlan.parse(phase.plan, config.model.layers, field=f"phases[{i}].plan")
    # an absent accelerator, or too few devices, is refused here too; "auto" is resolved once
    kind = resolve(config.accelerator, option="TrainConfig.accelerator")
    check_ranks(kind, devices, option="TrainConfig.accelerator")
    config = replace(config, accelerator=kind)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = {
            d: ctx.Process(
                target=rank_main,
                args=(d, store.port, phases, config, out, collect_weights, (cpus or {}).get(d)),
                name=f"rank-{d}",
                daemon=True,
            )
            for d in range(devices)
        }
        for p in procs.values():
            p.start()
    finally:
        if env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env
    result = RunResult()
    waiting = set(procs)
    faulted: set[int] = set()
    pending = [(i, ph.fault) for i, ph in enumerate(phases) if ph.fault is not None]
    deadline = time.monotonic() + timeout_s
    try:
        while waiting - faulted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(waiting)} still running after {timeout_s} s")
            for i, fault in list(pending):
                if store.check([f"gen{i}/hanging"]):
                    pending.remove((i, fault))
                    faulted.add(fault.device)
                    time.sleep(fault.settle_s)
                    at = time.time()
                    if fault.kill:
                        os.kill(procs[fault.device].pid or 0, signal.SIGKILL)
                    request_abort(store, f"gen{i}/", f"device {fault.device} failed")
                    result.faults.append((i, fault.device, fault.kill, at))
            try:
                message = out.get(timeout=0.05)
            except queue_module.Empty:
                dead = [d for d in waiting - faulted if not procs[d].is_alive()]
                if dead and out.empty():
                    raise RuntimeError(f"ranks {dead} exited without reporting") from None
                continue
            kind = message[0]
            if kind == "step":
                result.steps.setdefault(message[1], []).append(message[2])
            elif kind == "aborted":
                result.aborts.append(tuple(message[1:]))
            elif kind == "build":
                result.builds.append(tuple(message[1:]))
            elif kind == "weights":
                _, i, d, weights = message
                result.weights.setdefault(i, {})[d] = weights
            elif kind == "done":
                waiting.discard(message[1])
            elif kind == "error":
                raise RuntimeError(f"rank {message[1]} failed:\n{message[2]}")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        out.close()
    for steps in result.steps.values():
        steps.sort(key=lambda r: (r.step, r.device))
    return result
