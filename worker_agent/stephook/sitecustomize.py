"""Steps of a script that knows nothing of Pitstop, for ``python -m worker_agent launch``.

The launcher puts this folder first on each rank's ``PYTHONPATH``, so Python runs this module at
start-up. In the rank itself (its parent is the launcher: ``PITSTOP_STEP_HOOK`` holds the
launcher's pid), a daemon thread waits for the script to import ``torch.optim`` and registers a
global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``) that
tells the launcher over the rank's link, in the link's JSON lines, that it trains and each
step's number and duration. The number is the optimizer's own where it keeps one (Adam and its
kin hold ``step`` in their state, which a checkpoint restores, so a restarted script goes on
from its checkpoint's step); otherwise the steps are counted from the process's start. That
is how the launcher sees an unmodified script start training, hang (no step for long) or
straggle. Only the first optimizer to step is counted, so a script with two steps each one
once. Then the ``sitecustomize`` this one hides, if another folder on the path has one, runs as
it would have.
Nothing here imports more than the standard library.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Any

WAIT_S = 3600.0  # a script that imports no optimizer within this is left alone


class _Steps:
    def __init__(self, fd: int) -> None:
        self.fd, self.count, self.last = fd, 0, time.monotonic()
        self.first: int | None = None  # id() of the optimizer counted

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the launcher is gone: nothing more to tell
            os.write(self.fd, (json.dumps(message) + "\n").encode())

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.first is None:
            self.first = id(optimizer)
            self.send({"t": "state", "state": "training"})
        elif id(optimizer) != self.first:
            return
        now = time.monotonic()
        self.count += 1
        step = _kept_step(optimizer) or self.count
        self.send({"t": "step", "step": step, "step_time_s": max(now - self.last, 0.0)})
        self.last = now


def _kept_step(optimizer: Any) -> int | None:
    """The ``step`` the optimizer keeps for its first parameter, when it keeps one in host
    memory (reading one on a GPU would wait for the GPU each step): None otherwise."""
    try:
        first = optimizer.param_groups[0]["params"][0]
        held = optimizer.state.get(first, {}).get("step")
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    if held is None or getattr(getattr(held, "device", None), "type", "cpu") != "cpu":
        return None
    try:
        return int(held)
    except (TypeError, ValueError, RuntimeError):
        return None


def _watch(steps: _Steps) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        optim = sys.modules.get("torch.optim.optimizer")
        register = getattr(optim, "register_optimizer_step_post_hook", None)
        if register is not None:
            steps.last = time.monotonic()
            register(steps)
            return
        time.sleep(0.05)


def _start() -> None:
    fd, parent = os.environ.get("PITSTOP_LINK_FD"), os.environ.get("PITSTOP_STEP_HOOK")
    if not fd or not parent or str(os.getppid()) != parent:
        return  # not a rank of the launcher (a process the script started, say)
    steps = _Steps(int(fd))
    steps.send({"t": "hello", "device": int(os.environ.get("PITSTOP_DEVICE", "0")),
                "pid": os.getpid()})  # fmt: skip
    threading.Thread(target=_watch, args=(steps,), name="pitstop-steps", daemon=True).start()


def _chain() -> None:
    """Run the ``sitecustomize`` of the next folder on the path that has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_start()
_chain()
