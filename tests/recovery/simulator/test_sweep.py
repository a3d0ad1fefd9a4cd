"""A sweep cut into pieces, run in any order and merged, gives the one-process summary."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.scenario import load_scenario
from controlplane.recovery.simulator import Experiment, TraceSpec, run
from controlplane.recovery.simulator.sweep import (
    experiment_from_dict,
    merge,
    pieces,
    run_piece,
)
from controlplane.recovery.simulator.timeline import Run

from .test_command import scenario


@settings(max_examples=4, deadline=None)
@given(seeds=st.integers(1, 3), base_seed=st.integers(0, 50), shuffle=st.randoms())
def test_merged_pieces_give_the_summary_of_one_process(
    tmp_path_factory: pytest.TempPathFactory, seeds: int, base_seed: int, shuffle: random.Random
) -> None:
    tmp = tmp_path_factory.mktemp("sweep")
    state = load_scenario(scenario(tmp)).state
    experiment = Experiment(
        hours=3,
        policies=("odyssey", "checkpoint", "dynamic"),
        trace=TraceSpec(failure_rate_per_device_hour=0.3, repair_hours=0.5),
        seeds=seeds,
        base_seed=base_seed,
    )
    whole = run(state, experiment, out_dir=tmp / "whole", report=False, scenario="s")
    todo = pieces(experiment)
    assert len(todo) == seeds * 4  # three policies and the ideal per seed
    shuffle.shuffle(todo)
    # each piece's run travels as JSON, as it does between Celery workers
    runs = [
        Run.from_dict(json.loads(json.dumps(run_piece(state, experiment, p).to_dict())), 8)
        for p in todo
    ]
    merged = merge(experiment, runs, scenario="s")
    curves = merged.pop("curves")
    assert merged == whole
    assert set(curves["samples"]) == {"odyssey", "checkpoint", "dynamic", "ideal"}
    ideal_end = curves["samples"]["ideal"][-1]
    assert all(series[-1] <= ideal_end * (1 + 1e-9) for series in curves["samples"].values())
    with pytest.raises(InvalidScenario, match="pieces have no run"):
        merge(experiment, runs[1:])


def test_experiments_from_json_name_the_field_at_fault(tmp_path: Path) -> None:
    state = load_scenario(scenario(tmp_path)).state
    good = experiment_from_dict({"hours": 2, "policies": ["odyssey"], "seeds": 3}, state)
    assert good.seeds == 3 and isinstance(good.trace, TraceSpec)
    assert good.trace.failure_rate_per_device_hour == 0.2  # the scenario's
    cases: dict[str, dict[str, Any]] = {
        "policies": {"policies": "odyssey"},
        "colour": {"policies": ["odyssey"], "colour": 1},
        "trace.burst_prob": {"policies": ["odyssey"], "trace": {"burst_prob": 2}},
        "trace.shape": {"policies": ["odyssey"], "trace": {"shape": 2}},
        "trace": {"policies": ["odyssey"], "trace": {"distribution": "gamma"}},
        "hours": {"policies": ["odyssey"], "hours": -1},
    }
    for field, data in cases.items():
        with pytest.raises(InvalidScenario) as caught:
            experiment_from_dict(data, state)
        assert caught.value.field == field, (field, str(caught.value))


def test_a_replayed_trace_file_runs_every_seed_over_the_same_failures(tmp_path: Path) -> None:
    state = load_scenario(scenario(tmp_path)).state
    csv_text = "time_s,devices,kind,repair_s\n600,3,crash,1800\n4000,0;1,node_lost,\n"
    data = {"hours": 2, "policies": ["odyssey", "checkpoint"], "seeds": 2, "trace_csv": csv_text}
    experiment = experiment_from_dict(data, state)
    assert [f.time_s for f in experiment.trace_for(state, 0).failures] == [600.0, 4000.0]
    runs = {p: run_piece(state, experiment, p) for p in pieces(experiment)}
    by_policy: dict[str, list[Run]] = {}
    for piece, one in runs.items():
        by_policy.setdefault(piece.policy, []).append(one)
    for policy, seeds in by_policy.items():  # one trace, so every seed's run is the same
        first, second = (json.dumps(r.to_dict(), sort_keys=True) for r in seeds)
        assert first.replace('"seed": 0', "") == second.replace('"seed": 1', ""), policy
    bad = {
        "trace": {**data, "trace": {"burst_prob": 0.1}},  # both ways at once
        "trace_csv": {**data, "trace_csv": "time_s,devices\nsoon,3\n"},
    }
    for field, wrong in bad.items():
        with pytest.raises(InvalidScenario) as caught:
            experiment_from_dict(wrong, state)
        assert (caught.value.field or "").startswith(field), (field, str(caught.value))
