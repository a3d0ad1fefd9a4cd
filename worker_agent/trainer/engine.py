"""One rank's training under an execution plan: pipeline × data parallel, 1F1B, rerouting.

``TrainPlan.parse(plan_dict, layers)`` reads a plan in the core's format (``codec.plan_to_dict``)
and refuses what the trainer cannot run (tp > 1, a rerouted stage on a device that does not hold
its layers). ``Worker(device, config)`` holds the layers of its own stage with one AdamW per
layer; ``Worker.step(generation, plan, step)`` runs one step and returns its ``StepResult``.
Its layers, optimizer state and the step's tensors live on ``Worker.accelerator``, the device
``TrainConfig.accelerator`` names for this device id (``device.select``; the CPU by default).

A step, on every device of the plan:

1. Runs its operations in the order of ``schedule.build_schedule``: forwards and backwards of its
   own stage's micro-batches and of the rerouted micro-batches it serves. Boundary activations
   and their gradients go point-to-point to the device that runs the next (previous) stage of
   the same micro-batch, with a tag naming the micro-batch, so every receive is posted at the
   start of the step. A last stage scales its micro-batch's mean loss by 1/N (N micro-batches
   over all pipelines) before the backward pass.
2. Sums the gradients of every sync segment (``estimator.sync.sync_rounds``: a run of layers
   held by the same devices) over the devices holding it, round by round. Each holder then has
   the gradient of the global-batch mean loss.
3. Sums the devices' shares of the loss (nonzero on last stages only) in one scalar all-reduce
   over the plan's devices: every rank returns the global-batch mean loss.
4. Steps every layer's optimizer.

Under CheckFree+ (``TrainConfig.checkfree_plus``) a pipeline of 4 stages or more runs its odd
micro-batches with its first two and last two stages swapped (``TrainPlan.swapped``), entering
through stage 1's copy of the embedding and leaving through the LM head's copy on the stage
before the last (``TrainPlan.copies``); the edge parts' gradients are summed over the layer's
holders and the copies' after step 2, so the copies stay equal to the layers. Without it
nothing of this runs.

An abort (``comm.Aborted``) leaves the weights and optimizer state as they were before the step,
with the step's gradients dropped, so a survivor can run the same step again under a new plan.
A completed step can be undone once (``Worker.rollback``), for a rank that completed a step its
peers lost to an abort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from controlplane.recovery.codec import plan_from_dict
from controlplane.recovery.estimator.sync import SyncSegment, sync_rounds
from controlplane.recovery.model import Cluster, ExecutionPlan, ModelProfile
from controlplane.recovery.policies.checkfree import MIN_STAGES_PLUS
from worker_agent.trainer.comm import Aborted, Generation
from worker_agent.trainer.data import Corpus
from worker_agent.trainer.device import Accelerator, select
from worker_agent.trainer.model import (
    Layer,
    ModelConfig,
    build_edge,
    build_layer,
    edge_parts,
    loss_of,
    run_layers,
)
from worker_agent.trainer.schedule import Op, build_schedule, executor, stage_at

# A device id bound for parsing plans: the trainer is given plans, it does not own a cluster.
MAX_DEVICES = 1 << 20


class PlanNotSupported(ValueError):
    """A plan the trainer cannot run; ``field`` names the value at fault, as the core does."""

    def __init__(self, message: str, *, field: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """The model, the samples per micro-batch, the optimizer (AdamW, or plain SGD) and where
    the layers compute (``accelerator``: ``cpu``, ``cuda``, ``npu`` or ``auto``; ``device.select``).

    The global batch is the plan's micro-batches times ``micro_batch``.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    micro_batch: int = 2
    data_seed: int = 0
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    accelerator: str = "cpu"
    # CheckFree+: pipelines of 4 stages or more train out of order (``TrainPlan.swapped``) and
    # their swap partners keep copies of the embedding and LM head (``TrainPlan.copies``)
    checkfree_plus: bool = False


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """A plan checked for the trainer, with what every step needs precomputed."""

    plan: ExecutionPlan
    schedule: dict[int, list[Op]]
    rounds: list[list[SyncSegment]]
    # global index of each pipeline's first micro-batch
    offsets: tuple[int, ...]
    held: dict[int, tuple[int, int]]
    # CheckFree+ (``swap``): the pipelines trained out of order (``schedule.stage_at``), the
    # devices that keep a copy of an edge layer's ``edge_parts`` (stage 1 of such a pipeline:
    # the embedding of layer 0; the stage before the last: the final norm and LM head of the
    # last layer), and every holder of each edge layer's parts (the layer's and the copies),
    # over which their gradients are summed; all empty without CheckFree+
    swapped: frozenset[int] = frozenset()
    copies: dict[int, tuple[int, ...]] = field(default_factory=dict)
    edge_holders: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def parse(
        cls, data: object, layers: int, *, field: str = "plan", swap: bool = False
    ) -> TrainPlan:
        """A plan dict in the core's format for a model of ``layers`` layers (``swap``: as
        CheckFree+ trains it)."""
        profile = ModelProfile.uniform(name="trainer", layers=layers, fwd_s=0.0, bwd_s=0.0)
        plan = plan_from_dict(data, profile=profile, cluster=Cluster(MAX_DEVICES), field=field)
        return cls.of(plan, field=field, swap=swap)

    @classmethod
    def of(cls, plan: ExecutionPlan, *, field: str = "plan", swap: bool = False) -> TrainPlan:
        held: dict[int, tuple[int, int]] = {}
        for p, s, stage in plan.stages():
            where = f"{field}.pipelines[{p}].stages[{s}].devices"
            if not stage.rerouted:
                if len(stage.devices) != 1:
                    raise PlanNotSupported(
                        f"tensor parallelism is not supported: the stage has "
                        f"{len(stage.devices)} devices (tp = {len(stage.devices)}), the "
                        "reference trainer runs tp = 1 only",
                        field=where,
                    )
                held[stage.devices[0]] = stage.layers
        for p, s, stage in plan.stages():
            if stage.rerouted:
                for d in stage.devices:
                    if held.get(d) != stage.layers:
                        raise PlanNotSupported(
                            f"rerouted stage of layers {list(stage.layers)} lists device {d}, "
                            "which does not run those layers as its own stage",
                            field=f"{field}.pipelines[{p}].stages[{s}].devices",
                        )
        offsets = [0]
        for pipeline in plan.pipelines[:-1]:
            offsets.append(offsets[-1] + pipeline.micro_batches)
        swapped, copies, edge_holders = _swaps(plan, held) if swap else (frozenset(), {}, {})
        return cls(
            plan=plan,
            schedule=build_schedule(plan, swapped=swapped),
            rounds=sync_rounds(plan),
            offsets=tuple(offsets),
            held=held,
            swapped=swapped,
            copies=copies,
            edge_holders=edge_holders,
        )

    @property
    def devices(self) -> list[int]:
        return sorted(self.held)

    @property
    def layers(self) -> int:
        return self.plan.pipelines[0].stages[-1].layers[1]

    def sync_groups(self) -> list[tuple[int, ...]]:
        """Device sets with a collective of their own: every sync segment's holders, and all
        the plan's devices (the loss; a generation may also hold devices that only send)."""
        segments = [
            tuple(sorted(d for g in seg.groups for d in g))
            for round_ in self.rounds
            for seg in round_
            if len(seg.groups) > 1
        ]
        return [*segments, *self.edge_holders.values(), tuple(self.devices)]

    def stage_at(self, pipeline: int, position: int, micro: int) -> int:
        """The stage ``micro`` runs at ``position`` of ``pipeline`` (``schedule.stage_at``)."""
        return stage_at(self.plan, pipeline, position, micro, self.swapped)

    def executor(self, pipeline: int, position: int, micro: int) -> int:
        """The device that runs ``micro`` at ``position`` of ``pipeline``."""
        return executor(self.plan, pipeline, position, micro, self.swapped)

    def tag(self, op: Op) -> int:
        """The tag of the message an operation receives: unique within one step."""
        stages = max(p.depth for p in self.plan.pipelines)
        micros = max(p.micro_batches for p in self.plan.pipelines)
        return ((op.pipeline * stages + op.stage) * micros + op.micro) * 2 + int(op.backward)


