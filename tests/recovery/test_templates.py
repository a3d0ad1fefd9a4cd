"""Oobleck template splits ranked by the 1F1B step at a pipeline's real micro-batch count."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator.time import estimate_step_time
from controlplane.recovery.model import Cluster, Layers, ModelProfile, Training
from controlplane.recovery.policies.oobleck import instantiate
from controlplane.recovery.policies.oobleck.templates import best_split, split_at, step_time
from tests.recovery.builders import small_profiles

SETTINGS = settings(max_examples=150, deadline=None)


def one_f_one_b_s(fwd: list[float], bwd: list[float], micro_batches: int) -> float:
    """Eq. 11 written out: every stage runs 1F1B, an operation starts when its stage is free and
    its input has arrived (forward from the stage before, backward from the stage after)."""
    stages = len(fwd)
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, micro_batches)
        order = [("F", j) for j in range(warmup)]
        for j in range(micro_batches - warmup):
            order += [("F", warmup + j), ("B", j)]
        order += [("B", j) for j in range(micro_batches - warmup, micro_batches)]
        orders.append(order)
    position = {(s, op): i for s, order in enumerate(orders) for i, op in enumerate(order)}

    @cache
    def end(s: int, i: int) -> float:
        kind, j = orders[s][i]
        ready = end(s, i - 1) if i else 0.0
        if kind == "F" and s > 0:
            ready = max(ready, end(s - 1, position[(s - 1, ("F", j))]))
        if kind == "B" and s < stages - 1:
            ready = max(ready, end(s + 1, position[(s + 1, ("B", j))]))
        return ready + (fwd[s] if kind == "F" else bwd[s])

    return max(end(s, len(orders[s]) - 1) for s in range(stages))


def seconds(profile: ModelProfile, split: Layers, micro_batches: int) -> float:
    fwd = [profile.fwd(*r) for r in split]
    bwd = [profile.bwd(*r) for r in split]
    return one_f_one_b_s(fwd, bwd, micro_batches)


def fits(profile: ModelProfile, split: Layers, capacity: float) -> bool:
    # Odyssey eq. 14 with S − k micro-batches in flight at stage k
    return all(
        profile.static_bytes(*r) + (len(split) - k) * profile.activation_bytes(*r) <= capacity
        for k, r in enumerate(split)
    )


def compositions(layers: int, stages: int) -> Iterable[Layers]:
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        yield tuple(itertools.pairwise((0, *cuts, layers)))


def uniform(layers: int, static: float = 0.0) -> ModelProfile:
    return ModelProfile.uniform(name="uniform", layers=layers, fwd_s=1.0, bwd_s=2.0, m_p=static)


def test_the_1f1b_transcription_gives_eq_9_on_equal_stages() -> None:
    # the test's own yardstick first: (S + m − 1)(F + B)
    assert one_f_one_b_s([1.0] * 3, [2.0] * 3, 5) == pytest.approx(7 * 3.0)
    assert step_time(uniform(6), ((0, 2), (2, 4), (4, 6)), 5) == pytest.approx(7 * 6.0)


@SETTINGS
@given(
    small_profiles(),
    st.integers(1, 4),
    st.integers(1, 12),
    st.sampled_from([math.inf, 6.0, 10.0, 20.0]),
)
def test_split_at_the_real_count_beats_every_split_the_template_dp_proposes(
    profile: ModelProfile, stages: int, micro_batches: int, capacity: float
) -> None:
    chosen = split_at(profile, stages, 1, capacity, micro_batches)
    feasible = [s for s in compositions(profile.layers, stages) if fits(profile, s, capacity)]
    if stages > profile.layers or not feasible:
        assert chosen is None
        return
    assert chosen is not None and chosen in feasible
    mine = seconds(profile, chosen, micro_batches)
    assert step_time(profile, chosen, micro_batches) == pytest.approx(mine)
    # the template DP's best splits at 4S (the template's own) and at the real count
    for nb in (None, micro_batches):
        proposed = best_split(profile, stages, 1, capacity, nb)
        assert proposed is not None
        assert mine <= seconds(profile, proposed[0], micro_batches) + 1e-9
    # and no split one boundary move away is faster
    bounds = [x for x, _ in chosen] + [profile.layers]
    for i, step in itertools.product(range(1, stages), (-1, 1)):
        moved = bounds.copy()
        moved[i] += step
        if moved[i - 1] < moved[i] < moved[i + 1]:
            split = tuple(itertools.pairwise(moved))
            if fits(profile, split, capacity):
                assert mine <= seconds(profile, split, micro_batches) + 1e-9


def test_two_micro_batches_favour_a_longer_first_stage_than_the_4s_split() -> None:
    # 6 equal layers (F = 1, B = 2) on 2 stages. At 4S = 8 micro-batches the even 3 + 3 is best;
    # at 2 the first stage runs F0 F1 while the second does F0 B0, so a shorter second stage
    # returns B0 sooner: 4 + 2 takes 4 + 4 + 2·8 = 26 s against (S + m − 1)·9 = 27 s for 3 + 3.
    profile = uniform(6)
    template = best_split(profile, 2, 1, math.inf)
    assert template is not None and template[0] == ((0, 3), (3, 6))
    chosen = split_at(profile, 2, 1, math.inf, 2)
    assert chosen == ((0, 4), (4, 6))
    assert seconds(profile, template[0], 2) == pytest.approx(27.0)
    assert seconds(profile, chosen, 2) == pytest.approx(26.0)
    assert seconds(profile, chosen, 2) == min(seconds(profile, s, 2) for s in compositions(6, 2))
    # at the planning count itself the template's split stays
    assert split_at(profile, 2, 1, math.inf, 8) == template[0]


@SETTINGS
@given(small_profiles(), st.integers(2, 6), st.integers(2, 24))
def test_instantiated_pipelines_run_their_best_split_at_their_share(
    profile: ModelProfile, nodes: int, global_batch: int
) -> None:
    cluster = Cluster(devices=nodes, devices_per_node=1, device_memory_bytes=20.0)
    training = Training(global_batch=global_batch, micro_batch=1)
    try:
        plan = instantiate(profile, cluster, training, f=1)
    except InfeasiblePlan:  # no template fits, or too small a batch: nothing to rank
        return
    assert sum(p.micro_batches for p in plan.pipelines) == global_batch
    for pipeline in plan.pipelines:
        split = tuple(s.layers for s in pipeline.stages)
        m = pipeline.micro_batches
        template = best_split(profile, len(split), 1, 20.0)
        assert template is not None
        assert split == split_at(profile, len(split), 1, 20.0, m)
        assert seconds(profile, split, m) <= seconds(profile, template[0], m) + 1e-9
    # with free communication the plan's step is the slowest of those pipelines
    slowest = max(
        seconds(profile, tuple(s.layers for s in p.stages), p.micro_batches) for p in plan.pipelines
    )
    assert estimate_step_time(profile, cluster, plan) == pytest.approx(slowest)


@pytest.mark.parametrize(
    ("global_batch", "memory", "split", "step_s"),
    [
        (4, 4.5, ((0, 4), (4, 6)), 26.0),  # 2 micro-batches each: the 4 + 2 split above
        (16, 4.5, ((0, 3), (3, 6)), 9 * 9.0),  # 8 each: the even split, (S + m − 1)(F + B)
        (4, 3.5, ((0, 3), (3, 6)), 27.0),  # 4 layers' state no longer fits a device
    ],
)
def test_oobleck_splits_each_pipeline_for_its_share(
    global_batch: int, memory: float, split: Layers, step_s: float
) -> None:
    # 6 layers of 1 byte of state: a pipeline needs 2 nodes, so 4 nodes make two of them
    cluster = Cluster(devices=4, devices_per_node=1, device_memory_bytes=memory)
    plan = instantiate(uniform(6, static=1.0), cluster, Training(global_batch, 1), f=1)
    assert [tuple(s.layers for s in p.stages) for p in plan.pipelines] == [split, split]
    assert estimate_step_time(uniform(6, static=1.0), cluster, plan) == pytest.approx(step_s)
