"""The restorer: Kuhn-Munkres weight placement and the colouring of asymmetric gradient sync."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from controlplane.recovery import restorer
from controlplane.recovery.errors import InfeasiblePlan, InvalidScenario, UnknownDevice
from controlplane.recovery.estimator.sync import SyncSegment, sync_rounds, sync_segments
from controlplane.recovery.estimator.time import gradient_sync_time, ring_allreduce_s
from controlplane.recovery.model import Cluster, ExecutionPlan, ModelProfile, Pipeline, Stage
from controlplane.recovery.restorer import (
    Placement,
    held_ranges,
    missing_bytes,
    place,
    place_in_device_order,
)

Group = tuple[int, ...]
LayerRange = tuple[int, int]


def bytes_profile(per_layer: Sequence[float]) -> ModelProfile:
    """A profile whose state bytes per layer (parameters + optimizer) are ``per_layer``."""
    n = len(per_layer)
    zeros = (0.0,) * n
    return ModelProfile(
        name="test",
        fwd_s=(1.0,) * n,
        bwd_s=(2.0,) * n,
        m_p=tuple(per_layer),
        m_o=zeros,
        m_g=tuple(per_layer),
        m_a=zeros,
    )


def ranges(sizes: Sequence[int]) -> list[LayerRange]:
    """Consecutive layer ranges of the given lengths, from layer 0."""
    edges = [0, *itertools.accumulate(sizes)]
    return list(itertools.pairwise(edges))


def make_plan(*pipelines: Sequence[tuple[Group, LayerRange]]) -> ExecutionPlan:
    """An execution plan from (devices, layers) stages, one sequence per pipeline."""
    return ExecutionPlan(
        pipelines=tuple(
            Pipeline(stages=tuple(Stage(devices=d, layers=r) for d, r in p), micro_batches=1)
            for p in pipelines
        )
    )


def grid(sizes_per_pipeline: Sequence[Sequence[int]], tp: int = 1) -> ExecutionPlan:
    """Pipelines with the given stage lengths, device ids numbered stage after stage."""
    pipelines = []
    device = 0
    for sizes in sizes_per_pipeline:
        stages = []
        for r in ranges(sizes):
            stages.append((tuple(range(device, device + tp)), r))
            device += tp
        pipelines.append(stages)
    return make_plan(*pipelines)


def brute_force_bytes(
    profile: ModelProfile,
    old_plan: ExecutionPlan,
    groups: Sequence[Group],
    slots: Sequence[LayerRange],
) -> float:
    held = held_ranges(old_plan)
    return min(
        sum(missing_bytes(profile, held.get(g), s) for g, s in zip(chosen, slots, strict=True))
        for chosen in itertools.permutations(groups, len(slots))
    )


def assert_valid(
    placement: Placement, groups: Sequence[Group], slots: Sequence[LayerRange]
) -> None:
    assert len(placement.groups) == len(slots)
    assert len(set(placement.groups)) == len(slots)
    assert set(placement.groups) <= set(groups)


# Odyssey Fig. 3 / §6 vectors: 9 layers, one byte per layer, DP 3 × PP 3 with devices a0 a1 a2 =
# 0 1 2, b0 b1 b2 = 3 4 5, c0 c1 c2 = 6 7 8; the new plan is DP 2 × PP 4 with layers [2,2,2,3].
UNIT9 = bytes_profile([1.0] * 9)
FIG3_OLD = grid([[3, 3, 3]] * 3)
FIG3_SLOTS = ranges([2, 2, 2, 3])


def test_missing_bytes_reproduce_fig3_matrix() -> None:
    rows: list[LayerRange | None] = [(0, 3), (3, 6), (6, 9), None]
    matrix = [[missing_bytes(UNIT9, h, s) for s in FIG3_SLOTS] for h in rows]
    assert matrix == [[0, 1, 2, 3], [2, 1, 0, 3], [2, 2, 2, 0], [2, 2, 2, 3]]


def test_fig3_matrix_minimum_is_two_layers() -> None:
    cluster = Cluster(devices=9, spares=1)
    groups = [(0,), (1,), (2,), (9,)]  # holders of [1-3], [4-6], [7-9] and a spare holding none
    placement = place(UNIT9, cluster, FIG3_OLD, groups, FIG3_SLOTS)
    assert placement.bytes_moved == 2
    assert placement.groups == ((0,), (9,), (1,), (2,))


def test_km_moves_three_layers_where_device_order_moves_twelve() -> None:
    cluster = Cluster(devices=9)
    survivors = [(d,) for d in (0, 1, 2, 3, 4, 5, 6, 8)]  # c1 (device 7) failed
    slots = FIG3_SLOTS * 2
    assert place(UNIT9, cluster, FIG3_OLD, survivors, slots).bytes_moved == 3
    assert place_in_device_order(UNIT9, cluster, FIG3_OLD, survivors, slots).bytes_moved == 12


@st.composite
def placement_cases(
    draw: st.DrawFn, max_groups: int = 7
) -> tuple[ModelProfile, Cluster, ExecutionPlan, list[Group], list[LayerRange]]:
    """A random old plan, failures, spares and new slots over at most ``max_groups`` groups."""
    layers = draw(st.integers(2, 9))
    per_layer = draw(
        st.lists(
            st.one_of(st.integers(0, 5).map(float), st.floats(0, 100)),
            min_size=layers,
            max_size=layers,
        )
    )
    tp = draw(st.sampled_from([1, 2]))

    def split() -> list[int]:
        stages = draw(st.integers(1, min(layers, 4)))
        cuts = (
            sorted(
                draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))
            )
            if stages > 1
            else []
        )
        edges = [0, *cuts, layers]
        return [b - a for a, b in itertools.pairwise(edges)]

    old_plan = grid([split() for _ in range(draw(st.integers(1, 3)))], tp=tp)
    own = list(old_plan.own_groups())
    survivors = [g for g in own if draw(st.booleans())]
    spares = draw(st.integers(0 if survivors else 1, 2))
    first_spare = len(own) * tp
    groups = survivors + [
        tuple(range(first_spare + k * tp, first_spare + (k + 1) * tp)) for k in range(spares)
    ]
    groups = groups[:max_groups]
    slots: list[LayerRange] = []
    while True:
        pipeline = ranges(split())
        if len(slots) + len(pipeline) > len(groups):
            break
        slots += pipeline
        if draw(st.booleans()):
            break
    if not slots:  # at least one slot: a one-stage pipeline
        slots = [(0, layers)]
    cluster = Cluster(
        devices=len(own) * tp,
        spares=spares * tp,
        devices_per_node=draw(st.sampled_from([1, 2, 4])),
        intra_node_gbps=draw(st.sampled_from([None, 800.0])),
        inter_node_gbps=draw(st.sampled_from([None, 100.0])),
    )
    order = draw(st.permutations(groups))
    return bytes_profile(per_layer), cluster, old_plan, list(order), slots


@settings(max_examples=150, deadline=None)
@given(placement_cases())
def test_km_total_equals_brute_force(
    case: tuple[ModelProfile, Cluster, ExecutionPlan, list[Group], list[LayerRange]],
) -> None:
    profile, cluster, old_plan, groups, slots = case
    placement = place(profile, cluster, old_plan, groups, slots)
    assert_valid(placement, groups, slots)
    expected = brute_force_bytes(profile, old_plan, groups, slots)
    assert placement.bytes_moved == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(placement_cases(max_groups=40))
def test_km_moves_no_more_than_device_order_and_is_deterministic(
    case: tuple[ModelProfile, Cluster, ExecutionPlan, list[Group], list[LayerRange]],
) -> None:
    profile, cluster, old_plan, groups, slots = case
    placement = place(profile, cluster, old_plan, groups, slots)
    assert_valid(placement, groups, slots)
    naive = place_in_device_order(profile, cluster, old_plan, groups, slots)
    assert placement.bytes_moved <= naive.bytes_moved * (1 + 1e-9) + 1e-9
    assert place(profile, cluster, old_plan, groups, slots) == placement
    assert place(profile, cluster, old_plan, sorted(groups, reverse=True), slots) == placement


@settings(max_examples=100, deadline=None)
@given(placement_cases(max_groups=40))
def test_class_flow_path_matches_dense_kuhn_munkres(
    case: tuple[ModelProfile, Cluster, ExecutionPlan, list[Group], list[LayerRange]],
) -> None:
    profile, cluster, old_plan, groups, slots = case
    dense = place(profile, cluster, old_plan, groups, slots)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(restorer, "DENSE_PAIRS_LIMIT", 0)
        flow = place(profile, cluster, old_plan, groups, slots)
    assert_valid(flow, groups, slots)
    assert flow.bytes_moved == pytest.approx(dense.bytes_moved, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("tp", [1, 2])
def test_unchanged_plan_moves_nothing(tp: int) -> None:
    old_plan = grid([[3, 2, 4], [2, 4, 3], [3, 3, 3]], tp=tp)
    cluster = Cluster(devices=9 * tp, devices_per_node=2, intra_node_gbps=800, inter_node_gbps=100)
    groups = list(old_plan.own_groups())
    slots = [s.layers for _, _, s in old_plan.stages()]
    placement = place(bytes_profile([1.0] * 9), cluster, old_plan, groups, slots)
    assert placement == Placement(groups=tuple(groups), bytes_moved=0.0, transfer_s=0.0)


# Nodes of two devices: 0,1 | 2,3. Old plan: pipelines (0, 1) and (2, 3) of one layer per stage;
# device 1 failed, so layer 0 is held on both nodes and layer 1 only on node 1 (device 3).
TWO_NODES = Cluster(devices=4, devices_per_node=2, intra_node_gbps=800, inter_node_gbps=80)
TWO_PIPELINES = grid([[1, 1], [1, 1]])


def test_transfer_takes_a_missing_layer_from_the_receivers_node() -> None:
    profile = bytes_profile([8e9, 8e9])
    # 0 and 2 keep layer 0; 3 lacks layer 0, held by 0 (node 0) and 2 (its own node 1)
    placement = place(
        profile, TWO_NODES, TWO_PIPELINES, [(0,), (2,), (3,)], [(0, 1), (0, 1), (0, 2)]
    )
    assert placement.groups == ((0,), (2,), (3,))
    assert placement.bytes_moved == 8e9
    assert placement.transfer_s == pytest.approx(8e9 / 100e9)


def test_receiver_is_chosen_on_the_node_that_holds_what_it_lacks() -> None:
    profile = bytes_profile([8e9, 4e9])
    # a holder of layer 0 is cheapest (it lacks 4 GB); of those, 2 shares node 1 with layer 1
    placement = place(profile, TWO_NODES, TWO_PIPELINES, [(0,), (2,), (3,)], [(0, 2)])
    assert placement.groups == ((2,),)
    assert placement.bytes_moved == 4e9
    assert placement.transfer_s == pytest.approx(4e9 / 100e9)


def test_transfer_spreads_sends_over_the_least_loaded_holders() -> None:
    profile = bytes_profile([10e9])
    cluster = Cluster(devices=2, spares=2, devices_per_node=1, inter_node_gbps=80)
    old_plan = grid([[1], [1]])  # devices 0 and 1 both hold layer 0; 2 and 3 are spares
    placement = place(profile, cluster, old_plan, [(0,), (1,), (2,), (3,)], [(0, 1)] * 4)
    assert placement.bytes_moved == 20e9
    # the two spares each receive from a different holder: 10 GB over 10 GB/s, not 20 GB
    assert placement.transfer_s == pytest.approx(1.0)


def test_tensor_parallel_devices_each_receive_their_shard() -> None:
    profile = bytes_profile([10e9])
    cluster = Cluster(devices=2, spares=2, devices_per_node=1, inter_node_gbps=80)
    old_plan = grid([[1]], tp=2)
    placement = place(profile, cluster, old_plan, [(0, 1), (2, 3)], [(0, 1)] * 2)
    assert placement.bytes_moved == 10e9
    assert placement.transfer_s == pytest.approx(0.5)


def test_layers_without_a_live_holder_are_reported_unsourced() -> None:
    profile = bytes_profile([1.0, 2.0, 3.0, 4.0])
    cluster = Cluster(devices=4, spares=2, intra_node_gbps=800, inter_node_gbps=100)
    old_plan = grid([[2, 2], [2, 2]])  # devices 1 and 3 held layers [2, 4); both failed
    placement = place(profile, cluster, old_plan, [(0,), (2,), (4,), (5,)], ranges([2, 2]) * 2)
    assert placement.unsourced_layers == ((2, 4),)
    assert placement.unsourced_bytes == 14.0
    assert placement.bytes_moved == 14.0
    assert placement.transfer_s == 0.0


def test_no_old_plan_means_everything_comes_from_a_checkpoint() -> None:
    profile = bytes_profile([1.0, 2.0, 3.0])
    placement = place(profile, Cluster(devices=3), None, [(2,), (0,), (1,)], ranges([1, 2]))
    assert placement.groups == ((0,), (1,))
    assert placement.unsourced_layers == ((0, 3),)
    assert placement.bytes_moved == placement.unsourced_bytes == 6.0


def test_placement_rejects_bad_inputs() -> None:
    profile = bytes_profile([1.0, 1.0])
    cluster = Cluster(devices=4)
    with pytest.raises(InfeasiblePlan):
        place(profile, cluster, None, [(0,)], [(0, 1), (1, 2)])
    with pytest.raises(InvalidScenario, match="overlap"):
        place(profile, cluster, None, [(0, 1), (1, 2)], [(0, 2)])
    with pytest.raises(InvalidScenario, match="tensor-parallel"):
        place(profile, cluster, None, [(0, 1), (2,)], [(0, 2)])
    with pytest.raises(InvalidScenario, match="slots"):
        place(profile, cluster, None, [(0,)], [(1, 3)])
    with pytest.raises(UnknownDevice):
        place(profile, cluster, None, [(0,), (7,)], [(0, 2)])


def test_decision_at_16k_devices_places_every_slot() -> None:
    # 2,048 pipelines × 8 stages of 8 layers on 16,384 devices, 100 fail, 7-stage pipelines follow
    layers = 64
    profile = bytes_profile([3e9] * layers)
    cluster = Cluster(devices=16_384, intra_node_gbps=800, inter_node_gbps=200)
    old_plan = grid([[8] * 8] * 2048)
    failed = set(random.Random(0).sample(range(16_384), 100))
    groups = [(d,) for d in range(16_384) if d not in failed]
    new_stage = ranges([10, 9, 9, 9, 9, 9, 9])
    slots = new_stage * (len(groups) // 7)
    placement = place(profile, cluster, old_plan, groups, slots)
    assert_valid(placement, groups, slots)
    assert not failed & {d for g in placement.groups for d in g}
    assert placement.unsourced_layers == ()
    naive = place_in_device_order(profile, cluster, old_plan, groups, slots)
    assert placement.bytes_moved < naive.bytes_moved
    assert 0 < placement.transfer_s < naive.transfer_s

    # exact: equal to the optimum of the class-level transportation LP, solved independently
    held = held_ranges(old_plan)
    supply = Counter(held.get(g) for g in groups)
    demand = Counter(slots)
    rows, cols = list(supply), list(demand)
    cost = np.array([[missing_bytes(profile, r, c) for c in cols] for r in rows]).ravel()
    a_ub = np.kron(np.eye(len(rows)), np.ones(len(cols)))
    a_eq = np.kron(np.ones(len(rows)), np.eye(len(cols)))
    lp = linprog(
        cost,
        A_ub=a_ub,
        b_ub=[supply[r] for r in rows],
        A_eq=a_eq,
        b_eq=[demand[c] for c in cols],
        method="highs",
    )
    assert lp.status == 0
    assert placement.bytes_moved == pytest.approx(lp.fun, rel=1e-9)


# Odyssey Fig. 4 / §6 vector: 12 layers, A [1-3][4-6][7-9][10-12], B [1-4][5-8][9-12].
# Odyssey Fig. 4 / §6 vector: 12 layers, A [1-3][4-6][7-9][10-12], B [1-4][5-8][9-12].
FIG4_PLAN = make_plan(
    [((k,), r) for k, r in enumerate(ranges([3, 3, 3, 3]))],
    [((10 + k,), r) for k, r in enumerate(ranges([4, 4, 4]))],
)


def test_fig4_vector_gives_six_segments_in_two_rounds() -> None:
    segments = sync_segments(FIG4_PLAN)
    assert segments == [
        SyncSegment((0, 3), ((0,), (10,))),
        SyncSegment((3, 4), ((1,), (10,))),
        SyncSegment((4, 6), ((1,), (11,))),
        SyncSegment((6, 8), ((2,), (11,))),
        SyncSegment((8, 9), ((2,), (12,))),
        SyncSegment((9, 12), ((3,), (12,))),
    ]
    rounds = sync_rounds(FIG4_PLAN)
    assert [[s.layers for s in r] for r in rounds] == [
        [(0, 3), (4, 6), (8, 9)],
        [(3, 4), (6, 8), (9, 12)],
    ]


def test_symmetric_plan_syncs_each_stage_in_one_round() -> None:
    plan = grid([[3, 2, 4]] * 5, tp=2)
    rounds = sync_rounds(plan)
    assert len(rounds) == 1
    assert [s.layers for s in rounds[0]] == ranges([3, 2, 4])
    assert all(len(s.groups) == 5 for s in rounds[0])


def test_rerouted_stage_syncs_among_its_live_replicas() -> None:
    plan = grid([[2, 2]] * 3)
    # pipeline 1 lost stage 0 (device 2); its micro-batches run on the replicas 0 and 4
    p1 = plan.pipelines[1]
    rerouted = Stage(devices=(0, 4), layers=(0, 2), rerouted=True)
    plan = ExecutionPlan(
        pipelines=(plan.pipelines[0], Pipeline((rerouted, p1.stages[1]), 1), plan.pipelines[2])
    )
    assert sync_segments(plan) == [
        SyncSegment((0, 2), ((0,), (4,))),
        SyncSegment((2, 4), ((1,), (3,), (5,))),
    ]
    assert len(sync_rounds(plan)) == 1


@st.composite
def plans(draw: st.DrawFn, rerouted: bool = False) -> ExecutionPlan:
    """Random pipelines over up to 12 layers; with ``rerouted``, some stages (not of pipeline 0)
    are marked rerouted onto pipeline 0's groups."""
    layers = draw(st.integers(1, 12))
    tp = draw(st.sampled_from([1, 2]))
    sizes = []
    for _ in range(draw(st.integers(1, 5))):
        cuts = draw(st.sets(st.integers(1, layers - 1))) if layers > 1 else set()
        edges = [0, *sorted(cuts), layers]
        sizes.append([b - a for a, b in itertools.pairwise(edges)])
    plan = grid(sizes, tp=tp)
    if not rerouted:
        return plan
    pipelines = [plan.pipelines[0]]
    borrowed = plan.pipelines[0].stages[0].devices
    for pipeline in plan.pipelines[1:]:
        stages = tuple(
            Stage(devices=borrowed, layers=s.layers, rerouted=True) if draw(st.booleans()) else s
            for s in pipeline.stages
        )
        pipelines.append(Pipeline(stages=stages, micro_batches=1))
    return ExecutionPlan(pipelines=tuple(pipelines))


