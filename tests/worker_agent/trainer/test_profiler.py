"""The profiler: memory terms against an independent count, activations, the scenario it writes,
and a tiny run of the estimator-accuracy benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import estimator_accuracy
from controlplane.recovery import cli
from controlplane.recovery.scenario import load_scenario
from worker_agent.trainer.__main__ import main as trainer_main
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.model import ModelConfig, build_layer
from worker_agent.trainer.profiler import Profile, profile_model

MODEL = ModelConfig(layers=2, d_model=32, heads=2, ffn=88, seq=16)


def profiled(micro_batch: int) -> Profile:
    return profile_model(TrainConfig(model=MODEL, micro_batch=micro_batch), warmup=1, repeat=3)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return profiled(2)


def test_memory_terms_are_the_layers_bytes(profile: Profile) -> None:
    assert len(profile.layers) == 2
    for k, measured in enumerate(profile.layers):
        params = list(build_layer(MODEL, k).parameters())
        numel = sum(p.numel() for p in params)
        assert measured.m_p == 4 * numel  # float32
        assert measured.m_g == 4 * numel  # one gradient per parameter
        # AdamW: two float32 moments per parameter and a float32 step count per tensor
        assert measured.m_o == 2 * 4 * numel + 4 * len(params)
    # layer 0 holds the embedding, layer 1 the final norm and the head
    assert profile.layers[0].m_p == 4 * (
        MODEL.vocab * MODEL.d_model
        + sum(p.numel() for p in build_layer(MODEL, 0).block.parameters())
    )
    assert profile.boundary_bytes == 2 * MODEL.seq * MODEL.d_model * 4


def test_activations_are_positive_and_grow_with_the_micro_batch(profile: Profile) -> None:
    bigger = profiled(4)
    for small, large in zip(profile.layers, bigger.layers, strict=True):
        assert small.m_a > 0
        # doubling the samples doubles what a layer keeps, give or take a few shared tensors
        assert 1.8 < large.m_a / small.m_a <= 2.0
        assert small.fwd_s > 0 and small.bwd_s > 0
        assert small.fwd_spread[0] <= small.fwd_s <= small.fwd_spread[1]
    # the activations dwarf nothing they should not: a block keeps at least its input and output
    hidden = 2 * MODEL.seq * MODEL.d_model * 4
    assert profile.layers[1].m_a >= 2 * hidden


def test_the_scenario_loads_in_the_core_and_estimates(profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(profile.scenario(devices=2, pp=2, micro_batches=4, gbps=10.0)))
    state = load_scenario(path).state
    assert state.profile.fwd_s == tuple(p.fwd_s for p in profile.layers)
    assert state.profile.m_a == tuple(float(p.m_a) for p in profile.layers)
    assert state.profile.update_s == tuple(p.optimizer_s for p in profile.layers)
    assert all(p.optimizer_s > 0 for p in profile.layers)
    assert state.training.micro_batch == 2 and state.training.global_batch == 8
    result = cli.estimate(state)
    # two unequal stages: the 1F1B recurrence lies between eq. 9 with the faster and the slower
    times = [sum(p.fwd_s + p.bwd_s for p in profile.layers[a:b]) for a, b in ((0, 1), (1, 2))]
    # then each device's optimizer update, the slower one's
    update = max(p.optimizer_s for p in profile.layers)
    assert 5 * min(times) + update <= result["est_step_time_s"]
    assert (
        result["est_step_time_s"] <= 5 * max(times) + 8 * profile.boundary_bytes * 8 / 10e9 + update
    )
    one = load_one(profile, tmp_path)
    # eq. 9: (1 + 4 - 1)(t_f + t_b), then one update of every layer
    assert one == pytest.approx(4 * sum(times) + sum(p.optimizer_s for p in profile.layers))
    assert set(result["peak_memory_bytes"]) == {"0", "1"}
    first = profile.layers[0]
    # stage 0 of 2 keeps two micro-batches in flight (eq. 14)
    assert result["peak_memory_bytes"]["0"] == pytest.approx(
        first.m_p + first.m_o + first.m_g + 2 * first.m_a
    )


def load_one(profile: Profile, tmp_path: Path) -> float:
    """The estimate of the profile's one-device scenario (4 micro-batches) read from a file."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps(profile.scenario(devices=1, micro_batches=4)))
    return float(cli.estimate(load_scenario(path).state)["est_step_time_s"])


def test_the_profile_command_writes_a_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.json"
    args = ["--layers", "2", "--d-model", "32", "--seq", "16", "--warmup", "0", "--repeat", "2"]
    assert trainer_main(["profile", *args, "--devices", "2", "--pp", "2", "--out", str(out)]) == 0
    assert "m_a MiB" in capsys.readouterr().out
    assert cli.main(["estimate", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["est_step_time_s"] > 0
    assert set(result["peak_memory_bytes"]) == {"0", "1"}


def test_the_benchmark_runs_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    estimator_accuracy.main(["--quick", "--plans", "pp1-m4", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "estimator_accuracy.json").read_text())
    assert [r["plan"] for r in payload["rows"]] == ["pp1-m4"]
    row = payload["rows"][0]
    assert row["estimate_s"] > 0 and row["measured_s"] > 0
    assert len(row["rounds"]) == 1 and len(row["rounds"][0]["step_times_s"]) == 2
    assert "mean absolute percentage error" in capsys.readouterr().out


def test_chained_and_isolated_profiles_time_every_layer(profile: Profile) -> None:
    """The default times the layers within passes of the whole model, the other alone; both give
    every layer a positive forward and backward (the chained backward is read off gradient hooks
    between the layers, so a hook on the wrong tensor would give one layer a negative time)."""
    alone = profile_model(
        TrainConfig(model=MODEL, micro_batch=2), warmup=1, repeat=3, chained=False
    )
    assert profile.conditions["method"] == "chained" and alone.conditions["method"] == "isolated"
    for p in (profile, alone):
        assert all(layer.fwd_s > 0 and layer.bwd_s > 0 for layer in p.layers)
        lo, hi = p.layers[0].bwd_spread
        assert 0 < lo <= p.layers[0].bwd_s <= hi
