"""Where a rank computes, and the collective backend that goes with it.

``select(choice, device=d)`` turns a choice of ``auto``, ``cpu``, ``cuda`` or ``npu`` into an
``Accelerator``: the torch device that rank ``d``'s layers, optimizer state, micro-batches and
message buffers live on, and the backend of its collectives: gloo on the CPU, nccl on CUDA, hccl
on an Ascend NPU. ``auto`` takes CUDA when ``torch.cuda.is_available()``, else an NPU when the
optional package ``torch_npu`` imports and ``torch.npu.is_available()``, else the CPU. A choice
that is not here raises ``Unavailable``, whose message names the option that asked for it.

``torch_npu`` is imported only by ``npu_available()``, inside a guarded import (``ImportError``:
not available), never when this module or any other of the trainer is imported: the package is
optional, and importing it patches torch.

A rank's device index is ``LOCAL_RANK`` when the environment gives one, else its device id
modulo the number of devices of that kind here (device ids are the core's, numbered across the
cluster).
"""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

CHOICES = ("auto", "cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
OPTION = "--accelerator"


class Unavailable(ValueError):
    """The accelerator asked for is not here (or not for this rank); the message says which
    option asked, and what to use instead."""


@dataclass(frozen=True, slots=True)
class Accelerator:
    """A kind of device (``cpu``, ``cuda``, ``npu``) and, but for the CPU, its index here."""

    kind: str = "cpu"
    index: int | None = None

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device(self.kind, self.index)
            if self.index is not None
            else torch.device(self.kind)
        )

    @property
    def backend(self) -> str:
        """The collective backend: gloo, nccl or hccl."""
        return BACKENDS[self.kind]

    def activate(self) -> None:
        """Make this device the calling thread's current one (nothing on the CPU)."""
        if self.kind != "cpu":
            _module(self.kind).set_device(self.torch_device)

    def synchronize(self) -> None:
        """Wait for the work queued on this device (nothing on the CPU)."""
        if self.kind != "cpu":
            _module(self.kind).synchronize(self.torch_device)

    def memory_bytes(self) -> float | None:
        """The device's memory; None on the CPU or when the device does not say."""
        if self.kind == "cpu":
            return None
        try:
            return float(_module(self.kind).get_device_properties(self.torch_device).total_memory)
        except (AttributeError, RuntimeError):
            return None

    def __str__(self) -> str:
        return f"{self.torch_device} ({self.backend})"


CPU = Accelerator()


def _module(kind: str) -> Any:
    """``torch.cuda``, or ``torch.npu`` (which only ``torch_npu`` adds)."""
    return getattr(torch, kind)


def npu_available() -> bool:
    """Whether ``torch_npu`` imports and sees an NPU; imports it (the only place that does)."""
    try:
        importlib.import_module("torch_npu")  # optional: adds torch.npu and the hccl backend
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return npu is not None and bool(npu.is_available())


def count(kind: str) -> int:
    """Devices of ``kind`` here (the CPU: 1, shared by every rank)."""
    if kind == "cpu":
        return 1
    return int(_module(kind).device_count())


def resolve(choice: str, *, option: str = OPTION) -> str:
    """The kind ``choice`` means here: ``auto`` resolved, an absent kind refused."""
    if choice not in CHOICES:
        raise Unavailable(f"{option} {choice}: not one of {', '.join(CHOICES)}")
    if choice == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu(option, choice) else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        built = "" if torch.version.cuda else ", which was built without CUDA"
        raise Unavailable(
            f"{option} cuda: torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}{built}); use {option} cpu or auto"
        )
    if choice == "npu" and not _npu(option, choice):
        raise Unavailable(
            f"{option} npu: no Ascend NPU here (the optional package torch_npu does not import, "
            f"or torch.npu.is_available() is False); use {option} cpu or auto"
        )
    return choice


def _npu(option: str, choice: str) -> bool:
    try:
        return npu_available()
    except Exception as exc:  # a broken install: say so in one line rather than fall back
        raise Unavailable(
            f"{option} {choice}: torch_npu is installed but failed to import "
            f"({type(exc).__name__}: {exc}); use {option} cpu"
        ) from exc


def select(choice: str = "auto", *, device: int | None = None, option: str = OPTION) -> Accelerator:
    """The accelerator of rank ``device`` (a device id; None: not a rank, index 0 or
    ``LOCAL_RANK``) for ``choice``; raises ``Unavailable``."""
    kind = resolve(choice, option=option)
    if kind == "cpu":
        return CPU
    n = count(kind)
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        try:
            index = int(local)
        except ValueError:
            raise Unavailable(f"{option} {kind}: LOCAL_RANK={local!r} is not an integer") from None
        if not 0 <= index < n:
            raise Unavailable(
                f"{option} {kind}: LOCAL_RANK={index}, but {kind} has {n} devices here"
            )
    else:
        index = (device or 0) % n
    return Accelerator(kind, index)


def check_ranks(kind: str, ranks: int, *, option: str = OPTION) -> None:
    """Refuse more ranks on this machine than it has devices of ``kind`` (every rank of an nccl
    or hccl group needs a device of its own; on the CPU, ranks share the cores)."""
    if kind != "cpu" and ranks > count(kind):
        raise Unavailable(
            f"{option} {kind}: {ranks} ranks need {ranks} {kind} devices, this machine has "
            f"{count(kind)} (a {BACKENDS[kind]} group takes one device per rank); use fewer "
            f"ranks or {option} cpu"
        )


def add_option(parser: argparse.ArgumentParser) -> None:
    """The commands' ``--accelerator`` option (``--device`` is a rank's device id there)."""
    parser.add_argument(
        OPTION,
        choices=CHOICES,
        default="auto",
        help="where the ranks compute: auto (cuda if available, else npu if torch_npu imports "
        "and sees one, else cpu), cpu (gloo), cuda (nccl) or npu (hccl)",
    )