def _swaps(
    plan: ExecutionPlan, held: dict[int, tuple[int, int]]
) -> tuple[frozenset[int], dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """CheckFree+'s ``swapped``, ``copies`` and ``edge_holders`` of a plan (``TrainPlan``).

    A pipeline trains out of order when it has ``MIN_STAGES_PLUS`` stages or more (the two swap
    pairs must not overlap, as the core's policy requires) and none rerouted (a rerouted
    stage's micro-batches run on another pipeline's device, which keeps no copy).
    """
    swapped = frozenset(
        p
        for p, pipeline in enumerate(plan.pipelines)
        if pipeline.depth >= MIN_STAGES_PLUS and not any(s.rerouted for s in pipeline.stages)
    )
    if not swapped:
        return swapped, {}, {}
    last = plan.pipelines[0].stages[-1].layers[1] - 1
    copies: dict[int, list[int]] = {}
    for p in sorted(swapped):
        stages = plan.pipelines[p].stages
        copies.setdefault(stages[1].devices[0], []).append(0)
        copies.setdefault(stages[-2].devices[0], []).append(last)
    edge_holders = {
        k: tuple(
            sorted(
                {d for d, (first, end) in held.items() if first <= k < end}
                | {d for d, ks in copies.items() if k in ks}
            )
        )
        for k in (0, last)
    }
    return swapped, {d: tuple(sorted(ks)) for d, ks in copies.items()}, edge_holders


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step as one rank saw it: the global-batch mean loss is the same on every rank."""

    step: int
    loss: float
    step_time_s: float
    samples: int
    device: int = -1


@dataclass
class _Pass:
    """What a forward keeps for its backward."""

    inputs: torch.Tensor | None
    output: torch.Tensor  # the loss on a last stage


def flat_state(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, where: torch.device
) -> torch.Tensor:
    """Parameters and their AdamW state as one flat float32 tensor on ``where``: every
    parameter, every first moment, every second moment (zeros before the first step, and with
    SGD, which keeps no state), then each parameter's step count."""
    moments: list[torch.Tensor] = []
    for name in ("exp_avg", "exp_avg_sq"):
        for p in params:
            state = optimizer.state.get(p, {})
            moments.append(
                state[name].reshape(-1)
                if name in state
                else torch.zeros(p.numel(), device=p.device)
            )
    steps = [float(optimizer.state.get(p, {}).get("step", 0.0)) for p in params]
    parts = [p.detach().reshape(-1) for p in params] + moments
    parts.append(torch.tensor(steps, device=where))
    return torch.cat(parts).to(torch.float32)


def load_flat_state(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, flat: torch.Tensor
) -> None:
    """Set ``params`` and their state in ``optimizer`` from ``flat_state``'s layout (a
    parameter with a step count of 0 gets no state, as before its first step)."""
    total = sum(p.numel() for p in params)
    steps = flat[3 * total :]
    offset = 0
    views: list[list[torch.Tensor]] = [[], [], []]
    for part in range(3):
        for p in params:
            views[part].append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    with torch.no_grad():
        for p, value in zip(params, views[0], strict=True):
            p.copy_(value)
    for p, avg, avg_sq, count in zip(params, views[1], views[2], steps, strict=True):
        optimizer.state.pop(p, None)
        if float(count) > 0:
            optimizer.state[p] = {
                "step": torch.tensor(float(count)),
                "exp_avg": avg.clone(),
                "exp_avg_sq": avg_sq.clone(),
            }


@dataclass
class Worker:
    """The layers one device holds, their per-layer optimizers, and its share of each step."""

    device: int
    config: TrainConfig = TrainConfig()
    corpus: Corpus = field(default_factory=Corpus.default)
    layers: dict[int, Layer] = field(default_factory=dict)
    optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    # every held layer's state before the last step's optimizer update
    undo: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    # the L2 norm of the held layers' gradients in the last completed step (CheckFree's weight)
    grad_norm: float = 0.0
    _undo_norm: float = field(default=0.0, repr=False)
    # where the layers, their optimizer state and the step's tensors live (``device.select``)
    accelerator: Accelerator = field(init=False, repr=False)
    # CheckFree+: the copies this device keeps of edge layers' ``edge_parts`` (by layer), each
    # with its own optimizer, and their state before the last update (``rollback``)
    copies: dict[int, nn.ModuleDict] = field(default_factory=dict)
    copy_optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    _undo_copies: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        torch.set_num_threads(1)
        self.accelerator = select(
            self.config.accelerator, device=self.device, option="TrainConfig.accelerator"
        )

    @property
    def where(self) -> torch.device:
        """The torch device of this worker's tensors."""
        return self.accelerator.torch_device

    def build(self, index: int) -> Layer:
        """Layer ``index`` with its initial weights (drawn on the CPU, from its own seed, so
        that every device kind starts from the same ones), on this worker's device."""
        return build_layer(self.config.model, index).to(self.where)

    # --- the layers held ---

    def fresh_optimizer(self, layer: nn.Module) -> torch.optim.Optimizer:
        c = self.config
        if c.optimizer == "sgd":
            return torch.optim.SGD(layer.parameters(), lr=c.lr, foreach=False)
        return torch.optim.AdamW(
            layer.parameters(),
            lr=c.lr,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
            foreach=False,
        )

    def hold(self, first: int, end: int) -> None:
        """Hold layers [first, end) with their initial weights and fresh optimizer state."""
        self.undo = None
        self.layers = {k: self.build(k) for k in range(first, end)}
        self.optimizers = {k: self.fresh_optimizer(layer) for k, layer in self.layers.items()}

    def adopt(self, plan: TrainPlan) -> None:
        """Hold the initial weights of this device's stage of ``plan`` (nothing if it has none),
        and of the edge parts it keeps copies of (CheckFree+)."""
        if self.device in plan.held:
            self.hold(*plan.held[self.device])
        else:
            self.layers, self.optimizers = {}, {}
        self.copies, self.copy_optimizers, self._undo_copies = {}, {}, {}
        for k in plan.copies.get(self.device, ()):
            self.copies[k] = build_edge(self.config.model, k).to(self.where)
            self.copy_optimizers[k] = self.fresh_optimizer(self.copies[k])

    def _check(self, plan: TrainPlan) -> tuple[int, int]:
        if plan.layers != self.config.model.layers:
            raise PlanNotSupported(
                f"the plan has {plan.layers} layers, the model {self.config.model.layers}",
                field="plan.pipelines",
            )
        if self.device not in plan.held:
            raise ValueError(f"device {self.device} has no stage in the plan")
        first, end = plan.held[self.device]
        if set(self.layers) != set(range(first, end)):
            raise ValueError(
                f"device {self.device} holds layers {sorted(self.layers)}, its stage needs "
                f"[{first}, {end})"
            )
        if set(self.copies) != set(plan.copies.get(self.device, ())):
            raise ValueError(
                f"device {self.device} keeps copies of layers {sorted(self.copies)}' edge "
                f"parts, the plan needs {list(plan.copies.get(self.device, ()))}"
            )
        return first, end

    # --- one step ---

    def step(self, gen: Generation, plan: TrainPlan, step: int) -> StepResult:
        """One training step of the plan on this device; raises ``comm.Aborted`` on abort."""
        self._check(plan)
        if gen.abort.is_set():  # a plan of one device has no collective that would notice
            raise Aborted("the generation was aborted before the step")
        started = time.perf_counter()
        try:
            loss_share = gen.guard(lambda: self._passes(gen, plan, step))
            gen.guard(lambda: self._sync_gradients(gen, plan))
            total = torch.tensor([loss_share], dtype=torch.float64, device=self.where)
            gen.guard(lambda: gen.all_reduce(plan.devices, total))
        except BaseException:
            self.zero_grad()
            raise
        # what this step changes, kept until the next one: see ``rollback``
        self.undo = {k: self.export_layer(k) for k in self.layers}
        self._undo_copies = {k: self.export_edge(k) for k in self.copies}
        self._undo_norm = self.grad_norm
        self.grad_norm = self._grad_norm()
        for optimizer in self.optimizers.values():
            optimizer.step()
        for optimizer in self.copy_optimizers.values():
            optimizer.step()
        self.zero_grad()
        samples = plan.plan.micro_batches * self.config.micro_batch
        return StepResult(
            step=step,
            loss=float(total.item()),
            step_time_s=time.perf_counter() - started,
            samples=samples,
            device=self.device,
        )

    def warm_up(self) -> None:
        """Take once, on a throwaway layer, the code paths a first step and a handover take
        (lazy imports of the optimizer, first-use kernels), so that a standby that takes over a
        stage pays none of it then; the device's own layers are untouched."""
        spare = Worker(self.device, self.config, corpus=self.corpus)
        index = min(1, self.config.model.layers - 1)
        spare.import_layer(index, spare.export_layer_of(index))
        layer = spare.layers[index]
        c = self.config
        if index > 0:
            shape = (c.micro_batch, c.model.seq, c.model.d_model)
            x = torch.zeros(shape, device=self.where, requires_grad=True)
        else:
            x = torch.zeros(c.micro_batch, c.model.seq, dtype=torch.long, device=self.where)
        layer(x).float().sum().backward()
        spare.optimizers[index].step()

    def export_layer_of(self, index: int) -> torch.Tensor:
        """The ``export_layer`` of layer ``index``'s initial weights, held or not."""
        held = self.layers.get(index)
        self.layers[index] = self.build(index)
        optimizer = self.optimizers.get(index)
        self.optimizers[index] = self.fresh_optimizer(self.layers[index])
        try:
            return self.export_layer(index)
        finally:
            if held is None:
                del self.layers[index], self.optimizers[index]
            else:
                self.layers[index] = held
                if optimizer is not None:
                    self.optimizers[index] = optimizer

    def _grad_norm(self) -> float:
        squares = [x for k in self.layers for x in self.grad_squares(k)]
        return float(sum(squares) ** 0.5)

    def grad_squares(self, index: int) -> list[float]:
        """The squared L2 norm of each parameter's gradient of layer ``index`` (in float64)."""
        return [
            float(p.grad.detach().double().pow(2).sum())
            for p in self.layers[index].parameters()
            if p.grad is not None
        ]

    def zero_grad(self) -> None:
        for optimizer in [*self.optimizers.values(), *self.copy_optimizers.values()]:
            optimizer.zero_grad(set_to_none=True)

    def rollback(self) -> None:
        """Undo the last step's update: its layers go back to their state before it.

        For a survivor that completed a step its peers lost to an abort (the abort came just as
        the step's last all-reduce completed on some ranks only), so that all agree again.
        """
        if self.undo is None:
            raise RuntimeError(f"device {self.device} has no step to undo")
        for k, flat in self.undo.items():
            self.import_layer(k, flat)
        for k, flat in self._undo_copies.items():
            if k in self.copies:
                self.import_edge(k, flat)
        self.undo, self._undo_copies = None, {}
        self.grad_norm = self._undo_norm

    def _batch(self, plan: TrainPlan, step: int, op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.config.micro_batch
        first = (plan.offsets[op.pipeline] + op.micro) * b
        x, y = self.corpus.batch(self.config.data_seed, step, first, b, self.config.model.seq)
        return x.to(self.where), y.to(self.where)

    def _passes(self, gen: Generation, plan: TrainPlan, step: int) -> float:
        """Every forward and backward of this device in schedule order; its share of the loss."""
        ops = plan.schedule.get(self.device, [])
        model = self.config.model
        shape = (self.config.micro_batch, model.seq, model.d_model)
        n = plan.plan.micro_batches
        recvs = gen.stream("receives")  # waited on in schedule order
        sends = gen.stream("sends")
        slot: dict[Op, tuple[int, torch.Tensor]] = {}
        try:
            for op in ops:
                depth = plan.plan.pipelines[op.pipeline].depth
                if op.backward and op.stage < depth - 1:
                    src = plan.executor(op.pipeline, op.stage + 1, op.micro)
                elif not op.backward and op.stage > 0:
                    src = plan.executor(op.pipeline, op.stage - 1, op.micro)
                else:
                    continue
                buf = torch.empty(shape, device=self.where)
                slot[op] = (gen.recv(recvs, buf, src, plan.tag(op)), buf)
            saved: dict[tuple[int, int, int], _Pass] = {}
            share = 0.0
            for op in ops:
                key = (op.pipeline, op.stage, op.micro)
                at = plan.stage_at(op.pipeline, op.stage, op.micro)
                first, end = plan.plan.pipelines[op.pipeline].stages[at].layers
                last = op.stage == plan.plan.pipelines[op.pipeline].depth - 1
                if not op.backward:
                    inputs: torch.Tensor | None = None
                    if op.stage == 0:
                        x = self._batch(plan, step, op)[0]
                    else:
                        index, x = slot.pop(op)
                        recvs.wait_for(index + 1, gen.abort)
                        x.requires_grad_(True)
                        inputs = x
                    if op.pipeline in plan.swapped:
                        y = self._run_swapped(first, end, x, entry=op.stage == 0, exit=last)
                    else:
                        y = run_layers(self.layers, first, end, x)
                    if last:
                        y = loss_of(y, self._batch(plan, step, op)[1])
                    else:
                        nxt = Op(False, op.pipeline, op.stage + 1, op.micro)
                        dst = plan.executor(op.pipeline, op.stage + 1, op.micro)
                        gen.send(sends, y.detach(), dst, plan.tag(nxt))
                    saved[key] = _Pass(inputs, y)
                else:
                    done = saved.pop(key)
                    if last:
                        torch.autograd.backward(done.output / n)
                        share += float(done.output.item()) / n
                    else:
                        index, grad = slot.pop(op)
                        recvs.wait_for(index + 1, gen.abort)
                        torch.autograd.backward(done.output, grad)
                    if done.inputs is not None:
                        prev = Op(True, op.pipeline, op.stage - 1, op.micro)
                        dst = plan.executor(op.pipeline, op.stage - 1, op.micro)
                        assert done.inputs.grad is not None
                        gen.send(sends, done.inputs.grad, dst, plan.tag(prev))
            # Every send is received before its receiver finishes; wait, abortably.
            sends.wait_for(sends.count, gen.abort)
            return share
        finally:
            recvs.close()
            sends.close()

    def _run_swapped(
        self, first: int, end: int, x: torch.Tensor, *, entry: bool, exit: bool
    ) -> torch.Tensor:
        """Layers [first, end) at a position of a pipeline trained out of order: the embedding
        first when the position is the first (the layer's, or this device's copy), then the
        blocks, then the final norm and LM head when it is the last; the edge parts of a layer
        run at no other position (a swapped micro-batch enters and leaves through the copies).
        """
        last = self.config.model.layers - 1
        if entry:
            x = self._edge(0)["embed"](x)
        for k in range(first, end):
            x = self.layers[k].block(x)
        if exit:
            edge = self._edge(last)
            x = edge["head"](edge["norm"](x))
        return x

    def _edge(self, index: int) -> dict[str, nn.Module]:
        """Layer ``index``'s ``edge_parts`` that this device holds: the layer's own, or its
        copy (CheckFree+)."""
        if index in self.copies:
            return dict(self.copies[index].items())
        layer = self.layers[index]
        return {part: getattr(layer, part) for part in edge_parts(self.config.model, index)}

    def edge_parameters(self, index: int) -> list[torch.nn.Parameter]:
        """The parameters of layer ``index``'s ``edge_parts`` held here, in ``build_edge``'s
        order (``embed.weight``; ``norm.weight``, ``head.weight``)."""
        return [p for module in self._edge(index).values() for p in module.parameters()]

    def _sync_gradients(self, gen: Generation, plan: TrainPlan) -> None:
        """All-reduce (sum) every segment's gradients over its holders, round by round; then,
        under CheckFree+, every edge layer's ``edge_parts`` over their holders (the layer's and
        the copies'), left out of the segments."""
        edges = {
            id(p) for k in plan.edge_holders if k in self.layers for p in self.edge_parameters(k)
        }
        for round_ in plan.rounds:
            for segment in round_:
                devices = sorted(d for g in segment.groups for d in g)
                if self.device not in devices or len(devices) < 2:
                    continue
                params = [p for k in range(*segment.layers) for p in self.layers[k].parameters()]
                self._all_reduce_grads(gen, devices, [p for p in params if id(p) not in edges])
        for k, holders in sorted(plan.edge_holders.items()):
            if self.device in holders and len(holders) > 1:
                self._all_reduce_grads(gen, list(holders), self.edge_parameters(k))

    @staticmethod
    def _all_reduce_grads(
        gen: Generation, devices: list[int], params: list[torch.nn.Parameter]
    ) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        gen.all_reduce(devices, flat)
        offset = 0
        for p in params:
            size = p.numel()
            p.grad = flat[offset : offset + size].view_as(p).clone()
            offset += size

    # --- the state of a layer, for a handover ---

    def export_layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s parameters and AdamW state as one flat float32 tensor.

        In order: every parameter, every first moment, every second moment (zeros before the
        first step, and with SGD, which keeps no state), then each parameter's step count; on
        this worker's device.
        """
        layer, optimizer = self.layers[index], self.optimizers[index]
        return flat_state(list(layer.parameters()), optimizer, self.where)

    def export_layers(self, first: int, end: int) -> dict[int, torch.Tensor]:
        """``export_layer`` of every layer of [first, end)."""
        return {k: self.export_layer(k) for k in range(first, end)}

    def import_layers(self, states: dict[int, torch.Tensor]) -> None:
        """``import_layer`` of every (layer, state) given."""
        for k, flat in states.items():
            self.import_layer(k, flat)

    def state_numel(self, index: int) -> int:
        """Size of ``export_layer(index)``, known to a rank that does not hold the layer."""
        shapes = [p.numel() for p in build_layer(self.config.model, index).parameters()]
        return 3 * sum(shapes) + len(shapes)

    def import_layer(self, index: int, flat: torch.Tensor) -> None:
        """Hold layer ``index`` with the weights and optimizer state ``export_layer`` gave (a
        tensor on this worker's device)."""
        layer = self.build(index)
        optimizer = self.fresh_optimizer(layer)
        load_flat_state(list(layer.parameters()), optimizer, flat)
        self.layers[index] = layer
        self.optimizers[index] = optimizer

    # --- CheckFree+'s copies of the edge parts ---

    def export_edge(self, index: int) -> torch.Tensor:
        """Layer ``index``'s ``edge_parts`` (its own or this device's copy) with their AdamW
        state, as one flat float32 tensor laid out as ``export_layer``'s."""
        optimizer = self.copy_optimizers[index] if index in self.copies else self.optimizers[index]
        return flat_state(self.edge_parameters(index), optimizer, self.where)

    def edge_numel(self, index: int) -> int:
        """Size of ``export_edge(index)``, known to a rank that holds none of it."""
        shapes = [p.numel() for p in build_edge(self.config.model, index).parameters()]
        return 3 * sum(shapes) + len(shapes)

    def import_edge(self, index: int, flat: torch.Tensor, *, into_layer: bool = False) -> None:
        """Take the edge parts ``export_edge`` gave: as this device's copy (a fresh module and
        optimizer), or, ``into_layer``, into the held layer ``index`` itself (its other
        parameters and their optimizer state are left as they are)."""
        if into_layer:
            optimizer = self.optimizers[index]
        else:
            self.copies[index] = build_edge(self.config.model, index).to(self.where)
            optimizer = self.copy_optimizers[index] = self.fresh_optimizer(self.copies[index])
        load_flat_state(self.edge_parameters(index), optimizer, flat)
