"""CheckFree+ in the reference trainer: out-of-order training, copies of the embedding and LM
head on the swap partners, and a lost first or last stage rebuilt from its partner.

- The plan: pipelines of 4 stages or more swap their first two and last two stages for the odd
  micro-batches, and the partners keep copies of the edge parts; shallower pipelines and
  pipelines with a rerouted stage do not. Without ``checkfree_plus`` nothing of it exists.
- Training (4 and 5 CPU ranks, SGD): the losses and weights are those of one process running
  the same out-of-order schedule with a single embedding and LM head, and not those of the
  in-order model.
- Recovery (rank processes under a scripted agent, AdamW): the first stage is killed and
  rebuilt on a standby by the core's ``checkfree_plus`` plan with ``restore:
  neighbours_plus``: its blocks are its partner's, its embedding the partner's copy, weights and
  optimizer state; then the last stage, likewise from the stage before it. After each, the
  first loss is the one computed here from the ranks' weights, and at the end every copy equals
  its layer's edge parts bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker_agent.trainer.reference import (
    Reference,
    assert_weights_close,
    pipeline,
    plan,
    rerouted,
    stage,
    train_reference,
    train_reference_out_of_order,
)
from worker_agent.trainer.checkfree import NoSource, rebuilds
from worker_agent.trainer.drill import Drill, core_decision
from worker_agent.trainer.engine import TrainConfig, TrainPlan
from worker_agent.trainer.launch import Phase, RunResult, run_local
from worker_agent.trainer.model import ModelConfig, build_edge, build_layer

PP4 = plan(pipeline(4, stage(0, 0, 2), stage(1, 2, 4), stage(2, 4, 6), stage(3, 6, 8)))
# a swapped pipeline beside one that is not: the edge parts' holders span both
MIXED = plan(
    pipeline(2, stage(0, 0, 2), stage(1, 2, 4), stage(2, 4, 6), stage(3, 6, 8)),
    pipeline(2, stage(4, 0, 8)),
)
SGD = TrainConfig(optimizer="sgd", lr=0.5, checkfree_plus=True)
STEPS = 3


# --- the plan ---


def test_odd_micro_batches_swap_the_edge_pairs_and_the_partners_keep_copies() -> None:
    train = TrainPlan.parse(PP4, 8, swap=True)
    assert train.swapped == {0}
    assert train.copies == {1: (0,), 2: (7,)}
    assert train.edge_holders == {0: (0, 1), 7: (2, 3)}
    assert {(0, 1), (2, 3)} <= set(train.sync_groups())
    assert [train.executor(0, pos, 0) for pos in range(4)] == [0, 1, 2, 3]
    assert [train.executor(0, pos, 1) for pos in range(4)] == [1, 0, 3, 2]
    assert [train.executor(0, pos, 3) for pos in range(4)] == [1, 0, 3, 2]
    # every device runs every micro-batch once each way, the odd ones in the swapped order
    for device, ops in train.schedule.items():
        assert len(ops) == 2 * 4
        for op in ops:
            assert train.executor(op.pipeline, op.stage, op.micro) == device
    mixed = TrainPlan.parse(MIXED, 8, swap=True)
    assert mixed.swapped == {0} and mixed.copies == {1: (0,), 2: (7,)}
    assert mixed.edge_holders == {0: (0, 1, 4), 7: (2, 3, 4)}


def test_shallow_or_rerouted_pipelines_and_the_default_train_in_order() -> None:
    pp3 = plan(pipeline(4, stage(0, 0, 3), stage(1, 3, 6), stage(2, 6, 8)))
    with_reroute = plan(
        pipeline(2, stage(0, 0, 2), stage(1, 2, 4), stage(2, 4, 6), stage(3, 6, 8)),
        pipeline(2, stage(4, 0, 2), stage(5, 2, 4), rerouted([2], 4, 6), stage(7, 6, 8)),
        family="rerouting",
    )
    assert TrainPlan.parse(pp3, 8, swap=True).swapped == frozenset()
    assert TrainPlan.parse(with_reroute, 8, swap=True).swapped == {0}
    default = TrainPlan.parse(PP4, 8)
    assert (default.swapped, default.copies, default.edge_holders) == (frozenset(), {}, {})
    assert [default.executor(0, pos, 1) for pos in range(4)] == [0, 1, 2, 3]
    assert default.sync_groups() == [(0, 1, 2, 3)]


def test_a_lost_edge_stage_takes_its_edge_parts_from_the_partners_copy_or_is_refused() -> None:
    old = TrainPlan.parse(PP4, 8, swap=True)
    new = TrainPlan.parse(
        plan(pipeline(4, stage(4, 0, 2), stage(1, 2, 4), stage(2, 4, 6), stage(3, 6, 8))), 8
    )
    config = ModelConfig()
    live = {1, 2, 3, 4}
    got = rebuilds(old.plan, new.plan, live, config, plus=True, copies=old.copies)
    assert [(r.layer, r.dst, r.sources, r.edge) for r in got] == [
        (0, 4, ((1, 2),), 1),
        (1, 4, ((1, 3),), None),
    ]
    with pytest.raises(NoSource, match=r"embed\.weight.*--checkfree-plus"):
        rebuilds(old.plan, new.plan, live, config, plus=True, copies={})
    with pytest.raises(NoSource, match="edge stage"):
        rebuilds(old.plan, new.plan, live, config, plus=False, copies=old.copies)


# --- training out of order ---


@pytest.fixture(scope="module")
def run() -> RunResult:
    phases = [Phase(PP4, STEPS, first_step=0), Phase(MIXED, STEPS, first_step=0)]
    return run_local(5, phases, SGD, collect_weights=True, timeout_s=240)


@pytest.mark.parametrize(("phase", "layout"), [(0, PP4), (1, MIXED)], ids=["pp4", "mixed"])
def test_out_of_order_training_is_the_single_process_out_of_order_models(
    run: RunResult, phase: int, layout: dict[str, Any]
) -> None:
    want = train_reference_out_of_order(SGD, layout, range(STEPS))
    losses = list(run.losses(phase).values())
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    assert_weights_close(run.weights[phase], want.weights, rtol=1e-4, atol=2e-6)
    in_order: Reference = train_reference(SGD, 8, range(STEPS))
    assert abs(losses[-1] - in_order.losses[-1]) > 1e-3  # the swap changes what is learnt


# --- recovery of the edge stages ---


def _dump(workdir: Path, device: int, tag: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(workdir / "dump" / f"{device}-{tag}.pt")
    return state


def _split(flat: torch.Tensor, module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """An ``export_layer``/``export_edge`` tensor by parameter: value, moments, step count."""
    shapes = [(name, p.shape, p.numel()) for name, p in module.named_parameters()]
    total = sum(n for _, _, n in shapes)
    out: dict[str, dict[str, Any]] = {name: {} for name, _, _ in shapes}
    for part, key in enumerate(("value", "exp_avg", "exp_avg_sq")):
        offset = part * total
        for name, shape, n in shapes:
            out[name][key] = flat[offset : offset + n].view(shape)
            offset += n
    for i, (name, _, _) in enumerate(shapes):
        out[name]["step"] = float(flat[3 * total + i])
    return out


def _layer(state: dict[str, Any], k: int) -> dict[str, dict[str, Any]]:
    return _split(state["layers"][k], build_layer(ModelConfig(), k))


def _copy(state: dict[str, Any], k: int) -> dict[str, dict[str, Any]]:
    return _split(state["copies"][k], build_edge(ModelConfig(), k))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[key], b[key]) for key in ("value", "exp_avg", "exp_avg_sq")) and (
        a["step"] == b["step"]
    )


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("checkfree-plus")
    first, _, _ = core_decision(PP4, [0], "checkfree_plus", spares=1)
    second, _, _ = core_decision(first, [3], "checkfree_plus")
    args = ["--checkfree-plus", "--dump", str(workdir / "dump")]
    with Drill(PP4, workdir, args=args, timeout_s=150) as drill:
        drill.start(range(5))  # device 4: the standby
        drill.wait_steps(range(4), 3)
        killed = drill.kill(0)  # the first stage, with the embedding
        drill.abort("d0/", 0)
        drill.apply([1, 2, 3, 4], "d1", first, "d1/", restore="neighbours_plus")
        d1 = drill.wait_done([1, 2, 3, 4], "d1")
        drill.wait_steps([1, 2, 3, 4], 3, killed)
        restarted = drill.start([0], generation="d1/", plan=first)  # back, as a standby
        drill.wait(lambda: "idle" in drill.states(0)[-1:], "device 0 idle again")
        killed_last = drill.kill(3)  # the last stage, with the LM head
        drill.abort("d1/", 3)
        drill.apply([0, 1, 2, 4], "d2", second, "d2/", restore="neighbours_plus")
        d2 = drill.wait_done([0, 1, 2, 4], "d2")
        drill.wait_steps([0, 1, 2, 4], 3, killed_last)
        drill.send([0, 1, 2, 4], id="stop", action="stop", generation="d2/")
        drill.wait_done([0, 1, 2, 4], "stop")
        for device in (0, 1, 2, 4):
            assert drill.procs[device].wait(timeout=30) == 0
        yield {
            "drill": drill,
            "workdir": workdir,
            "plans": (first, second),
            "killed": (killed, killed_last),
            "done": (d1, d2),
            "restarted": restarted,
        }


def test_the_cores_plans_put_the_standbys_in_the_lost_edge_stages(drill: dict[str, Any]) -> None:
    first, second = drill["plans"]
    assert first["pipelines"][0]["stages"][0] == {"devices": [4], "layers": [0, 2]}
    assert second["pipelines"][0]["stages"][-1] == {"devices": [0], "layers": [6, 8]}
    for done in drill["done"]:
        assert all(d.message.ok for d in done.values()), done


def test_before_any_failure_the_losses_are_the_out_of_order_models(drill: dict[str, Any]) -> None:
    d: Drill = drill["drill"]
    before = {s.message.step: s.message.loss for s in d.steps(1) if s.at < drill["killed"][0]}
    steps = sorted(before)
    assert steps[:3] == [0, 1, 2]
    want = train_reference_out_of_order(TrainConfig(checkfree_plus=True), PP4, range(len(steps)))
    np.testing.assert_allclose([before[s] for s in steps], want.losses, rtol=1e-5)


@pytest.mark.parametrize(
    ("tag", "rebuilt", "partner", "lost", "source", "edge"),
    [("d1", 4, 1, (0, 2), (2, 4), 0), ("d2", 0, 2, (6, 8), (4, 6), 7)],
    ids=["first-stage", "last-stage"],
)
def test_a_lost_edge_stage_is_its_partners_blocks_and_copy(
    drill: dict[str, Any],
    tag: str,
    rebuilt: int,
    partner: int,
    lost: tuple[int, int],
    source: tuple[int, int],
    edge: int,
) -> None:
    got, near = _dump(drill["workdir"], rebuilt, tag), _dump(drill["workdir"], partner, tag)
    assert got["step"] == near["step"]
    assert sorted(got["layers"]) == list(range(*lost)) and sorted(near["copies"]) == [edge]
    for k, j in zip(range(*lost), range(*source), strict=True):
        mine, theirs = _layer(got, k), _layer(near, j)
        for name, part in mine.items():
            if name.startswith("block."):  # copied as it is, with a fresh optimizer
                assert torch.equal(part["value"], theirs[name]["value"]), (k, name)
                assert not part["exp_avg"].any() and part["step"] == 0, (k, name)
    copy = _copy(near, edge)
    layer = _layer(got, edge)
    assert set(copy) < set(layer)
    for name, part in copy.items():  # the edge parts: the partner's copy, optimizer state too
        assert _same(layer[name], part), name
        assert part["step"] > 0


@pytest.mark.parametrize("index", [0, 1], ids=["first-stage", "last-stage"])
def test_training_goes_on_with_the_loss_of_the_rebuilt_model(
    drill: dict[str, Any], index: int
) -> None:
    d: Drill = drill["drill"]
    tag, plan_after = ("d1", "d2")[index], drill["plans"][index]
    owners = {s["devices"][0]: tuple(s["layers"]) for s in plan_after["pipelines"][0]["stages"]}
    dumps = {device: _dump(drill["workdir"], device, tag) for device in owners}
    step = dumps[min(owners)]["step"]
    assert {state["step"] for state in dumps.values()} == {step}
    start = {
        k: {name: part["value"] for name, part in _layer(state, k).items()}
        for state in dumps.values()
        for k in state["layers"]
    }
    want = train_reference_out_of_order(
        TrainConfig(checkfree_plus=True), plan_after, range(step, step + 1), start=start
    )
    after = [s.message for s in d.steps(1, drill["done"][index][1].at)]
    assert after[0].step == step
    assert math.isclose(after[0].loss, want.losses[0], rel_tol=1e-5)
    for device in owners:
        losses = d.losses(device)
        assert all(math.isfinite(v) for v in losses.values())
        assert losses[step] == d.losses(1)[step]  # every rank reports the same loss


def test_at_the_end_every_copy_equals_its_layers_edge_parts(drill: dict[str, Any]) -> None:
    end = {device: _dump(drill["workdir"], device, "end") for device in (0, 1, 2, 4)}
    assert len({state["step"] for state in end.values()}) == 1
    for holder, copier, k in ((4, 1, 0), (0, 2, 7)):
        layer, copy = _layer(end[holder], k), _copy(end[copier], k)
        for name, part in copy.items():
            assert _same(layer[name], part), (k, name)
