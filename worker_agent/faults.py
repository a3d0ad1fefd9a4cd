"""Faults injected on purpose, for drills: local, bounded, and only into an agent's own ranks.

    python -m worker_agent inject KIND (--pid PID | --agent PID --device D) [--seconds S]
        [--stopped-fraction F]

``KIND`` is one of:

- ``kill``: SIGKILL the rank (a crash);
- ``hang``: SIGSTOP the rank (the agent sees no step progress, reports a hang and kills it;
  with ``--seconds`` it is continued after that long, if it is still there);
- ``slow``: stop and continue the rank in a duty cycle (``--stopped-fraction`` of every 0.1 s
  stopped) for ``--seconds`` (at most 600), then continue it: a straggler;
- ``nan``: tell the rank over its link (``{"t": "inject", "kind": "nan"}``) to make its next
  loss NaN (``TrainerLink.injected("nan")``);
- ``drop``: the agent closes its websocket abruptly (no close frame), then connects again.

The request goes to the agent, which does it: over its control socket (a Unix socket, owner
only, ``$TMPDIR/pitstop-agent-<agent pid>.sock``), or, from the control plane, as an ``inject``
command (``POST /api/v1/jobs/{id}/drills/``). ``--pid`` names a rank (its agent is its
parent) or the agent itself (``drop``); ``--agent`` with ``--device`` names a rank by device. A
process that is not a rank of a running agent is never signalled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker_agent import protocol

KINDS = tuple(kind.value for kind in protocol.InjectKind)
MAX_SECONDS = protocol.MAX_INJECT_SECONDS
SLOW_PERIOD_S = 0.1


def control_path(agent_pid: int) -> Path:
    """Where the agent of ``agent_pid`` listens for injections."""
    return Path(tempfile.gettempdir()) / f"pitstop-agent-{agent_pid}.sock"


def parent_of(pid: int) -> int | None:
    """The parent process of ``pid`` (from /proc), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name in parentheses may hold spaces: the fields after its ')' are fixed
    return int(stat.rsplit(")", 1)[1].split()[1])


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def hang(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


async def resume_after(pid: int, seconds: float) -> None:
    """Continue a stopped process after ``seconds``, if it is still there."""
    await asyncio.sleep(min(seconds, MAX_SECONDS))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def slow(
    pid: int, seconds: float, stopped_fraction: float = 0.75, period_s: float = SLOW_PERIOD_S
) -> None:
    """Stop and continue ``pid`` in a duty cycle for ``seconds`` (bounded), then continue it."""
    if not 0 < stopped_fraction < 1:
        raise ValueError("the stopped fraction must be within (0, 1)")
    loop = asyncio.get_running_loop()
    end = loop.time() + min(seconds, MAX_SECONDS)
    try:
        while loop.time() < end:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(period_s * stopped_fraction)
            os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(period_s * (1 - stopped_fraction))
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def request(agent_pid: int, message: dict[str, Any], *, timeout_s: float = 10) -> dict[str, Any]:
    """Send one injection request to the agent; its answer (``ok``, and ``error`` if not)."""
    path = control_path(agent_pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        answer: dict[str, Any] = json.loads(sock.makefile("rb").readline() or b"{}")
    return answer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m worker_agent inject", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--pid", type=int, help="a rank's process id (or, for drop, the agent's)")
    p.add_argument("--agent", type=int, help="the agent's process id (with --device)")
    p.add_argument("--device", type=int, help="the rank's device (with --agent)")
    p.add_argument("--seconds", type=float, help=f"how long to slow, or to hang (≤ {MAX_SECONDS})")
    p.add_argument(
        "--stopped-fraction",
        type=float,
        default=0.75,
        help="slow: the share of each 0.1 s the rank is stopped",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.seconds is not None and not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--seconds must be within (0, {MAX_SECONDS:g}]")
    if not 0 < args.stopped_fraction < 1:
        p.error("--stopped-fraction must be within (0, 1)")
    message: dict[str, Any] = {
        "kind": args.kind,
        "seconds": args.seconds,
        "stopped_fraction": args.stopped_fraction,
    }
    if args.agent is not None:
        agent, message["device"] = args.agent, args.device
        if args.device is None and args.kind != "drop":
            p.error("--agent needs --device (which rank)")
    elif args.pid is not None:
        if control_path(args.pid).exists():  # the agent itself
            agent, message["device"] = args.pid, args.device
        else:
            parent = parent_of(args.pid)
            if parent is None or not control_path(parent).exists():
                p.error(f"process {args.pid} is not a rank of a running agent")
            assert parent is not None
            agent, message["pid"] = parent, args.pid
    else:
        p.error("name the target: --pid PID, or --agent PID --device D")
    try:
        answer = request(agent, message)
    except OSError as exc:
        print(f"inject: the agent {agent} cannot be reached: {exc}")
        return 1
    if not answer.get("ok"):
        print(f"inject: refused: {answer.get('error', 'no answer')}")
        return 1
    print(f"inject: {args.kind} done: {json.dumps(answer)}")
    return 0
