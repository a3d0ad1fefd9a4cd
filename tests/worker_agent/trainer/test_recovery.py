"""Recovery paths inside the trainer, with rank processes under a scripted agent (``drill``).

- In-memory restore (FlashRecovery): a warm standby, started before the fault, takes the failed
  device's stage in the core's ``flashrecovery`` plan and gets its weights and optimizer state
  from the live replica, bitwise; the losses go on as the uninterrupted reference's. A bad
  restore mode is refused naming the field, and training goes on unchanged.
- CheckFree: a lost intermediate stage with no replica is rebuilt on the standby as the
  gradient-norm weighted average of its neighbours, computed here from the neighbours' state.
- Checkpoint restart: every rank stopped, new processes load the newest complete checkpoint and
  redo the steps since, with the same losses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker_agent.trainer.reference import pipeline, plan, stage, train_reference
from worker_agent.link import DoneMessage
from worker_agent.trainer import checkpoint
from worker_agent.trainer.drill import Drill, core_decision
from worker_agent.trainer.engine import TrainConfig, TrainPlan, Worker
from worker_agent.trainer.model import ModelConfig, build_layer

PP2_DP2 = plan(
    pipeline(2, stage(0, 0, 4), stage(1, 4, 8)), pipeline(2, stage(2, 0, 4), stage(3, 4, 8))
)
PP3 = plan(pipeline(4, stage(0, 0, 2), stage(1, 2, 4), stage(2, 4, 6)))
PP2 = plan(pipeline(4, stage(0, 0, 4), stage(1, 4, 8)))


def _dump(workdir: Path, device: int, tag: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(workdir / "dump" / f"{device}-{tag}.pt")
    return state


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Drill, dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("flash")
    new, _, _ = core_decision(PP2_DP2, [1], "flashrecovery", spares=1)
    with Drill(PP2_DP2, workdir, args=["--dump", str(workdir / "dump")], timeout_s=90) as drill:
        drill.start(range(5))  # device 4: the warm standby, idle under PP2_DP2
        drill.wait_steps(range(4), 2)
        drill.apply(range(5), "bad", new, "d9/", restore="tape")
        drill.wait_done(range(5), "bad")
        drill.wait_steps(range(4), 3)
        pid = drill.procs[4].pid
        killed = drill.kill(1)
        drill.abort("d0/", 1)
        drill.apply([0, 2, 3, 4], "d1", new, "d1/")
        drill.wait_done([0, 2, 3, 4], "d1")
        drill.wait_steps([0, 2, 3, 4], 3, killed)
        yield drill, {"plan": new, "pid": pid, "killed": killed, "workdir": workdir}


def test_the_core_plan_swaps_the_failed_device_for_the_standby(
    flash: tuple[Drill, dict[str, Any]],
) -> None:
    drill, info = flash
    stages = [s for p in info["plan"]["pipelines"] for s in p["stages"]]
    assert {"devices": [4], "layers": [4, 8]} in stages
    assert all(1 not in s["devices"] for s in stages)
    # the standby was already running: no process was started for the recovery
    assert drill.procs[4].pid == info["pid"] and drill.started[4] < info["killed"]
    assert all(d.message.ok for d in drill.done("d1").values())


def test_the_standby_holds_its_peers_weights_and_optimizer_state_bitwise(
    flash: tuple[Drill, dict[str, Any]],
) -> None:
    _, info = flash
    standby = _dump(info["workdir"], 4, "d1")
    peer = _dump(info["workdir"], 3, "d1")
    assert sorted(standby["layers"]) == [4, 5, 6, 7] == sorted(peer["layers"])
    for k in range(4, 8):
        assert torch.equal(standby["layers"][k], peer["layers"][k]), k
    assert standby["step"] == peer["step"] == _dump(info["workdir"], 0, "d1")["step"]


def test_training_goes_on_from_the_same_step_with_the_references_losses(
    flash: tuple[Drill, dict[str, Any]],
) -> None:
    drill, _ = flash
    steps = [s.message.step for s in drill.steps(0)]
    assert steps == list(range(len(steps)))  # the aborted step was redone once, not skipped
    first = drill.steps(4)[0].message.step
    # the standby joins at the step the survivors agreed on (a step completed by every
    # survivor as the peer died counts; one some lost is redone)
    assert first == drill.steps(0, drill.done("d1")[0].at)[0].message.step > 0
    losses = drill.losses(0)
    reference = train_reference(TrainConfig(), 8, range(max(losses) + 1))
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], reference.losses, rtol=1e-5)
    assert all(drill.losses(4)[s] == losses[s] for s in drill.losses(4))


def test_a_bad_restore_mode_is_refused_and_changes_nothing(
    flash: tuple[Drill, dict[str, Any]],
) -> None:
    drill, _ = flash
    done = drill.done("bad")
    messages = [d.message for d in done.values()]
    assert all(isinstance(m, DoneMessage) and not m.ok for m in messages)
    assert {(m.error.code, m.error.field) for m in messages if m.error} == {("invalid", "restore")}
    assert not drill.store.check(["d9/timing/0"])  # no generation was built
    assert not drill.steps(4)[:1] or drill.steps(4)[0].at > done[4].at
    before = [s.message.step for s in drill.steps(0) if s.at < done[0].at]
    after = [s.message.step for s in drill.steps(0, done[0].at)]
    assert after[0] == max(before) + 1  # the same generation trains on


def _params(flat: torch.Tensor, config: ModelConfig, index: int) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    for name, p in build_layer(config, index).named_parameters():
        out[name] = flat[offset : offset + p.numel()].double().numpy()
        offset += p.numel()
    return out


def test_checkfree_rebuilds_a_lost_stage_as_its_neighbours_weighted_average(
    tmp_path: Path,
) -> None:
    new, _, _ = core_decision(PP3, [1], "checkfree", spares=1)
    assert {"devices": [3], "layers": [2, 4]} in new["pipelines"][0]["stages"]
    with Drill(PP3, tmp_path, args=["--dump", str(tmp_path / "dump")], timeout_s=90) as drill:
        drill.start(range(4))
        drill.wait_steps(range(3), 3)
        killed = drill.kill(1)
        drill.abort("d0/", 1)
        drill.apply([0, 2, 3], "d1", new, "d1/", restore="neighbours")
        assert all(d.message.ok for d in drill.wait_done([0, 2, 3], "d1").values())
        drill.wait_steps([0, 2, 3], 2, killed)
        rebuilt, before, after = (_dump(tmp_path, d, "d1") for d in (3, 0, 2))
        assert rebuilt["step"] == before["step"] == after["step"]
        assert drill.steps(3)[0].message.step == rebuilt["step"]
        assert all(math.isfinite(v) for v in drill.losses(3).values())
    config = TrainConfig(model=ModelConfig(layers=6)).model
    wa, wb = before["grad_norm"], after["grad_norm"]
    assert wa > 0 and wb > 0 and wa != wb
    for k, (ka, kb) in {2: (0, 4), 3: (1, 5)}.items():
        got = _params(rebuilt["layers"][k], config, k)
        a = _params(before["layers"][ka], config, ka)
        b = _params(after["layers"][kb], config, kb)
        assert got.keys() == {n for n in a if n.startswith("block.")}
        for name, value in got.items():
            want = (wa * a[name] + wb * b[name]) / (wa + wb)
            np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-7)
        # a fresh optimizer: no moments, no step count
        size = sum(p.numel() for p in build_layer(config, k).parameters())
        assert not rebuilt["layers"][k][size:].any()


def test_a_checkpoint_restart_loads_the_newest_checkpoint_and_redoes_the_steps_since(
    tmp_path: Path,
) -> None:
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    with Drill(PP2, tmp_path, args=args, timeout_s=90) as drill:
        drill.start(range(2))
        drill.wait_steps(range(2), 5)
        drill.kill(1)
        drill.stop_all()
        reached = max(s.message.step for s in drill.steps(0))
        saved = checkpoint.latest(tmp_path / "ckpt", 8)
        assert saved is not None and saved % 3 == 0 and saved <= reached + 1
        restarted = drill.start(range(2), generation="d1/", args=["--resume"], plan=PP2)
        drill.wait_steps(range(2), 2, restarted)
        redone = drill.steps(0, restarted)
        assert redone[0].message.step == saved
        first_run = {s.message.step: s.message.loss for s in drill.steps(0) if s.at < restarted}
        for s in redone:
            if s.message.step in first_run:
                assert s.message.loss == first_run[s.message.step]


def test_a_checkpoint_round_trip_is_bitwise_and_only_complete_ones_count(tmp_path: Path) -> None:
    config = TrainConfig(model=ModelConfig(layers=4))
    train = TrainPlan.parse(plan(pipeline(1, stage(0, 0, 2), stage(1, 2, 4))), 4)
    workers = [Worker(0, config), Worker(1, config)]
    workers[0].hold(0, 2)
    workers[1].hold(2, 4)
    for w in workers:  # some optimizer state to carry
        for k, layer in w.layers.items():
            for p in layer.parameters():
                p.grad = torch.full_like(p, 0.1 * (k + 1))
            w.optimizers[k].step()
    assert checkpoint.save(workers[0], train, tmp_path, 6) == [0, 1]
    assert checkpoint.latest(tmp_path, 4) is None  # layers 2 and 3 are missing
    checkpoint.save(workers[1], train, tmp_path, 6)
    assert checkpoint.latest(tmp_path, 4) == 6
    for step in (9, 12):
        for w in workers:
            checkpoint.save(w, train, tmp_path, step)
    assert checkpoint.steps(tmp_path) == [9, 12]  # the two newest are kept
    other = Worker(2, config)
    checkpoint.load(other, tmp_path, 12, 1, 3)  # another split loads the same files
    assert sorted(other.layers) == [1, 2]
    for k, owner in ((1, workers[0]), (2, workers[1])):
        assert torch.equal(other.export_layer(k), owner.export_layer(k))
    assert not list(tmp_path.rglob(".*"))  # no temporary file left
