"""Database rows into core objects and back, through the core's codec only.

The job row keeps the core's scenario and the current plan as JSON; the device rows say which
devices are down. Everything the core answers is stored as the codec writes it, so a row can be
read back into core objects (``decision_from_dict``) and shown by the API as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from controlplane.recovery.codec import (
    Scenario,
    decision_to_dict,
    plan_from_dict,
    plan_to_dict,
    scenario_from_dict,
    validate_plan,
)
from controlplane.recovery.decision import Decision, decide, grow
from controlplane.recovery.errors import InvalidScenario, RecoveryError, Superseded
from controlplane.recovery.measured import measured_name, model_section, ring_gbps
from controlplane.recovery.measured import with_measurement as _with_measurement
from controlplane.recovery.model import ClusterState, Failure, FailureKind
from controlplane.recovery.policies import default_names, names
from controlplane.recovery.policies import get as get_policy

__all__ = [
    "InvalidScenario",
    "RecoveryError",
    "Scenario",
    "Superseded",
    "check_policies",
    "cluster_layout",
    "decide_for",
    "parse_scenario",
    "state_of",
    "validate_override",
    "with_measurement",
]


def parse_scenario(data: Any) -> Scenario:
    """A job's scenario checked by the core; ``InvalidScenario`` names the field at fault."""
    return scenario_from_dict(data)


def check_policies(enabled: Any, scenario: Scenario) -> list[str]:
    """The job's enabled policies: known names, each once, buildable with the scenario's
    options. An empty list means every policy asked by default (``default_names``)."""
    if not isinstance(enabled, list) or not all(isinstance(n, str) for n in enabled):
        raise InvalidScenario("expected a list of policy names", field="enabled_policies")
    known = names()
    for i, name in enumerate(enabled):
        if name not in known:
            raise InvalidScenario(
                f"unknown policy {name!r}; known: {', '.join(known)}",
                field=f"enabled_policies[{i}]",
            )
    if len(set(enabled)) != len(enabled):
        raise InvalidScenario("names a policy twice", field="enabled_policies")
    for name in enabled or known:
        get_policy(name, **scenario.options.get(name, {}))  # InvalidOption names the option
    return list(enabled)


def cluster_layout(scenario: Scenario) -> tuple[int, int, int]:
    """(devices, spares, devices per node) of the scenario's cluster."""
    cluster = scenario.state.cluster
    return cluster.devices, cluster.spares, cluster.devices_per_node


def state_of(
    scenario: Any,
    plan: Any,
    failed: set[int],
    restartable: set[int] | None = None,
    *,
    parsed: Scenario | None = None,
) -> ClusterState:
    """The core's state of a job: its scenario, the plan it runs now, the devices down now
    (``restartable``: those of them down by their process's fault, on nodes still heard);
    ``parsed``: the scenario as the caller parsed it already (a second parse of a 16,384-device
    scenario is a quarter of a second)."""
    state = (parsed or parse_scenario(scenario)).state
    if isinstance(scenario, dict) and plan == scenario.get("plan"):
        current = state.plan  # until its first recovery, a job runs its scenario's plan
    else:
        current = plan_from_dict(plan, profile=state.profile, cluster=state.cluster)
    down = frozenset(failed)
    return replace(
        state, plan=current, failed=down, restartable=frozenset(restartable or ()) & down
    )


def decide_for(
    scenario: Any,
    plan: Any,
    failed: set[int],
    *,
    kind: str,
    devices: list[int],
    policies: list[str],
    restartable: set[int] | None = None,
    grows: bool = False,
    parsed: Scenario | None = None,
    stale: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Every enabled policy's candidates for a failure of ``devices`` (codec decision dict);
    ``grows``: whether the running job takes back the devices it lost to that failure, now
    healthy (the core's ``grow``: the running plan kept, first, or the policies' growths).

    ``failed`` is every device down now, the failure's included. No row is read or written
    here: the caller stores the answer (or shows it, for a what-if). ``parsed``: the scenario
    as the caller parsed it already; ``stale``: the core's (``decide``), which raises
    ``Superseded`` when it says the failure changed.
    """
    parsed = parsed or parse_scenario(scenario)
    state = state_of(scenario, plan, failed, restartable, parsed=parsed)
    failure = Failure(
        kind=FailureKind(kind), devices=frozenset(devices), detected_by="control plane"
    )
    asked = policies or default_names()
    options = {name: dict(parsed.options[name]) for name in asked if name in parsed.options}
    if grows:
        decision: Decision = grow(state, failure, policies=asked, options=options)
    else:
        decision = decide(state, failure, policies=asked, options=options, stale=stale)
    return decision_to_dict(decision)


def grows_with(policies: list[str]) -> bool:
    """Whether one of ``policies`` (registry names) may grow a running job (``Policy.grow``)."""
    return any(get_policy(name).grows for name in policies)


def validate_override(scenario: Any, plan: Any, failed: set[int], edited: Any) -> dict[str, Any]:
    """An operator's edited plan checked against the job as it is now (memory, layers, batch,
    no failed device); returns it in the codec's format. ``InvalidScenario`` names the field."""
    state = state_of(scenario, plan, failed)
    return plan_to_dict(validate_plan(edited, state, field="plan"))


def with_measurement(
    scenario: Any,
    plan: Any,
    *,
    modules: list[dict[str, Any]],
    micro_batches: int,
    boundary_bytes: float | None = None,
    sync: tuple[float, float, int] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's scenario and running plan made from its script's measurement (``modules``,
    the global batch's ``micro_batches``, one gradient all-reduce's bytes, seconds and members),
    checked by the core; ``InvalidScenario`` names the field when they cannot fit."""
    model = model_section(measured_name(scenario["model"]["name"]), modules, boundary_bytes)
    gbps = ring_gbps(*sync) if sync is not None else None
    new, running = _with_measurement(
        scenario, plan, model=model, micro_batches=micro_batches, gbps=gbps
    )
    state = parse_scenario(new).state
    plan_from_dict(running, profile=state.profile, cluster=state.cluster)
    return new, running
