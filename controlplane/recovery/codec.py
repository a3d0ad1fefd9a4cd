"""The core's one codec: plans, transitions, candidates and cluster states to and from plain dicts.

Every edge where a plan crosses into or out of the core uses this format: scenario files, the
CLI's output, database JSON columns, REST bodies, agent protocol frames and an operator's edited
plan. Encoding gives JSON-ready dicts; decoding validates with pydantic and with the core's own
rules and raises ``InvalidScenario`` whose ``field`` names the value at fault as a path
(``plan.pipelines[0].stages[1].layers``), so an API can show the error beside that field.

``validate_plan`` is the check for a plan someone wrote (an override): on top of the structure it
refuses failed devices, a batch that does not add up and a stage over memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.recovery import policies as registry
from controlplane.recovery.codes import Caveat, Code, Option
from controlplane.recovery.decision import Decision
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.estimator.memory import peak_memory
from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    Family,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
    TransitionCost,
)

PositiveFloat = Annotated[float, Field(ge=0)]
PerLayer = PositiveFloat | list[PositiveFloat]
PER_LAYER_TERMS = ("fwd_s", "bwd_s", "m_p", "m_o", "m_g", "m_a")


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
    update_s: PerLayer = 0.0


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
    # options of the policies by name, e.g. {"oobleck": {"f": 3}} (policies.describe lists them)
    policies: dict[str, dict[str, float | int | str | bool | None]] = {}


class TransitionSpec(_Strict):
    detection_s: PositiveFloat = 0.0
    search_s: PositiveFloat = 0.0
    weight_transfer_s: PositiveFloat = 0.0
    restart_s: PositiveFloat = 0.0
    lost_work_s: PositiveFloat = 0.0
    total_s: PositiveFloat | None = None  # derived: accepted on the way in, never trusted


class CandidateSpec(_Strict):
    policy: Annotated[str, Field(min_length=1)]
    code: Code
    note: str = ""
    feasible: bool | None = None  # derived from the code: accepted on the way in, never trusted
    option: Option | None = None
    plan: dict[str, Any] | None = None
    est_step_time_s: PositiveFloat | None = None
    transition: TransitionSpec = TransitionSpec()
    peak_memory_bytes: dict[int, PositiveFloat] = {}
    objective: PositiveFloat = 0.0
    caveats: list[Caveat] = []


class FailureSpec(_Strict):
    kind: FailureKind
    devices: Annotated[list[int], Field(min_length=1)]
    detected_at_s: PositiveFloat = 0.0
    detected_by: str = "scenario"


class DecisionSpec(_Strict):
    failure: dict[str, Any]
    candidates: list[dict[str, Any]]
    chosen: Annotated[int, Field(ge=0)] | None
    search_time_s: PositiveFloat = 0.0


Spec = TypeVar("Spec", bound=_Strict)


def _field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parse(spec: type[Spec], data: Any, prefix: str) -> Spec:
    """Validate ``data`` against a spec; the first error names its field under ``prefix``."""
    try:
        return spec.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InvalidScenario(
            error["msg"].lower(), field=_field_path(prefix, error["loc"]) or prefix or None
        ) from None


# --- plans ---


def plan_to_dict(plan: ExecutionPlan) -> dict[str, Any]:
    """The scenario format's ``plan`` object (``rerouted`` only on the stages that are)."""

    def stage_dict(stage: Stage) -> dict[str, Any]:
        out: dict[str, Any] = {"devices": list(stage.devices), "layers": list(stage.layers)}
        if stage.rerouted:
            out["rerouted"] = True
        return out

    return {
        "family": plan.family.value,
        "pipelines": [
            {"stages": [stage_dict(s) for s in p.stages], "micro_batches": p.micro_batches}
            for p in plan.pipelines
        ],
    }


