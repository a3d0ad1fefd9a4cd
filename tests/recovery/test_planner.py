"""The planner: Algorithm 1's rules, and the fast search against the exhaustive reference."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.model import Cluster, ModelProfile, Training
from controlplane.recovery.planner import (
    PipelineOracle,
    distribute_batch,
    even_splits,
    search,
    usable_groups,
)
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


def test_even_splits_place_remainder_everywhere() -> None:
    splits = list(even_splits(9, 4))
    assert len(splits) == 4
    assert ((0, 2), (2, 4), (4, 6), (6, 9)) in splits
    for split in splits:
        sizes = [b - a for a, b in split]
        assert sum(sizes) == 9 and max(sizes) - min(sizes) <= 1


def test_even_splits_limit_bounds_placements() -> None:
    assert len(list(even_splits(48, 32, limit=100))) <= 101
    assert len(list(even_splits(20, 16))) == math.comb(16, 4)
    assert len(list(even_splits(20, 16, limit=10**6))) == math.comb(16, 4)


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
