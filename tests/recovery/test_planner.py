"""The planner: Algorithm 1's rules, and the fast search against the exhaustive reference."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.simulator_speed import healthy_state
from controlplane.recovery.model import Cluster, ModelProfile, Training
from controlplane.recovery.planner import (
    PipelineOracle,
    distribute_batch,
    distribute_runs,
    dp_window,
    even_splits,
    forget,
    search,
    usable_groups,
)
from tests.recovery import bruteforce
from tests.recovery.builders import examples, grid_state, uniform_profile


@pytest.mark.parametrize(
    ("n", "lengths", "expected"),
    [
        (64, [2, 2, 3], [19, 18, 27]),
        (16, [3, 2, 2], [7, 5, 4]),
        (3, [4, 1, 1], [1, 1, 1]),
        (2, [1, 1, 1], None),
    ],
)
def test_distribute_batch_vectors(n: int, lengths: list[int], expected: list[int] | None) -> None:
    assert distribute_batch(n, lengths) == expected


@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=12), extra=st.integers(0, 200))
def test_distribute_batch_keeps_batch_and_feeds_every_pipeline(
    lengths: list[int], extra: int
) -> None:
    n = len(lengths) + extra
    shares = distribute_batch(n, lengths)
    assert shares is not None
    assert sum(shares) == n
    assert min(shares) >= 1


@given(
    runs=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 6)), min_size=1, max_size=5),
    n=st.integers(0, 300),
)
def test_distribute_runs_gives_each_pipeline_its_distribute_batch_share(
    runs: list[tuple[int, int]], n: int
) -> None:
    """The run-length split, expanded, is ``distribute_batch``'s, empty shares refilled too."""
    lengths = [length for length, count in runs for _ in range(count)]
    split = distribute_runs(n, runs)
    expected = distribute_batch(n, lengths)
    if expected is None:
        assert split is None
        return
    assert split is not None
    assert [length for length, _, k in split for _ in range(k)] == lengths
    assert [m for _, m, k in split for _ in range(k)] == expected


def test_even_splits_place_remainder_everywhere() -> None:
    splits = list(even_splits(9, 4))
    assert len(splits) == 4
    assert ((0, 2), (2, 4), (4, 6), (6, 9)) in splits
    for split in splits:
        sizes = [b - a for a, b in split]
        assert sum(sizes) == 9 and max(sizes) - min(sizes) <= 1


def test_oracle_picks_late_heavy_split_under_memory_cap() -> None:
    gb = 1e9
    profile = uniform_profile(32, 1.0, 2.0, m_p=0.4 * gb, m_o=2.4 * gb, m_g=0.4 * gb, m_a=0.5 * gb)
    fast = PipelineOracle(profile, math.inf, 1).best(3, 7)
    capped = PipelineOracle(profile, 50 * gb, 1).best(3, 8)
    assert fast is not None and fast[1] == ((0, 11), (11, 22), (22, 32))
    assert capped is not None and capped[1] == ((0, 10), (10, 21), (21, 32))


@st.composite
def profiles(draw: st.DrawFn) -> ModelProfile:
    layers = draw(st.integers(2, 12))
    per_layer = st.lists(st.floats(0.1, 3.0), min_size=layers, max_size=layers)
    fwd = draw(per_layer)
    return ModelProfile(
        name="random",
        fwd_s=tuple(fwd),
        bwd_s=tuple(2 * f for f in fwd),
        m_p=(1.0,) * layers,
        m_o=(6.0,) * layers,
        m_g=(1.0,) * layers,
        m_a=tuple(draw(per_layer)),
    )


