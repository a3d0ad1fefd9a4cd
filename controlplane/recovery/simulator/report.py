"""The interactive HTML report: samples, throughput, downtime by cause, one seed's recoveries."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from controlplane.recovery.simulator.metrics import (
    mean_cumulative_samples,
    mean_throughput,
    time_grid,
)
from controlplane.recovery.simulator.timeline import DOWN_CAUSES, Cause, Run

HOUR = 3600.0
# one colour per cause, the same in the downtime bars and the Gantt chart
COLOURS = {
    Cause.RUNNING: "#59a14f",
    Cause.DETECTION: "#e15759",
    Cause.PLANNING: "#f28e2b",
    Cause.WEIGHT_TRANSFER: "#4e79a7",
    Cause.RESTART: "#b07aa1",
    Cause.LOST_WORK: "#9c755f",
    Cause.INFEASIBLE: "#333333",
}


def _samples_figure(runs: Mapping[str, Sequence[Run]], times: list[float]) -> go.Figure:
    fig = go.Figure()
    for name, policy_runs in runs.items():
        fig.add_trace(
            go.Scatter(
                x=[t / HOUR for t in times],
                y=mean_cumulative_samples(policy_runs, times),
                name=name,
                mode="lines",
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
            go.Scatter(x=mids, y=mean_throughput(policy_runs, times), name=name, mode="lines")
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
    path: Path, runs: Mapping[str, Sequence[Run]], summary: Mapping[str, Any], title: str
) -> None:
    """One self-contained HTML file: plotly.js is embedded, nothing is fetched."""
    horizon = next(iter(runs.values()))[0].horizon_s
    times = time_grid(horizon)
    figures = [
        _samples_figure(runs, times),
        _throughput_figure(runs, times),
        _downtime_figure(summary),
        _gantt_figure(runs),
    ]
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)
    ]
    ratios = ", ".join(f"{name} {ratio:.3f}×" for name, ratio in summary["ratios"].items())
    path.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>Ratios (samples of the first policy over each): <code>{html.escape(ratios)}</code></p>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
