"""One device's trainer across generations: what the agent drives.

```python
rank = Rank(device=3, host="10.0.0.1", port=29500)   # a client of the job's TCPStore
rank.apply(plan_dict, prefix="gen0/")                 # initial weights of its stage
while running:
    try:
        result = rank.train_step()                    # StepResult: step, loss, step_time_s, ...
    except Aborted:                                   # a peer failed: the step left no trace
        rank.apply(new_plan_dict, prefix="gen1/", live=survivors)
```

``apply`` joins the generation of a plan under a fresh prefix: it builds the groups (every
device of the plan, and every device that must send layers, calls it with the same arguments),
starts an ``AbortWatcher`` on ``prefix + "abort"`` and, unless ``fresh``, moves the layers the
new plan needs from the live holders under the previous plan (``handover.transfers``). A device
that only sends layers, or has nothing to do with the new plan, returns holding nothing (every
device may call ``apply``; one that takes no part builds no group).

``restore`` says where the layers no device of the new plan holds come from:

- ``"peers"`` (the default): from a live device that held them under the previous plan
  (``handover``): rerouting, a dynamic re-plan, an in-memory restore onto a standby;
- ``"neighbours"``: a lost stage with no live copy is rebuilt as the gradient-norm weighted
  average of its pipeline neighbours (CheckFree), ``"neighbours_plus"`` also copies an edge stage
  from its swap partner (CheckFree+), its embedding or LM head from the partner's copy, which a
  rank keeps when its ``TrainConfig.checkfree_plus`` is set (``checkfree``); the other layers
  move from peers;
- ``"checkpoint"``: every device loads its stage from the newest complete checkpoint and the
  step goes back to the checkpoint's (``checkpoint``).

A mode that is not one of these is refused (``BadRestore``) before anything changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from worker_agent.trainer import checkpoint
from worker_agent.trainer.checkfree import Rebuild, rebuild, rebuilds, share_copies
from worker_agent.trainer.comm import (
    DEFAULT_TIMEOUT,
    AbortWatcher,
    Generation,
    connect,
    request_abort,
    run_abortable,
)
from worker_agent.trainer.engine import StepResult, TrainConfig, TrainPlan, Worker
from worker_agent.trainer.handover import NoHolder, handover, participants, transfers

RESTORES = ("peers", "neighbours", "neighbours_plus", "checkpoint")


class BadRestore(ValueError):
    """A restore mode the rank cannot carry out; ``field`` is ``restore``."""

    field = "restore"


class Rank:
    """A device's layers, its place in the current generation and the step counter."""

    def __init__(
        self,
        device: int,
        host: str,
        port: int,
        config: TrainConfig | None = None,
        *,
        timeout: timedelta = DEFAULT_TIMEOUT,
        checkpoint_dir: Path | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        self.device = device
        self.host = host
        self.port = port
        self.timeout = timeout
        self.config = config or TrainConfig()
        self.store = connect(host, port, timeout=timeout)
        self.worker = Worker(device, self.config)
        self.worker.accelerator.activate()
        self.plan: TrainPlan | None = None
        self.generation: Generation | None = None
        self.abort: threading.Event | None = None
        self.step = 0  # the next step to run: the data's step number
        self._watcher: AbortWatcher | None = None
        # ``checkpoint_every`` steps (0: never) the layers this device writes go to the directory
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        # seconds the last ``apply`` spent: regroup (groups, step agreement), transfer (layers)
        self.timings: dict[str, float] = {}
        self.dump: Path | None = None  # where a drill wants the rank's state (``serve``)

    @property
    def training(self) -> bool:
        """Whether this device runs a stage of the current plan."""
        return self.plan is not None and self.device in self.plan.held

    def apply(
        self,
        plan: Any,
        prefix: str,
        *,
        live: Iterable[int] | None = None,
        fresh: bool = False,
        abort: threading.Event | None = None,
        restore: str = "peers",
    ) -> None:
        """Join the generation that runs ``plan`` (the core's plan dict) under ``prefix``.

        ``live``: the devices that may send layers (default: those of both the previous plan
        and the new one). ``fresh``: start from the initial weights instead. ``abort``: an
        event the agent may set itself (a fresh one per generation); the generation's watcher
        sets it too. ``restore``: where layers no live device holds come from (the module's
        docstring). Raises ``comm.Aborted`` if the new generation is aborted while it is built or
        layers move; ``BadRestore``, ``NoHolder`` (``checkfree.NoSource``) and
        ``engine.PlanNotSupported`` before anything changes.
        """
        started, started_at = time.perf_counter(), time.time()
        if restore not in RESTORES:
            raise BadRestore(f"restore: unknown mode {restore!r}; known: {', '.join(RESTORES)}")
        new = TrainPlan.parse(plan, self.config.model.layers, swap=self.config.checkfree_plus)
        old = None if fresh else self.plan
        # a device of the new plan is alive by construction; one left out of it may be dead
        alive = set(old.held if old else ()) & set(new.held) if live is None else set(live)
        loaded: int | None = None
        rebuilt: list[Rebuild] = []
        if restore == "checkpoint":
            if self.checkpoint_dir is None:
                raise BadRestore("restore: this rank keeps no checkpoint (no checkpoint directory)")
            loaded = checkpoint.latest(self.checkpoint_dir, self.config.model.layers)
            if loaded is None:
                raise NoHolder(f"no complete checkpoint in {self.checkpoint_dir}")
            moves = []
        elif old is not None and restore.startswith("neighbours"):
            plus = restore == "neighbours_plus"
            rebuilt = rebuilds(
                old.plan, new.plan, alive, self.config.model, plus=plus, copies=old.copies
            )
            moves = transfers(old.plan, new.plan, alive, skip={r.layer for r in rebuilt})
        else:
            moves = transfers(old.plan, new.plan, alive) if old is not None else []
        senders = {src for r in rebuilt for src, _ in r.sources}
        members = sorted(set(participants(moves, new.plan)) | senders)
        self.leave()
        if self.device not in members:  # neither a stage nor a layer to send: idle
            self.worker.layers, self.worker.optimizers, self.worker.undo = {}, {}, None
            self.worker.copies, self.worker.copy_optimizers = {}, {}
            self.plan = new
            return
        self.abort = abort or threading.Event()
        self._watcher = AbortWatcher(self.host, self.port, prefix, self.abort)
        self.generation = Generation(
            # a store connection of its own: an abandoned generation's build may still wait on
            # its own (a TCPStore client serves one request at a time) and hold this one up
            connect(self.host, self.port, timeout=self.timeout),
            prefix,
            self.device,
            members,
            self.abort,
            subsets=new.sync_groups(),
            timeout=self.timeout,
            accelerator=self.worker.accelerator,
        )
        if old is not None and loaded is None:
            self._agree_on_step(old, self.generation)
        regrouped = time.perf_counter()
        if loaded is not None:
            if self.device in new.held:
                checkpoint.load(
                    self.worker, self.checkpoint_dir or Path(), loaded, *new.held[self.device]
                )
            else:
                self.worker.layers, self.worker.optimizers = {}, {}
            self.step = loaded
        elif old is None:
            self.worker.adopt(new)
        else:
            rebuild(self.worker, self.generation, rebuilt)
            handover(self.worker, self.generation, moves, new)
        if old is not None or loaded is not None:  # CheckFree+'s copies, as the layers are now
            share_copies(self.worker, self.generation, new)
        self.worker.undo = None
        self.plan = new
        self.timings = {
            "started_at": started_at,
            "regroup_s": regrouped - started,
            "transfer_s": time.perf_counter() - regrouped,
        }
        if old is None and loaded is None and self.checkpoint_every > 0:
            self._save()

    def _agree_on_step(self, old: TrainPlan, gen: Generation) -> None:
        """Every member of the new generation goes on from the same step.

        An abort that lands as a step's last all-reduce completes can leave some survivors with
        the step done and others without; those ahead undo it (``Worker.rollback``). A member
        that held no stage of the old plan takes the agreed step.
        """
        mine = self.step if self.device in old.held else -1
        self.store.set(f"{gen.prefix}step/{self.device}", str(mine))
        keys = [f"{gen.prefix}step/{d}" for d in gen.members]
        waiter = connect(self.host, self.port, timeout=self.timeout)  # a wait holds its client
        assert self.abort is not None
        run_abortable(lambda: waiter.wait(keys, self.timeout), self.abort, "agreeing on the step")
        known = [s for s in (int(self.store.get(k)) for k in keys) if s >= 0]
        if not known:
            return
        agreed = min(known)
        if max(known) > agreed + 1:
            raise RuntimeError(f"members are at steps {sorted(set(known))}: more than one apart")
        if mine > agreed:
            self.worker.rollback()
        self.step = agreed

    def train_step(self) -> StepResult:
        """One step of the current plan; the counter moves on only if it completed."""
        if self.plan is None or self.generation is None or not self.training:
            raise RuntimeError(f"device {self.device} has no stage in the current plan")
        result = self.worker.step(self.generation, self.plan, self.step)
        self.step += 1
        if self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0:
            self._save()
        return result

    def _save(self) -> None:
        """The layers this device writes, as the checkpoint of the current step."""
        if self.checkpoint_dir is not None and self.plan is not None and self.training:
            checkpoint.save(self.worker, self.plan, self.checkpoint_dir, self.step)

    def request_abort(self, reason: str = "abort") -> None:
        """Make every member of the current generation leave its collectives."""
        if self.generation is not None:
            request_abort(self.store, self.generation.prefix, reason)

    def leave(self) -> None:
        """Stop watching the current generation; its groups are left to the garbage collector,
        or kept for good if it was aborted (threads may still wait in them)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.generation is not None and self.abort is not None and self.abort.is_set():
            self.generation.abandon()
        self.generation = None
