"""Loss parity: every step's loss of a user's script recovered by Pitstop against an
uninterrupted run of the same global batch, one recovery path each.

Each path runs an example script under two launchers (``python -m worker_agent launch``, node
ranks 0 and 1, a fresh master port) reporting to the stack the demo runs (Daphne, the embedded
Redis, a Celery worker, the detector; one for the whole run, in a temporary data directory).
The launchers make their job themselves with an admin's API token (one job per path, named
``parity-PATH``), so the policies asked are the launcher's own, and ``decide()`` picks among
them with the cost model once the script's own profile has reached it:

- ``ddp-reroute``: ``examples/elastic_ddp.py`` (SGD, 4 micro-batches), ``--elastic``, one
  process a node; node 1's launcher's process group SIGKILLed (the node is lost): rerouting
  expected, node 0 trains alone on the whole global batch;
- ``ddp-restore``: the same with ``--optimizer adamw --width 2048 --samples 512``; node 1's
  training process alone SIGKILLed: flashrecovery expected, a new process restored from its
  peer's memory;
- ``hsdp-restore``: ``examples/elastic_hsdp.py --width 512 --samples 256``, ``--elastic
  --nproc-per-node 2 --replica-size 2`` (a replica group of two processes a node); device 3's
  process SIGKILLed: flashrecovery expected, its group restarted from the other's shards;
- ``hsdp-reroute``: the same, node 1's launcher SIGKILLed: rerouting expected, group 0 alone;
- ``fsdp2-reshard``: ``examples/torchrun_fsdp2.py`` (plain FSDP2, asynchronous DCP checkpoints
  every 5 steps), ``--nnodes 1:2``, no ``--elastic``; node 1's launcher SIGKILLed:
  restart_shrink expected, node 0 restarts alone from the newest complete checkpoint, resharded
  from two ranks to one.

Both nodes train ``--steps-before`` steps (and, under ``--elastic``, until the job's model is
the script's measured one), then the kill; the run goes on until every node of the chosen plan
has printed ``--steps-after`` steps past the kill's, then both launchers are stopped. The policy
recorded is the one the control plane chose (the job's latest recovery, its
``candidates[chosen]["policy"]``), reported, not asserted: the cost model weighs the step times
the script measured on this machine, so on a busy one a path may take another (``ddp-restore``
rerouted when one replica measured faster than two); the candidates it weighed are in the JSON.

The reference is the uninterrupted run of the same global batch: for the two ``--elastic``
scripts, one process computing every micro-batch of each step (the loss divided by their count,
the gradients accumulated, then the optimizer step; ``batch(step, index)`` seeded by
``step * 1_000_003 + index``), the math of the tests' references; for the FSDP2 script, the
script itself under plain ``torchrun --standalone --nproc-per-node 2``. The reference's loss is
rounded as the scripts print theirs (6 decimals). Every step line of every rank of the recovered
run (before the kill too) is compared: ``|got − ref| / max(1, |ref|)``; a path is within the
tolerance when every step after the recovery (after the kill's step, or for the restarted script
every step of the restart, the replayed ones included) is at most 1e-5, the tests' tolerance
(float32 sums taken in another order: equal, not bitwise).

    python -m benchmarks.loss_parity [--paths ddp-reroute,...] [--steps-before 10]
        [--steps-after 20] [--timeout 120] [--out PATH] [--plot PATH]

Prints a table, writes the JSON (each path's step and loss series, the run's and the
reference's) and an SVG plot (loss and relative difference per step, a column per path).
Bounded (every wait has a deadline), loopback only; every process it started is stopped on exit,
error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.launch_restart import ELASTIC_SCRIPT, OPEN, stack_environment
from benchmarks.results import write_results
from controlplane.demo import ControlPlane, Processes, children_of, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
HSDP_SCRIPT = ROOT / "examples" / "elastic_hsdp.py"
FSDP2_SCRIPT = ROOT / "examples" / "torchrun_fsdp2.py"
# every example's step line; the plain torchrun scripts' have a restart count
LINE = re.compile(
    rb"^rank (\d+) step (\d+) loss (-?[0-9.]+(?:e[-+]?\d+)?)(?: restart (\d+))? world (\d+)$",
    re.M,
)
TOLERANCE = 1e-5
FLOOR = 1e-9  # a relative difference of 0 is drawn here on the log axis
MICRO_BATCHES = 4
MEASURED = "(measured by the script)"
# an environment variable every process of a path inherits: what is left of it is found by it
MARK = "LOSS_PARITY_RUN"


@dataclass(frozen=True)
class Case:
    """One recovery path: the script, the launchers' flags, what is killed."""

    name: str
    script: Path
    script_args: tuple[str, ...]
    flags: tuple[str, ...]  # the launchers' own: nodes, processes a node, --elastic
    kill: str  # "launcher": node 1's launcher's process group; "process": device's process
    victim: int  # the node (launcher) or the device (process)
    expected: str  # the policy this path is meant to show (not asserted)
    reference: str  # "ddp", "hsdp" or "torchrun"
    optimizer: str = "sgd"
    width: int = 64
    samples: int = 16

    @property
    def elastic(self) -> bool:
        return "--elastic" in self.flags

    @property
    def per_node(self) -> int:
        return int(self.flags[self.flags.index("--nproc-per-node") + 1])


