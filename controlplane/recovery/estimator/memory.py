"""Memory estimator: peak bytes per device under 1F1B (Odyssey eq. 14)."""

from __future__ import annotations

import math

from controlplane.recovery.model import ExecutionPlan, ModelProfile


def stage_peak_bytes(
    profile: ModelProfile,
    layers: tuple[int, int],
    stage: int,
    stages: int,
    micro_batches: int,
    tp: int = 1,
) -> float:
    """Odyssey eq. 14: ``N_l(m_p + m_o + m_g) + (N_pp − i) N_l m_a``, per device of a TP group.

    Stage i holds the activations of min(N_pp − i, micro-batches) in-flight micro-batches in the
    steady 1F1B phase; with at least N_pp micro-batches this is the paper's formula.
    """
    in_flight = min(stages - stage, micro_batches)
    return (profile.static_bytes(*layers) + in_flight * profile.activation_bytes(*layers)) / tp


def peak_memory(profile: ModelProfile, plan: ExecutionPlan) -> dict[int, float]:
    """Peak bytes on every device the plan uses.

    A device that serves rerouted micro-batches also keeps their activations: its share of a
    failed replica's micro-batches, rounded up, each with the stage's activations.
    """
    peaks: dict[int, float] = {}
    extra_mb: dict[tuple[int, int], float] = {}
    replicas: dict[tuple[int, int], int] = {}
    tp = plan.tp  # a property that walks the plan: read it once
    for pipeline in plan.pipelines:
        for i, stage in enumerate(pipeline.stages):
            if stage.rerouted:
                extra_mb[stage.layers] = extra_mb.get(stage.layers, 0) + pipeline.micro_batches
                continue
            replicas[stage.layers] = replicas.get(stage.layers, 0) + 1
            bytes_ = stage_peak_bytes(
                profile,
                stage.layers,
                i,
                pipeline.depth,
                pipeline.micro_batches,
                tp,
            )
            for device in stage.devices:
                peaks[device] = bytes_
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            lost = extra_mb.get(stage.layers)
            if stage.rerouted or not lost:
                continue
            share = math.ceil(lost / replicas[stage.layers])
            extra = share * profile.activation_bytes(*stage.layers) / tp
            for device in stage.devices:
                peaks[device] += extra
    return peaks