def segments_per_device(segments: Sequence[SyncSegment]) -> Counter[int]:
    return Counter(d for s in segments for g in s.groups for d in g)


def assert_proper_rounds(plan: ExecutionPlan, rounds: list[list[SyncSegment]]) -> None:
    for round_ in rounds:
        devices = [d for s in round_ for g in s.groups for d in g]
        assert len(devices) == len(set(devices))
    covered = sorted(layer for r in rounds for s in r for layer in range(*s.layers))
    end = max(stage.layers[1] for _, _, stage in plan.stages())
    assert covered == list(range(end))


@settings(max_examples=200, deadline=None)
@given(plans(rerouted=True))
def test_colouring_is_proper_and_covers_each_layer_once(plan: ExecutionPlan) -> None:
    rounds = sync_rounds(plan)
    assert_proper_rounds(plan, rounds)
    assert sorted((s for r in rounds for s in r), key=lambda s: s.layers) == sync_segments(plan)


@settings(max_examples=200, deadline=None)
@given(plans(rerouted=True))
def test_rounds_equal_the_most_segments_on_one_device(plan: ExecutionPlan) -> None:
    # the lower bound is met: the conflict graph is an interval graph, coloured in layer order
    rounds = sync_rounds(plan)
    assert len(rounds) == max(segments_per_device(sync_segments(plan)).values())


