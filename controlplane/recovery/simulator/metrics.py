"""Aggregates over seeds: per-policy means and 95% intervals, ratios, curves for the report."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from scipy.stats import t as student_t

from controlplane.recovery.causes import DOWN_CAUSES
from controlplane.recovery.simulator.timeline import Run


def mean_ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and the two ends of its 95% Student-t interval (a point for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = float(student_t.ppf(0.975, len(values) - 1)) * statistics.stdev(values)
    half /= math.sqrt(len(values))
    return mean, mean - half, mean + half


def policy_summary(runs: Sequence[Run]) -> dict[str, Any]:
    """The summary.json entry of one policy over its seeds."""
    mean, lo, hi = mean_ci95([r.samples for r in runs])
    by_cause = [r.downtime_by_cause_s() for r in runs]
    return {
        "samples_mean": mean,
        "samples_ci95": [lo, hi],
        "throughput_mean": statistics.fmean(r.throughput for r in runs),
        "downtime_s_mean": statistics.fmean(r.downtime_s for r in runs),
        "recoveries_mean": statistics.fmean(r.recovery_count for r in runs),
        "infeasible_mean": statistics.fmean(r.infeasible_count for r in runs),
        "downtime_by_cause_s_mean": {
            cause.value: statistics.fmean(b[cause.value] for b in by_cause) for cause in DOWN_CAUSES
        },
        "seeds": len(runs),
    }


def summarize(
    runs: Mapping[str, Sequence[Run]],
    parameters: Mapping[str, Any] | None = None,
    *,
    ideal: Sequence[Run] | None = None,
) -> dict[str, Any]:
    """``summary.json``: per-policy figures and each one's ratio to the first policy.

    A ratio is samples_mean of the first policy over samples_mean of the policy; null when the
    policy trained nothing. With the ``ideal``'s runs (one per seed, in the policies' seed order),
    its figures and each policy's share of its samples are added.
    """
    table = {name: policy_summary(policy_runs) for name, policy_runs in runs.items()}
    first = next(iter(table.values()))["samples_mean"] if table else 0.0
    ratios = {
        name: first / entry["samples_mean"] if entry["samples_mean"] > 0 else None
        for name, entry in table.items()
    }
    out: dict[str, Any] = {"policies": table, "ratios": ratios}
    gain = choice_gain(runs)
    if gain is not None:
        out["choice_gain"] = gain
    if ideal is not None:
        out["ideal"] = policy_summary(ideal)
        out["share_of_ideal"] = {
            name: share_of_ideal(policy_runs, ideal) for name, policy_runs in runs.items()
        }
    if parameters is not None:
        out["parameters"] = dict(parameters)
    return out


CHOOSER = "pitstop"  # the policy that picks among the others' recoveries at each failure
WORTH = 1.05  # the gain over the best fixed policy at which choosing is said to pay


def choice_gain(runs: Mapping[str, Sequence[Run]], chooser: str = CHOOSER) -> dict[str, Any] | None:
    """What choosing per failure earned against the best fixed policy of the same sweep: the
    one of the others with the most samples (mean over seeds), and ``chooser``'s samples over
    its on each trace (but those where it trained nothing), mean and 95 % interval; None without
    ``chooser`` or another policy.

    "pays" is whether the mean gain reaches ``WORTH`` (5 %); the interval says how sure it is.
    """
    if chooser not in runs or len(runs) < 2:
        return None
    others = {name: policy_runs for name, policy_runs in runs.items() if name != chooser}
    best = max(others, key=lambda name: statistics.fmean(r.samples for r in others[name]))
    ratios = _seed_ratios(runs[chooser], others[best])
    if not ratios:
        return None
    mean, lo, hi = mean_ci95(ratios)
    return {
        "policy": chooser,
        "against": best,
        "mean": mean,
        "ci95": [lo, hi],
        "pays": mean >= WORTH,
        "seeds": len(ratios),
    }


def share_of_ideal(runs: Sequence[Run], ideal: Sequence[Run]) -> dict[str, Any] | None:
    """Mean and 95 % interval over seeds of a policy's samples over the ideal's on each trace.

    Seeds on which the ideal trained nothing (nor, then, any policy) have no share; None when
    no seed has one.
    """
    shares = _seed_ratios(runs, ideal)
    if not shares:
        return None
    mean, lo, hi = mean_ci95(shares)
    return {"mean": mean, "ci95": [lo, hi]}


def _seed_ratios(runs: Sequence[Run], against: Sequence[Run]) -> list[float]:
    """Each seed's samples of ``runs`` over those of ``against`` on the same trace, but the
    seeds on which ``against`` trained nothing."""
    return [
        run.samples / other.samples
        for run, other in zip(runs, against, strict=True)
        if other.samples > 0
    ]


def time_grid(horizon_s: float, points: int = 200) -> list[float]:
    return [horizon_s * i / (points - 1) for i in range(points)]


def mean_cumulative_samples(runs: Sequence[Run], times_s: list[float]) -> list[float]:
    """Samples trained by each time, averaged over the runs (seeds) of one policy."""
    curves = [r.cumulative_samples(times_s) for r in runs]
    return [statistics.fmean(values) for values in zip(*curves, strict=True)]


def mean_throughput(runs: Sequence[Run], times_s: list[float]) -> list[float]:
    """Samples per second in each interval between consecutive grid times, seed-averaged."""
    done = mean_cumulative_samples(runs, times_s)
    return [
        (b - a) / (t1 - t0) if t1 > t0 else 0.0
        for (a, b), (t0, t1) in zip(pairwise(done), pairwise(times_s), strict=True)
    ]