@given(
    profile=profiles(),
    groups=st.integers(1, 24),
    old_dp=st.integers(1, 8),
    micro_batches=st.integers(1, 48),
    capacity=st.one_of(st.just(math.inf), st.floats(20.0, 120.0)),
)
@settings(max_examples=examples(120), deadline=None)
def test_fast_search_finds_the_exhaustive_optimum(
    profile: ModelProfile, groups: int, old_dp: int, micro_batches: int, capacity: float
) -> None:
    cluster = Cluster(devices=groups, device_memory_bytes=capacity)
    training = Training(global_batch=micro_batches)
    dp_options = [old_dp - 1, old_dp, old_dp + 1]
    kwargs = {"groups": groups, "tp": 1, "dp_options": dp_options}
    fast = search(profile, cluster, training, top_k=1, **kwargs)  # type: ignore[arg-type]
    exhaustive = search(profile, cluster, training, top_k=1, exhaustive=True, **kwargs)  # type: ignore[arg-type]
    assert fast.complete
    assert [s.compute_time_s for s in fast.shapes] == pytest.approx(
        [s.compute_time_s for s in exhaustive.shapes]
    )
    for shape in fast.shapes:
        assert sum(shape.lengths) == groups
        assert sum(p.micro_batches for p in shape.pipelines) == micro_batches
        assert len(shape.pipelines) in dp_options
        for pipeline in shape.pipelines:
            assert pipeline.layers[0][0] == 0 and pipeline.layers[-1][1] == profile.layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pipeline.layers))


def test_search_returns_shapes_fastest_first() -> None:
    profile = uniform_profile(16)
    result = search(
        profile,
        Cluster(devices=12),
        Training(global_batch=24),
        groups=12,
        tp=1,
        dp_options=[2, 3, 4],
        top_k=5,
    )
    times = [s.compute_time_s for s in result.shapes]
    assert len(times) == 5 and times == sorted(times)


def test_symmetric_search_may_leave_groups_idle() -> None:
    result = search(
        uniform_profile(8),
        Cluster(devices=7),
        Training(global_batch=8),
        groups=7,
        tp=1,
        dp_options=range(1, 8),
        symmetric_only=True,
        top_k=3,
    )
    for shape in result.shapes:
        assert len(set(shape.lengths)) == 1 and sum(shape.lengths) <= 7


def test_usable_groups_drop_broken_tp_groups_and_regroup_within_node() -> None:
    state = grid_state(pp=2, dp=2, tp=2, failed=[1], devices_per_node=4)
    groups = usable_groups(state)
    assert (0, 1) not in groups
    assert all(len(g) == 2 and 1 not in g for g in groups)
    # device 0 is alone on its node's loose devices and cannot form a group of 2
    assert all(0 not in g for g in groups)
    assert len(groups) == 3


# --- the planner against an independent brute force (tests/recovery/bruteforce.py) ---


@st.composite
def small_models(draw: st.DrawFn, max_layers: int = 10) -> bruteforce.Layers:
    """Random per-layer costs; a third of the draws make every layer alike (many ties)."""
    layers = draw(st.integers(1, max_layers))
    if draw(st.integers(0, 2)) == 0:
        f, a = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        return bruteforce.Layers((float(f),) * layers, (2.0 * f,) * layers, (8.0,) * layers,
                                 (float(a),) * layers)  # fmt: skip
    seconds = st.lists(st.integers(1, 9), min_size=layers, max_size=layers)
    fwd = draw(seconds)
    bwd = draw(seconds)
    act = draw(seconds)
    return bruteforce.Layers(
        tuple(float(f) for f in fwd),
        tuple(float(f + b) for f, b in zip(fwd, bwd, strict=True)),  # backward ≥ forward
        (8.0,) * layers,
        tuple(float(a) for a in act),
    )


def as_profile(model: bruteforce.Layers) -> ModelProfile:
    # static bytes are m_p + m_o + m_g: put them all in m_o
    zeros = (0.0,) * model.count
    return ModelProfile(
        name="brute",
        fwd_s=model.fwd,
        bwd_s=model.bwd,
        m_p=zeros,
        m_o=model.static,
        m_g=zeros,
        m_a=model.act,
    )


def tight_capacity(draw: st.DrawFn, model: bruteforce.Layers, stages: int) -> float:
    """Unlimited, or near what one stage of ``stages`` needs, so memory often decides."""
    if draw(st.booleans()):
        return math.inf
    per_stage = (sum(model.static) + 2 * sum(model.act)) / max(stages, 1)
    return float(per_stage * draw(st.sampled_from([0.8, 1.0, 1.2, 1.5, 2.0, 3.0])))


@st.composite
def pipeline_cases(draw: st.DrawFn) -> tuple[bruteforce.Layers, int, int, float]:
    """A model, a pipeline length (one past the layers too), micro-batches and a capacity."""
    model = draw(small_models(max_layers=16))
    stages = draw(st.integers(1, model.count + 1))
    return model, stages, draw(st.integers(1, 12)), tight_capacity(draw, model, stages)