@settings(max_examples=100, deadline=None)
@given(plans())
def test_segments_merge_only_where_holders_change(plan: ExecutionPlan) -> None:
    segments = sync_segments(plan)
    assert all(a.groups != b.groups for a, b in itertools.pairwise(segments))
    assert all(len(s.groups) == plan.dp for s in segments)


def test_symmetric_plan_of_any_shape_takes_one_round() -> None:
    for shape in ([1], [4, 4], [2, 3, 1, 6]):
        plan = grid([shape] * 4)
        assert len(sync_segments(plan)) == len(shape)
        assert len(sync_rounds(plan)) == 1


def test_colouring_at_2048_pipelines_of_8_stages_is_proper() -> None:
    rng = random.Random(1)
    sizes = []
    for _ in range(2048):
        edges = [0, *sorted(rng.sample(range(1, 64), 7)), 64]
        sizes.append([b - a for a, b in itertools.pairwise(edges)])
    plan = grid(sizes)
    rounds = sync_rounds(plan)
    assert_proper_rounds(plan, rounds)
    assert len(rounds) == max(segments_per_device(sync_segments(plan)).values())


def test_gradient_sync_time_sums_the_slowest_all_reduce_of_each_round() -> None:
    profile = bytes_profile([1e9] * 12)
    cluster = Cluster(devices=16, devices_per_node=16, intra_node_gbps=800, inter_node_gbps=100)
    bandwidth = cluster.group_bandwidth_bytes_per_s([0, 10])
    # rounds {[1-3], [5-6], [9]} and {[4], [7-8], [10-12]}: 3 layers are the slowest in each
    expected = 2 * ring_allreduce_s(3e9, 2, bandwidth)
    assert gradient_sync_time(profile, cluster, FIG4_PLAN) == pytest.approx(expected)
    assert math.isclose(expected, 2 * 3e9 / 100e9)