DDP = ("--nnodes", "2", "--nproc-per-node", "1", "--elastic")
HSDP = ("--nnodes", "2", "--nproc-per-node", "2", "--elastic", "--replica-size", "2")
HSDP_ARGS = ("--width", "512", "--samples", "256")
SHRINK = ("--nnodes", "1:2", "--nproc-per-node", "1")  # restart_shrink down to 1 node
ADAMW = ("--optimizer", "adamw", "--width", "2048", "--samples", "512")
CASES = {
    c.name: c
    for c in (
        Case("ddp-reroute", ELASTIC_SCRIPT, (), DDP, "launcher", 1, "rerouting", "ddp"),
        Case(
            "ddp-restore", ELASTIC_SCRIPT, ADAMW, DDP, "process", 1, "flashrecovery",
            "ddp", optimizer="adamw", width=2048, samples=512,
        ),
        Case(
            "hsdp-restore", HSDP_SCRIPT, HSDP_ARGS, HSDP, "process", 3, "flashrecovery", "hsdp",
            optimizer="adamw", width=512, samples=256,
        ),
        Case(
            "hsdp-reroute", HSDP_SCRIPT, HSDP_ARGS, HSDP, "launcher", 1, "rerouting", "hsdp",
            optimizer="adamw", width=512, samples=256,
        ),
        Case(
            "fsdp2-reshard", FSDP2_SCRIPT, (), SHRINK, "launcher", 1,
            "restart_shrink", "torchrun", optimizer="adamw",
        ),
    )
}  # fmt: skip


class Stopped(KeyboardInterrupt):
    """SIGTERM: stop everything, as for Ctrl-C."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped


# --- the processes ---


def marked(mark: str) -> list[int]:
    """This user's processes whose environment holds ``MARK=mark``: the ones a path started."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            if needle in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return [pid for pid in found if pid != os.getpid()]


