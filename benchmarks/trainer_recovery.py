"""Recovery inside the reference trainer: SIGKILL one rank, time until training goes on.

On this machine, loopback only, ``--pp`` × ``--dp`` rank processes of ``python -m
worker_agent.trainer rank`` (8 by default: PP4 × DP2 of the default 8-layer model, 16 samples a
step) run under a scripted agent (``worker_agent.trainer.drill``), which plays the agent and the
control plane: it sees the death through ``waitpid``, sets ``<generation>abort``, asks the
core's ``decide`` with the path's policy alone for the plan, and sends ``apply_plan`` with the
policy's ``restore``. One rank, at a random phase of a step, is killed per repetition. Paths:

- ``rerouting``: the lost stage's micro-batches run on its live replica (``rerouting`` policy);
- ``dynamic``: a re-plan over the survivors, layers handed over from live holders (``dynamic``);
- ``flashrecovery``: a warm standby (a ninth rank, started with the others, idle) takes the
  failed device's stage, its weights and optimizer state copied from the live replica;
- ``checkfree``: PP(pp·dp) × DP1, an intermediate stage killed, rebuilt on the standby as its
  neighbours' gradient-norm weighted average (``checkfree``, ``restore: neighbours``);
- ``checkpoint``: ranks checkpoint every ``--checkpoint-every`` steps; after the kill every rank
  is stopped, new processes start (the core's ``checkpoint`` plan, the spare in the failed
  device's place), load the newest complete checkpoint and redo the steps since.

Per repetition: kill → first completed step after recovery (the slowest rank of the new plan),
broken down into detect (kill → waitpid), plan (``decide``), regroup (leaving the aborted step,
new groups, agreeing on the step; for a restart: stopping and starting the processes), transfer
(layers moved, rebuilt or loaded) and step (the first step); the ratio to checkpoint restart;
post-recovery throughput (median interval between steps) as a share of the pre-fault one,
beside the estimator's share (its step time of the old plan over the new one's); and the losses
after the recovery against an uninterrupted run with the same seed. Every repetition is bounded
(``--timeout``), and none may come near the groups' 60 s collective timeout.

    python -m benchmarks.trainer_recovery [--repeats 3] [--paths P,Q] [--out FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.results import write_results
from worker_agent.trainer.comm import DEFAULT_TIMEOUT
from worker_agent.trainer.drill import Drill, core_decision

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 8
PATHS = ("rerouting", "dynamic", "flashrecovery", "checkfree", "checkpoint")
RESTORE = {"checkfree": "neighbours", "checkpoint": "checkpoint"}
POLICY = {
    "rerouting": "rerouting",
    "dynamic": "dynamic",
    "flashrecovery": "flashrecovery",
    "checkfree": "checkfree",
    "checkpoint": "checkpoint",
}
GOALS_S = {"rerouting": 1.0, "flashrecovery": 3.0}
MICRO_BATCH = 2
SAMPLES = 16


def grid(pp: int, dp: int) -> dict[str, Any]:
    """PP × DP over devices 0 … pp·dp−1, the layers split evenly, 16 samples a step."""
    per = LAYERS // pp
    micro = SAMPLES // MICRO_BATCH // dp
    return {
        "family": "dynamic",
        "pipelines": [
            {
                "stages": [
                    {"devices": [r * pp + s], "layers": [s * per, (s + 1) * per]} for s in range(pp)
                ],
                "micro_batches": micro,
            }
            for r in range(dp)
        ],
    }


def devices_of(plan: dict[str, Any]) -> list[int]:
    return sorted({d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]})


def median_interval(times: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else math.nan


@dataclass
class Settings:
    pp: int
    dp: int
    before: int
    after: int
    checkpoint_every: int
    timeout_s: float


def run_path(path: str, settings: Settings, rng: random.Random, workdir: Path) -> dict[str, Any]:
    """One repetition of one path: the timeline, the throughput shares and the losses."""
    ranks = settings.pp * settings.dp
    plan = grid(ranks, 1) if path == "checkfree" else grid(settings.pp, settings.dp)
    training = devices_of(plan)
    standby = [ranks] if path in ("flashrecovery", "checkfree") else []
    # CheckFree needs both neighbours: an intermediate stage
    victim = rng.randrange(1, ranks - 1) if path == "checkfree" else rng.choice(training)
    args = []
    if path == "checkpoint":
        args = ["--checkpoint-dir", str(workdir / "ckpt")]
        args += ["--checkpoint-every", str(settings.checkpoint_every)]
    spares = 1 if path in ("flashrecovery", "checkfree", "checkpoint") else 0
    with Drill(plan, workdir, args=args, timeout_s=settings.timeout_s) as drill:
        drill.start(training + standby)
        drill.wait_steps(training, settings.before)
        pre = [s.at for s in drill.steps(training[0])]
        step_s = median_interval(pre[1:])
        # a random phase of a step: some time after a step ended, less than a step
        mark = len(drill.steps(training[0]))
        drill.wait(lambda: len(drill.steps(training[0])) > mark, "a step to end")
        time.sleep(rng.uniform(0, step_s))
        killed = drill.kill(victim)
        drill.wait(lambda: victim in drill.exited, "the death")
        detected = drill.exited[victim]
        drill.abort("d0/", victim)
        new, est_before, est_after = core_decision(
            plan, [victim], POLICY[path], spares=spares, micro_batch=MICRO_BATCH
        )
        planned = time.monotonic()
        after_devices = devices_of(new)
        row: dict[str, Any] = {"path": path, "victim": victim}
        if path == "checkpoint":
            drill.stop_all()
            stopped = time.monotonic()
            reached = max(s.message.step for s in drill.steps(training[0]))
            restarted = drill.start(after_devices, generation="d1/", args=["--resume"], plan=new)
            first = drill.first_step_after(after_devices, restarted)
            timings = [drill.timing("d1/", d) for d in after_devices]
            ready = max(
                next(
                    s.at
                    for s in drill.seen
                    if s.device == d
                    and s.at > restarted
                    and getattr(s.message, "state", None) == "training"
                )
                for d in after_devices
            )
            transfer = max(t.get("transfer_s", 0.0) for t in timings)
            row["regroup_s"] = ready - planned - transfer
            row["stop_s"] = stopped - planned
            row["transfer_s"] = transfer
            row["step_s"] = first - ready
            resumed_at = drill.steps(after_devices[0], restarted)[0].message.step
            row["steps_redone"] = reached + 1 - resumed_at
        else:
            sent = drill.apply(
                [d for d in training + standby if d != victim],
                "d1-apply",
                new,
                "d1/",
                restore=RESTORE.get(path),
            )
            reached = max(s.message.step for s in drill.steps(training[0]) if s.at < sent)
            done = drill.wait_done(after_devices, "d1-apply")
            if not all(d.message.ok for d in done.values()):
                raise RuntimeError(f"{path}: the plan was refused: {done}")
            first = drill.first_step_after(after_devices, max(d.at for d in done.values()))
            timings = [drill.timing("d1/", d) for d in after_devices]
            transfer = max(t.get("transfer_s", 0.0) for t in timings)
            done_at = max(d.at for d in done.values())
            row["regroup_s"] = done_at - sent - transfer
            row["transfer_s"] = transfer
            row["step_s"] = first - done_at
            resumed_at = drill.steps(after_devices[0], done_at)[0].message.step
            row["steps_redone"] = reached + 1 - resumed_at
        row["last_step_before"] = reached
        row["detect_s"] = detected - killed
        row["plan_s"] = planned - detected
        row["total_s"] = first - killed
        drill.wait_steps(after_devices, settings.after, first - 1e-9)
        post = [s.at for s in drill.steps(after_devices[0], first - 1e-9)]
        row["throughput_share"] = step_s / median_interval(post)
        row["estimated_share"] = est_before / est_after
        row["losses"] = {str(k): v for k, v in sorted(drill.losses(after_devices[0]).items())}
        row["plan"] = new
    return row


def baseline(settings: Settings, workdir: Path, steps: int) -> dict[int, float]:
    """The losses of an uninterrupted run of the PP × DP plan (every plan trains the same
    samples, so one run serves every path)."""
    plan = grid(settings.pp, settings.dp)
    with Drill(plan, workdir, timeout_s=settings.timeout_s) as drill:
        drill.start(devices_of(plan))
        drill.wait_steps(devices_of(plan), steps)
        return drill.losses(0)


def summarize(rows: list[dict[str, Any]], reference: dict[int, float]) -> list[dict[str, Any]]:
    out = []
    restart = [r["total_s"] for r in rows if r["path"] == "checkpoint"]
    restart_median = statistics.median(restart) if restart else math.nan
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        totals = [r["total_s"] for r in mine]
        cell: dict[str, Any] = {"path": path, "repeats": len(mine)}
        cell["total_median_s"] = statistics.median(totals)
        cell["total_min_s"], cell["total_max_s"] = min(totals), max(totals)
        for key in ("detect_s", "plan_s", "regroup_s", "transfer_s", "step_s"):
            cell[key] = statistics.median(r[key] for r in mine)
        cell["vs_restart"] = restart_median / cell["total_median_s"]
        cell["steps_redone"] = statistics.median(r["steps_redone"] for r in mine)
        cell["throughput_share"] = statistics.median(r["throughput_share"] for r in mine)
        cell["estimated_share"] = statistics.median(r["estimated_share"] for r in mine)
        gaps = [
            abs(v - reference[int(k)])
            for r in mine
            for k, v in r["losses"].items()
            if int(k) in reference
        ]
        cell["max_loss_gap"] = max(gaps) if gaps else math.nan
        out.append(cell)
    return out


def svg(
    summary: list[dict[str, Any]], rows: list[dict[str, Any]], reference: dict[int, float]
) -> str:
    """Two panels: kill → first step per path (median, min–max; log scale), and the losses
    after each path's first recovery against the uninterrupted run."""
    w, h, pad = 900, 360, 50
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
    ]
    # panel 1: bars on a log axis, 0.01 s to 100 s
    x0, x1, y0, y1 = pad + 60, w // 2 - 20, pad, h - pad

    def ly(v: float) -> float:
        v = min(max(v, 0.01), 100.0)
        return y1 - (math.log10(v) + 2) / 4 * (y1 - y0)

    for e in range(-2, 3):
        y = ly(10.0**e)
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{10.0**e:g} s</text>')
    bw = (x1 - x0) / max(1, len(summary))
    for i, cell in enumerate(summary):
        cx = x0 + bw * (i + 0.5)
        top, low, high = (ly(cell[k]) for k in ("total_median_s", "total_min_s", "total_max_s"))
        parts.append(
            f'<rect x="{cx - bw * 0.3:.1f}" y="{top:.1f}" width="{bw * 0.6:.1f}" '
            f'height="{y1 - top:.1f}" fill="{colors[i % 5]}"/>'
        )
        parts.append(
            f'<line x1="{cx:.1f}" y1="{low:.1f}" x2="{cx:.1f}" y2="{high:.1f}" stroke="black"/>'
        )
        parts.append(f'<text x="{cx:.1f}" y="{y1 + 14}" text-anchor="middle">{cell["path"]}</text>')
        parts.append(
            f'<text x="{cx:.1f}" y="{top - 4:.1f}" text-anchor="middle">'
            f"{cell['total_median_s']:.2f}</text>"
        )
    parts.append(
        f'<text x="{(x0 + x1) / 2}" y="{pad - 20}" text-anchor="middle" font-size="13">'
        "kill → first step after recovery (median, min–max)</text>"
    )
    # panel 2: losses
    x0, x1 = w // 2 + 60, w - 20
    firsts: dict[str, dict[str, Any]] = {}
    for r in rows:
        firsts.setdefault(r["path"], r)
    steps = sorted(reference)
    values = list(reference.values()) + [v for r in firsts.values() for v in r["losses"].values()]
    lo, hi = min(values), max(values)
    smax = max([max(steps)] + [int(k) for r in firsts.values() for k in r["losses"]])

    def px(s: float) -> float:
        return x0 + s / max(1, smax) * (x1 - x0)

    def py(v: float) -> float:
        return float(y1 - (v - lo) / max(1e-9, hi - lo) * (y1 - y0))

    for v in (lo, (lo + hi) / 2, hi):
        parts.append(f'<text x="{x0 - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    parts.append(f'<text x="{(x0 + x1) / 2}" y="{y1 + 28}" text-anchor="middle">step</text>')
    line = " ".join(f"{px(s):.1f},{py(reference[s]):.1f}" for s in steps)
    parts.append(
        f'<polyline points="{line}" fill="none" stroke="black" stroke-width="3" '
        'stroke-opacity="0.3"/>'
    )
    for i, path in enumerate(p["path"] for p in summary):
        r = firsts[path]
        pts = sorted((int(k), v) for k, v in r["losses"].items())
        line = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colors[i % 5]}"/>')
        parts.append(f'<text x="{x1 - 110}" y="{y0 + 14 * i}" fill="{colors[i % 5]}">{path}</text>')
    parts.append(
        f'<text x="{x1 - 110}" y="{y0 + 14 * len(summary)}" fill="#888">uninterrupted</text>'
    )
    parts.append(
        f'<text x="{(x0 + x1) / 2}" y="{pad - 20}" text-anchor="middle" font-size="13">'
        "loss per step (each path's first repetition)</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated, of " + ", ".join(PATHS)
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps-before", type=int, default=4, help="steps before the kill")
    parser.add_argument("--steps-after", type=int, default=5, help="steps after the recovery")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="which rank dies, and when")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per wait, bounded")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/trainer_recovery.json"
    )
    parser.add_argument("--plot", type=Path, help="also draw the SVG here")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown or LAYERS % (args.pp * args.dp) or args.pp < 2:
        parser.error(f"unknown paths {sorted(unknown)}, or pp·dp not dividing {LAYERS}, or pp < 2")
    settings = Settings(
        args.pp, args.dp, args.steps_before, args.steps_after, args.checkpoint_every, args.timeout
    )
    rng = random.Random(args.seed)
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trainer-recovery-") as tmp:
        reference = baseline(
            settings, Path(tmp) / "baseline", args.steps_before + args.steps_after + 3
        )
        for rep in range(args.repeats):
            for path in paths:
                row = run_path(path, settings, rng, Path(tmp) / f"{path}-{rep}")
                row["repeat"] = rep
                rows.append(row)
                print(
                    f"{path} #{rep}: device {row['victim']} killed, first step after "
                    f"{row['total_s']:.3f} s",
                    flush=True,
                )
    load_after = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    load = f"before: {load}; after: {load_after.stdout.strip()}"
    limit = DEFAULT_TIMEOUT.total_seconds()
    # survivors that waited in a collective until its timeout would take over ``limit``; a
    # restart's processes hold no collective while they start
    stuck = [r for r in rows if r["path"] != "checkpoint" and r["total_s"] >= limit / 2]
    summary = summarize(rows, reference)
    columns = [
        "path",
        "total_median_s",
        "total_min_s",
        "total_max_s",
        "detect_s",
        "plan_s",
        "regroup_s",
        "transfer_s",
        "step_s",
        "vs_restart",
        "steps_redone",
        "throughput_share",
        "estimated_share",
        "max_loss_gap",
    ]
    print(" ".join(f"{c:>16}" for c in columns))
    for cell in summary:
        print(" ".join(f"{_cell(cell[c]):>16}" for c in columns))
    print(f"load: {load}")
    for cell in summary:
        goal = GOALS_S.get(cell["path"])
        if goal is not None:
            met = cell["total_median_s"] <= goal and cell["vs_restart"] >= 10.0
            verdict = "met" if met else "NOT met"
            print(f"{cell['path']}: goal ≤ {goal:g} s and ≥ 10× restart: {verdict}")
    write_results(
        args.out,
        {
            "benchmark": "trainer_recovery",
            "ranks": args.pp * args.dp,
            "settings": vars(settings),
            "load": load,
            "collective_timeout_s": limit,
            "results": summary,
            "rows": rows,
            "reference_losses": {str(k): v for k, v in sorted(reference.items())},
        },
    )
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        args.plot.write_text(svg(summary, rows, reference))
        print(f"wrote {args.plot}")
    if stuck:
        print(f"{len(stuck)} repetitions took over half the collective timeout ({limit:g} s)")
        return 1
    return 0


if __name__ == "__main__":
    # a SIGTERM unwinds, so that the processes it started are stopped (``finally``)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
