"""Training under several plans equals one process training the whole model on the whole batch.

One launch of 4 ranks runs five plans one after the other, each from the initial weights and
each under a generation of its own: PP2 × DP2; an asymmetric plan (a 3-stage pipeline with an
uneven layer split and 3 micro-batches beside a 1-stage pipeline with 1); and three rerouting
plans: the core's for PP2 × DP2 when device 3 fails, and when devices 1 and 2 fail (devices 0
and 3 each run the other pipeline's lost stage, the first stage rerouted too), and a third
pipeline lost whole, its 2 micro-batches spread over both replicas of each stage. SGD makes
the weights after a step a linear function of the gradient, so a gradient summed over the wrong
devices or scaled wrongly shows.
"""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.recovery.codec import plan_to_dict
from controlplane.recovery.policies.rerouting import reroute
from tests.worker_agent.trainer.reference import (
    Reference,
    assert_weights_close,
    pipeline,
    plan,
    rerouted,
    stage,
    train_reference,
)
from worker_agent.trainer.engine import TrainConfig, TrainPlan
from worker_agent.trainer.launch import Phase, RunResult, run_local

CONFIG = TrainConfig(optimizer="sgd", lr=0.5)
STEPS = 3

PLANS = {
    "pp2-dp2": plan(
        pipeline(2, stage(0, 0, 4), stage(1, 4, 8)), pipeline(2, stage(2, 0, 4), stage(3, 4, 8))
    ),
    "asymmetric": plan(
        pipeline(3, stage(0, 0, 2), stage(1, 2, 5), stage(2, 5, 8)), pipeline(1, stage(3, 0, 8))
    ),
    "rerouting": plan(
        pipeline(2, stage(0, 0, 4), stage(1, 4, 8)),
        pipeline(2, stage(2, 0, 4), rerouted([1], 4, 8)),
        family="rerouting",
    ),
    "crossed": plan(
        pipeline(2, stage(0, 0, 4), rerouted([3], 4, 8)),
        pipeline(2, rerouted([0], 0, 4), stage(3, 4, 8)),
        family="rerouting",
    ),
    "spread": plan(
        pipeline(1, stage(0, 0, 4), stage(1, 4, 8)),
        pipeline(1, stage(2, 0, 4), stage(3, 4, 8)),
        pipeline(2, rerouted([0, 2], 0, 4), rerouted([1, 3], 4, 8)),
        family="rerouting",
    ),
}


def test_the_rerouting_plans_are_the_cores() -> None:
    pp2_dp2 = TrainPlan.parse(PLANS["pp2-dp2"], 8).plan
    for name, failed in (("rerouting", {3}), ("crossed", {1, 2})):
        rerouted_plan = reroute(pp2_dp2, frozenset(failed))
        assert not isinstance(rerouted_plan, str)
        assert plan_to_dict(rerouted_plan) == PLANS[name]


@pytest.fixture(scope="module")
def run() -> RunResult:
    phases = [Phase(p, STEPS, first_step=0) for p in PLANS.values()]
    return run_local(4, phases, CONFIG, collect_weights=True, timeout_s=150)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return train_reference(CONFIG, 4 * CONFIG.micro_batch, range(STEPS))


@pytest.mark.parametrize("phase", range(len(PLANS)), ids=list(PLANS))
def test_losses_equal_the_single_process_reference(
    run: RunResult, reference: Reference, phase: int
) -> None:
    losses = list(run.losses(phase).values())
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-5)
    # and the model learns: the reference's loss falls
    assert reference.losses[-1] < reference.losses[0] - 0.05


@pytest.mark.parametrize("phase", range(len(PLANS)), ids=list(PLANS))
def test_weights_equal_the_single_process_reference(
    run: RunResult, reference: Reference, phase: int
) -> None:
    assert_weights_close(run.weights[phase], reference.weights, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("phase", range(len(PLANS)), ids=list(PLANS))
def test_every_rank_reports_the_same_loss(run: RunResult, phase: int) -> None:
    by_step: dict[int, set[float]] = {}
    for r in run.steps[phase]:
        by_step.setdefault(r.step, set()).add(round(r.loss, 9))
    assert all(len(v) == 1 for v in by_step.values()), by_step


REPLICATED = [i for i, name in enumerate(PLANS) if name != "crossed"]


@pytest.mark.parametrize("phase", REPLICATED, ids=[list(PLANS)[i] for i in REPLICATED])
def test_replicas_of_a_layer_hold_identical_weights(run: RunResult, phase: int) -> None:
    holders: dict[int, list[int]] = {}
    for device, layers in run.weights[phase].items():
        for k in layers:
            holders.setdefault(k, []).append(device)
    replicated = {k: ds for k, ds in holders.items() if len(ds) > 1}
    assert replicated, "the plan replicates some layer"
    for k, devices in replicated.items():
        first = run.weights[phase][devices[0]][k]
        for d in devices[1:]:
            for name, value in run.weights[phase][d][k].items():
                assert np.array_equal(value, first[name]), (k, d, name)


def test_steps_report_the_global_batch(run: RunResult) -> None:
    reports = [r for steps in run.steps.values() for r in steps]
    assert {r.samples for r in reports} == {4 * CONFIG.micro_batch}
    assert all(r.step_time_s > 0 for r in reports)