def stop(processes: list[subprocess.Popen[bytes]], mark: str, grace: float = 20.0) -> None:
    """SIGTERM each (a launcher says goodbye and stops its processes), wait ``grace``, then
    SIGKILL the process group of any still there, and whatever process of ``mark`` is left
    (a rank leads its own session; its launcher's death kills it, and this finds it if not)."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # not reaped: its pid is still its group's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # each leads its own session
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
    for pid in marked(mark):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def devices_of(launcher: subprocess.Popen[bytes]) -> dict[int, int]:
    """A launcher's processes by device (``PITSTOP_DEVICE`` in each one's environment)."""
    found = {}
    for pid in children_of(launcher.pid):
        with contextlib.suppress(OSError, ValueError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for item in environ:
                if item.startswith(b"PITSTOP_DEVICE="):
                    found[int(item.split(b"=", 1)[1])] = pid
    return found


# --- the step lines ---


@dataclass(frozen=True)
class Line:
    node: int
    rank: int
    step: int
    loss: float
    restart: int | None
    world: int


def lines(out: Path, node: int) -> list[Line]:
    text = out.read_bytes() if out.exists() else b""
    return [
        Line(node, int(r), int(s), float(loss), int(n) if n else None, int(w))
        for r, s, loss, n, w in LINE.findall(text)
    ]


def last_step(found: list[Line]) -> int:
    return max((line.step for line in found), default=0)


# --- the references ---


def single_process(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, samples: int
) -> dict[int, float]:
    """Each step's mean loss over the global batch, trained in one process: every micro-batch
    of the step, its loss divided by their count, the gradients accumulated, then the step."""
    losses = {}
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for index in range(MICRO_BATCHES):
            seed = torch.Generator().manual_seed(step * 1_000_003 + index)
            x = torch.randn(samples, 32, generator=seed)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / MICRO_BATCHES
            torch.autograd.backward(loss)
            total += float(loss.detach())
        optimizer.step()
        losses[step + 1] = total
    return losses


def reference(
    case: Case, steps: int, data: Path, env: dict[str, str], timeout: float
) -> dict[int, float]:
    """step -> the uninterrupted run's loss, rounded as the scripts print it."""
    if case.reference == "torchrun":
        return {s: round(v, 6) for s, v in torchrun_reference(case, steps, data, env, timeout)}
    torch.manual_seed(0)
    w = case.width
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, w), torch.nn.ReLU()]
    if case.reference == "hsdp":  # examples/elastic_hsdp.py's build()
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 1))
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.01)
        if case.optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    found = single_process(model, optimizer, steps, case.samples)
    return {s: round(v, 6) for s, v in found.items()}


def torchrun_reference(
    case: Case, steps: int, data: Path, env: dict[str, str], timeout: float
) -> list[tuple[int, float]]:
    """The script under plain torchrun on two ranks, never stopped: rank 0's (step, loss)."""
    mark = f"{env[MARK]}-reference"
    out = data / f"{case.name}-reference.out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(case.script), *case.script_args, "--steps", str(steps),
    ]  # fmt: skip
    with out.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, env={**env, MARK: mark}, stdout=sink,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        status = process.wait(timeout=timeout)
    finally:
        stop([process], mark, grace=5)
    if status != 0:
        tail = out.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the torchrun reference exited {status}:\n{tail}")
    return [(line.step, line.loss) for line in lines(out, 0) if line.rank == 0]


# --- one path ---


def job_of(plane: ControlPlane, name: str) -> dict[str, Any] | None:
    found = plane.api("/api/v1/jobs/")["results"]
    return next((j for j in found if j["name"] == name), None)


def recoveries(plane: ControlPlane, job: int) -> list[dict[str, Any]]:
    """The job's recoveries, the latest first."""
    found: list[dict[str, Any]] = plane.api(f"/api/v1/recoveries/?job={job}")["results"]
    return found


def plan_devices(decision: dict[str, Any]) -> set[int]:
    pipelines = (decision.get("plan") or {}).get("pipelines") or []
    return {d for p in pipelines for s in p["stages"] for d in s["devices"]}


def candidates(decision: dict[str, Any]) -> list[dict[str, Any]]:
    """The policies the control plane weighed: feasible or why not, its estimates."""
    keys = ("policy", "feasible", "code", "est_step_time_s", "objective")
    return [
        {**{k: c.get(k) for k in keys}, "transition_s": (c.get("transition") or {}).get("total_s")}
        for c in decision.get("candidates") or []
    ]


def chosen_policy(decision: dict[str, Any]) -> str | None:
    chosen = decision.get("chosen")
    if chosen is None or not decision.get("candidates"):
        return None
    return str(decision["candidates"][chosen].get("policy"))


