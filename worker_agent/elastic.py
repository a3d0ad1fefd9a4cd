"""A data-parallel loop that survives a lost replica without a restart: Pitstop's DDP.

    from worker_agent import elastic

    run = elastic.DataParallel(model, optimizer, micro_batches=8)  # instead of DDP(model)
    while run.step < steps:
        loss = run.train_step(lambda step, index: loss_of(model, batch(step, index)))

``micro_batches`` is the global batch in micro-batches, the same whatever the world; the step
asks ``loss_of(step, index)`` for this rank's share of the step's global micro-batch indices
(``0 … micro_batches − 1``, shared out evenly among the members in device order), sums the
gradients of every rank (one all-reduce of the flattened gradients and the loss, so the step
is DDP's: the same mean gradient over the global batch), steps the optimizer and returns the
global batch's mean loss. The data must be addressed by ``(step, index)``, so that whichever
rank computes a micro-batch computes the same one.

When a peer dies the all-reduce is left at once (the agent sets the generation's abort key, or
the transport fails and this rank sets it): the step leaves no trace (the gradients are zeroed,
the optimizer has not stepped) and the rank waits for the control plane's plan. A plan that
keeps this rank (``apply_plan``: its devices, under a new generation) is joined and the step is
run again on the new world: the lost replica's micro-batches are rerouted to the survivors
(Odyssey's data rerouting at the replica level), the global batch and the learning-rate schedule
unchanged; the loss and weights match an uninterrupted run's within float rounding (the sum of
the micro-batches' gradients is taken in another order). A plan without this rank leaves it
idle; ``stop`` ends it (``Stopped``, a ``SystemExit`` with status 0). A process started again
into a generation (its predecessor crashed; the launcher starts it) takes the model, optimizer
state and step of a live replica as it joins (``_enter``): FlashRecovery's restore from peers.

Under ``pitstop-run --elastic`` the launcher gives each process its device, the job's store
(hosted by node 0's launcher), the generation and the world's members (``PITSTOP_DEVICE``,
``PITSTOP_STORE``, ``PITSTOP_GENERATION``, ``PITSTOP_MEMBERS``). Under plain ``torchrun`` there
is no agent: rank 0 hosts a store at ``MASTER_ADDR:MASTER_PORT``, the members are the ranks,
and a lost peer ends the run as under DDP.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from worker_agent import protocol
from worker_agent.link import CommandMessage, LinkError, TrainerLink
from worker_agent.trainer.comm import Aborted, AbortWatcher, Generation, connect


class Stopped(SystemExit):
    """The agent said stop: the run ends, with status 0."""

    def __init__(self) -> None:
        super().__init__(0)


def share(members: Sequence[int], device: int, micro_batches: int) -> range:
    """``device``'s micro-batch indices of a step: ``micro_batches`` shared out evenly among
    the sorted ``members``, the first ones taking one more when they do not divide."""
    ordered = sorted(members)
    rank = ordered.index(device)
    each, extra = divmod(micro_batches, len(ordered))
    first = rank * each + min(rank, extra)
    return range(first, first + each + (1 if rank < extra else 0))


class DataParallel:
    """``model`` trained by data parallelism over the job's members, in memory across a lost
    replica (module docstring). ``model`` and ``optimizer`` are the script's own; the step
    runs their backward and ``optimizer.step()`` itself."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batches: int,
        link: TrainerLink | None = None,
    ) -> None:
        if micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        self.model, self.optimizer, self.micro_batches = model, optimizer, micro_batches
        self.link = link if link is not None else TrainerLink.from_env()
        self.step = 0
        self._last: float | None = None  # when the previous step ended
        self.params = [p for p in model.parameters() if p.requires_grad]
        env = os.environ
        if self.link.active:
            if self.link.device is None or self.link.store is None:
                raise RuntimeError("the agent gave no device or store: run under --elastic")
            self.device = self.link.device
            host, _, port = self.link.store.rpartition(":")
            members = env.get("PITSTOP_MEMBERS", "")
            everyone = [int(d) for d in members.split(",") if d] or [self.device]
            prefix = self.link.generation
            self._host, self._port = host, int(port)
            self.store: Any = connect(host, int(port))
        else:  # plain torchrun: its store, or rank 0's, as a script's init_process_group
            self.device, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
            everyone, prefix = list(range(world)), "d0/"
            self._host = env.get("MASTER_ADDR", "127.0.0.1")
            self._port = int(env.get("MASTER_PORT", "29500"))
            hosts = self.device == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            self.store = dist.TCPStore(
                self._host, self._port, world, is_master=hosts, wait_for_workers=False
            )
        self.generation: Generation | None = None
        self._watcher: AbortWatcher | None = None
        try:
            self._enter(prefix, everyone)
        except Aborted:  # a peer failed before the first step: wait for the plan around it
            if not self.link.active:
                raise
            self._leave()
            self.link.set_state("idle")
            return
        self.link.set_state("training")

    # --- the world --------------------------------------------------------------------------

    @property
    def members(self) -> tuple[int, ...]:
        return self.generation.members if self.generation is not None else ()

    def _join(self, prefix: str, members: Sequence[int]) -> None:
        """Build the generation of ``members`` under ``prefix`` (every member calls it)."""
        abort = threading.Event()
        watcher = AbortWatcher(self._host, self._port, prefix, abort)
        try:
            generation = Generation(self.store, prefix, self.device, members, abort)
        except Aborted:
            watcher.stop()
            raise
        self._leave()
        self.generation, self._watcher = generation, watcher

    def _leave(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.generation is not None:
            self.generation.abandon()
        self.generation, self._watcher = None, None

    def _enter(self, prefix: str, members: Sequence[int]) -> None:
        """Join the generation of ``members`` and start it from one state (every member calls
        it, the new ones from their start, the others when the plan comes): when every member
        is at the same step, the lowest member's weights, as DDP's broadcast; otherwise the
        model, optimizer state and step of the lowest member furthest on, copied to the others
        over the network (a restarted or replacement process restored from a live replica:
        FlashRecovery's restore from peers, no checkpoint)."""
        self._join(prefix, members)
        generation = self.generation
        assert generation is not None
        steps = torch.zeros(len(generation.members), dtype=torch.int64)
        steps[generation.rank] = self.step + 1
        generation.guard(lambda: generation.all_reduce(generation.members, steps))
        furthest = int(steps.max())
        if int(steps.min()) == furthest:
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            generation.guard(lambda: generation.broadcast(flat, min(generation.members)))
            self._unflatten(flat, [p.data for p in self.params])
            return
        source = generation.members[int((steps == furthest).nonzero()[0])]
        state = self._state_of(generation, source)
        if self.device != source:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])

    def _state_of(self, generation: Generation, source: int) -> dict[str, Any]:
        """``source``'s model, optimizer state and step, on every member (its length, then its
        bytes, each broadcast)."""
        blob = b""
        if self.device == source:
            buffer = io.BytesIO()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save({**state, "step": self.step}, buffer)
            blob = buffer.getvalue()
        size = torch.tensor([len(blob)], dtype=torch.int64)
        generation.guard(lambda: generation.broadcast(size, source))
        if blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        else:
            data = torch.empty(int(size), dtype=torch.uint8)
        generation.guard(lambda: generation.broadcast(data, source))
        loaded: dict[str, Any] = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        return loaded

    # --- the step ---------------------------------------------------------------------------

    def train_step(self, loss_of: Callable[[int, int], torch.Tensor]) -> float:
        """One optimizer step over the global batch: ``loss_of(step, index)`` for this rank's
        micro-batches, the gradients summed over every member, ``optimizer.step()``. A step a
        peer's loss interrupts is run again on the world of the next plan. Returns the global
        batch's mean loss."""
        while True:
            self._carry_out_waiting()
            if self.generation is None:
                self._wait_for_plan()
                continue
            started = time.perf_counter()
            try:
                loss = self._try_step(self.generation, loss_of)
            except Aborted:
                self.optimizer.zero_grad(set_to_none=True)  # the step leaves no trace
                self._leave()
                self.link.set_state("idle")
                self._last = None
                continue
            self.step += 1
            # from the previous step's end, the script's own work between steps included, as
            # torchrun scripts' steps are timed (the agent compares ranks' step times: the
            # all-reduce alone would make whichever rank waits for the other look slow)
            now = time.perf_counter()
            self.link.report_step(self.step, loss, now - (self._last or started))
            self._last = now
            return loss

    def _try_step(
        self, generation: Generation, loss_of: Callable[[int, int], torch.Tensor]
    ) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for index in share(generation.members, self.device, self.micro_batches):
            if generation.abort.is_set():
                raise Aborted("a peer failed")
            loss = loss_of(self.step, index) / self.micro_batches
            torch.autograd.backward(loss)
            total += float(loss.detach())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([*(g.reshape(-1) for g in grads), torch.tensor([total])])
        generation.guard(lambda: generation.all_reduce(generation.members, flat))
        self._unflatten(flat[:-1], grads)
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        self.optimizer.step()
        return float(flat[-1])

    @staticmethod
    def _unflatten(flat: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        offset = 0
        for tensor in into:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view_as(tensor))
            offset += n

    # --- the agent's commands ---------------------------------------------------------------

    def _carry_out_waiting(self) -> None:
        """Commands that came between steps (a plan, a pause, a stop)."""
        while (command := self.link.poll_command(0)) is not None:
            self._carry_out(command)

    def _wait_for_plan(self) -> None:
        """Idle (this rank is in no plan, or its generation was aborted) until a command."""
        if not self.link.active:
            raise RuntimeError("a peer was lost and no agent is here to recover: the run ends")
        command = self.link.poll_command(0.5)
        if command is None:
            if self.link.agent_gone:
                raise Stopped
            return
        self._carry_out(command)

    def _carry_out(self, command: CommandMessage) -> None:
        if command.action == "stop":
            self.link.done(command.id, True)
            self._leave()
            raise Stopped
        if command.action in ("pause", "resume"):
            self.link.done(command.id, True)  # a pause holds between steps: nothing to keep
            return
        if command.action != "apply_plan" or command.plan is None:
            why = LinkError(code="unsupported", message=f"{command.action} is not carried out")
            self.link.done(command.id, False, why)
            return
        if command.restore not in (None, "peers"):
            why = LinkError(message=f"restore {command.restore!r}: only peers", field="restore")
            self.link.done(command.id, False, why)
            return
        members = sorted(protocol.plan_devices(command.plan))
        if self.generation is not None and command.generation == self.generation.prefix:
            self.link.done(command.id, True)  # started in it (a restarted process): joined
            return
        if self.device not in members:  # not in the plan: idle until one takes it again
            self._leave()
            self.link.set_state("idle")
            self.link.done(command.id, True)
            return
        self.link.set_state("restoring")
        try:
            self._enter(command.generation, members)
        except Aborted as exc:
            self.link.done(command.id, False, LinkError(code="aborted", message=str(exc)))
            self.link.set_state("idle")
            return
        if command.step is not None:
            self.step = command.step
        self.link.set_state("training")
        self.link.done(command.id, True)
