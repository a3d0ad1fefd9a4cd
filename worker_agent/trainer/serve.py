"""A rank under the agent: the reference trainer's training loop over ``TrainerLink``.

    python -m worker_agent run ... -- python -m worker_agent.trainer rank --plan FILE

The agent starts one such process per device and gives it its device, the job's store and the
generation (``PITSTOP_DEVICE``, ``PITSTOP_STORE``, ``PITSTOP_GENERATION``; docs/trainer.md,
"The agent"). The rank trains the plan of FILE from the initial weights, reports every step,
and carries out the agent's commands:

- ``apply_plan``: join the new generation and move the layers the new plan needs from their
  holders (``Rank.apply``; the holders asked are the devices of both plans and the command's
  ``holders``, the previous plan's live devices that the new plan leaves out: such a rank sends
  what it is asked for and then idles, a spare), then train on from ``step`` when the command
  gives one. A step in progress is left first: at once when the
  generation is aborted (the agent sets ``<generation>abort`` when a rank dies or hangs), or
  after a grace of a few step times when it is not (peers that already moved on).
- ``pause`` / ``resume`` (``resume`` may give the step to go on from); ``stop`` ends the rank.
- ``restore`` on its own is refused: ``apply_plan`` with ``restore: checkpoint`` reloads the
  checkpoint under a new generation.

The command's ``restore`` says where layers that no device of the new plan holds come from:
``peers`` (the default), ``neighbours`` / ``neighbours_plus`` (CheckFree), ``checkpoint``
(``Rank.apply``). A mode the rank does not know is refused (``invalid``, field ``restore``).
With a ``dump`` directory the rank writes its state after each applied plan and when it ends
(``dump``), and every apply's timings go to the store (``<generation>timing/<device>``), for
drills and tests.

A plan the trainer cannot run (tp > 1, a layer with no live holder) is refused with the field
at fault, and the rank keeps its state.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from controlplane.recovery.errors import RecoveryError
from worker_agent.link import CommandMessage, LinkError, TrainerLink
from worker_agent.trainer.comm import Aborted
from worker_agent.trainer.engine import PlanNotSupported, TrainConfig, TrainPlan
from worker_agent.trainer.handover import NoHolder
from worker_agent.trainer.rank import BadRestore, Rank

# A command that needs the rank out of its step waits this many step times (and at least
# GRACE_FLOOR_S) for the step to end by itself before it aborts it.
GRACE_STEPS = 3.0
GRACE_FLOOR_S = 1.0
PREEMPTING = ("apply_plan", "stop")


@dataclass
class _Pump:
    """Moves the agent's commands into a queue; a preempting one aborts a step stuck too long.

    ``pending`` is set while a preempting command waits in the queue (the loop clears it when it
    takes one): if the loop is in a step meanwhile, the step gets the grace, then the abort.
    """

    link: TrainerLink
    rank: Rank
    commands: queue.Queue[CommandMessage | None]
    in_step: threading.Event
    pending: threading.Event
    last_step_s: float = 0.0

    def run(self) -> None:
        for command in self.link.commands():
            if command.action in PREEMPTING:
                self.pending.set()
            self.commands.put(command)
            deadline: float | None = None
            while self.pending.is_set():
                if not self.in_step.is_set():
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + max(GRACE_FLOOR_S, GRACE_STEPS * self.last_step_s)
                elif time.monotonic() >= deadline and self.rank.abort is not None:
                    self.rank.abort.set()
                    break
                time.sleep(0.01)
        self.commands.put(None)


def serve(
    link: TrainerLink,
    plan: Any,
    config: TrainConfig,
    *,
    host: str,
    port: int,
    device: int,
    max_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    dump: Path | None = None,
) -> int:
    """Train ``plan`` and carry out the agent's commands until ``stop`` or the agent is gone
    (without an agent: until ``max_steps``). ``resume``: start from the newest complete
    checkpoint in ``checkpoint_dir`` rather than the initial weights."""
    rank = Rank(
        device,
        host,
        port,
        config,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )
    rank.dump = dump
    link.set_state("restoring")
    try:
        rank.apply(plan, link.generation, fresh=True, restore="checkpoint" if resume else "peers")
        _record(rank, "start")
        state = "training" if rank.training else "idle"
        if not rank.training:  # a warm standby: ready to take a stage without first-use costs
            rank.worker.warm_up()
    except Aborted:  # a peer failed before the first step: wait for the plan around it
        state = "idle"
    link.set_state(state)
    commands: queue.Queue[CommandMessage | None] = queue.Queue()
    in_step, pending = threading.Event(), threading.Event()
    pump = _Pump(link, rank, commands, in_step, pending)
    if link.active:
        threading.Thread(target=pump.run, name="commands", daemon=True).start()
    while max_steps is None or rank.step < max_steps:
        training = state == "training" and rank.training
        try:
            command = commands.get(timeout=0 if training else 0.1)
        except queue.Empty:
            command = None
        else:
            if command is None:  # the agent is gone
                _record(rank, "end")
                return 0
            if command.action in PREEMPTING:
                pending.clear()
            if command.action == "stop":  # before the done: then the agent stops every rank
                _record(rank, "end")
            state = _carry_out(link, rank, command, state)
            if command.action == "stop":
                return 0
            continue
        if not training:
            if not link.active:
                return 0  # alone, with nothing to train
            continue
        in_step.set()
        try:
            result = rank.train_step()
        except Aborted:
            state = "idle"  # the step left no trace; a new plan comes
            link.set_state(state)
            continue
        finally:
            in_step.clear()
        pump.last_step_s = result.step_time_s
        link.report_step(result.step, result.loss, result.step_time_s, samples=result.samples)
    _record(rank, "end")
    return 0


def _record(rank: Rank, tag: str) -> None:
    """The last apply's timings in the store; with a dump directory, the rank's state in
    ``DIR/{device}-{tag}.pt``: step, gradient norm, every held layer's ``export_layer`` and
    every CheckFree+ copy's ``export_edge``."""
    if rank.generation is not None and rank.timings:
        key = f"{rank.generation.prefix}timing/{rank.device}"
        rank.store.set(key, json.dumps({**rank.timings, "at": time.time()}))
    directory = rank.dump
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "step": rank.step,
        "grad_norm": rank.worker.grad_norm,
        "layers": {k: rank.worker.export_layer(k).cpu() for k in sorted(rank.worker.layers)},
        "copies": {k: rank.worker.export_edge(k).cpu() for k in sorted(rank.worker.copies)},
    }
    tmp = directory / f".{rank.device}-{tag}.pt"
    torch.save(state, tmp)
    tmp.replace(directory / f"{rank.device}-{tag}.pt")