def run_case(
    case: Case, plane: ControlPlane, data: Path, env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    """Two launchers of the case's script, the kill, the steps after it, the reference and the
    comparison; ``status`` "failed" with a reason when a wait ran past ``--timeout``."""
    began = time.monotonic()
    name = f"parity-{case.name}"
    here = data / case.name
    here.mkdir()
    mark = f"{env[MARK]}-{case.name}"
    port = free_port()
    script = [str(case.script), *case.script_args, "--steps", "100000"]
    script += ["--step-s", str(args.step_s)]
    if case.reference == "torchrun":
        script += ["--checkpoint-dir", str(here / "checkpoint")]
    outs = [here / f"node-{rank}.out" for rank in (0, 1)]
    launchers: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"path": case.name, "expected_policy": case.expected}
    try:
        for rank in (0, 1):
            command = [
                sys.executable, "-m", "worker_agent", "launch", *case.flags,
                "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--max-restarts", "3",
                "--server", f"ws://127.0.0.1:{plane.port}", "--job", name, *script,
            ]  # fmt: skip
            with outs[rank].open("wb") as out, (here / f"node-{rank}.log").open("wb") as log:
                launchers.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env={**env, MARK: mark, "PITSTOP_API_TOKEN": plane.token},
                        stdout=out,
                        stderr=log,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        job = wait_for(lambda: job_of(plane, name), "job made by the launchers", args.timeout)
        result["job"] = job["id"]
        wait_for(
            lambda: all(last_step(lines(outs[r], r)) >= args.steps_before for r in (0, 1)),
            f"{args.steps_before} steps on both nodes",
            args.timeout,
        )
        if case.elastic:  # the cost model decides on the script's own measured profile
            wait_for(
                lambda: (
                    plane.api(f"/api/v1/jobs/{job['id']}/")["scenario"]["model"]["name"]
                    .strip()
                    .endswith(MEASURED)
                ),
                "the script's profile",
                args.timeout,
            )
        before = {d["id"] for d in recoveries(plane, job["id"])}
        if case.kill == "launcher":
            os.killpg(launchers[case.victim].pid, signal.SIGKILL)  # the node is lost
        else:
            node = case.victim // (2 if "--replica-size" in case.flags else 1)
            victim = wait_for(
                lambda: devices_of(launchers[node]).get(case.victim), "the victim", 10
            )
            os.kill(victim, signal.SIGKILL)
        kill_step = max(last_step(lines(out, r)) for r, out in enumerate(outs))
        result["kill_step"] = kill_step

        def ended() -> dict[str, Any] | None:
            found = [d for d in recoveries(plane, job["id"]) if d["id"] not in before]
            return found[0] if found and found[0]["status"] not in OPEN else None

        decision = wait_for(ended, "the recovery's end", args.timeout)
        # the nodes of the chosen plan train on (whichever policy the cost model chose)
        nodes = sorted({d // case.per_node for d in plan_devices(decision)}) or [0]
        target = kill_step + args.steps_after

        def trained() -> bool:
            return all(
                last_step(after(case, lines(outs[r], r), kill_step)) >= target for r in nodes
            )

        wait_for(trained, f"{args.steps_after} steps after the kill", args.timeout)
        latest = recoveries(plane, job["id"])
        result.update(
            policy=chosen_policy(latest[0]),
            recovery=latest[0]["status"],
            recoveries=[[d["status"], chosen_policy(d)] for d in reversed(latest)],
            candidates=candidates(latest[0]),
            status="recovered",
        )
    except Exception as exc:  # a wait past --timeout, the API unreachable: this path failed
        reason = str(exc) if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        result.update(status="failed", reason=reason)
        with contextlib.suppress(Exception):
            if "job" in result:
                latest = recoveries(plane, result["job"])
                if latest:
                    result.update(policy=chosen_policy(latest[0]), recovery=latest[0]["status"])
    finally:
        stop(launchers, mark)
    run = [line for r, out in enumerate(outs) for line in lines(out, r)]
    if case.kill == "launcher" and run and "kill_step" in result:
        # the lost node's processes die with their launcher a moment after it (the kernel's
        # signal at their parent's death), and may finish a step first: the kill's step is
        # the last one of the first world (its size, its first start), whoever printed it
        first = [line for line in run if line.world == run[0].world and not line.restart]
        result["kill_step"] = max(result["kill_step"], last_step(first))
    later = set(after(case, run, result.get("kill_step", 1 << 60)))
    result["run"] = [
        {
            "node": line.node, "rank": line.rank, "step": line.step, "loss": line.loss,
            "world": line.world, "restart": line.restart,
            "after": line in later,
        }
        for line in run
    ]  # fmt: skip
    if run:
        try:
            expected = reference(case, last_step(run), data, env, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            result.update(status="failed", reason=f"reference: {exc}")
            expected = {}
        result["reference"] = [[s, v] for s, v in sorted(expected.items())]
        for row in result["run"]:
            want = expected.get(row["step"])
            row["rel_diff"] = (
                None if want is None else abs(row["loss"] - want) / max(1.0, abs(want))
            )
        diffs = [r["rel_diff"] for r in result["run"] if r["rel_diff"] is not None]
        kept = [r["rel_diff"] for r in result["run"] if r["after"] and r["rel_diff"] is not None]
        result["max_rel_diff"] = max(diffs) if diffs else None
        result["max_rel_diff_after"] = max(kept) if kept else None
        result["steps_after"] = len({r["step"] for r in result["run"] if r["after"]})
        firsts = [r["step"] for r in result["run"] if r["after"]]
        result["first_step_after"] = min(firsts) if firsts else None
        missing = any(r["rel_diff"] is None for r in result["run"])
        result["within_tolerance"] = bool(kept) and not missing and max(kept) <= TOLERANCE
    result["seconds"] = round(time.monotonic() - began, 1)
    return result


def after(case: Case, found: list[Line], kill_step: int) -> list[Line]:
    """The lines of the recovered run: a restarted script's (restart ≥ 1, its replayed steps
    included), else every step past the kill's."""
    if case.reference == "torchrun":
        return [line for line in found if (line.restart or 0) >= 1]
    return [line for line in found if line.step > kill_step]


# --- the outputs ---


def table(results: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'path':<14} {'policy chosen':<15} {'kill at':>7} {'first after':>11} "
        f"{'steps after':>11} {'max rel. diff':>13} {'within 1e-5':>11}"
    )
    rows, notes = [head], []
    for r in results:
        diff = r.get("max_rel_diff")
        shown = "-" if diff is None else f"{diff:.2e}"
        within = "yes" if r.get("within_tolerance") else "NO"
        if r["status"] != "recovered":
            within = f"failed: {r.get('reason', '')}"
        policy = r.get("policy") or "-"
        if r.get("policy") and r["policy"] != r["expected_policy"]:
            policy += "*"
            notes.append(f"* {r['path']}: chosen instead of {r['expected_policy']}")
        rows.append(
            f"{r['path']:<14} {policy:<15} {r.get('kill_step', '-'):>7} "
            f"{r.get('first_step_after') or '-':>11} {r.get('steps_after', '-'):>11} "
            f"{shown:>13} {within:>11}"
        )
    return rows + notes


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """A column per path: the loss per step (the reference a line, the run's steps markers, the
    kill a dashed line) over the relative difference per step on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"font.size": 7, "axes.titlesize": 8, "svg.fonttype": "none", "svg.hashsalt": "parity"}
    )
    n = len(results)
    fig, axes = plt.subplots(
        2, n, figsize=(max(4.0, 2.4 * n), 5), squeeze=False, sharex="col",
        gridspec_kw={"height_ratios": [3, 2]},
    )  # fmt: skip
    for col, r in enumerate(results):
        top, bottom = axes[0][col], axes[1][col]
        ref = r.get("reference") or []
        if ref:
            top.plot([s for s, _ in ref], [v for _, v in ref], color="0.35", lw=1,
                     label="uninterrupted", zorder=1)  # fmt: skip
        run = r.get("run") or []
        for later, colour, label in ((False, "tab:blue", "before"), (True, "tab:orange", "after")):
            picked = [row for row in run if row["after"] is later]
            top.scatter([row["step"] for row in picked], [row["loss"] for row in picked], s=7,
                        color=colour, label=f"recovered run, {label} the kill", zorder=2,
                        linewidths=0)  # fmt: skip
            diffs = [row for row in picked if row.get("rel_diff") is not None]
            bottom.scatter([row["step"] for row in diffs],
                           [max(FLOOR, row["rel_diff"]) for row in diffs],
                           s=7, color=colour, linewidths=0)  # fmt: skip
        if "kill_step" in r:
            for ax in (top, bottom):
                ax.axvline(r["kill_step"] + 0.5, color="tab:red", ls="--", lw=0.8)
        bottom.axhline(TOLERANCE, color="0.2", ls=":", lw=0.8)
        bottom.text(0.02, TOLERANCE * 1.6, "1e-5", transform=bottom.get_yaxis_transform(),
                    fontsize=6, color="0.2")  # fmt: skip
        bottom.set_yscale("log")
        bottom.set_ylim(FLOOR / 3, 1e-3)
        title = f"{r['path']}\n{r.get('policy') or 'no recovery'}"
        if r.get("policy") and r["policy"] != r["expected_policy"]:
            title += f" (not {r['expected_policy']})"  # the cost model chose otherwise
        first, killed = r.get("first_step_after"), r.get("kill_step")
        if first is not None and killed is not None and first <= killed:
            title += f", from step {first - 1}"  # a restart from a checkpoint: steps replayed
        if r.get("status") != "recovered":
            title += " (failed)"
        top.set_title(title)
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(True, lw=0.3, alpha=0.5)
            ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("loss (global batch mean)")
    axes[1][0].set_ylabel(f"|run − ref| / max(1, |ref|)\n(0 drawn at {FLOOR:g})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    kill = plt.Line2D([], [], color="tab:red", ls="--", lw=0.8)
    tolerance = plt.Line2D([], [], color="0.2", ls=":", lw=0.8)
    fig.legend(
        [*handles, kill, tolerance],
        [*labels, "the kill", "tolerance 1e-5"],
        loc="lower center", ncol=5, fontsize=7, frameon=False,
    )  # fmt: skip
    fig.suptitle("Each step's loss of a recovered run against an uninterrupted one", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lstrip(".") or "svg", metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {path}")


# --- main ---


@contextlib.contextmanager
def control_plane(data: Path, env: dict[str, str]) -> Iterator[ControlPlane]:
    (data / "logs").mkdir()
    processes = Processes(data / "logs", env)
    plane = ControlPlane(data, free_port(), processes)
    try:
        plane.start()
        plane.setup("parity", "parity", [])  # an admin and its API token, no job
        yield plane
    finally:
        processes.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--paths", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    parser.add_argument(
        "--steps-before", type=int, default=10, help="steps both nodes train before the kill"
    )
    parser.add_argument("--steps-after", type=int, default=20, help="steps past the kill's")
    parser.add_argument("--step-s", type=float, default=0.05, help="the scripts' sleep a step")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each wait may take")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/loss_parity.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/loss-parity.svg")
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in names if p not in CASES]
    if not names or unknown:
        parser.error(f"unknown path(s) {', '.join(unknown) or '(none given)'}; of {list(CASES)}")
    if args.steps_before < 1 or args.steps_after < 1 or not args.timeout > 0:
        parser.error("--steps-before and --steps-after must be ≥ 1, --timeout > 0")
    previous = signal.signal(signal.SIGTERM, _stopped)
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="pitstop-loss-parity-") as tmp:
            data = Path(tmp)
            env = stack_environment(
                data, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **{MARK: uuid.uuid4().hex}
            )
            torch.set_num_threads(1)
            with control_plane(data, env) as plane:
                for name in tqdm(names, desc="paths", unit="path"):
                    results.append(run_case(CASES[name], plane, data, env, args))
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("\n".join(table(results)))
    write_results(
        args.out,
        {
            "tolerance": TOLERANCE,
            "steps_before": args.steps_before,
            "steps_after": args.steps_after,
            "results": results,
        },
    )
    plot(results, args.plot)
    ok = all(r["status"] == "recovered" and r.get("within_tolerance") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
