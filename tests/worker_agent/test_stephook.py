"""The step hook that reports an unmodified script's steps to the launcher: the optimizer's own
step where it keeps one (restored with a checkpoint), else a count from the process's start."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

HOOK = Path(__file__).resolve().parents[2] / "worker_agent" / "stephook" / "sitecustomize.py"


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.delenv("PITSTOP_STEP_HOOK", raising=False)  # loaded, not started
    spec = importlib.util.spec_from_file_location("pitstop_stephook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    yield read, write
    os.close(read)
    os.close(write)


def said(read: int) -> list[dict[str, object]]:
    return [json.loads(line) for line in os.read(read, 65536).decode().splitlines()]


def train(optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()


def hooked(
    hook: ModuleType,
    pipe: tuple[int, int],
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
) -> list[dict[str, object]]:
    """What the hook says over the pipe while ``optimizer`` takes three steps."""
    handle = register_optimizer_step_post_hook(hook._Steps(pipe[1]))
    try:
        train(optimizer, model, 3)
    finally:
        handle.remove()
    return said(pipe[0])


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_an_optimizer_restored_from_a_checkpoint_reports_its_own_steps(
    hook: ModuleType, pipe: tuple[int, int], kind: Any
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = kind(model.parameters())
    train(before, model, 7)  # the run before the restart, checkpointed at step 7
    saved = before.state_dict()
    after = kind(model.parameters())
    after.load_state_dict(saved)
    reported = [m["step"] for m in hooked(hook, pipe, after, model) if m["t"] == "step"]
    assert reported == [8, 9, 10]


def test_an_optimizer_that_keeps_no_step_is_counted_from_the_start(
    hook: ModuleType, pipe: tuple[int, int]
) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    messages = hooked(hook, pipe, optimizer, model)
    assert messages[0] == {"t": "state", "state": "training"}
    assert [m["step"] for m in messages if m["t"] == "step"] == [1, 2, 3]
