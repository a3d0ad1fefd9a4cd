"""The decision shortcuts the simulator relies on at scale keep Odyssey's decisions exact."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.simulator_speed import healthy_state
from controlplane.recovery.codes import Code, Option
from controlplane.recovery.estimator.time import (
    estimate_pipeline,
    estimate_step_time,
    gradient_sync_floor_s,
    gradient_sync_time,
    pipeline_floor_s,
    split_sync_floor_s,
)
from controlplane.recovery.model import (
    Assumptions,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Layers,
    ModelProfile,
    Pipeline,
    Stage,
)
from controlplane.recovery.planner import (
    dp_window,
    every_shape_reaches,
    realize,
    search,
    usable_groups,
)
from controlplane.recovery.policies.dynamic import plan_dynamic, without_split_floors
from controlplane.recovery.policies.odyssey import choose_family
from controlplane.recovery.policies.rerouting import plan_rerouting
from tests.recovery.builders import grid_state, uniform_profile

GB = 1e9


@st.composite
def failed_states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(2, 6))
    tp = draw(st.sampled_from([1, 2]))
    devices = pp * dp * tp
    failed = draw(st.sets(st.integers(0, devices - 1), min_size=1, max_size=max(1, devices // 3)))
    layers = draw(st.integers(pp, 10))
    return grid_state(
        layers=layers,
        pp=pp,
        dp=dp,
        tp=tp,
        micro_batches=draw(st.integers(1, 6)),
        failed=sorted(failed),
        profile=uniform_profile(
            layers, m_p=1 * GB, m_o=6 * GB, m_g=draw(st.sampled_from([1, 4])) * GB
        ),
        devices_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        failure_rate=draw(st.sampled_from([0.0, 0.1, 10.0])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0), (10.0, 1.0), (1.0, 10.0)])),
        assumptions=Assumptions(restart_s=draw(st.sampled_from([0.0, 2.0, 60.0]))),
    )


@given(state=failed_states())
@settings(max_examples=80, deadline=None)
def test_dominance_cut_never_changes_odyssey_choice(state: ClusterState) -> None:
    cut = choose_family("odyssey", state)
    full = choose_family("odyssey", state, dominance_cut=False)
    with without_split_floors():
        before = choose_family("odyssey", state)
    assert cut.feasible == full.feasible == before.feasible
    assert cut.objective == full.objective == before.objective
    assert cut.plan == full.plan == before.plan


@given(state=failed_states())
@settings(max_examples=80, deadline=None)
def test_gradient_sync_floor_holds_for_every_replan(state: ClusterState) -> None:
    candidate = plan_dynamic("dynamic", state)
    if not candidate.feasible or candidate.plan is None:
        return
    plan = candidate.plan
    floor = gradient_sync_floor_s(
        state.profile,
        state.cluster,
        groups=len(usable_groups(state)),
        dp=plan.dp,
        tp=plan.tp,
    )
    assert floor <= gradient_sync_time(state.profile, state.cluster, plan) * (1 + 1e-12)


def test_dominated_replan_says_so() -> None:
    state = grid_state(layers=8, pp=2, dp=4, micro_batches=4, failed=[1], failure_rate=0.1)
    candidate = plan_dynamic("dynamic", state, beat=math.inf)
    assert not candidate.feasible and candidate.code == "dominated"
    chosen = choose_family("odyssey", state)
    assert chosen.feasible and chosen.note and chosen.option is not None


@st.composite
def splits_of(draw: st.DrawFn, layers: int) -> Layers:
    cuts = draw(st.sets(st.integers(1, layers - 1), max_size=layers - 1))
    bounds = [0, *sorted(cuts), layers]
    return tuple(itertools.pairwise(bounds))


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_the_sync_floor_of_a_plans_layer_splits_holds_for_every_plan_of_them(
    data: st.DataObject,
) -> None:
    """A plan's gradient sync is never below the floor of its distinct splits, and is that floor
    wherever every ring crosses nodes (one device a node): its rounds follow from the splits."""
    layers = data.draw(st.integers(2, 12))
    pool = data.draw(st.lists(splits_of(layers), min_size=1, max_size=4, unique=True))
    chosen = data.draw(st.lists(st.sampled_from(pool), min_size=2, max_size=7))
    tp = data.draw(st.sampled_from([1, 2]))
    per_node = data.draw(st.sampled_from([1, 2, 4, 8, 64]))
    devices = iter(data.draw(st.permutations(range(sum(map(len, chosen)) * tp))))
    plan = ExecutionPlan(
        pipelines=tuple(
            Pipeline(
                stages=tuple(
                    Stage(devices=tuple(next(devices) for _ in range(tp)), layers=r) for r in split
                ),
                micro_batches=1,
            )
            for split in chosen
        )
    )
    profile = uniform_profile(layers, m_g=data.draw(st.sampled_from([1, 3])) * GB)
    cluster = Cluster(
        devices=sum(map(len, chosen)) * tp,
        devices_per_node=per_node,
        intra_node_gbps=400.0,
        inter_node_gbps=100.0,
    )
    floor = split_sync_floor_s(profile, cluster, set(chosen), dp=plan.dp, tp=tp)
    sync = gradient_sync_time(profile, cluster, plan)
    assert floor <= sync * (1 + 1e-12)
    if per_node == 1:
        assert math.isclose(floor, sync, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("devices", "failed", "ruled_out_by"),
    [
        (128, (17, 53), "slowest pipeline"),
        (128, (41, 112), "slowest pipeline"),
        (1024, tuple(range(0, 1024, 64)), "slowest pipeline"),
        (1024, tuple(range(0, 1024, 61)), "slowest pipeline"),
        (1024, tuple(range(0, 1024, 53)), "slowest pipeline"),
        (1024, tuple(range(0, 1024, 42)), "layer splits"),
    ],
)
def test_a_replan_that_cannot_beat_rerouting_is_not_placed_and_the_choice_holds(
    devices: int, failed: tuple[int, ...], ruled_out_by: str
) -> None:
    """Llama-2-7B on PP 8 loses a few devices: the fastest re-plan mixes pipelines of 7 and 8
    stages, whose gradient sync takes two rounds. Its compute plus the uniform floor could still
    beat rerouting, its own splits' floor cannot, so it is not placed. Up to 20 failed devices
    every re-plan's slowest pipeline with its sends, plus its own splits' sync, is too slow, so
    there is no search (and no caveat: that is a proof; with 20 only the split sets of shapes of
    7 to at most 15 stages prove it, as ``planner.every_shape_reaches`` enumerates them). With
    25, the window search runs and every shape it finds is ruled out by its own splits. Either
    way Odyssey chooses what it chooses with every re-plan placed and scored (no cut, no
    floors)."""
    state = replace(healthy_state(devices, 1 / (1.8 * 16384)), failed=frozenset(failed))
    rerouting = plan_rerouting("odyssey", state)
    replan = plan_dynamic("odyssey", state, beat=rerouting.objective)
    assert replan.code == Code.DOMINATED and ruled_out_by in replan.note
    if ruled_out_by == "slowest pipeline":
        assert replan.caveats == ()
    cut = choose_family("odyssey", state)
    full = choose_family("odyssey", state, dominance_cut=False)
    with without_split_floors():
        before = choose_family("odyssey", state)
    assert full.plan is not None and full.option == cut.option == before.option == Option.REROUTE
    assert (
        (cut.objective, cut.plan) == (full.objective, full.plan) == (before.objective, before.plan)
    )
    # what was ruled out really was slower: the re-plan placed and scored loses to rerouting
    with without_split_floors():
        placed = plan_dynamic("odyssey", state)
    assert placed.feasible and placed.objective < rerouting.objective


def test_shapes_of_the_same_splits_at_another_width_are_bounded_at_their_own_width() -> None:
    """Found by the property above: 11 groups, widths 4 to 6. The fastest shape (6 pipelines)
    is placed; a 5-pipeline shape with the splits of a 6-pipeline one syncs faster (a ring of 5
    groups moves 2·4/5 of the gradients, one of 6 moves 2·5/6), and wins. Its bound must be its
    own width's, not the other shape's."""
    state = grid_state(
        layers=4,
        pp=3,
        dp=5,
        micro_batches=2,
        failed=[0, 1, 2, 3],
        profile=uniform_profile(4, m_p=1 * GB, m_o=6 * GB, m_g=1 * GB),
        devices_per_node=1,
        failure_rate=0.0,
        bandwidth_gbps=(400.0, 100.0),
        assumptions=Assumptions(restart_s=0.0),
    )
    with without_split_floors():
        before = choose_family("odyssey", state)
    chosen = choose_family("odyssey", state)
    assert before.plan is not None and before.plan.dp == 5
    assert (chosen.objective, chosen.plan) == (before.objective, before.plan)


@st.composite
def sending_profiles(draw: st.DrawFn, layers: int) -> ModelProfile:
    """Random per-layer times, and activations of whole gigabytes, so that sends weigh."""
    times = st.lists(st.integers(0, 5), min_size=layers, max_size=layers)
    return ModelProfile(
        name="sends",
        fwd_s=tuple(map(float, draw(times))),
        bwd_s=tuple(map(float, draw(times))),
        m_p=(0.0,) * layers,
        m_o=(0.0,) * layers,
        m_g=(1 * GB,) * layers,
        m_a=tuple(x * GB for x in draw(times)),
    )


LINKS = [(400.0, 100.0), (10.0, 1.0), (1.0, 10.0), (None, 10.0)]


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_a_pipelines_floor_holds_wherever_it_is_placed(data: st.DataObject) -> None:
    """Eq. 11 with every send at the fastest link is never above the pipeline's estimate on any
    devices, and is that estimate when every send takes the fastest link."""
    layers = data.draw(st.integers(1, 9))
    profile = data.draw(sending_profiles(layers))
    split = data.draw(splits_of(layers)) if layers > 1 else ((0, 1),)
    tp = data.draw(st.sampled_from([1, 2]))
    per_node = data.draw(st.sampled_from([1, 2, 4, 64]))
    intra, inter = data.draw(st.sampled_from(LINKS))
    cluster = Cluster(
        devices=len(split) * tp,
        devices_per_node=per_node,
        intra_node_gbps=intra,
        inter_node_gbps=inter,
    )
    devices = iter(data.draw(st.permutations(range(len(split) * tp))))
    stages = tuple(Stage(devices=tuple(next(devices) for _ in range(tp)), layers=r) for r in split)
    pipeline = Pipeline(stages=stages, micro_batches=data.draw(st.integers(1, 6)))
    floor = pipeline_floor_s(profile, cluster, split, pipeline.micro_batches, tp)
    estimate = estimate_pipeline(profile, cluster, pipeline, tp)
    assert floor <= estimate * (1 + 1e-12)
    fastest_everywhere = (per_node == 64 and (intra is None or inter <= intra)) or (
        per_node == 1 and (intra is not None and inter >= intra)
    )
    if fastest_everywhere:
        assert math.isclose(floor, estimate, rel_tol=1e-12)


@st.composite
def sending_states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(2, 4))
    layers = draw(st.integers(pp, 8))
    failed = draw(st.sets(st.integers(0, pp * dp - 1), min_size=1, max_size=max(1, pp * dp // 3)))
    intra, inter = draw(st.sampled_from(LINKS))
    return grid_state(
        layers=layers,
        pp=pp,
        dp=dp,
        micro_batches=draw(st.integers(pp, 2 * pp + 2)),  # at least one a group
        failed=sorted(failed),
        profile=draw(sending_profiles(layers)),
        devices_per_node=draw(st.sampled_from([1, 2, 4])),
        bandwidth_gbps=(intra, inter),  # type: ignore[arg-type]
    )


@given(state=sending_states(), data=st.data())
@settings(max_examples=60, deadline=None)
def test_every_searched_shape_once_placed_takes_the_step_every_shape_is_said_to_reach(
    state: ClusterState, data: st.DataObject
) -> None:
    """``every_shape_reaches`` says True only when every shape the search can return, once
    placed, takes at least that step (its slowest pipeline with its sends, plus its gradient
    sync); just above the fastest such shape it must not."""
    groups = usable_groups(state)
    for dp in dp_window(state.plan.dp, len(groups)):
        every = search(
            state.profile,
            state.cluster,
            state.training,
            groups=len(groups),
            tp=state.plan.tp,
            dp_options=[dp],
            top_k=10**6,
            node_budget=None,
        )
        if not every.shapes:
            continue
        steps = [
            estimate_step_time(state.profile, state.cluster, realize(state, shape, groups)[0])
            for shape in every.shapes
        ]

        def reach(step_s: float, dp: int = dp) -> bool | None:
            return every_shape_reaches(
                state.profile,
                state.cluster,
                state.training,
                groups=len(groups),
                tp=state.plan.tp,
                dp=dp,
                step_s=step_s,
            )

        above = min(steps) * (1 + data.draw(st.sampled_from([1e-9, 0.01, 0.5]))) + 1e-9
        assert reach(above) is not True
        assert reach(0.0) is True