def plan_from_dict(
    data: Any, *, profile: ModelProfile, cluster: Cluster, field: str = "plan"
) -> ExecutionPlan:
    """A plan's structure checked: known devices used once, one TP width, layers covered
    (``data``: the plan object, or its spec already validated)."""
    spec = data if isinstance(data, PlanSpec) else _parse(PlanSpec, data, field)
    pipelines = []
    tp: int | None = None
    owner: dict[int, str] = {}
    for p, pipe in enumerate(spec.pipelines):
        stages = []
        expected_first = 0
        for s, stage in enumerate(pipe.stages):
            where = f"{field}.pipelines[{p}].stages[{s}]"
            first, end = stage.layers
            if first != expected_first or end <= first or end > profile.layers:
                raise InvalidScenario(
                    f"layers {stage.layers} do not continue the pipeline at layer "
                    f"{expected_first} (the model has {profile.layers} layers, ranges are "
                    "half-open)",
                    field=f"{where}.layers",
                )
            expected_first = end
            # a rerouted stage lists every live replica it borrows, so only own stages set tp
            if not stage.rerouted:
                tp = tp or len(stage.devices)
                if len(stage.devices) != tp:
                    raise InvalidScenario(
                        f"has {len(stage.devices)} devices but the plan's tensor-parallel "
                        f"groups have {tp}",
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
                Stage(devices=tuple(stage.devices), layers=(first, end), rerouted=stage.rerouted)
            )
        if expected_first != profile.layers:
            raise InvalidScenario(
                f"covers layers [0, {expected_first}) of {profile.layers}",
                field=f"{field}.pipelines[{p}].stages",
            )
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=pipe.micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines), family=spec.family)


def validate_plan(data: Any, state: ClusterState, *, field: str = "plan") -> ExecutionPlan:
    """A plan someone wrote for ``state`` (an operator's override), checked before it is used.

    Beyond ``plan_from_dict``'s structure: no failed device, the pipelines' micro-batches add up
    to the training batch, and every device fits its peak memory (eq. 14).
    """
    plan = plan_from_dict(data, profile=state.profile, cluster=state.cluster, field=field)
    for p, s, stage in plan.stages():
        down = sorted(set(stage.devices) & state.failed)
        if down:
            raise InvalidScenario(
                f"uses failed devices {down}", field=f"{field}.pipelines[{p}].stages[{s}].devices"
            )
    if plan.micro_batches != state.training.micro_batches:
        raise InvalidScenario(
            f"pipelines run {plan.micro_batches} micro-batches but global_batch/micro_batch is "
            f"{state.training.micro_batches}",
            field=f"{field}.pipelines",
        )
    capacity = state.cluster.device_memory_bytes
    peaks = peak_memory(state.profile, plan)
    for p, s, stage in plan.stages():
        worst = max((peaks.get(d, 0.0) for d in stage.devices), default=0.0)
        if worst > capacity:
            raise InvalidScenario(
                f"needs {worst:.4g} bytes per device, over the {capacity:.4g} a device has",
                field=f"{field}.pipelines[{p}].stages[{s}]",
            )
    return plan


# --- transitions and candidates ---


def transition_to_dict(cost: TransitionCost) -> dict[str, float]:
    return {
        "detection_s": cost.detection_s,
        "search_s": cost.search_s,
        "weight_transfer_s": cost.weight_transfer_s,
        "restart_s": cost.restart_s,
        "lost_work_s": cost.lost_work_s,
        "total_s": cost.total_s,
    }


def transition_from_dict(data: Any, *, field: str = "transition") -> TransitionCost:
    spec = _parse(TransitionSpec, data, field)
    return TransitionCost(
        detection_s=spec.detection_s,
        search_s=spec.search_s,
        weight_transfer_s=spec.weight_transfer_s,
        restart_s=spec.restart_s,
        lost_work_s=spec.lost_work_s,
    )


def candidate_to_dict(candidate: Candidate) -> dict[str, Any]:
    step = candidate.est_step_time_s
    return {
        "policy": candidate.policy,
        "code": str(candidate.code),
        "note": candidate.note,
        "feasible": candidate.feasible,
        "option": None if candidate.option is None else str(candidate.option),
        "plan": None if candidate.plan is None else plan_to_dict(candidate.plan),
        "est_step_time_s": None if math.isinf(step) else step,
        "transition": transition_to_dict(candidate.transition),
        "peak_memory_bytes": {str(d): b for d, b in sorted(candidate.peak_memory_bytes.items())},
        "objective": candidate.objective,
        "caveats": [str(c) for c in candidate.caveats],
    }


