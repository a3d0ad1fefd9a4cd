"""One rank's training under an execution plan: pipeline × data parallel, 1F1B, rerouting.

``TrainPlan.parse(plan_dict, layers)`` reads a plan in the core's format (``codec.plan_to_dict``)
and refuses what the trainer cannot run (tp > 1, a rerouted stage on a device that does not hold
its layers). ``Worker(device, config)`` holds the layers of its own stage with one AdamW per
layer; ``Worker.step(generation, plan, step)`` runs one step and returns its ``StepResult``.

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

from controlplane.recovery.codec import plan_from_dict
from controlplane.recovery.estimator.sync import SyncSegment, sync_rounds
from controlplane.recovery.model import Cluster, ExecutionPlan, ModelProfile
from worker_agent.trainer.comm import Aborted, Generation
from worker_agent.trainer.data import Corpus
from worker_agent.trainer.model import Layer, ModelConfig, build_layer, loss_of, run_layers
from worker_agent.trainer.schedule import Op, build_schedule, executor

# A device id bound for parsing plans: the trainer is given plans, it does not own a cluster.
MAX_DEVICES = 1 << 20


class PlanNotSupported(ValueError):
    """A plan the trainer cannot run; ``field`` names the value at fault, as the core does."""

    def __init__(self, message: str, *, field: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """The model, the samples per micro-batch and the optimizer (AdamW, or plain SGD).

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


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """A plan checked for the trainer, with what every step needs precomputed."""

    plan: ExecutionPlan
    schedule: dict[int, list[Op]]
    rounds: list[list[SyncSegment]]
    # global index of each pipeline's first micro-batch
    offsets: tuple[int, ...]
    held: dict[int, tuple[int, int]]

    @classmethod
    def parse(cls, data: object, layers: int, *, field: str = "plan") -> TrainPlan:
        """A plan dict in the core's format for a model of ``layers`` layers."""
        profile = ModelProfile.uniform(name="trainer", layers=layers, fwd_s=0.0, bwd_s=0.0)
        plan = plan_from_dict(data, profile=profile, cluster=Cluster(MAX_DEVICES), field=field)
        return cls.of(plan, field=field)

    @classmethod
    def of(cls, plan: ExecutionPlan, *, field: str = "plan") -> TrainPlan:
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
        return cls(
            plan=plan,
            schedule=build_schedule(plan),
            rounds=sync_rounds(plan),
            offsets=tuple(offsets),
            held=held,
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
        return [*segments, tuple(self.devices)]

    def tag(self, op: Op) -> int:
        """The tag of the message an operation receives: unique within one step."""
        stages = max(p.depth for p in self.plan.pipelines)
        micros = max(p.micro_batches for p in self.plan.pipelines)
        return ((op.pipeline * stages + op.stage) * micros + op.micro) * 2 + int(op.backward)


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

    def __post_init__(self) -> None:
        torch.set_num_threads(1)

    # --- the layers held ---

    def fresh_optimizer(self, layer: Layer) -> torch.optim.Optimizer:
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
        self.layers = {k: build_layer(self.config.model, k) for k in range(first, end)}
        self.optimizers = {k: self.fresh_optimizer(layer) for k, layer in self.layers.items()}

    def adopt(self, plan: TrainPlan) -> None:
        """Hold the initial weights of this device's stage of ``plan`` (nothing if it has none)."""
        if self.device in plan.held:
            self.hold(*plan.held[self.device])
        else:
            self.layers, self.optimizers = {}, {}

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
            total = torch.tensor([loss_share], dtype=torch.float64)
            gen.guard(lambda: gen.all_reduce(plan.devices, total))
        except BaseException:
            self.zero_grad()
            raise
        # what this step changes, kept until the next one: see ``rollback``
        self.undo = {k: self.export_layer(k) for k in self.layers}
        self._undo_norm = self.grad_norm
        self.grad_norm = self._grad_norm()
        for optimizer in self.optimizers.values():
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
            x = torch.zeros(c.micro_batch, c.model.seq, c.model.d_model, requires_grad=True)
        else:
            x = torch.zeros(c.micro_batch, c.model.seq, dtype=torch.long)
        layer(x).float().sum().backward()
        spare.optimizers[index].step()

    def export_layer_of(self, index: int) -> torch.Tensor:
        """The ``export_layer`` of layer ``index``'s initial weights, held or not."""
        held = self.layers.get(index)
        self.layers[index] = build_layer(self.config.model, index)
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
        squares = [
            float(p.grad.detach().double().pow(2).sum())
            for layer in self.layers.values()
            for p in layer.parameters()
            if p.grad is not None
        ]
        return float(sum(squares) ** 0.5)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
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
        self.undo = None
        self.grad_norm = self._undo_norm

    def _batch(self, plan: TrainPlan, step: int, op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.config.micro_batch
        first = (plan.offsets[op.pipeline] + op.micro) * b
        return self.corpus.batch(self.config.data_seed, step, first, b, self.config.model.seq)

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
                    src = executor(plan.plan, op.pipeline, op.stage + 1, op.micro)
                elif not op.backward and op.stage > 0:
                    src = executor(plan.plan, op.pipeline, op.stage - 1, op.micro)
                else:
                    continue
                buf = torch.empty(shape)
                slot[op] = (gen.recv(recvs, buf, src, plan.tag(op)), buf)
            saved: dict[tuple[int, int, int], _Pass] = {}
            share = 0.0
            for op in ops:
                key = (op.pipeline, op.stage, op.micro)
                stage = plan.plan.pipelines[op.pipeline].stages[op.stage]
                first, end = stage.layers
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
                    y = run_layers(self.layers, first, end, x)
                    if last:
                        y = loss_of(y, self._batch(plan, step, op)[1])
                    else:
                        nxt = Op(False, op.pipeline, op.stage + 1, op.micro)
                        dst = executor(plan.plan, op.pipeline, op.stage + 1, op.micro)
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
                        dst = executor(plan.plan, op.pipeline, op.stage - 1, op.micro)
                        assert done.inputs.grad is not None
                        gen.send(sends, done.inputs.grad, dst, plan.tag(prev))
            # Every send is received before its receiver finishes; wait, abortably.
            sends.wait_for(sends.count, gen.abort)
            return share
        finally:
            recvs.close()
            sends.close()

    def _sync_gradients(self, gen: Generation, plan: TrainPlan) -> None:
        """All-reduce (sum) every segment's gradients over its holders, round by round."""
        for round_ in plan.rounds:
            for segment in round_:
                devices = sorted(d for g in segment.groups for d in g)
                if self.device not in devices or len(devices) < 2:
                    continue
                params = [p for k in range(*segment.layers) for p in self.layers[k].parameters()]
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
        first step, and with SGD, which keeps no state), then each parameter's step count.
        """
        layer, optimizer = self.layers[index], self.optimizers[index]
        params = list(layer.parameters())
        moments: list[torch.Tensor] = []
        for name in ("exp_avg", "exp_avg_sq"):
            for p in params:
                state = optimizer.state.get(p, {})
                moments.append(state[name].reshape(-1) if name in state else torch.zeros(p.numel()))
        steps = [float(optimizer.state.get(p, {}).get("step", 0.0)) for p in params]
        parts = [p.detach().reshape(-1) for p in params] + moments + [torch.tensor(steps)]
        return torch.cat(parts).to(torch.float32)

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
        """Hold layer ``index`` with the weights and optimizer state ``export_layer`` gave."""
        layer = build_layer(self.config.model, index)
        optimizer = self.fresh_optimizer(layer)
        params = list(layer.parameters())
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
            if float(count) > 0:
                optimizer.state[p] = {
                    "step": torch.tensor(float(count)),
                    "exp_avg": avg.clone(),
                    "exp_avg_sq": avg_sq.clone(),
                }
        self.layers[index] = layer
        self.optimizers[index] = optimizer
