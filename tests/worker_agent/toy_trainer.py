"""A trainer for the agent's tests, run as a real child process: it "trains" by sleeping a step
time and reporting falling losses through ``TrainerLink``, and carries out the agent's commands,
writing each one it carries out to ``TOY_LOG`` (one line: device, command id, action).

    python -m tests.worker_agent.toy_trainer [--step-time S] [--refuse ACTION] [--follow D]
        [--warm-up S]

With ``--follow D`` the ranks step in lockstep with device D's rank, as ranks in one collective
do: each waits for D's step before it takes its own, while D's process lives (files beside
``TOY_LOG``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from worker_agent.link import CommandMessage, LinkError, TrainerLink


def carry_out(link: TrainerLink, command: CommandMessage, refuse: str | None) -> str:
    """The state the rank is in after ``command``."""
    if command.action == refuse:
        link.done(command.id, ok=False, error=LinkError(code="invalid", message="refused"))
        return "training"
    log = os.environ.get("TOY_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{link.device} {command.id} {command.action} {command.generation}\n")
    state = "training"
    if command.action == "pause":
        state = "paused"
    elif command.action == "stop":
        state = "idle"
    elif command.action == "apply_plan" and command.plan is not None:
        link.set_state("restoring")
        time.sleep(0.05)  # the weights this rank's new stage needs
        used = {d for p in command.plan["pipelines"] for s in p["stages"] for d in s["devices"]}
        state = "training" if link.device in used else "idle"
    link.set_state(state)
    link.done(command.id, ok=True)
    return state


def work(seconds: float) -> None:
    """Sleep ``seconds`` in slices, counting only slices that were not stopped: like compute, a
    stopped process does no work (a plain sleep would go on counting while it is stopped)."""
    done = 0.0
    while done < seconds:
        began = time.monotonic()
        time.sleep(0.01)
        if time.monotonic() - began < 0.02:
            done += 0.01


def wait_for(leader: int, step: int, folder: Path) -> None:
    """Until the rank of device ``leader`` has reached ``step``, or its process is gone."""
    while True:
        try:
            pid = int((folder / f"pid-{leader}").read_text())
            reached = int((folder / f"step-{leader}").read_text() or 0)
        except (OSError, ValueError):
            reached, pid = -1, 0
        if reached >= step:
            return
        if pid:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return  # the leader died: go on without it, as survivors of an abort do
        time.sleep(0.005)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--refuse", help="answer this action with ok: false")
    parser.add_argument(
        "--close-link-after",
        type=int,
        help="close the link after this step on device 1 and go on without it",
    )
    parser.add_argument(
        "--outlive-agent", action="store_true", help="go on training when the agent is gone"
    )
    parser.add_argument("--follow", type=int, help="step in lockstep with this device's rank")
    parser.add_argument(
        "--warm-up", type=float, default=0.0, help="seconds of work before the first step"
    )
    parser.add_argument(
        "--chatter", type=int, default=0, help="lines written to stderr at every step"
    )
    args = parser.parse_args()
    link = TrainerLink.from_env()
    folder = Path(os.environ.get("TOY_LOG", "toy.log")).parent
    if args.follow is not None and link.device == args.follow:
        (folder / f"pid-{link.device}").write_text(str(os.getpid()))
    state, step = "training", 0
    link.set_state(state)
    work(args.warm_up)  # groups forming, weights loading, the first step compiled
    while args.outlive_agent or not link.agent_gone:
        timeout = 0.0
        if state == "training":
            began = time.monotonic()
            if args.follow is not None and link.device != args.follow:
                wait_for(args.follow, step, folder)
            work(args.step_time)
            step += 1
            if args.follow is not None and link.device == args.follow:
                (folder / f"step-{link.device}").write_text(str(step))
            loss = 4.0 / (1 + 0.05 * step)
            if link.injected("nan"):
                loss = float("nan")
            link.report_step(step, loss, time.monotonic() - began, samples=8, memory_bytes=1e9)
            for line in range(args.chatter):
                print(f"device {link.device} step {step} line {line}: {'.' * 60}", file=sys.stderr)
            if step == args.close_link_after and link.device == 1:
                link.close()
                while True:  # alive, but silent: only the link's end tells
                    time.sleep(0.1)
        else:
            timeout = 0.1
        command = link.poll_command(timeout)
        if command is not None:
            state = carry_out(link, command, args.refuse)
            if command.action == "resume" and command.step is not None:
                step = command.step
            if command.action == "stop":
                return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
