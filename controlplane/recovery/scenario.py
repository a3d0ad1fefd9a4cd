"""Scenario files: the JSON contract of the CLI and simulator, parsed into a ClusterState."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import (
    Assumptions,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Family,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)

PositiveFloat = Annotated[float, Field(ge=0)]
PerLayer = PositiveFloat | list[PositiveFloat]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name: str = "model"
    layers: Annotated[int, Field(ge=1)]
    fwd_s: PerLayer
    bwd_s: PerLayer
    m_p: PerLayer = 0.0
    m_o: PerLayer = 0.0
    m_g: PerLayer = 0.0
    m_a: PerLayer = 0.0
    boundary_bytes: PositiveFloat | None = None


class ClusterSpec(_Strict):
    devices: Annotated[int, Field(ge=1)]
    devices_per_node: Annotated[int, Field(ge=1)] = 8
    device_memory_bytes: Annotated[float, Field(gt=0)] | None = None
    intra_node_gbps: Annotated[float, Field(gt=0)] | None = None
    inter_node_gbps: Annotated[float, Field(gt=0)] | None = None
    failure_rate_per_device_hour: PositiveFloat = 0.0
    spares: Annotated[int, Field(ge=0)] = 0


class TrainingSpec(_Strict):
    global_batch: Annotated[int, Field(ge=1)]
    micro_batch: Annotated[int, Field(ge=1)] = 1


class StageSpec(_Strict):
    devices: Annotated[list[int], Field(min_length=1)]
    layers: Annotated[list[int], Field(min_length=2, max_length=2)]
    rerouted: bool = False


class PipelineSpec(_Strict):
    stages: Annotated[list[StageSpec], Field(min_length=1)]
    micro_batches: Annotated[int, Field(ge=1)]


class PlanSpec(_Strict):
    family: Family = Family.DYNAMIC
    pipelines: Annotated[list[PipelineSpec], Field(min_length=1)]


class ScenarioSpec(_Strict):
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    plan: PlanSpec
    failed: list[int] = []
    assumptions: dict[str, float | int | str | bool | None] = {}


def _per_layer(value: float | list[float], layers: int, field: str) -> tuple[float, ...]:
    if isinstance(value, list):
        if len(value) != layers:
            raise InvalidScenario(f"has {len(value)} values for {layers} layers", field=field)
        return tuple(float(v) for v in value)
    return (float(value),) * layers


def _profile(spec: ModelSpec) -> ModelProfile:
    terms = {
        name: _per_layer(getattr(spec, name), spec.layers, f"model.{name}")
        for name in ("fwd_s", "bwd_s", "m_p", "m_o", "m_g", "m_a")
    }
    return ModelProfile(name=spec.name, boundary_bytes=spec.boundary_bytes, **terms)


def _plan(spec: PlanSpec, profile: ModelProfile, cluster: Cluster) -> ExecutionPlan:
    pipelines = []
    tp: int | None = None
    owner: dict[int, str] = {}
    for p, pipe in enumerate(spec.pipelines):
        stages = []
        expected_first = 0
        for s, stage in enumerate(pipe.stages):
            where = f"plan.pipelines[{p}].stages[{s}]"
            first, end = stage.layers
            if first != expected_first or end <= first or end > profile.layers:
                raise InvalidScenario(
                    f"layers {stage.layers} do not continue the pipeline at layer "
                    f"{expected_first} (the model has {profile.layers} layers, ranges are "
                    "half-open)",
                    field=f"{where}.layers",
                )
            expected_first = end
            if tp is None:
                tp = len(stage.devices)
            elif len(stage.devices) != tp and not stage.rerouted:
                raise InvalidScenario(
                    f"has {len(stage.devices)} devices but the plan's tensor-parallel groups "
                    f"have {tp}",
                    field=f"{where}.devices",
                )
            for d in stage.devices:
                cluster.check_device(d, field=f"{where}.devices")
                if not stage.rerouted:
                    if d in owner:
                        raise InvalidScenario(
                            f"device {d} is already used by {owner[d]}",
                            field=f"{where}.devices",
                        )
                    owner[d] = where
            stages.append(
                Stage(
                    devices=tuple(stage.devices),
                    layers=(first, end),
                    rerouted=stage.rerouted,
                )
            )
        if expected_first != profile.layers:
            raise InvalidScenario(
                f"covers layers [0, {expected_first}) of {profile.layers}",
                field=f"plan.pipelines[{p}].stages",
            )
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=pipe.micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines), family=spec.family)


def _assumptions(overrides: dict[str, Any]) -> Assumptions:
    known = {f.name: f for f in fields(Assumptions)}
    for key, value in overrides.items():
        if key not in known:
            raise InvalidScenario(
                f"unknown assumption; known: {', '.join(known)}",
                field=f"assumptions.{key}",
            )
        default = getattr(Assumptions(), key)
        numeric = default is None or (
            isinstance(default, (int, float)) and not isinstance(default, bool)
        )
        if isinstance(value, bool) != isinstance(default, bool) or (
            numeric and not isinstance(value, (int, float))
        ):
            raise InvalidScenario(f"expected a value like {default!r}", field=f"assumptions.{key}")
        if isinstance(value, (int, float)) and value < 0:
            raise InvalidScenario("must not be negative", field=f"assumptions.{key}")
    return replace(Assumptions(), **overrides)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def build_state(data: Any) -> ClusterState:
    """Validate a scenario object (parsed JSON) and build the state it describes."""
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InvalidScenario(error["msg"].lower(), field=_field_path(error["loc"])) from None
    profile = _profile(spec.model)
    c = spec.cluster
    cluster = Cluster(
        devices=c.devices,
        devices_per_node=c.devices_per_node,
        device_memory_bytes=c.device_memory_bytes or float("inf"),
        intra_node_gbps=c.intra_node_gbps,
        inter_node_gbps=c.inter_node_gbps,
        failure_rate_per_device_hour=c.failure_rate_per_device_hour,
        spares=c.spares,
    )
    training = Training(
        global_batch=spec.training.global_batch, micro_batch=spec.training.micro_batch
    )
    plan = _plan(spec.plan, profile, cluster)
    if plan.micro_batches != training.micro_batches:
        raise InvalidScenario(
            f"pipelines run {plan.micro_batches} micro-batches but global_batch/micro_batch is "
            f"{training.micro_batches}",
            field="plan.pipelines",
        )
    for i, d in enumerate(spec.failed):
        cluster.check_device(d, field=f"failed[{i}]")
    return ClusterState(
        profile=profile,
        cluster=cluster,
        training=training,
        plan=plan,
        failed=frozenset(spec.failed),
        assumptions=_assumptions(spec.assumptions),
    )


def load_scenario(path: str | Path) -> ClusterState:
    """Read and validate a scenario file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidScenario(f"cannot read {path}: {exc.strerror}", field="scenario") from None
    except json.JSONDecodeError as exc:
        raise InvalidScenario(
            f"not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            field="scenario",
        ) from None
    return build_state(data)
