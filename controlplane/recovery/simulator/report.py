"""The interactive HTML report: samples, throughput, downtime by cause, one seed's recoveries."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from controlplane.recovery.causes import COLOURS, DOWN_CAUSES, Cause
from controlplane.recovery.simulator.ideal import IDEAL
from controlplane.recovery.simulator.metrics import (
    mean_cumulative_samples,
    mean_throughput,
    time_grid,
)
from controlplane.recovery.simulator.timeline import Run

HOUR = 3600.0
# the ideal is a reference, not a contender: a dashed grey line beside the policies
IDEAL_LINE = {"dash": "dash", "color": "#7f7f7f"}


def _line(name: str) -> dict[str, str]:
    return IDEAL_LINE if name == IDEAL else {}


def _samples_figure(runs: Mapping[str, Sequence[Run]], times: list[float]) -> go.Figure:
    fig = go.Figure()
    for name, policy_runs in runs.items():
        fig.add_trace(
            go.Scatter(
                x=[t / HOUR for t in times],
                y=mean_cumulative_samples(policy_runs, times),
                name=name,
                mode="lines",
                line=_line(name),
            )
        )
    fig.update_layout(
        title="Samples trained (mean over seeds)",
        xaxis_title="hours",
        yaxis_title="samples",
    )
    return fig


def _throughput_figure(runs: Mapping[str, Sequence[Run]], times: list[float]) -> go.Figure:
    fig = go.Figure()
    mids = [(a + b) / 2 / HOUR for a, b in pairwise(times)]
    for name, policy_runs in runs.items():
        fig.add_trace(
            go.Scatter(
                x=mids,
                y=mean_throughput(policy_runs, times),
                name=name,
                mode="lines",
                line=_line(name),
            )
        )
    fig.update_layout(
        title="Throughput, downtime included (mean over seeds)",
        xaxis_title="hours",
        yaxis_title="samples/s",
    )
    return fig


def _downtime_figure(summary: Mapping[str, Any]) -> go.Figure:
    table = summary["policies"]
    names = list(table)
    fig = go.Figure()
    for cause in DOWN_CAUSES:
        fig.add_trace(
            go.Bar(
                x=names,
                y=[table[n]["downtime_by_cause_s_mean"][cause.value] / HOUR for n in names],
                name=cause.value,
                marker_color=COLOURS[cause],
            )
        )
    fig.update_layout(
        barmode="stack",
        title="Downtime by cause (mean over seeds)",
        yaxis_title="hours",
    )
    return fig


def _share_figure(summary: Mapping[str, Any]) -> go.Figure:
    """Each policy's share of the ideal's samples, with its 95 % interval over seeds."""
    shares = {n: s for n, s in summary["share_of_ideal"].items() if s is not None}
    fig = go.Figure(
        go.Bar(
            x=list(shares),
            y=[s["mean"] for s in shares.values()],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [s["ci95"][1] - s["mean"] for s in shares.values()],
                "arrayminus": [s["mean"] - s["ci95"][0] for s in shares.values()],
            },
        )
    )
    fig.update_layout(
        title="Share of the ideal's samples (mean over seeds, 95 % interval)",
        yaxis={"title": "share", "range": [0, 1.05]},
    )
    return fig


def _gantt_figure(runs: Mapping[str, Sequence[Run]]) -> go.Figure:
    """Every segment of the first seed, one row per policy; hover shows its span."""
    fig = go.Figure()
    for cause in Cause:
        rows, starts, lengths, texts = [], [], [], []
        for name, policy_runs in runs.items():
            for s in policy_runs[0].segments:
                if s.cause is cause:
                    rows.append(name)
                    starts.append(s.start_s / HOUR)
                    lengths.append(s.duration_s / HOUR)
                    texts.append(f"{cause.value}: {s.start_s:.1f}–{s.end_s:.1f} s")
        if rows:
            fig.add_trace(
                go.Bar(
                    y=rows,
                    x=lengths,
                    base=starts,
                    orientation="h",
                    name=cause.value,
                    marker_color=COLOURS[cause],
                    hovertext=texts,
                    hoverinfo="text",
                )
            )
    seed = next(iter(runs.values()))[0].seed
    fig.update_layout(
        barmode="overlay",
        title=f"Recovery timeline, seed {seed} (zoom in: transitions are short)",
        xaxis_title="hours",
    )
    return fig


def write_report(
    path: Path,
    runs: Mapping[str, Sequence[Run]],
    summary: Mapping[str, Any],
    title: str,
    *,
    ideal: Sequence[Run] | None = None,
) -> None:
    """One self-contained HTML file: plotly.js is embedded, nothing is fetched.

    With the ``ideal``'s runs (and the summary made with them) it is drawn beside the policies
    and each policy's share of it is shown.
    """
    lines = {**runs, IDEAL: ideal} if ideal is not None else runs
    horizon = next(iter(runs.values()))[0].horizon_s
    times = time_grid(horizon)
    figures = [_samples_figure(lines, times), _throughput_figure(lines, times)]
    if ideal is not None:
        figures.append(_share_figure(summary))
    figures += [_downtime_figure(summary), _gantt_figure(lines)]
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)
    ]
    ratios = ", ".join(
        f"{name} {'–' if ratio is None else f'{ratio:.3f}×'}"
        for name, ratio in summary["ratios"].items()
    )
    text = (
        f"<p>Ratios (samples of the first policy over each): <code>{html.escape(ratios)}</code></p>"
    )
    if ideal is not None:
        shares = ", ".join(
            f"{name} {share['mean']:.3f} [{share['ci95'][0]:.3f}, {share['ci95'][1]:.3f}]"
            for name, share in summary["share_of_ideal"].items()
            if share is not None
        )
        text += (
            "<p>Share of the ideal's samples (every recovery free and instant, the fastest plan "
            f"on the healthy devices; mean [95 % interval]): <code>{html.escape(shares)}</code></p>"
        )
    path.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1>" + text + "\n".join(parts) + "</body></html>\n"
    )
