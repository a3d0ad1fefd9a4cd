"""A job's scenario from its training script's own measurement.

A script written with ``worker_agent.elastic`` measures itself on its first steps in each new
world: every top-level module's forward and backward seconds for one micro-batch, its share of
the optimizer's step, its parameter, optimizer-state, gradient and saved-activation bytes, the
global batch in micro-batches and one gradient all-reduce. ``with_measurement`` makes the job's
model section of it (a layer a module) and fits the scenario's plan and the running plan to it:
a data-parallel job (one stage a pipeline) gets stages over every layer and the global batch
shared among its pipelines; a job whose pipelines split the layers keeps them, and only a
measurement of as many modules as it has layers fits it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.recovery.errors import InvalidScenario

# A launcher's job before its script measured itself: the placeholder model's name ends so.
UNMEASURED = " (not profiled)"
MEASURED = " (measured by the script)"
COST_TERMS = ("fwd_s", "bwd_s", "m_p", "m_o", "m_g", "m_a", "update_s")


def ring_gbps(nbytes: float, seconds: float, members: int) -> float | None:
    """The link bandwidth an all-reduce of ``nbytes`` among ``members`` in ``seconds`` shows,
    in the core's terms (a ring moves 2(k−1)/k of the bytes through each member's link); none
    when it says nothing (one member, nothing moved)."""
    if members < 2 or seconds <= 0 or nbytes <= 0:
        return None
    return 2 * (members - 1) / members * nbytes * 8 / seconds / 1e9


def model_section(
    name: str, modules: Sequence[Mapping[str, Any]], boundary_bytes: float | None = None
) -> dict[str, Any]:
    """The scenario's ``model``: one layer a measured module, in the order they ran."""
    model: dict[str, Any] = {"name": name, "layers": len(modules)}
    for term in COST_TERMS:
        model[term] = [float(m.get(term, 0.0)) for m in modules]
    if boundary_bytes is not None:
        model["boundary_bytes"] = float(boundary_bytes)
    return model


def measured_name(previous: str) -> str:
    """The model's name once measured: the script's, from the launcher's placeholder."""
    base = previous.removesuffix(UNMEASURED).removesuffix(MEASURED)
    return base + MEASURED


def _shares(total: int, parts: int) -> list[int]:
    each, extra = divmod(total, parts)
    return [each + (1 if k < extra else 0) for k in range(parts)]


def with_measurement(
    scenario: Mapping[str, Any],
    plan: Mapping[str, Any],
    *,
    model: Mapping[str, Any],
    micro_batches: int,
    gbps: float | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``scenario`` and the running ``plan`` with ``model`` measured by the script, its global
    batch of ``micro_batches`` and, when given, the link its gradient sync showed. New dicts;
    ``InvalidScenario`` (field ``modules`` or ``micro_batches``) when they cannot fit."""
    new, running = copy.deepcopy(dict(scenario)), copy.deepcopy(dict(plan))
    layers = len(model["fwd_s"])
    plans = [new["plan"], running]
    pipelines = [p for each in plans for p in each["pipelines"]]
    data_parallel = all(len(p["stages"]) == 1 for p in pipelines)
    if not data_parallel:
        had = int(new["model"]["layers"])
        if layers != had:
            raise InvalidScenario(
                f"the job's pipelines split its {had} layers: a measurement of {layers} modules"
                " cannot replace them",
                field="modules",
            )
        batch = int(new["training"]["global_batch"]) // int(new["training"].get("micro_batch", 1))
        if micro_batches != batch:
            raise InvalidScenario(
                f"the job's pipelines run {batch} micro-batches, the script {micro_batches}",
                field="micro_batches",
            )
    new["model"] = dict(model)
    if data_parallel:
        for each in plans:
            count = len(each["pipelines"])
            if micro_batches < count:
                raise InvalidScenario(
                    f"{micro_batches} micro-batches for {count} replicas: each needs one",
                    field="micro_batches",
                )
            for pipe, share in zip(each["pipelines"], _shares(micro_batches, count), strict=True):
                pipe["stages"][0]["layers"] = [0, layers]
                pipe["micro_batches"] = share
        new["training"]["global_batch"] = micro_batches * int(new["training"].get("micro_batch", 1))
    if gbps is not None:
        cluster = new["cluster"]
        per_node = int(cluster.get("devices_per_node") or cluster["devices"])
        used = {d for p in running["pipelines"] for s in p["stages"] for d in s["devices"]}
        nodes = {d // per_node for d in used}
        cluster["inter_node_gbps" if len(nodes) > 1 else "intra_node_gbps"] = gbps
    return new, running