def _carry_out(link: TrainerLink, rank: Rank, command: CommandMessage, state: str) -> str:
    """Carry out one command; the state the rank is in after it."""
    action = command.action
    if action == "apply_plan":
        if command.plan is None:
            link.done(
                command.id, False, LinkError(message="apply_plan without a plan", field="plan")
            )
            return state
        try:
            new = TrainPlan.parse(command.plan, rank.config.model.layers)
            live = set(rank.plan.held if rank.plan else ()) & set(new.held)
            live |= set(command.holders or ())  # live devices the new plan leaves out
            link.set_state("restoring")
            rank.apply(
                command.plan, command.generation, live=live, restore=command.restore or "peers"
            )
            _record(rank, command.id)
        except BadRestore as exc:
            link.done(command.id, False, LinkError(message=str(exc), field="restore"))
            link.set_state(state)
            return state
        except (PlanNotSupported, RecoveryError, NoHolder) as exc:
            field = getattr(exc, "field", None) or "plan"
            link.done(command.id, False, LinkError(message=str(exc), field=field))
            link.set_state(state)
            return state
        except Aborted as exc:
            link.done(command.id, False, LinkError(code="aborted", message=str(exc)))
            link.set_state("idle")
            return "idle"
        if command.step is not None:
            rank.step = command.step
        state = "training" if rank.training else "idle"
    elif action == "pause":
        state = "paused"
    elif action == "resume":
        if command.step is not None:
            rank.step = command.step
        state = "training" if rank.training else "idle"
    elif action == "restore":
        message = (
            "restore on its own is not carried out: the generation would not change; send "
            "apply_plan with restore: checkpoint"
        )
        link.done(command.id, False, LinkError(code="unsupported", message=message))
        return state
    elif action == "stop":
        state = "idle"
    link.set_state(state)
    link.done(command.id, True)
    return state