def candidate_from_dict(
    data: Any, *, profile: ModelProfile, cluster: Cluster, field: str = "candidate"
) -> Candidate:
    """A stored candidate back, its plan's structure checked (it may be infeasible)."""
    spec = _parse(CandidateSpec, data, field)
    plan = None
    if spec.plan is not None:
        plan = plan_from_dict(spec.plan, profile=profile, cluster=cluster, field=f"{field}.plan")
    return Candidate(
        policy=spec.policy,
        code=spec.code,
        note=spec.note,
        option=spec.option,
        plan=plan,
        est_step_time_s=math.inf if spec.est_step_time_s is None else spec.est_step_time_s,
        transition=transition_from_dict(spec.transition.model_dump(), field=f"{field}.transition"),
        peak_memory_bytes=dict(spec.peak_memory_bytes),
        objective=spec.objective,
        caveats=tuple(spec.caveats),
    )


# --- failures and decisions ---


def failure_to_dict(failure: Failure) -> dict[str, Any]:
    return {
        "kind": str(failure.kind),
        "devices": sorted(failure.devices),
        "detected_at_s": failure.detected_at_s,
        "detected_by": failure.detected_by,
    }


def failure_from_dict(data: Any, *, cluster: Cluster, field: str = "failure") -> Failure:
    spec = _parse(FailureSpec, data, field)
    for i, device in enumerate(spec.devices):
        cluster.check_device(device, field=f"{field}.devices[{i}]")
    return Failure(
        kind=spec.kind,
        devices=frozenset(spec.devices),
        detected_at_s=spec.detected_at_s,
        detected_by=spec.detected_by,
    )


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    """The decision as ``plan`` prints it and a decision row stores it."""
    return {
        "failure": failure_to_dict(decision.failure),
        "search_time_s": decision.search_s,
        "chosen": decision.chosen,
        "candidates": [candidate_to_dict(c) for c in decision.candidates],
    }


def decision_from_dict(
    data: Any, *, profile: ModelProfile, cluster: Cluster, field: str = "decision"
) -> Decision:
    """A stored decision back; ``chosen`` must name a feasible candidate."""
    spec = _parse(DecisionSpec, data, field)
    candidates = tuple(
        candidate_from_dict(c, profile=profile, cluster=cluster, field=f"{field}.candidates[{i}]")
        for i, c in enumerate(spec.candidates)
    )
    if spec.chosen is not None and (
        spec.chosen >= len(candidates) or not candidates[spec.chosen].feasible
    ):
        raise InvalidScenario("does not name a feasible candidate", field=f"{field}.chosen")
    return Decision(
        failure=failure_from_dict(spec.failure, cluster=cluster, field=f"{field}.failure"),
        candidates=candidates,
        chosen=spec.chosen,
        search_s=spec.search_time_s,
    )


# --- cluster states (the scenario format) ---


def _per_layer(value: float | list[float], layers: int, field: str) -> tuple[float, ...]:
    if isinstance(value, list):
        if len(value) != layers:
            raise InvalidScenario(f"has {len(value)} values for {layers} layers", field=field)
        return tuple(float(v) for v in value)
    return (float(value),) * layers


def _check_setting(value: Any, default: Any, field: str) -> None:
    """A value for a setting whose default is ``default``: the same kind, and not negative
    unless the default is (an offset)."""
    numeric = default is None or (
        isinstance(default, (int, float)) and not isinstance(default, bool)
    )
    if isinstance(value, bool) != isinstance(default, bool) or (
        numeric and not isinstance(value, (int, float))
    ):
        raise InvalidScenario(f"expected a value like {default!r}", field=field)
    may_be_negative = isinstance(default, (int, float)) and default < 0
    if isinstance(value, (int, float)) and value < 0 and not may_be_negative:
        raise InvalidScenario("must not be negative", field=field)


def _assumptions(overrides: dict[str, Any]) -> Assumptions:
    known = {f.name: f for f in fields(Assumptions)}
    for key, value in overrides.items():
        if key not in known:
            raise InvalidScenario(
                f"unknown assumption; known: {', '.join(known)}",
                field=f"assumptions.{key}",
            )
        _check_setting(value, getattr(Assumptions(), key), f"assumptions.{key}")
    return replace(Assumptions(), **overrides)


