"""The trainer's parts in one process: layers, samples, schedule, plan checks, layer state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from controlplane.recovery.errors import InvalidScenario
from tests.worker_agent.trainer.reference import pipeline, plan, rerouted, stage
from worker_agent.trainer.data import Corpus
from worker_agent.trainer.engine import PlanNotSupported, TrainConfig, TrainPlan, Worker
from worker_agent.trainer.model import ModelConfig, build_layer, build_layers, loss_of, run_layers
from worker_agent.trainer.schedule import Op, build_schedule

SMALL = ModelConfig(layers=4, d_model=32, heads=2, ffn=64, seq=16)


def test_a_layer_has_the_same_initial_weights_whichever_range_builds_it() -> None:
    alone = build_layer(SMALL, 2)
    in_range = build_layers(SMALL, 1, 4)[2]
    whole = build_layers(SMALL, 0, 4)[2]
    for (name, a), b, c in zip(
        alone.named_parameters(), in_range.parameters(), whole.parameters(), strict=True
    ):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert not torch.equal(alone.block.mlp.up.weight, build_layer(SMALL, 1).block.mlp.up.weight)


def test_the_first_and_last_layers_carry_the_embedding_and_the_head() -> None:
    layers = build_layers(SMALL, 0, 4)
    assert layers[0].embed is not None and layers[0].head is None
    assert layers[3].head is not None and layers[1].embed is None and layers[1].head is None
    tokens = torch.randint(0, 256, (2, SMALL.seq))
    assert run_layers(layers, 0, 4, tokens).shape == (2, SMALL.seq, 256)
    one = ModelConfig(layers=1, d_model=32, heads=2, ffn=64, seq=16)
    (only,) = build_layers(one, 0, 1).values()
    assert only.embed is not None and only.head is not None
    assert only(tokens).shape == (2, SMALL.seq, 256)


def test_attention_is_causal() -> None:
    layers = build_layers(SMALL, 0, 4)
    tokens = torch.randint(0, 256, (1, SMALL.seq))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    a, b = run_layers(layers, 0, 4, tokens), run_layers(layers, 0, 4, changed)
    assert torch.allclose(a[0, :-1], b[0, :-1]) and not torch.allclose(a[0, -1], b[0, -1])


def test_samples_are_addressed_by_seed_step_and_global_index() -> None:
    corpus = Corpus.default()
    x, y = corpus.batch(0, 5, 10, 4, 32)
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    again, _ = corpus.batch(0, 5, 12, 1, 32)
    assert torch.equal(again[0], x[2])
    assert not torch.equal(corpus.batch(0, 6, 10, 1, 32)[0][0], x[0])
    assert not torch.equal(corpus.batch(1, 5, 10, 1, 32)[0][0], x[0])


def _letters(ops: list[Op]) -> str:
    return " ".join(("B" if o.backward else "F") + str(o.micro) for o in ops)


def test_every_stage_of_a_pipeline_runs_1f1b() -> None:
    p = TrainPlan.parse(
        plan(pipeline(6, stage(0, 0, 1), stage(1, 1, 2), stage(2, 2, 3), stage(3, 3, 4))), 4
    )
    order = build_schedule(p.plan)
    assert _letters(order[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _letters(order[2]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert _letters(order[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


def test_crossed_rerouting_runs_every_micro_batch_once_on_a_holder() -> None:
    """Each device serves the other pipeline's lost stage: no order may wait on itself."""
    crossed = plan(
        pipeline(3, stage(0, 0, 2), rerouted([3], 2, 4)),
        pipeline(3, rerouted([0], 0, 2), stage(3, 2, 4)),
        family="rerouting",
    )
    order = build_schedule(TrainPlan.parse(crossed, 4).plan)
    assert set(order) == {0, 3}
    everything = sorted(op for ops in order.values() for op in ops)
    assert everything == sorted(
        Op(b, p, s, m) for b in (False, True) for p in (0, 1) for s in (0, 1) for m in range(3)
    )
    assert {op.stage for op in order[0]} == {0} and {op.stage for op in order[3]} == {1}


def test_a_rerouted_stage_spreads_its_micro_batches_over_the_replicas() -> None:
    spread = plan(
        pipeline(2, stage(0, 0, 2), stage(1, 2, 4)),
        pipeline(2, stage(2, 0, 2), stage(3, 2, 4)),
        pipeline(4, stage(4, 0, 2), rerouted([1, 3], 2, 4)),
        family="rerouting",
    )
    order = build_schedule(TrainPlan.parse(spread, 4).plan)
    served = {d: sorted(op.micro for op in order[d] if op.pipeline == 2) for d in (1, 3)}
    assert served == {1: [0, 0, 2, 2], 3: [1, 1, 3, 3]}


def _tp2() -> dict[str, Any]:
    return plan(pipeline(2, {"devices": [0, 1], "layers": [0, 4]}))


def test_tensor_parallelism_is_refused_naming_the_field() -> None:
    with pytest.raises(PlanNotSupported, match="tensor parallelism") as caught:
        TrainPlan.parse(_tp2(), 4)
    assert caught.value.field == "plan.pipelines[0].stages[0].devices"


def test_a_rerouted_stage_on_a_device_without_its_layers_is_refused() -> None:
    bad = plan(
        pipeline(1, stage(0, 0, 2), stage(1, 2, 4)),
        pipeline(1, stage(2, 0, 2), rerouted([0], 2, 4)),
        family="rerouting",
    )
    with pytest.raises(PlanNotSupported) as caught:
        TrainPlan.parse(bad, 4)
    assert caught.value.field == "plan.pipelines[1].stages[1].devices"


def test_a_plan_for_another_model_is_refused() -> None:
    with pytest.raises(InvalidScenario, match="covers layers"):
        TrainPlan.parse(plan(pipeline(1, stage(0, 0, 4))), 8)


def _train_one_step(worker: Worker) -> None:
    x, y = worker.corpus.batch(0, 0, 0, 2, worker.config.model.seq)
    loss = loss_of(run_layers(worker.layers, 0, worker.config.model.layers, x), y)
    torch.autograd.backward(loss)
    for optimizer in worker.optimizers.values():
        optimizer.step()
    worker.zero_grad()


def test_a_layer_exported_and_imported_trains_on_identically() -> None:
    config = TrainConfig(model=SMALL, lr=1e-2)
    a, b = Worker(0, config), Worker(1, config)
    a.hold(0, 4)
    _train_one_step(a)
    b.layers, b.optimizers = {}, {}
    for k in range(4):
        flat = a.export_layer(k)
        assert flat.numel() == b.state_numel(k)
        b.import_layer(k, flat.clone())
    _train_one_step(a)
    _train_one_step(b)
    for k in range(4):
        for (name, pa), pb in zip(
            a.layers[k].named_parameters(), b.layers[k].parameters(), strict=True
        ):
            assert torch.equal(pa, pb), (k, name)


def test_an_import_without_the_optimizer_state_would_differ() -> None:
    """The check above can fail: fresh moments give another second step."""
    config = TrainConfig(model=SMALL, lr=1e-2)
    a, b = Worker(0, config), Worker(1, config)
    a.hold(0, 4)
    _train_one_step(a)
    b.hold(0, 4)
    with torch.no_grad():
        for k in range(4):
            for pa, pb in zip(a.layers[k].parameters(), b.layers[k].parameters(), strict=True):
                pb.copy_(pa)
    _train_one_step(a)
    _train_one_step(b)
    assert not torch.equal(a.layers[1].block.mlp.up.weight, b.layers[1].block.mlp.up.weight)
