"""A training script's measurement of itself, for its job's scenario (the ``profile`` frame).

``worker_agent.elastic`` measures a few steps of each new world with hooks on the model's
top-level modules (a ``ModuleList`` or ``ModuleDict`` child counts as its members), one
micro-batch at a time:

- forward: from a module's forward pre-hook to its forward hook;
- backward: from the gradient of its output (a hook on that tensor) to the gradient of the
  next module's in backward order, the first module's to the end of the backward;
- saved activations: what autograd saves while it runs forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, its parameters' storages
  left out (FSDP's gathered weights are the module's parameters while it runs);
- parameters, gradients and optimizer state: their bytes (a sharded tensor's whole size);
- the optimizer's step, shared among the modules by their parameters' size.

The medians over the measured passes go into the profile; ``time_scale`` divides the times
(HSDP: a replica group's ranks run their micro-batches at once).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from worker_agent.link import ProfileMessage


def _top_level(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found: list[tuple[str, torch.nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict):
            found.extend((f"{name}.{n}", c) for n, c in child.named_children())
        else:
            found.append((name, child))
    return found or [("model", model)]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard of a sharded (``DTensor``) one, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensor: torch.Tensor) -> float:
    return float(tensor.numel() * tensor.element_size())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class StepProfiler:
    """Hooks on ``model``'s top-level modules while ``attach``-ed; ``message`` sums it up."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = _top_level(model)
        self.forward: list[list[float]] = [[] for _ in self.modules]
        self.backward: list[list[float]] = [[] for _ in self.modules]
        self.saved: list[list[float]] = [[] for _ in self.modules]
        self.outputs = [0.0 for _ in self.modules]
        self.updates: list[float] = []
        self.syncs: list[tuple[float, float, int]] = []  # bytes, seconds, members
        self._handles: list[Any] = []
        self._started: dict[int, float] = {}
        self._saving: dict[int, tuple[Any, set[int], list[float]]] = {}
        self._marks: list[tuple[float, int]] = []  # (when, module): its output's gradient

    # --- hooks ------------------------------------------------------------------------------

    def attach(self) -> None:
        for index, (_, module) in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._before(index)))
            self._handles.append(module.register_forward_hook(self._after(index), always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for context, _, _ in self._saving.values():  # a forward that raised
            context.__exit__(None, None, None)
        self._saving.clear()

    def _before(self, index: int) -> Any:
        def hook(module: torch.nn.Module, _args: Any) -> None:
            # the parameters' storages count as seen (FSDP's pre-hook ran: gathered, if sharded)
            seen = {local_part(p).untyped_storage().data_ptr() for p in module.parameters()}
            total = [0.0]

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total[0] += float(storage.nbytes())
                return tensor

            context = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
            context.__enter__()
            self._saving[index] = (context, seen, total)
            self._started[index] = time.perf_counter()

        return hook

    def _after(self, index: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            ended = time.perf_counter()
            saving = self._saving.pop(index, None)
            if saving is not None:
                context, _, total = saving
                context.__exit__(None, None, None)
                self.saved[index].append(total[0])
            if index in self._started:
                self.forward[index].append(ended - self._started.pop(index))
            out = next(_tensors(output), None)
            if out is None:
                return
            self.outputs[index] = max(self.outputs[index], nbytes(out))
            if out.requires_grad:
                mark = lambda grad: self._marks.append((time.perf_counter(), index))  # noqa: E731
                out.register_hook(mark)  # type: ignore[no-untyped-call]

        return hook

    def pass_done(self, ended: float) -> None:
        """A micro-batch's backward ended at ``ended``: each module's backward from the marks."""
        marks = sorted(self._marks)
        for (at, index), following in zip(marks, [*marks[1:], (ended, -1)], strict=True):
            self.backward[index].append(following[0] - at)
        self._marks.clear()

    # --- the profile ------------------------------------------------------------------------

    def message(
        self, optimizer: torch.optim.Optimizer, *, micro_batches: int, time_scale: float = 1.0
    ) -> ProfileMessage:
        sizes = [sum(nbytes(p) for p in m.parameters()) for _, m in self.modules]
        whole = sum(sizes) or 1.0
        update = statistics.median(self.updates) if self.updates else 0.0

        def median(values: list[float]) -> float:
            return statistics.median(values) if values else 0.0

        modules = []
        for index, (name, module) in enumerate(self.modules):
            params = list(module.parameters())
            state = [
                nbytes(value)
                for p in params
                for value in optimizer.state.get(p, {}).values()
                if isinstance(value, torch.Tensor)
            ]
            modules.append(
                {
                    "name": name[:200],
                    "fwd_s": median(self.forward[index]) * time_scale,
                    "bwd_s": median(self.backward[index]) * time_scale,
                    "update_s": update * sizes[index] / whole,
                    "m_p": sizes[index],
                    "m_o": sum(state),
                    "m_g": sum(nbytes(p) for p in params if p.requires_grad),
                    "m_a": median(self.saved[index]),
                }
            )
        sync: dict[str, Any] = {}
        if self.syncs:
            size, seconds, members = min(self.syncs, key=lambda s: s[1])  # least waiting
            sync = {"sync_bytes": size, "sync_s": seconds, "sync_members": members}
        boundary = max(self.outputs[:-1], default=0.0) or None
        return ProfileMessage(
            modules=modules, micro_batches=micro_batches, boundary_bytes=boundary, **sync
        )
