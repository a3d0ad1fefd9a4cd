"""Oobleck: templates, instantiation, §5 repair and the policy's candidates, with the vectors of
Oobleck's `develop` code."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Sequence
from functools import partial

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.recovery.model import (
    Assumptions,
    Candidate,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.policies.oobleck import (
    OobleckPolicy,
    instantiate,
    repair_pipelines,
)
from controlplane.recovery.policies.oobleck.templates import (
    TemplateSet,
    best_instantiation,
    best_split,
    build_templates,
    fill_time,
    instantiation_options,
    template_time,
    water_fill,
)
from tests.recovery.builders import small_profiles

SETTINGS = settings(max_examples=60, deadline=None)


def uniform(layers: int, *, static: float = 0.0, act: float = 0.0) -> ModelProfile:
    return ModelProfile.uniform(
        name="oobleck-test", layers=layers, fwd_s=1.0, bwd_s=2.0, m_p=static, m_a=act
    )


def one_gpu_cluster(nodes: int, memory: float = math.inf) -> Cluster:
    return Cluster(
        devices=nodes,
        devices_per_node=1,
        device_memory_bytes=memory,
        intra_node_gbps=800.0,
        inter_node_gbps=200.0,
    )


def templates_for(state: ClusterState, f: int) -> TemplateSet:
    ts = build_templates(
        state.profile,
        state.cluster.devices // state.cluster.devices_per_node,
        state.cluster.devices_per_node // state.plan.tp,
        f,
        state.plan.tp,
        state.cluster.device_memory_bytes,
    )
    assert ts is not None
    return ts


def plan_from_nodes(
    nodes: Sequence[Sequence[int]], ts: TemplateSet, micro_batches: Sequence[int]
) -> ExecutionPlan:
    """One GPU per node: pipeline i runs template len(nodes[i]) on those nodes in order."""
    pipelines = []
    for members, share in zip(nodes, micro_batches, strict=True):
        template = ts.get(len(members))
        assert template is not None
        stages = tuple(
            Stage(devices=(n,), layers=r) for n, r in zip(members, template.layers, strict=True)
        )
        pipelines.append(Pipeline(stages=stages, micro_batches=share))
    return ExecutionPlan(pipelines=tuple(pipelines))


def propose(
    state: ClusterState, failed: Iterable[int], *, f: int = 1, replan: bool = False
) -> tuple[ClusterState, list[Candidate]]:
    devices = frozenset(failed)
    after = ClusterState(
        profile=state.profile,
        cluster=state.cluster,
        training=state.training,
        plan=state.plan,
        failed=state.failed | devices,
        assumptions=state.assumptions,
    )
    policy = OobleckPolicy(f=f, replan=replan)
    return after, policy.propose(after, Failure(kind=FailureKind.CRASH, devices=devices))


def node_sets(plan: ExecutionPlan, per_node: int = 1) -> list[tuple[int, ...]]:
    sets = [
        tuple(sorted({d // per_node for s in p.stages for d in s.devices})) for p in plan.pipelines
    ]
    return sorted(sets, key=lambda r: (len(r), r[0]))


# --- templates -----------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6, 8])
def test_uniform_stages_take_5s_minus_1_stage_times(stages: int) -> None:
    # uniform stages: N_b = 4S' makes T = (N_b + S' − 1)(F+B) = (5S' − 1)(F+B)
    per_stage = 3
    found = best_split(uniform(stages * per_stage), stages, 1, math.inf)
    assert found is not None
    split, time_s = found
    assert split == tuple((s * per_stage, (s + 1) * per_stage) for s in range(stages))
    assert time_s == pytest.approx((5 * stages - 1) * per_stage * 3.0)


def test_one_stage_costs_four_stage_times_as_in_the_paper() -> None:
    # §4.1.2 eq. 4: T1 = F+B, T2 = 2(F+B), T3 = F+B
    assert template_time(uniform(5), ((0, 5),)) == pytest.approx(4 * 15.0)


def test_critical_stage_is_the_slowest_when_it_is_last() -> None:
    profile = ModelProfile(
        name="uneven",
        fwd_s=(1.0, 1.0, 2.0),
        bwd_s=(2.0, 2.0, 4.0),
        m_p=(0.0,) * 3,
        m_o=(0.0,) * 3,
        m_g=(0.0,) * 3,
        m_a=(0.0,) * 3,
    )
    # stages 3, 3, 6 and N_b = 12: T1 = 12, T2 = (12 − 3 + 2 − 1)·6 = 60, T3 = 6
    assert template_time(profile, ((0, 1), (1, 2), (2, 3))) == pytest.approx(78.0)


def test_split_follows_the_papers_t2_not_the_codes() -> None:
    # with the code's (`develop`) T2 = (2S'+k*+1)(F+B) the DP would pick
    # [0,2) [2,3) [3,4) [4,5), whose paper time is 429
    fwd = (4.0, 5.0, 5.0, 5.0, 3.0)
    profile = ModelProfile(
        name="uneven",
        fwd_s=fwd,
        bwd_s=tuple(2 * x for x in fwd),
        m_p=(0.0,) * 5,
        m_o=(0.0,) * 5,
        m_g=(0.0,) * 5,
        m_a=(0.0,) * 5,
    )
    assert best_split(profile, 4, 1, math.inf) == (((0, 1), (1, 2), (2, 3), (3, 5)), 426.0)


def compositions(layers: int, stages: int) -> Iterable[tuple[tuple[int, int], ...]]:
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(itertools.pairwise(bounds))


@SETTINGS
@given(
    small_profiles(max_layers=7), st.integers(1, 4), st.sampled_from([math.inf, 6.0, 10.0, 20.0])
)
def test_stage_mapping_dp_matches_brute_force(
    profile: ModelProfile, stages: int, capacity: float
) -> None:
    def fits(split: tuple[tuple[int, int], ...]) -> bool:
        # Odyssey eq. 14 with S − k micro-batches in flight at stage k
        return all(
            profile.static_bytes(*r) + (len(split) - k) * profile.activation_bytes(*r) <= capacity
            for k, r in enumerate(split)
        )

    feasible = [s for s in compositions(profile.layers, stages) if fits(s)]
    found = best_split(profile, stages, 1, capacity)
    if not feasible or stages > profile.layers:
        assert found is None
        return
    assert found is not None
    split, time_s = found
    assert fits(split)
    assert time_s == pytest.approx(min(template_time(profile, s) for s in feasible))


def test_node_range_is_n0_to_n_minus_f_n0() -> None:
    # 10 layers of 1 byte, 6 bytes per device: one stage cannot hold them, two can (n0 = 2)
    ts = build_templates(uniform(10, static=1.0), 9, 1, 2, 1, 6.0)
    assert ts is not None
    assert (ts.n0, ts.n_max, ts.sizes) == (2, 5, (2, 3, 4, 5))


def test_node_range_is_capped_at_the_layer_count() -> None:
    ts = build_templates(uniform(4), 16, 1, 1)
    assert ts is not None
    assert (ts.n0, ts.n_max) == (1, 4)


def test_one_gpu_per_node_gives_one_stage_per_node() -> None:
    ts = build_templates(uniform(12), 8, 1, 1)
    assert ts is not None
    assert all(t.stages == t.nodes for t in ts.templates)


def test_templates_fit_device_memory_by_eq_14() -> None:
    profile = uniform(12, static=1.0, act=0.5)
    ts = build_templates(profile, 8, 1, 1, 1, 9.0)
    assert ts is not None
    for t in ts.templates:
        for k, r in enumerate(t.layers):
            assert profile.static_bytes(*r) + (t.stages - k) * profile.activation_bytes(*r) <= 9.0


def test_no_template_fits_memory() -> None:
    assert build_templates(uniform(4, static=10.0), 8, 1, 1, 1, 5.0) is None
    state = ClusterState(
        profile=uniform(4, static=10.0),
        cluster=one_gpu_cluster(4, memory=5.0),
        training=Training(global_batch=8),
        plan=ExecutionPlan(
            pipelines=tuple(
                Pipeline(stages=(Stage(devices=(i,), layers=(0, 4)),), micro_batches=4)
                for i in range(2)
            )
        ),
    )
    _, candidates = propose(state, [0])
    assert [c.feasible for c in candidates] == [False]
    assert candidates[0].code == "out_of_memory"


def test_templates_for_80_layers_on_64_nodes_build_well_under_oobleck_58_s() -> None:
    profile = ModelProfile.uniform(
        name="80 layers", layers=80, fwd_s=0.01, bwd_s=0.02, m_p=1.0, m_a=1.0
    )
    best_split.cache_clear()
    build_templates.cache_clear()
    started = time.perf_counter()
    ts = build_templates(profile, 64, 1, 1)
    elapsed = time.perf_counter() - started
    assert ts is not None and len(ts.templates) == 63
    assert elapsed < 10.0


# --- instantiation (§4.2) ----------------------------------------------------------------


def test_seven_nodes_on_templates_2_3_4_as_figure_7() -> None:
    assert instantiation_options((2, 3, 4), 7) == [(0, 1, 1), (2, 1, 0)]
    assert instantiation_options((2, 3, 4), 7, f=2) == [(2, 1, 0)]


def test_thirteen_nodes_on_templates_2_3_4() -> None:
    assert instantiation_options((2, 3, 4), 13) == [
        (0, 3, 1),
        (1, 1, 2),
        (2, 3, 0),
        (3, 1, 1),
        (5, 1, 0),
    ]


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 12))
def test_every_node_count_from_f_plus_one_n0_has_an_instantiation(
    n0: int, f: int, extra: int
) -> None:
    nodes = (f + 1) * n0 + extra
    sizes = tuple(range(n0, nodes - f * n0 + 1))
    for count in range((f + 1) * n0, nodes + 1):
        assert instantiation_options(sizes, count, f), count


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(0, 2),
    st.integers(0, 6),
    st.integers(1, 24),
    st.data(),
)
def test_best_instantiation_matches_brute_force(
    n0: int, width: int, f: int, extra: int, micro_batches: int, data: st.DataObject
) -> None:
    sizes = list(range(n0, n0 + width))
    fill = {n: float(data.draw(st.integers(1, 20))) for n in sizes}
    period = {n: float(data.draw(st.integers(0, 6))) for n in sizes}
    nodes = (f + 1) * n0 + extra
    best = math.inf
    for x in instantiation_options(sizes, nodes, f):
        pipelines = [n for n, count in zip(sizes, x, strict=True) for _ in range(count)]
        shares = water_fill(
            micro_batches, [partial(fill_time, fill[n], period[n]) for n in pipelines]
        )
        if shares is not None:
            best = min(
                best,
                max(
                    fill_time(fill[n], period[n], k) for n, k in zip(pipelines, shares, strict=True)
                ),
            )
    found = best_instantiation(fill, period, nodes, f, micro_batches)
    if math.isinf(best):
        assert found is None
        return
    assert found is not None
    chosen, limit = found
    assert limit == pytest.approx(best)
    assert sum(chosen) == nodes and f + 1 <= len(chosen) <= micro_batches
    shares = water_fill(micro_batches, [partial(fill_time, fill[n], period[n]) for n in chosen])
    assert shares is not None
    assert max(
        fill_time(fill[n], period[n], k) for n, k in zip(chosen, shares, strict=True)
    ) == pytest.approx(best)


def test_water_filling_keeps_the_batch_and_balances_finish_times() -> None:
    finish = [partial(fill_time, 10.0, 2.0), partial(fill_time, 10.0, 2.0)]
    shares = water_fill(64, [*finish, partial(fill_time, 12.0, 1.5)])
    assert shares is not None and sum(shares) == 64
    assert water_fill(2, [partial(fill_time, 1.0, 1.0)] * 3) is None


# --- repair (§5.1), vectors from the develop branch's tests ---------------------------------

DEVELOP = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
REPAIRS = [
    ([2], [(0, 1), (3, 4), (5, 6, 7, 8), (9, 10, 11, 12, 13)]),
    ([6, 8], [(0, 1), (5, 7), (2, 3, 4), (9, 10, 11, 12, 13)]),
    ([1], [(0, 13), (2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]),
    ([1, 3, 4], [(0, 13), (2, 12), (9, 10, 11), (5, 6, 7, 8)]),
    ([1, 2, 3, 5, 6, 7, 9, 11, 12, 13], [(0, 4), (8, 10)]),
    ([1, 2, 3, 5, 6, 7, 9, 10, 11], [(0, 4), (8, 12, 13)]),
]


@pytest.mark.parametrize(("failed", "expected"), REPAIRS)
def test_repair_reinstantiates_borrows_and_merges_like_develop(
    failed: list[int], expected: list[tuple[int, ...]]
) -> None:
    assert repair_pipelines(DEVELOP, set(failed), 2) == expected


def develop_state() -> ClusterState:
    # 12 layers of 1 byte on 6-byte devices: n0 = 2; f = 1 gives templates 2..12
    profile = uniform(12, static=1.0)
    cluster = one_gpu_cluster(14, memory=6.0)
    ts = build_templates(profile, 14, 1, 1, 1, 6.0)
    assert ts is not None and ts.n0 == 2
    return ClusterState(
        profile=profile,
        cluster=cluster,
        training=Training(global_batch=56),
        plan=plan_from_nodes(DEVELOP, ts, [14] * 4),
    )


@pytest.mark.parametrize(("failed", "expected"), REPAIRS[:4])
def test_policy_pipelines_follow_the_develop_repairs(
    failed: list[int], expected: list[tuple[int, ...]]
) -> None:
    state = develop_state()
    after, candidates = propose(state, failed)
    first = candidates[0]
    assert first.feasible, first.note
    assert first.plan is not None
    assert node_sets(first.plan) == expected
    ts = templates_for(after, 1)
    for pipeline in first.plan.pipelines:
        template = ts.get(pipeline.depth)
        assert template is not None
        assert tuple(s.layers for s in pipeline.stages) == template.layers


@pytest.mark.parametrize("failed", [failed for failed, _ in REPAIRS[4:]])
def test_develop_merges_lose_layers_that_no_survivor_holds(failed: list[int]) -> None:
    # the develop vectors test node lists only; on real templates layers [6, 8) die with them
    _, candidates = propose(develop_state(), failed)
    assert [c.feasible for c in candidates] == [False]
    assert candidates[0].code == "no_live_replica"


def test_pipelines_that_cannot_borrow_merge() -> None:
    profile = uniform(12, static=1.0)
    ts = build_templates(profile, 6, 1, 1, 1, 6.0)
    assert ts is not None and ts.n0 == 2
    state = ClusterState(
        profile=profile,
        cluster=one_gpu_cluster(6, memory=6.0),
        training=Training(global_batch=12),
        plan=plan_from_nodes([[0, 1], [2, 3], [4, 5]], ts, [4, 4, 4]),
    )
    _, candidates = propose(state, [1, 3])
    first = candidates[0]
    assert first.feasible, first.note
    assert first.plan is not None
    assert node_sets(first.plan) == [(0, 2), (4, 5)]
    # node 2 held the same first half as node 0, so it takes the second from pipeline [4, 5]
    assert first.transition.weight_transfer_s > 0


def test_nine_nodes_losing_a_pipeline_with_f_2_keeps_three_pipelines() -> None:
    # `develop` returns [2,3] [4..8]; f + 1 = 3 pipelines must remain (§3.2)
    profile = uniform(10, static=1.0)
    ts = build_templates(profile, 9, 1, 2, 1, 6.0)
    assert ts is not None and ts.sizes == (2, 3, 4, 5)
    state = ClusterState(
        profile=profile,
        cluster=one_gpu_cluster(9, memory=6.0),
        training=Training(global_batch=32),
        plan=plan_from_nodes([[0, 1], [2, 3], [4, 5, 6, 7, 8]], ts, [10, 10, 12]),
    )
    _, candidates = propose(state, [0, 1], f=2)
    first = candidates[0]
    assert first.feasible, first.note
    assert first.plan is not None
    assert sorted(len(s) for s in node_sets(first.plan)) == [2, 2, 3]
    assert {n for s in node_sets(first.plan) for n in s} == set(range(2, 9))
    assert "re-instantiated" in first.note


def missing_layers(old: ExecutionPlan, new: ExecutionPlan) -> int:
    held = {s.devices: set(range(*s.layers)) for _, _, s in old.stages()}
    return sum(len(set(range(*s.layers)) - held.get(s.devices, set())) for _, _, s in new.stages())


def test_reinstantiation_places_nodes_where_the_fewest_layers_move() -> None:
    # brute force over every order of the 7 survivors on the (2, 2, 3) templates' positions
    profile = uniform(10, static=1.0)
    ts = build_templates(profile, 9, 1, 2, 1, 6.0)
    assert ts is not None
    state = ClusterState(
        profile=profile,
        cluster=one_gpu_cluster(9, memory=6.0),
        training=Training(global_batch=32),
        plan=plan_from_nodes([[0, 1], [2, 3], [8, 7, 6, 5, 4]], ts, [10, 10, 12]),
    )
    _, candidates = propose(state, [0, 1], f=2)
    plan = candidates[0].plan
    assert plan is not None
    slots = [s.layers for p in plan.pipelines for s in p.stages]
    best = min(
        missing_layers(
            state.plan,
            ExecutionPlan(
                pipelines=(
                    Pipeline(
                        stages=tuple(
                            Stage(devices=(n,), layers=r) for n, r in zip(order, slots, strict=True)
                        ),
                        micro_batches=1,
                    ),
                )
            ),
        )
        for order in itertools.permutations(range(2, 9))
    )
    assert missing_layers(state.plan, plan) == best


def test_undamaged_pipelines_that_are_not_templates_stay_as_they_are() -> None:
    state = develop_state()
    odd = Pipeline(
        stages=tuple(
            Stage(devices=(9 + i,), layers=r)
            for i, r in enumerate([(0, 2), (2, 4), (4, 6), (6, 8), (8, 12)])
        ),
        micro_batches=14,
    )
    state = state.with_plan(ExecutionPlan(pipelines=(*state.plan.pipelines[:3], odd)))
    _, candidates = propose(state, [6])
    assert candidates[0].plan is not None
    assert odd.stages in [p.stages for p in candidates[0].plan.pipelines]


# --- candidates --------------------------------------------------------------------------


def test_failure_off_the_plan_keeps_the_plan() -> None:
    state = develop_state()
    state = ClusterState(
        profile=state.profile,
        cluster=Cluster(devices=14, devices_per_node=1, device_memory_bytes=6.0, spares=1),
        training=state.training,
        plan=state.plan,
    )
    _, candidates = propose(state, [14])
    assert candidates[0].feasible
    assert candidates[0].plan == state.plan
    assert candidates[0].transition.total_s == 0.0


def test_too_few_nodes_left_is_below_min_nodes() -> None:
    state = develop_state()
    _, candidates = propose(state, range(11))
    assert [c.feasible for c in candidates] == [False]
    assert candidates[0].code == "too_few_nodes"
    assert candidates[0].note.startswith("3 healthy nodes < (f+1)·n0 = 4")


def test_losing_every_replica_of_a_layer_is_layer_lost() -> None:
    state = develop_state()
    # nodes 0, 2, 5 and 9 run the first stages, all of which hold layers [0, 3)
    _, candidates = propose(state, [0, 2, 5, 9])
    assert [c.feasible for c in candidates] == [False]
    assert candidates[0].code == "no_live_replica"
    assert candidates[0].note.startswith("no surviving replica of layers [0, 3)")


def test_fewer_micro_batches_than_f_plus_one_pipelines_is_batch_too_small() -> None:
    profile = uniform(12, static=1.0)
    ts = build_templates(profile, 8, 1, 2, 1, 6.0)
    assert ts is not None
    state = ClusterState(
        profile=profile,
        cluster=one_gpu_cluster(8, memory=6.0),
        training=Training(global_batch=2),
        plan=plan_from_nodes([[0, 1, 2, 3], [4, 5, 6, 7]], ts, [1, 1]),
    )
    _, candidates = propose(state, [7], f=2)
    assert [c.feasible for c in candidates] == [False]
    assert candidates[0].code == "no_fitting_plan"
    assert candidates[0].note.startswith(
        "2 micro-batches cannot cover 3 pipelines; nearest distributable global batch 3"
    )


def test_partial_node_loss_drops_the_whole_node() -> None:
    profile = uniform(8)
    cluster = Cluster(devices=16, devices_per_node=2)
    plan = instantiate(profile, cluster, Training(global_batch=32), f=1)
    state = ClusterState(
        profile=profile, cluster=cluster, training=Training(global_batch=32), plan=plan
    )
    _, candidates = propose(state, [3])
    first = candidates[0]
    assert first.feasible and first.plan is not None
    assert not {2, 3} & first.plan.devices()
    assert "partial node loss" in first.note


def test_tensor_parallel_groups_are_the_stages_of_a_node() -> None:
    profile = uniform(8)
    cluster = Cluster(devices=32, devices_per_node=4)
    plan = instantiate(profile, cluster, Training(global_batch=32), f=1, tp=2)
    assert all(len(s.devices) == 2 for _, _, s in plan.stages())
    state = ClusterState(
        profile=profile, cluster=cluster, training=Training(global_batch=32), plan=plan
    )
    _, candidates = propose(state, [5])
    first = candidates[0]
    assert first.feasible and first.plan is not None
    assert not set(range(4, 8)) & first.plan.devices()
    assert first.plan.micro_batches == 32


def test_replan_candidate_is_offered_when_asked() -> None:
    state = develop_state()
    state = ClusterState(
        profile=state.profile,
        cluster=state.cluster,
        training=state.training,
        plan=state.plan,
    )
    _, candidates = propose(state, [6], replan=True)
    assert len(candidates) == 2 and all(c.feasible for c in candidates)


def test_transition_is_search_transfer_regroup_and_one_lost_step() -> None:
    state = develop_state()
    _, candidates = propose(state, [6])
    transition = candidates[0].transition
    assert transition.restart_s == OobleckPolicy().regroup_s == 2.0
    assert transition.weight_transfer_s > 0
    assert transition.search_s == Assumptions().search_s
    from controlplane.recovery.estimator import estimate_step_time

    assert transition.lost_work_s == pytest.approx(
        estimate_step_time(state.profile, state.cluster, state.plan)
    )


# --- properties (§3.2, §5) -------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ClusterState, int, TemplateSet]:
    nodes = draw(st.integers(4, 12))
    f = draw(st.integers(1, 2))
    layers = draw(st.integers(nodes, 16))
    n0 = draw(st.integers(1, 3))
    assume((f + 1) * n0 <= nodes)
    capacity = float(math.ceil(layers / n0))
    profile = uniform(layers, static=1.0)
    cluster = one_gpu_cluster(nodes, memory=capacity)
    training = Training(global_batch=4 * nodes)
    plan = instantiate(profile, cluster, training, f=f)
    state = ClusterState(
        profile=profile,
        cluster=cluster,
        training=training,
        plan=plan,
    )
    ts = templates_for(state, f)
    return state, f, ts


def assert_oobleck_plan(plan: ExecutionPlan, state: ClusterState, f: int, ts: TemplateSet) -> None:
    healthy = set(range(state.cluster.devices)) - state.failed
    assert plan.dp >= f + 1
    seen: list[int] = []
    for pipeline in plan.pipelines:
        members = [s.devices[0] for s in pipeline.stages]
        seen.extend(members)
        template = ts.get(len(members))
        assert template is not None, len(members)
        assert tuple(s.layers for s in pipeline.stages) == template.layers
        assert pipeline.stages[0].layers[0] == 0
        assert pipeline.stages[-1].layers[1] == state.profile.layers
        assert all(a.layers[1] == b.layers[0] for a, b in itertools.pairwise(pipeline.stages))
    assert sorted(seen) == sorted(healthy)
    assert plan.micro_batches == state.training.micro_batches


@SETTINGS
@given(clusters(), st.data())
def test_up_to_f_failures_keep_f_plus_one_template_pipelines_on_every_node(
    setup: tuple[ClusterState, int, TemplateSet], data: st.DataObject
) -> None:
    state, f, ts = setup
    nodes = state.cluster.devices
    lost = data.draw(st.lists(st.integers(0, nodes - 1), min_size=1, max_size=f, unique=True))
    assume(nodes - len(lost) >= (f + 1) * ts.n0)
    cuts = data.draw(st.lists(st.booleans(), min_size=len(lost) - 1, max_size=len(lost) - 1))
    events: list[list[int]] = [[lost[0]]]
    for node, new_event in zip(lost[1:], cuts, strict=True):
        if new_event:
            events.append([node])
        else:
            events[-1].append(node)
    for event in events:
        state, candidates = propose(state, event, f=f)
        first = candidates[0]
        assert first.feasible, first.note
        assert first.plan is not None
        assert_oobleck_plan(first.plan, state, f, ts)
        state = state.with_plan(first.plan)


@SETTINGS
@given(clusters(), st.data())
def test_transfer_is_zero_when_no_pipeline_changes_shape(
    setup: tuple[ClusterState, int, TemplateSet], data: st.DataObject
) -> None:
    state, f, _ = setup
    assume(state.plan.dp > f + 1)
    # every node of some pipelines dies: the others stay exactly as they were
    doomed = data.draw(
        st.sets(st.integers(0, state.plan.dp - 1), min_size=1, max_size=state.plan.dp - f - 1)
    )
    failed = [d for p in doomed for s in state.plan.pipelines[p].stages for d in s.devices]
    _, candidates = propose(state, failed, f=f)
    first = candidates[0]
    assert first.feasible, first.note
    assert first.transition.weight_transfer_s == 0.0
    assert first.plan is not None
    kept = [p for i, p in enumerate(state.plan.pipelines) if i not in doomed]

    def shape(p: Pipeline) -> tuple[tuple[tuple[int, ...], tuple[int, int]], ...]:
        return tuple((s.devices, s.layers) for s in p.stages)

    assert sorted(map(shape, first.plan.pipelines)) == sorted(map(shape, kept))


@SETTINGS
@given(clusters(), st.data())
def test_infeasible_exactly_when_a_layer_lost_every_replica_or_too_few_nodes(
    setup: tuple[ClusterState, int, TemplateSet], data: st.DataObject
) -> None:
    state, f, ts = setup
    nodes = state.cluster.devices
    failed = data.draw(st.sets(st.integers(0, nodes - 1), min_size=1, max_size=nodes))
    survivors = [s.layers for _, _, s in state.plan.stages() if s.devices[0] not in failed]
    layer_lost = any(
        not any(a <= layer < b for a, b in survivors) for layer in range(state.profile.layers)
    )
    too_few = nodes - len(failed) < (f + 1) * ts.n0
    after, candidates = propose(state, failed, f=f)
    assert any(c.feasible for c in candidates) == (not layer_lost and not too_few)
    for c in candidates:
        if c.feasible:
            assert c.plan is not None
            assert not c.plan.devices() & after.failed
            assert c.plan.micro_batches == state.training.micro_batches
