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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from worker_agent import protocol
from worker_agent.link import CommandMessage, LinkError, TrainerLink
from worker_agent.selfprofile import StepProfiler, local_part, nbytes
from worker_agent.trainer.comm import POLL_S, Aborted, AbortWatcher, Generation, connect
from worker_agent.trainer.device import CPU, Accelerator, select

# A process that started itself again for a plan (``HybridSharded``) acknowledges the plan's
# command, named here, once it has joined the plan's world.
JOINED_VARIABLE = "PITSTOP_JOINED_COMMAND"
# Seconds a rank of a replica group waits for a command its group peer already has (the agents
# send every command to all their ranks; a copy arrives within milliseconds)
COMMAND_PATIENCE_S = 10.0
# Steps a world measures (after its first) before the profile goes to the control plane;
# PITSTOP_PROFILE_STEPS=0 turns the measurement off.
MEASURED_STEPS = int(os.environ.get("PITSTOP_PROFILE_STEPS", "3"))


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


def _like(local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's shard of a tensor sharded as ``reference`` is (or itself)."""
    if not isinstance(reference, DTensor):
        return local
    return DTensor.from_local(
        local,
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )


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
        self._connect(micro_batches, link)
        self._attach(model, optimizer)

    def _connect(self, micro_batches: int, link: TrainerLink | None) -> None:
        """This process's device, the job's store and the world it starts in."""
        if micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        self.micro_batches = micro_batches
        self.link = link if link is not None else TrainerLink.from_env()
        self.step = 0
        self._last: float | None = None  # when the previous step ended
        env = os.environ
        if self.link.active:
            if self.link.device is None or self.link.store is None:
                raise RuntimeError("the agent gave no device or store: run under --elastic")
            self.device = self.link.device
            host, _, port = self.link.store.rpartition(":")
            members = env.get("PITSTOP_MEMBERS", "")
            self._everyone = [int(d) for d in members.split(",") if d] or [self.device]
            # the generation the process was started in, with PITSTOP_MEMBERS (the link's own
            # follows the commands, and one may have come before the process started)
            self._prefix = env.get("PITSTOP_GENERATION") or self.link.generation
            self._host, self._port = host, int(port)
            self.store: Any = connect(host, int(port))
        else:  # plain torchrun: its store, or rank 0's, as a script's init_process_group
            self.device, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
            self._everyone, self._prefix = list(range(world)), "d0/"
            self._host = env.get("MASTER_ADDR", "127.0.0.1")
            self._port = int(env.get("MASTER_PORT", "29500"))
            hosts = self.device == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            self.store = dist.TCPStore(
                self._host, self._port, world, is_master=hosts, wait_for_workers=False
            )
        self.generation: Generation | None = None
        self._watcher: AbortWatcher | None = None
        # this world's measurement: its generation, its steps so far, the hooks' profiler
        self._profile: tuple[str, int, StepProfiler] | None = None
        self._unsent: StepProfiler | None = None  # measured, its profile sent at the next step

    def _attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Train ``model`` with ``optimizer``: join the first world and start it from one
        state (a process started again into a generation takes a live replica's)."""
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        # where the model is, the collectives are: gloo on the CPU, nccl on CUDA, hccl on an NPU
        on = local_part(self.params[0]).device if self.params else torch.device("cpu")
        self.accelerator = CPU if on.type == "cpu" else Accelerator(on.type, on.index)
        try:
            self._enter(self._prefix, self._everyone)
        except Aborted as exc:  # a peer failed before the first step: wait for the plan around it
            if not self.link.active:
                raise
            self._leave()
            self.link.set_state("idle")
            joined = os.environ.pop(JOINED_VARIABLE, None)
            if joined:  # the plan this process started itself again for failed
                self.link.done(joined, False, LinkError(code="aborted", message=str(exc)))
            return
        joined = os.environ.pop(JOINED_VARIABLE, None)
        if joined:  # started again by its own process for this plan (HybridSharded)
            self.link.done(joined, True)
        self.link.set_state("training")

    @property
    def _on(self) -> torch.device:
        """The device of this rank's tensors (the model's)."""
        return self.accelerator.torch_device

    # --- what DataParallel and HybridSharded do differently ---------------------------------

    def _group_of(self, device: int) -> int:
        """The replica a device belongs to: here each device is one."""
        return device

    def _replicas(self, members: Sequence[int]) -> list[tuple[int, ...]]:
        """The device sets whose tensors are replicas of one another (summed, broadcast)."""
        return [tuple(sorted(members))]

    def _peers(self, members: Sequence[int]) -> tuple[int, ...]:
        return next(r for r in self._replicas(members) if self.device in r)

    def _passes(self, members: Sequence[int]) -> list[tuple[int, float]]:
        """This rank's forward-backward passes of a step: a micro-batch index and its weight."""
        return [(i, 1.0) for i in share(members, self.device, self.micro_batches)]

    def _sync_gradients(self, last: bool) -> None:
        """Before each pass: whether its backward is the step's last."""

    def _refusal(self, members: Sequence[int]) -> LinkError | None:
        """Why this rank cannot train in a world of ``members``, if it cannot."""
        return None

    def _agree(self, synced: bool) -> bool:
        """Whether the step is taken, once this rank's sync ``synced`` or not: the ranks that
        hold one replica take it together (here, one rank is the replica)."""
        return synced

    def _before_entering(self, command: CommandMessage, members: Sequence[int]) -> None:
        """What a plan that keeps this rank needs before the rank joins its generation."""

    # --- the world --------------------------------------------------------------------------

    @property
    def members(self) -> tuple[int, ...]:
        return self.generation.members if self.generation is not None else ()

    def _join(self, prefix: str, members: Sequence[int]) -> None:
        """Build the generation of ``members`` under ``prefix`` (every member calls it)."""
        abort = threading.Event()
        watcher = AbortWatcher(self._host, self._port, prefix, abort)
        # a store connection of its own: an abandoned generation's build may still wait on its
        # own (a TCPStore client serves one request at a time), which would hold this one up
        store = connect(self._host, self._port)
        try:
            subsets = self._replicas(members)
            generation = Generation(
                store, prefix, self.device, members, abort, subsets=subsets,
                accelerator=self.accelerator,
            )  # fmt: skip
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
        is at the same step, the lowest replica's weights, as DDP's broadcast; otherwise the
        model, optimizer state and step of the lowest replica furthest on, copied to the others
        over the network (a restarted or replacement process restored from a live replica:
        FlashRecovery's restore from peers, no checkpoint)."""
        self._join(prefix, members)
        generation = self.generation
        assert generation is not None
        peers = self._peers(generation.members)
        steps = torch.zeros(len(generation.members), dtype=torch.int64, device=self._on)
        steps[generation.rank] = self.step + 1
        generation.guard(lambda: generation.all_reduce(generation.members, steps))
        furthest = int(steps.max())
        if int(steps.min()) == furthest:
            flat = torch.cat([local_part(p).detach().reshape(-1) for p in self.params])
            generation.guard(lambda: generation.broadcast(flat, min(peers), peers))
            self._unflatten(flat, [local_part(p).data for p in self.params])
            return
        ahead = self._group_of(generation.members[int((steps == furthest).nonzero()[0])])
        source = next(d for d in peers if self._group_of(d) == ahead)
        state = self._state_of(generation, source, peers)
        if self.device != source:
            self._load(state)

    def _state_of(
        self, generation: Generation, source: int, peers: Sequence[int]
    ) -> dict[str, Any]:
        """``source``'s model, optimizer state and step (its shard of them, sharded), on every
        one of ``peers`` (its length, then its bytes, each broadcast)."""
        blob = b""
        if self.device == source:
            buffer = io.BytesIO()
            torch.save(self._state(), buffer)
            blob = buffer.getvalue()
        size = torch.tensor([len(blob)], dtype=torch.int64, device=self._on)
        generation.guard(lambda: generation.broadcast(size, source, peers))
        if blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self._on)
        else:
            data = torch.empty(int(size), dtype=torch.uint8, device=self._on)
        generation.guard(lambda: generation.broadcast(data, source, peers))
        loaded: dict[str, Any] = torch.load(
            io.BytesIO(data.cpu().numpy().tobytes()), map_location=self._on, weights_only=True
        )
        return loaded

    def _state(self) -> dict[str, Any]:
        """Model, optimizer state and step, a sharded tensor as this rank's shard of it."""
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            index: {key: local_part(value).clone() for key, value in values.items()}
            for index, values in optimizer["state"].items()
        }
        model = {name: local_part(value).clone() for name, value in self.model.state_dict().items()}
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def _load(self, state: dict[str, Any]) -> None:
        """Take a replica's ``_state()``, each shard placed as this rank's own."""
        mine = self.model.state_dict()
        self.model.load_state_dict({k: _like(v, mine[k]) for k, v in state["model"].items()})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optimizer = state["optimizer"]
        optimizer["state"] = {
            index: {
                key: _like(value, params[index])
                if value.shape == local_part(params[index]).shape
                else value
                for key, value in values.items()
            }
            for index, values in optimizer["state"].items()
        }
        self.optimizer.load_state_dict(optimizer)
        self.step = int(state["step"])

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
        self._send_profile()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        passes = self._passes(generation.members)
        profiler = self._measuring(generation)
        if profiler is not None:
            profiler.attach()
        try:
            for n, (index, weight) in enumerate(passes):
                self._sync_gradients(n == len(passes) - 1)
                total += self._pass(generation, loss_of, index, weight)
                if profiler is not None:
                    profiler.pass_done(time.perf_counter())
        finally:
            if profiler is not None:
                profiler.detach()
        grads = [
            local_part(p.grad)
            if p.grad is not None
            else local_part(p).new_zeros(local_part(p).shape)
            for p in self.params
        ]
        flat = torch.cat([*(g.reshape(-1) for g in grads), torch.tensor([total], device=self._on)])
        peers = self._peers(generation.members)
        began = time.perf_counter()
        try:
            generation.guard(lambda: generation.all_reduce(peers, flat))
            synced = time.perf_counter()
            loss = flat[-1:]
            if peers != generation.members:  # the loss of every rank, not only the replicas
                loss = torch.tensor([total], device=self._on)
                generation.guard(lambda: generation.all_reduce(generation.members, loss))
        except Aborted:
            self._agree(False)
            raise
        if not self._agree(True):
            raise Aborted("a rank of the replica group did not finish the step's sync")
        self._unflatten(flat[:-1], grads)
        for p, g in zip(self.params, grads, strict=True):
            if p.grad is None:
                p.grad = _like(g, p)
        stepping = time.perf_counter()
        self.optimizer.step()
        if profiler is not None:
            profiler.updates.append(time.perf_counter() - stepping)
            profiler.syncs.append((nbytes(flat), synced - began, len(peers)))
            self._measured(generation, profiler)
        return float(loss[0])

    # --- measuring itself -------------------------------------------------------------------

    def _measuring(self, generation: Generation) -> StepProfiler | None:
        """The profiler of this step, when it is one of the measured steps of this world: under
        an agent, on the lowest member, the steps after the world's first (its groups' first
        use) up to ``MEASURED_STEPS``."""
        if MEASURED_STEPS < 1 or not self.link.active or self.device != min(generation.members):
            return None
        if self._profile is None or self._profile[0] != generation.prefix:
            self._profile = (generation.prefix, 0, StepProfiler(self.model))
        prefix, seen, profiler = self._profile
        self._profile = (prefix, seen + 1, profiler)
        return profiler if 1 <= seen <= MEASURED_STEPS else None

    def _measured(self, generation: Generation, profiler: StepProfiler) -> None:
        """After a measured step: the last one's profile is sent (the job's scenario is made of
        it), for this world, at the start of the next step (``_send_profile``)."""
        if self._profile is not None and self._profile[1] == MEASURED_STEPS + 1:
            self._unsent = profiler

    def _send_profile(self) -> None:
        """The measured profile to the agent, before the step's passes: the work only this rank
        does falls before the step's sync, where its peers wait for it in the same step (after
        the sync, it would lengthen this rank's step alone, and make it look a straggler)."""
        if self._unsent is None:
            return
        profiler, self._unsent = self._unsent, None
        message = profiler.message(
            self.optimizer, micro_batches=self.micro_batches, time_scale=1 / self._group_size()
        )
        self.link.profile(message)

    def _group_size(self) -> int:
        """Ranks that run a replica's micro-batches at once (HSDP's group; here one)."""
        return 1

    def _pass(
        self,
        generation: Generation,
        loss_of: Callable[[int, int], torch.Tensor],
        index: int,
        weight: float,
    ) -> float:
        """One micro-batch's forward and backward; its share of the global mean loss."""
        if generation.abort.is_set():
            raise Aborted("a peer failed")
        loss = loss_of(self.step, index) * (weight / self.micro_batches)
        torch.autograd.backward(loss)
        return float(loss.detach())

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
        refused = self._refusal(members) if self.device in members else None
        if refused is not None:
            self.link.done(command.id, False, refused)
            return
        if self.generation is not None:
            # the plan's world replaces this one: a peer still in it (its copy of the plan not
            # come yet, a plan no fault preceded) leaves its collectives now, not at a timeout
            self.generation.fail(f"device {self.device}: superseded by {command.generation}")
        if self.device not in members:  # not in the plan: idle until one takes it again
            self._leave()
            self.link.set_state("idle")
            self.link.done(command.id, True)
            return
        self._before_entering(command, members)
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


class HybridSharded(DataParallel):
    """HSDP in memory: ``fully_shard`` within replica groups of ``shard_size`` devices (device
    ``d`` in group ``d // shard_size``), the groups data-parallel replicas of one another.

        run = elastic.HybridSharded(micro_batches=8, shard_size=2)
        for layer in model.layers:
            fully_shard(layer, mesh=run.mesh)  # the replica group's mesh
        fully_shard(model, mesh=run.mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run.start(model, optimizer)
        while run.step < steps:
            loss = run.train_step(lambda step, index: loss_of(model, batch(step, index)))

    Within a group, FSDP2 gathers the parameters and reduce-scatters the gradients over the
    group's own gloo group (``run.mesh``; the process's default group). Across groups, the
    gradient shards are summed by the generation's abortable all-reduce, one per shard index
    (the replicate dimension), and each rank steps its shard of the optimizer.

    A lost rank takes its group out: the plan (``rerouting``) keeps the other groups, which
    run the step again on the lost group's micro-batches, as ``DataParallel``. A group comes
    back as new processes: the launcher starts the dead rank again, and a rank whose group's
    collectives failed (or whose group peers do not answer) starts itself again in place
    (``TrainerLink.exec_again``, the same process and link), so that the group's FSDP state
    and collectives are made anew; each takes its shard of the model and optimizer state
    from the rank of the same shard index in a live group.

    The group's collectives are FSDP's own and cannot be aborted: a peer killed (its
    sockets closed) fails them at once; a peer cut off by the network holds them until
    ``timeout``.
    """

    def __init__(
        self,
        *,
        micro_batches: int,
        shard_size: int,
        link: TrainerLink | None = None,
        timeout: timedelta = timedelta(seconds=30),
        accelerator: str = "cpu",
    ) -> None:
        if shard_size < 1:
            raise ValueError("shard_size must be at least 1")
        self.shard_size = shard_size
        self._connect(micro_batches, link)
        # the group's collectives' backend and the mesh's device (``auto``: CUDA, an NPU, else
        # the CPU); the model is sharded onto it, and ``start`` finds it there
        self.accelerator = select(accelerator, device=self.device, option="accelerator")
        self.accelerator.activate()
        told = os.environ.get("PITSTOP_REPLICA_SIZE")
        if told and int(told) != shard_size:
            raise ValueError(
                f"shard_size {shard_size} but the launcher's --replica-size is {told}: "
                "a replica group is the devices of one replica"
            )
        refused = self._refusal(self._everyone)
        if refused is not None:
            raise ValueError(refused.message)
        self._broken = False  # the group's collectives failed: this process starts again
        group, index = divmod(self.device, shard_size)
        dist.init_process_group(
            self.accelerator.backend,
            store=dist.PrefixStore(f"{self._prefix}shard/{group}/", self.store),
            rank=index,
            world_size=shard_size,
            timeout=timeout,
        )
        self.mesh = init_device_mesh(self.accelerator.kind, (shard_size,))

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Train ``model`` (``fully_shard``-ed on ``self.mesh``) with ``optimizer``."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # the group's gradients summed, not averaged: the step divides by the micro-batches
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self._attach(model, optimizer)

    def _group_of(self, device: int) -> int:
        return device // self.shard_size

    def _group_size(self) -> int:
        return self.shard_size

    def _replicas(self, members: Sequence[int]) -> list[tuple[int, ...]]:
        return [
            tuple(d for d in sorted(members) if d % self.shard_size == index)
            for index in range(self.shard_size)
        ]

    def _passes(self, members: Sequence[int]) -> list[tuple[int, float]]:
        """The group's share of the micro-batches, dealt round its ranks; every rank of a
        group runs as many passes (FSDP's collectives are the group's), a rank short of one
        running a micro-batch again with weight 0."""
        groups = sorted({self._group_of(d) for d in members})
        ours = share(groups, self._group_of(self.device), self.micro_batches)
        mine = list(ours)[self.device % self.shard_size :: self.shard_size]
        count = -(-len(ours) // self.shard_size)
        return [(i, 1.0) for i in mine] + [(ours.start, 0.0)] * (count - len(mine))

    def _sync_gradients(self, last: bool) -> None:
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)

    def _agree(self, synced: bool) -> bool:
        """The group steps only if every rank of it synced: across groups a rank's all-reduce
        may complete where its group peer's failed (a peer died midway), and a group whose
        shards stood at different steps would have no state to restore from. A vote over the
        group's own collectives (which a dead group peer fails: then the group is broken)."""
        vote = torch.tensor([1 if synced else 0], device=self._on)
        try:
            dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        except RuntimeError:
            self._broken = True
            return False
        return bool(vote[0])

    def _carry_out_waiting(self) -> None:
        """The ranks of a replica group take a command at the same step boundary: a vote over
        the group (any rank's command pending) before each step, and a rank whose copy has not
        come yet waits for it. Otherwise one rank could enter the plan's world while its group
        peer, a step in, waits for it in FSDP's collectives (a plan no fault preceded)."""
        if self.generation is None or not self.link.active or self.shard_size == 1:
            super()._carry_out_waiting()
            return
        command = self.link.poll_command(0)
        pending = torch.tensor([0 if command is None else 1], device=self._on)
        try:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        except RuntimeError:  # a group peer is gone: the generation is over, a plan will come
            self._broken = True
            self._leave()
            self.link.set_state("idle")
        if command is None and int(pending[0]):
            command = self.link.poll_command(COMMAND_PATIENCE_S)
        if command is not None:
            self._carry_out(command)
        super()._carry_out_waiting()

    def _pass(
        self,
        generation: Generation,
        loss_of: Callable[[int, int], torch.Tensor],
        index: int,
        weight: float,
    ) -> float:
        # no abort before or between a group's passes: FSDP's collectives are the group's,
        # and its ranks see an abort at different moments (each leaves at the sync, then they
        # vote: ``_agree``); FSDP keeps the unsynced gradients of the passes before, which the
        # step's last backward reduces
        try:
            loss = loss_of(self.step, index) * (weight / self.micro_batches)
            torch.autograd.backward(loss)
        except RuntimeError as exc:
            if not _transport_error(exc):
                raise
            self._broken = True
            generation.fail(f"device {self.device}: its replica group failed: {exc}")
            raise Aborted(f"the replica group failed: {exc}") from exc
        return float(loss.detach())

    def _refusal(self, members: Sequence[int]) -> LinkError | None:
        groups = {self._group_of(d) for d in members}
        whole = {g * self.shard_size + i for g in groups for i in range(self.shard_size)}
        if whole == set(members):
            return None
        return LinkError(
            message=f"devices {sorted(members)} split a replica group of {self.shard_size}",
            field="plan",
        )

    def _before_entering(self, command: CommandMessage, members: Sequence[int]) -> None:
        if self._broken or not self._group_answers():
            self._leave()
            env = dict(os.environ)
            env.update(
                {
                    "PITSTOP_GENERATION": command.generation,
                    "PITSTOP_MEMBERS": ",".join(map(str, members)),
                    JOINED_VARIABLE: command.id,
                }
            )
            self.link.exec_again(env)

    def _group_answers(self, patience: float = 5.0) -> bool:
        """Whether every peer of the replica group is the process this one trained with (one
        all-reduce over the group: a dead peer fails it, a new one never joins it)."""
        if self.shard_size == 1:
            return True
        try:
            work = dist.all_reduce(torch.ones(1, device=self._on), async_op=True)
            deadline = time.monotonic() + patience
            while not work.is_completed():
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_S)
            work.wait()
        except RuntimeError:
            return False
        return True


def _transport_error(exc: RuntimeError) -> bool:
    """Whether ``exc`` is a collective's failure (a peer gone), not the script's own error."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        word in text
        for word in ("gloo/transport", "connection reset", "connection closed", "timed out")
    )
