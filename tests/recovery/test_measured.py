"""A job's scenario from its script's measurement (``controlplane.recovery.measured``): for any
launcher-made job and any measurement, the core takes the result, every stage covers every
measured layer, the pipelines' micro-batches add up to the script's global batch and differ by
one at most; a job whose pipelines split its layers takes only a measurement that fits them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codec import plan_from_dict, scenario_from_dict
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.measured import (
    measured_name,
    model_section,
    ring_gbps,
    with_measurement,
)
from worker_agent.launch import World, job_scenario

ROOT = Path(__file__).resolve().parents[2]

costs = st.floats(0, 10, allow_nan=False)
sizes = st.floats(0, 1e9, allow_nan=False)
module = st.fixed_dictionaries(
    {"fwd_s": costs, "bwd_s": costs, "update_s": costs, "m_p": sizes, "m_o": sizes,
     "m_g": sizes, "m_a": sizes}
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    nnodes=st.integers(1, 6),
    nproc=st.sampled_from([1, 2, 4]),
    modules=st.lists(module, min_size=1, max_size=12),
    data=st.data(),
)
def test_any_launcher_job_takes_any_measurement_that_gives_each_replica_a_micro_batch(
    nnodes: int, nproc: int, modules: list[dict[str, float]], data: st.DataObject
) -> None:
    size = data.draw(st.sampled_from([k for k in (1, 2, 4) if nproc % k == 0]))
    world = World(nnodes, nproc, 0, "h", 1, "r", 3, "SIGTERM", "/tmp", replica_size=size)
    scenario = job_scenario(world, nnodes, "/w/train.py")
    replicas = nnodes * nproc // size
    micro_batches = data.draw(st.integers(replicas, 4 * replicas + 3))
    running = {"pipelines": scenario["plan"]["pipelines"][: data.draw(st.integers(1, replicas))]}
    gbps = data.draw(st.none() | st.floats(0.001, 1000))
    model = model_section(measured_name("train.py (not profiled)"), modules, 1024.0)
    new, plan = with_measurement(
        scenario, running, model=model, micro_batches=micro_batches, gbps=gbps
    )
    state = scenario_from_dict(new).state  # the core takes it
    plan_from_dict(plan, profile=state.profile, cluster=state.cluster)
    assert state.profile.layers == len(modules)
    assert state.profile.name == "train.py (measured by the script)"
    for each in (new["plan"], plan):
        assert all(s["layers"] == [0, len(modules)] for p in each["pipelines"] for s in p["stages"])
        shares = [p["micro_batches"] for p in each["pipelines"]]
        assert sum(shares) == micro_batches and max(shares) - min(shares) <= 1
    assert new["training"]["global_batch"] == micro_batches
    assert scenario["model"]["layers"] == 1  # the arguments are left as they were
    if gbps is not None:  # the sync crossed nodes when the running plan spans several
        spanned = {
            d // nproc for p in running["pipelines"] for s in p["stages"] for d in s["devices"]
        }
        assert new["cluster"]["inter_node_gbps" if len(spanned) > 1 else "intra_node_gbps"] == gbps


def test_a_replica_without_a_micro_batch_is_refused() -> None:
    world = World(2, 2, 0, "h", 1, "r", 3, "SIGTERM", "/tmp")
    scenario = job_scenario(world, 2, "train.py")
    model = model_section("m", [{"fwd_s": 1.0}], None)
    with pytest.raises(InvalidScenario) as refused:
        with_measurement(scenario, scenario["plan"], model=model, micro_batches=3)
    assert refused.value.field == "micro_batches"


def pipelined() -> dict[str, Any]:
    scenario: dict[str, Any] = json.loads(
        (ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text()
    )
    scenario["failed"] = []
    return scenario


def test_a_pipelined_job_takes_a_measurement_of_as_many_layers_and_its_batch_only() -> None:
    scenario = pipelined()
    layers = scenario["model"]["layers"]
    batch = scenario["training"]["global_batch"] // scenario["training"].get("micro_batch", 1)
    fitting = model_section("m", [{"fwd_s": 0.01, "bwd_s": 0.02}] * layers, None)
    new, plan = with_measurement(scenario, scenario["plan"], model=fitting, micro_batches=batch)
    assert new["plan"] == scenario["plan"] and plan == scenario["plan"]  # stages kept
    scenario_from_dict(new)
    with pytest.raises(InvalidScenario) as fewer:
        with_measurement(scenario, scenario["plan"], model=fitting | {"fwd_s": [0.1]},
                         micro_batches=batch)  # fmt: skip
    assert fewer.value.field == "modules"
    with pytest.raises(InvalidScenario) as other_batch:
        with_measurement(scenario, scenario["plan"], model=fitting, micro_batches=batch + 1)
    assert other_batch.value.field == "micro_batches"


@given(nbytes=st.floats(1, 1e12), seconds=st.floats(1e-6, 100), members=st.integers(2, 10_000))
def test_the_ring_bandwidth_moves_the_bytes_in_the_seconds_measured(
    nbytes: float, seconds: float, members: int
) -> None:
    gbps = ring_gbps(nbytes, seconds, members)
    assert gbps is not None
    # written out: each member sends and receives 2(k−1)/k of the buffer through its link
    moved = 2 * (members - 1) / members * nbytes
    assert moved * 8 / (gbps * 1e9) == pytest.approx(seconds)
    assert ring_gbps(nbytes, seconds, 1) is None and ring_gbps(0, seconds, members) is None
