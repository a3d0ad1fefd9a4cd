"""Memory estimator: peak bytes per device under 1F1B (Odyssey eq. 14)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from controlplane.recovery import replicas
from controlplane.recovery.model import Cluster, ExecutionPlan, ModelProfile


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


def borrowed_bytes(
    profile: ModelProfile, layers: tuple[int, int], lost: float, replicas: int, tp: int
) -> float:
    """What a live replica keeps for rerouted micro-batches: its share of the ``lost`` ones,
    rounded up, each with the stage's activations."""
    return math.ceil(lost / replicas) * profile.activation_bytes(*layers) / tp


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
            extra = borrowed_bytes(profile, stage.layers, lost, replicas[stage.layers], tp)
            for device in stage.devices:
                peaks[device] += extra
    return peaks


class StagePeaks(Mapping[int, float]):
    """``peak_memory`` of a plan with ``Replicas``: every live replica of a stage running m
    micro-batches peaks alike, so the peaks are kept per (stage, m) and a dict per device is
    built only when something reads them device by device."""

    def __init__(self, profile: ModelProfile, known: replicas.Replicas) -> None:
        self.known = known
        depth = len(known.split)
        self.by_stage: dict[tuple[int, int], float] = {}
        for s, layers in enumerate(known.split):
            lost = sum(known.rerouted[s].values())
            for m in known.micro_batch_counts:
                peak = stage_peak_bytes(profile, layers, s, depth, m, known.tp)
                if lost and known.live[s]:
                    peak += borrowed_bytes(profile, layers, lost, len(known.live[s]), known.tp)
                self.by_stage[s, m] = peak
        self._dict: dict[int, float] | None = None

    def _runs(self) -> Iterator[tuple[tuple[int, ...], float]]:
        """(devices, peak) of every live stage."""
        known = self.known
        for s, live in enumerate(known.live):
            for p, group in live.items():
                yield group, self.by_stage[s, known.micro_batches[p]]

    def _uniform(self) -> bool:
        return len(self.known.micro_batch_counts) == 1

    def above(self, capacity: float) -> list[int]:
        """The devices whose peak exceeds ``capacity``."""
        if not any(v > capacity for v in self.by_stage.values()):
            return []
        return [d for group, peak in self._runs() if peak > capacity for d in group]

    def highest(self) -> float:
        if self._uniform():
            m = self.known.micro_batches[0]
            return max(self.by_stage[s, m] for s, live in enumerate(self.known.live) if live)
        return max(peak for _, peak in self._runs())

    @property
    def _devices(self) -> dict[int, float]:
        if self._dict is None:
            self._dict = {d: peak for group, peak in self._runs() for d in group}
        return self._dict

    def __getitem__(self, device: int) -> float:
        return self._devices[device]

    def __iter__(self) -> Iterator[int]:
        return iter(self._devices)

    def __len__(self) -> int:
        return self.known.device_count


def device_peaks(
    profile: ModelProfile, cluster: Cluster, plan: ExecutionPlan
) -> Mapping[int, float]:
    """``peak_memory``, kept per stage where the plan has ``Replicas``."""
    known = replicas.of(plan, cluster)
    return peak_memory(profile, plan) if known is None else StagePeaks(profile, known)


def devices_above(peaks: Mapping[int, float], capacity: float) -> list[int]:
    if isinstance(peaks, StagePeaks):
        return peaks.above(capacity)
    return [d for d, b in peaks.items() if b > capacity]


def highest_peak(peaks: Mapping[int, float]) -> float:
    return peaks.highest() if isinstance(peaks, StagePeaks) else max(peaks.values())
