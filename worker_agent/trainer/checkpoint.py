"""Checkpoints of a job's layers, one file per layer and step, loadable under any plan.

A checkpoint at step ``s`` is the state a job goes on from at step ``s`` (steps ``0 .. s-1``
done): ``DIR/step-{s:08d}/layer-{k:04d}.pt`` holds layer ``k``'s ``Worker.export_layer``
(weights, AdamW moments, step counts). Each layer is written by one device only, the lowest
holder under the plan, through a temporary file renamed into place, so a reader sees a layer's
file whole or not at all. A checkpoint is complete when every layer's file is there; the newest
complete one is the one loaded (``latest``). Because files are per layer, a plan that splits the
layers differently, or puts them on other devices, loads the same checkpoint.

Each writer keeps its layers' two newest checkpoints and removes older ones. Files hold host
tensors, whatever device wrote them, and are loaded onto the reader's device.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

import torch

from worker_agent.trainer.engine import TrainPlan, Worker

_STEP = re.compile(r"^step-(\d{8})$")
KEEP = 2


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def layer_file(directory: Path, step: int, layer: int) -> Path:
    return step_dir(directory, step) / f"layer-{layer:04d}.pt"


def writer_of(plan: TrainPlan, layer: int) -> int:
    """The device that writes ``layer``: its lowest holder under ``plan``."""
    return min(d for d, (first, end) in plan.held.items() if first <= layer < end)


def _write(path: Path, tensor: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensor.cpu(), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(worker: Worker, plan: TrainPlan, directory: Path, step: int) -> list[int]:
    """Write the layers this device writes under ``plan`` as the checkpoint of ``step``; the
    layers written. Older checkpoints of those layers beyond the newest ``KEEP`` are removed."""
    mine = [k for k in sorted(worker.layers) if writer_of(plan, k) == worker.device]
    for k in mine:
        _write(layer_file(directory, step, k), worker.export_layer(k))
    older = [s for s in steps(directory) if s < step]
    for s in older[: max(0, len(older) - (KEEP - 1))]:
        for k in mine:
            layer_file(directory, s, k).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other writers' layers may still be there
            step_dir(directory, s).rmdir()
    return mine


def steps(directory: Path) -> list[int]:
    """Steps with a checkpoint directory, complete or not, in order."""
    if not directory.is_dir():
        return []
    found = (_STEP.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def latest(directory: Path, layers: int) -> int | None:
    """The newest step whose checkpoint holds every one of ``layers`` layers; None if none."""
    for s in reversed(steps(directory)):
        if all(layer_file(directory, s, k).is_file() for k in range(layers)):
            return s
    return None


def missing(directory: Path, layers: int) -> str | None:
    """Why ``directory`` holds no complete checkpoint of ``layers`` layers, in one line; None
    when it holds one."""
    if not directory.exists():
        return f"{directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    found = steps(directory)
    if not found:
        return f"{directory} holds no checkpoint (no step-NNNNNNNN directory)"
    if latest(directory, layers) is not None:
        return None
    newest = found[-1]
    lacking = [k for k in range(layers) if not layer_file(directory, newest, k).is_file()]
    names = ", ".join(layer_file(directory, newest, k).name for k in lacking)
    older = " (nor is any older one complete)" if len(found) > 1 else ""
    return (
        f"no complete checkpoint in {directory}: the newest, {step_dir(directory, newest).name},"
        f" lacks {len(lacking)} of the model's {layers} layer files: {names}{older}"
    )


def load(worker: Worker, directory: Path, step: int, first: int, end: int) -> None:
    """Hold layers [first, end) as the checkpoint of ``step`` has them (and nothing else), on
    the worker's device."""
    states = {
        k: torch.load(layer_file(directory, step, k), weights_only=True, map_location=worker.where)
        for k in range(first, end)
    }
    worker.layers, worker.optimizers, worker.undo = {}, {}, None
    worker.import_layers(states)