@given(case=pipeline_cases())
@settings(max_examples=examples(400), deadline=None)
def test_oracle_equals_brute_force(case: tuple[bruteforce.Layers, int, int, float]) -> None:
    model, stages, micro_batches, capacity = case
    expected = bruteforce.best_pipeline(model, stages, micro_batches, capacity)
    for exhaustive in (False, True):
        oracle = PipelineOracle(as_profile(model), capacity, 1, exhaustive=exhaustive)
        bound = oracle.split_bound(stages, micro_batches)
        found = oracle.best(stages, micro_batches)
        assert not oracle.incomplete
        if expected is None:
            assert found is None and bound == math.inf
            continue
        assert found is not None
        assert found[0] == pytest.approx(expected[0], rel=1e-9)
        assert bound <= expected[0] * (1 + 1e-9)
        # the split returned is one that fits and takes the time claimed
        split = [tuple(s) for s in found[1]]
        assert bruteforce.fits(model, split, micro_batches, capacity)  # type: ignore[arg-type]
        fwd = [sum(model.fwd[a:b]) for a, b in split]
        bwd = [sum(model.bwd[a:b]) for a, b in split]
        assert bruteforce.step_time(fwd, bwd, micro_batches) == pytest.approx(found[0])


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[bruteforce.Layers, int, int, int, float]:
    """A model, surviving groups, micro-batches, old DP width and a memory capacity."""
    model = draw(small_models(max_layers=12))
    groups = draw(st.integers(1, 14))
    old_dp = draw(st.integers(1, 5))
    capacity = tight_capacity(draw, model, max(1, groups // old_dp))
    return model, groups, draw(st.integers(1, 24)), old_dp, capacity


def uniform_case(layers: int, groups: int, micro_batches: int, old_dp: int) -> tuple[
    bruteforce.Layers, int, int, int, float
]:  # fmt: skip
    model = bruteforce.Layers((1.0,) * layers, (2.0,) * layers, (8.0,) * layers, (1.0,) * layers)
    return model, groups, micro_batches, old_dp, math.inf


# Cases where pruning by W + (m − 1)·w_max lost the optimum (found by a random sweep).
@example(case=uniform_case(10, 10, 15, 3))  # 11 groups of 4+4+3 stages lost one: 69 s, not 72
@example(case=uniform_case(7, 6, 9, 1))
@example(case=uniform_case(8, 14, 15, 1))
@given(case=plan_cases())
@settings(max_examples=examples(1000), deadline=None)
def test_search_equals_brute_force(case: tuple[bruteforce.Layers, int, int, int, float]) -> None:
    model, groups, micro_batches, old_dp, capacity = case
    widths = [old_dp - 1, old_dp, old_dp + 1]
    expected = bruteforce.best_plan_time(model, groups, micro_batches, widths, capacity)
    profile = as_profile(model)
    cluster = Cluster(devices=groups, device_memory_bytes=capacity)
    training = Training(global_batch=micro_batches)
    for exhaustive in (False, True):
        result = search(
            profile,
            cluster,
            training,
            groups=groups,
            tp=1,
            dp_options=widths,
            top_k=1,
            exhaustive=exhaustive,
        )
        assert result.complete
        if expected is None:
            assert result.shapes == []
        else:
            assert result.shapes[0].compute_time_s == pytest.approx(expected, rel=1e-9)


def test_pipeline_bound_holds_where_the_busiest_stage_overlaps() -> None:
    """32 equal layers on 3 stages, 7 micro-batches: [11, 11, 10] takes 291 (odyssey vector).

    A bound of W + (m − 1)·w_max (294 here) ignores that the stages after the busiest one work
    during its warm-up, and pruned this split.
    """
    profile = uniform_profile(32, 1.0, 2.0)
    oracle = PipelineOracle(profile, math.inf, 1)
    assert oracle.split_bound(3, 7) <= 291
    assert oracle.best(3, 7) == (291.0, ((0, 11), (11, 22), (22, 32)))
    model = bruteforce.Layers((1.0,) * 32, (2.0,) * 32, (0.0,) * 32, (0.0,) * 32)
    assert bruteforce.best_pipeline(model, 3, 7, math.inf) == (
        291.0,
        [(0, 11), (11, 22), (22, 32)],
    )


def test_every_layer_placement_counts_when_memory_binds() -> None:
    """14 stages, 14 micro-batches, 32 equal layers, 28 GB: only late extra layers fit."""
    gb = 1e9
    memory = {"m_p": 0.4 * gb, "m_o": 2.4 * gb, "m_g": 0.4 * gb, "m_a": 0.5 * gb}
    profile = uniform_profile(32, 1.0, 2.0, **memory)
    model = bruteforce.Layers((1.0,) * 32, (2.0,) * 32, (3.2 * gb,) * 32, (0.5 * gb,) * 32)
    expected = bruteforce.best_pipeline(model, 14, 14, 28 * gb)
    assert expected is not None and expected[0] == 189.0
    for exhaustive in (False, True):
        found = PipelineOracle(profile, 28 * gb, 1, exhaustive=exhaustive).best(14, 14)
        assert found is not None and found[0] == 189.0


def test_placement_budget_is_reported_not_hidden() -> None:
    """24 stages of 32 equal layers with 4 micro-batches tie on many placements: with a small
    budget the oracle cannot prove its best and says so, and so does the search."""
    profile = uniform_profile(32, 1.0, 2.0)
    oracle = PipelineOracle(profile, math.inf, 1, placement_budget=100)
    assert oracle.best(24, 4) is not None
    assert oracle.incomplete
    assert not PipelineOracle(profile, math.inf, 1).incomplete


def test_a_cut_answer_leaves_every_search_that_reads_it_incomplete() -> None:
    """One oracle serves many searches: a pair whose best a budget cut short is unproven each
    time it is read again, and a pair proven afresh does not inherit an earlier search's cut."""
    profile = uniform_profile(32, 1.0, 2.0)
    oracle = PipelineOracle(profile, math.inf, 1, placement_budget=100)
    first = oracle.best(24, 4)
    assert oracle.incomplete
    oracle.incomplete = False  # a new search
    assert oracle.best(24, 4) == first
    assert oracle.incomplete
    oracle.incomplete = False
    assert oracle.best(2, 4) is not None
    assert not oracle.incomplete


@pytest.mark.parametrize("top_k", [1, 5])
def test_a_remembered_search_answers_as_a_fresh_one(top_k: int) -> None:
    """A search asked again is answered from memory: the same shapes and proof as computed
    afresh, and a caller that changes the list it got changes nothing remembered."""
    profile = uniform_profile(16)
    args = (profile, Cluster(devices=12), Training(global_batch=24))
    kwargs = {"groups": 12, "tp": 1, "dp_options": [2, 3, 4], "top_k": top_k}
    forget()
    fresh = search(*args, **kwargs)  # type: ignore[arg-type]
    expected = (list(fresh.shapes), fresh.complete)
    fresh.shapes.clear()
    again = search(*args, **kwargs)  # type: ignore[arg-type]
    forget()
    recomputed = search(*args, **kwargs)  # type: ignore[arg-type]
    assert (again.shapes, again.complete) == expected == (recomputed.shapes, recomputed.complete)
    assert len(expected[0]) == top_k


def test_a_search_whose_short_pipelines_cannot_fit_finishes_within_its_budget() -> None:
    """Llama-2-7B's 32 layers fit no pipeline of one or two stages. A re-plan of 4,096 devices
    after 103 failures chose 1,000 or so pipelines of 32 stages first, leaving the rest to
    pipelines that could only be that short; the search walked those subtrees until its budget
    of 50,000 nodes was spent, with 3 shapes found. The first length that can hold a pipeline
    bounds what the groups left must fill, and the search is proven in hundreds of nodes."""
    state = replace(healthy_state(4096, 1 / (1.8 * 16384)), failed=frozenset(range(0, 4096, 40)))
    groups = len(usable_groups(state))
    found = search(
        state.profile,
        state.cluster,
        state.training,
        groups=groups,
        tp=1,
        dp_options=dp_window(state.plan.dp, groups),
        top_k=9,
        max_step_time_s=2.70,
        node_budget=50_000,
    )
    assert found.complete and found.nodes < 5_000
    assert len(found.shapes) == 9