def options_from_dict(data: Any, *, field: str = "policies") -> dict[str, dict[str, Any]]:
    """Policy options by name, each checked against the options its policy takes."""
    if not isinstance(data, dict):
        raise InvalidScenario("expected an object of policy names", field=field)
    options: dict[str, dict[str, Any]] = {}
    for name, given in data.items():
        if name not in registry.names():
            raise InvalidScenario(
                f"unknown policy; known: {', '.join(registry.names())}", field=f"{field}.{name}"
            )
        if not isinstance(given, dict):
            raise InvalidScenario("expected an object of options", field=f"{field}.{name}")
        known = registry.option_defaults(name)
        for key, value in given.items():
            if key not in known:
                raise registry.InvalidOption(
                    f"unknown option; {name} takes: {', '.join(known) or 'none'}",
                    field=f"{field}.{name}.{key}",
                )
            _check_setting(value, known[key], f"{field}.{name}.{key}")
        options[name] = dict(given)
    return options


@dataclass(frozen=True, slots=True)
class Scenario:
    """A scenario file's contents: the cluster state, and the options of the policies."""

    state: ClusterState
    options: Mapping[str, Mapping[str, Any]]


def scenario_from_dict(data: Any) -> Scenario:
    """A whole scenario object: its state and its ``policies`` section."""
    state = state_from_dict(data)
    return Scenario(state=state, options=options_from_dict(data.get("policies", {})))


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    data = state_to_dict(scenario.state)
    if scenario.options:
        data["policies"] = {name: dict(given) for name, given in scenario.options.items()}
    return data


def state_from_dict(data: Any) -> ClusterState:
    """A scenario object (parsed JSON) validated and built into the state it describes."""
    spec = _parse(ScenarioSpec, data, "")
    model = spec.model
    terms = {
        name: _per_layer(getattr(model, name), model.layers, f"model.{name}")
        for name in PER_LAYER_TERMS
    }
    profile = ModelProfile(
        name=model.name,
        boundary_bytes=model.boundary_bytes,
        update_s=_per_layer(model.update_s, model.layers, "model.update_s"),
        **terms,
    )
    c = spec.cluster
    cluster = Cluster(
        devices=c.devices,
        devices_per_node=c.devices_per_node,
        device_memory_bytes=c.device_memory_bytes or math.inf,
        intra_node_gbps=c.intra_node_gbps,
        inter_node_gbps=c.inter_node_gbps,
        failure_rate_per_device_hour=c.failure_rate_per_device_hour,
        spares=c.spares,
    )
    training = Training(
        global_batch=spec.training.global_batch, micro_batch=spec.training.micro_batch
    )
    # the spec as validated: dumped and validated again, a 16,384-device plan took 0.3 s more
    plan = plan_from_dict(spec.plan, profile=profile, cluster=cluster)
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


def state_to_dict(state: ClusterState) -> dict[str, Any]:
    """The scenario object of a state: per-layer terms as one number when all layers agree,
    and only the assumptions that differ from the defaults."""
    profile = state.profile
    model: dict[str, Any] = {"name": profile.name, "layers": profile.layers}
    for name in PER_LAYER_TERMS:
        values = getattr(profile, name)
        model[name] = values[0] if len(set(values)) == 1 else list(values)
    if profile.boundary_bytes is not None:
        model["boundary_bytes"] = profile.boundary_bytes
    if profile.has_update:
        values = profile.update_s
        model["update_s"] = values[0] if len(set(values)) == 1 else list(values)
    c = state.cluster
    defaults = Assumptions()
    return {
        "model": model,
        "cluster": {
            "devices": c.devices,
            "devices_per_node": c.devices_per_node,
            "device_memory_bytes": None
            if math.isinf(c.device_memory_bytes)
            else c.device_memory_bytes,
            "intra_node_gbps": c.intra_node_gbps,
            "inter_node_gbps": c.inter_node_gbps,
            "failure_rate_per_device_hour": c.failure_rate_per_device_hour,
            "spares": c.spares,
        },
        "training": {
            "global_batch": state.training.global_batch,
            "micro_batch": state.training.micro_batch,
        },
        "plan": plan_to_dict(state.plan),
        "failed": sorted(state.failed),
        "assumptions": {
            f.name: getattr(state.assumptions, f.name)
            for f in fields(Assumptions)
            if getattr(state.assumptions, f.name) != getattr(defaults, f.name)
        },
    }
