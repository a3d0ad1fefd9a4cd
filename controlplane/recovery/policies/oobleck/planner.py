"""Oobleck's planner (SOSP '23): node layout, pipeline repair (§5.1) and instantiation (§4.2)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import linear_sum_assignment

from controlplane.recovery.codes import Code, Declined
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator.time import cached_pipeline_time, p2p_times, stage_times
from controlplane.recovery.model import (
    Cluster,
    ExecutionPlan,
    Family,
    Group,
    LayerRange,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.policies.oobleck.templates import (
    PipelineTemplate,
    TemplateSet,
    best_instantiation,
    build_templates,
    split_at,
    water_fill,
)
from controlplane.recovery.restorer import (
    Placement,
    held_ranges,
    missing_bytes,
    place_in_device_order,
)

NodeList = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Oobleck's node (the unit of failure) in devices, and its stages: one TP group each.

    Oobleck splits a node's GPUs among stages and runs FSDP inside a stage; a Pitstop stage runs
    on one tensor-parallel group at the profile's TP degree, so a template has one stage per
    group. A TP group wider than a node makes a node of the tp/M machines that fail together.
    """

    tp: int
    node_devices: int
    stages_per_node: int

    def node_of(self, device: int) -> int:
        return device // self.node_devices

    def devices(self, node: int) -> range:
        return range(node * self.node_devices, (node + 1) * self.node_devices)

    def whole_nodes(self, devices: int) -> int:
        return devices // self.node_devices


def node_layout(cluster: Cluster, tp: int) -> NodeLayout | Declined:
    """The layout for a cluster and TP degree, or why Oobleck's node model does not fit it."""
    per_node = cluster.devices_per_node
    if tp <= per_node:
        return NodeLayout(tp=tp, node_devices=per_node, stages_per_node=per_node // tp)
    if tp % per_node == 0:
        return NodeLayout(tp=tp, node_devices=tp, stages_per_node=1)
    return Declined(
        Code.NO_FITTING_PLAN,
        f"a tensor-parallel group of {tp} devices neither fits in nor tiles nodes of "
        f"{per_node}; Oobleck's stages never span part of a node",
    )


def node_groups(layout: NodeLayout, node: int, old_plan: ExecutionPlan | None) -> list[Group]:
    """The node's TP groups: the old plan's intact groups on it first, the rest in device order."""
    devices = layout.devices(node)
    intact = sorted(g for g in held_ranges(old_plan) if set(g) <= set(devices))
    taken = {d for g in intact for d in g}
    loose = [d for d in devices if d not in taken]
    tp = layout.tp
    fresh = [tuple(loose[i : i + tp]) for i in range(0, len(loose) - tp + 1, tp)]
    return sorted(intact + fresh)[: layout.stages_per_node]


def repair_pipelines(
    pipelines: Sequence[Sequence[int]], lost: Collection[int], min_nodes: int
) -> list[NodeList]:
    """Oobleck §5.1 steps 1-3 on the pipelines' node lists, as the `develop` engine runs them.

    1. A pipeline keeping ≥ n0 nodes is reinstantiated with them.
    2. A smaller one borrows nodes, one at a time, from the largest pipeline (ties: the later),
       which gives its last node but never drops below n0.
    3. When none can lend, the small ones merge in order, with the first full pipeline if still
       short (Appendix B: the merged pipeline has n0 … 2n0−1 nodes).
    Returns node lists sorted, ordered by (size, first node). f is not enforced here (§8 item 5).
    Raises InfeasiblePlan when even merging cannot reach n0 nodes.
    """
    ranks = [[n for n in p if n not in lost] for p in pipelines]
    result: list[list[int]] = []
    need_merge = False
    for mine in ranks:
        if not mine:
            continue
        while len(mine) < min_nodes:
            lender = _largest(ranks, min_nodes)
            if lender is None:
                need_merge = True
                break
            while len(lender) > min_nodes and len(mine) < min_nodes:
                mine.append(lender.pop())
        # the same list object: a pipeline that lends later shrinks here too, as in `develop`
        result.append(mine)
    if need_merge:
        result = _merge(result, min_nodes)
    out = [tuple(sorted(r)) for r in result]
    return sorted(out, key=lambda r: (len(r), r[0]))


def _largest(pipelines: list[list[int]], min_nodes: int) -> list[int] | None:
    biggest: list[int] | None = None
    for p in pipelines:
        if biggest is None or len(p) >= len(biggest):
            biggest = p
    return biggest if biggest is not None and len(biggest) > min_nodes else None


def _merge(pipelines: list[list[int]], min_nodes: int) -> list[list[int]]:
    small = [p for p in pipelines if len(p) < min_nodes]
    full = [p for p in pipelines if len(p) >= min_nodes]
    while small:
        merged = small.pop(0)
        while len(merged) < min_nodes:
            if small:
                merged.extend(small.pop(0))
            elif full:
                merged.extend(full.pop(0))
            else:
                raise InfeasiblePlan(
                    f"{len(merged)} nodes left cannot form a pipeline", decline=Code.TOO_FEW_NODES
                )
        full.append(merged)
    return full


@dataclass(frozen=True, slots=True)
class Draft:
    """A pipeline before its batch share: its nodes, its stages, and whether a template made it
    (a template pipeline's split is chosen again at its share; a kept pipeline stays as it is)."""

    nodes: NodeList
    stages: tuple[Stage, ...]
    from_template: bool = True


def assign_nodes(
    profile: ModelProfile,
    layout: NodeLayout,
    old_plan: ExecutionPlan | None,
    nodes: Sequence[int],
    templates: Sequence[PipelineTemplate],
) -> list[Draft]:
    """Put ``nodes`` on the templates' node positions so that the fewest state bytes move.

    Kuhn-Munkres over (node, position); a position is a node's worth of consecutive stages and
    its cost is the best assignment of the node's groups to them (ours: layers stay
    where they are). A node never splits across pipelines, so one node lost hits one pipeline.
    """
    per_node = layout.stages_per_node
    held = held_ranges(old_plan)
    groups = {n: node_groups(layout, n, old_plan) for n in nodes}
    positions = [
        (p, i, t.layers[i * per_node : (i + 1) * per_node])
        for p, t in enumerate(templates)
        for i in range(t.nodes)
    ]
    if len(positions) != len(nodes):
        raise InfeasiblePlan(f"templates need {len(positions)} nodes, got {len(nodes)}")
    memo: dict[
        tuple[tuple[LayerRange | None, ...], tuple[LayerRange, ...]], tuple[float, list[int]]
    ]
    memo = {}

    def cost(node: int, slots: tuple[LayerRange, ...]) -> tuple[float, list[int]]:
        key = (tuple(held.get(g) for g in groups[node]), slots)
        if key not in memo:
            matrix = np.array(
                [[missing_bytes(profile, h, s) for s in slots] for h in key[0]], dtype=float
            )
            rows, cols = linear_sum_assignment(matrix)
            order = [0] * len(slots)
            for r, c in zip(rows, cols, strict=True):
                order[int(c)] = int(r)
            memo[key] = (float(matrix[rows, cols].sum()), order)
        return memo[key]

    if old_plan is None:
        # nothing to keep in place: nodes in order, as Oobleck's rank grid lays them out
        rows, cols = np.arange(len(nodes)), np.arange(len(nodes))
    else:
        matrix = np.array([[cost(n, slots)[0] for _, _, slots in positions] for n in nodes])
        rows, cols = linear_sum_assignment(matrix)
    stages: list[list[Stage | None]] = [[None] * t.stages for t in templates]
    members: list[list[tuple[int, int]]] = [[] for _ in templates]
    for r, c in zip(rows, cols, strict=True):
        node = nodes[int(r)]
        p, i, slots = positions[int(c)]
        members[p].append((i, node))
        for j, (slot, g) in enumerate(zip(slots, cost(node, slots)[1], strict=True)):
            stages[p][i * per_node + j] = Stage(devices=groups[node][g], layers=slot)
    return [
        Draft(
            nodes=tuple(n for _, n in sorted(members[p])),
            stages=tuple(s for s in stages[p] if s is not None),
        )
        for p in range(len(templates))
    ]


def finish(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    old_plan: ExecutionPlan | None,
    drafts: Sequence[Draft],
) -> tuple[ExecutionPlan, Placement] | Declined:
    """Share the batch by water-filling, split each template pipeline for its share, and cost the
    weight copy.

    Water-filling weighs each pipeline by the estimator's own eq. 11 at every count it tries, a
    template pipeline on the split it would run at that count, so the shares balance the step
    times the plan is scored by.
    """
    drafts = sorted(drafts, key=lambda d: (len(d.nodes), d.nodes))

    def stages_at(draft: Draft, micro_batches: int) -> tuple[Stage, ...]:
        if not draft.from_template:
            return draft.stages
        return _split_for_share(profile, cluster, draft, micro_batches)

    def step_s(draft: Draft) -> Callable[[int], float]:
        def at(micro_batches: int) -> float:
            stages = stages_at(draft, micro_batches)
            t_f, t_b = stage_times(profile, stages)
            p2p = p2p_times(profile, cluster, stages, len(stages[0].devices))
            return cached_pipeline_time(t_f, t_b, micro_batches, p2p)

        return at

    shares = water_fill(training.micro_batches, [step_s(d) for d in drafts])
    if shares is None:
        return Declined(
            Code.NO_FITTING_PLAN,
            f"{training.micro_batches} micro-batches cannot cover {len(drafts)} pipelines; "
            f"nearest distributable global batch {len(drafts) * training.micro_batch}",
        )
    plan = ExecutionPlan(
        pipelines=tuple(
            Pipeline(stages=stages_at(d, m), micro_batches=m)
            for d, m in zip(drafts, shares, strict=True)
        ),
        family=Family.DYNAMIC,
    )
    # Copy what each group lacks from surviving holders (restorer: intra-node first, least
    # loaded sender); the groups are fixed, so evaluate this exact mapping.
    pairs = sorted((s.devices, s.layers) for _, _, s in plan.stages())
    placement = place_in_device_order(
        profile, cluster, old_plan, [g for g, _ in pairs], [r for _, r in pairs]
    )
    if old_plan is not None and placement.unsourced_layers:
        return layer_lost(placement.unsourced_layers)
    return plan, placement


def _split_for_share(
    profile: ModelProfile, cluster: Cluster, draft: Draft, micro_batches: int
) -> tuple[Stage, ...]:
    """The draft's stages on the split ``split_at`` ranks first at this share; devices stay.

    ``split_at`` starts from the template's split, so the pipeline's compute never gets slower.
    Nodes were placed for the template's split; the weight copy is costed on the final ranges.
    """
    stages = draft.stages
    tp = len(stages[0].devices)
    split = split_at(profile, len(stages), tp, cluster.device_memory_bytes, micro_batches)
    assert split is not None, "the template's own split fits memory"
    return tuple(replace(s, layers=r) for s, r in zip(stages, split, strict=True))


def layer_lost(ranges: Sequence[LayerRange]) -> Declined:
    listed = ", ".join(f"[{a}, {b})" for a, b in ranges)
    return Declined(
        Code.NO_LIVE_REPLICA,
        f"no surviving replica of layers {listed}; state lost (>f failures on one stage)",
    )


def _template_model(
    profile: ModelProfile, ts: TemplateSet
) -> tuple[dict[int, float], dict[int, float]]:
    """Each template's 1F1B fill-and-drain time and bottleneck period, for choosing X."""
    fill: dict[int, float] = {}
    period: dict[int, float] = {}
    for t in ts.templates:
        work = [profile.fwd(*r) + profile.bwd(*r) for r in t.layers]
        fill[t.nodes], period[t.nodes] = sum(work), max(work)
    return fill, period


def reinstantiate(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    layout: NodeLayout,
    templates: TemplateSet,
    nodes: Sequence[int],
    f: int,
    old_plan: ExecutionPlan | None = None,
) -> tuple[ExecutionPlan, Placement] | Declined:
    """Oobleck §4.2: the best set of ≥ f+1 template pipelines over ``nodes``, placed so that the
    fewest bytes move from ``old_plan``; why not when none exists."""
    fill, period = _template_model(profile, templates)
    chosen = best_instantiation(fill, period, len(nodes), f, training.micro_batches)
    if chosen is None:
        if training.micro_batches < f + 1:
            return Declined(
                Code.NO_FITTING_PLAN,
                f"{training.micro_batches} micro-batches cannot cover {f + 1} pipelines; "
                f"nearest distributable global batch {(f + 1) * training.micro_batch}",
            )
        return Declined(
            Code.TOO_FEW_NODES,
            f"no set of ≥ {f + 1} pipeline templates (sizes {list(templates.sizes)}) uses the "
            f"{len(nodes)} healthy nodes",
        )
    sizes, _ = chosen
    picked = [templates.get(n) for n in sizes]
    drafts = assign_nodes(
        profile, layout, old_plan, sorted(nodes), [t for t in picked if t is not None]
    )
    return finish(profile, cluster, training, old_plan, drafts)


def instantiate(
    profile: ModelProfile, cluster: Cluster, training: Training, *, f: int = 1, tp: int = 1
) -> ExecutionPlan:
    """The plan Oobleck starts a job with: the best template pipelines over every whole node.

    Raises InfeasiblePlan with the reason when the cluster cannot hold f + 1 pipelines.
    """
    layout = node_layout(cluster, tp)
    if isinstance(layout, Declined):
        raise InfeasiblePlan(layout.note, decline=layout.code)
    nodes = layout.whole_nodes(cluster.devices)
    templates = build_templates(
        profile, nodes, layout.stages_per_node, f, tp, cluster.device_memory_bytes
    )
    if templates is None:
        oom = template_oom(profile, layout)
        raise InfeasiblePlan(oom.note, decline=oom.code)
    found = reinstantiate(profile, cluster, training, layout, templates, range(nodes), f)
    if isinstance(found, Declined):
        raise InfeasiblePlan(found.note, decline=found.code)
    return found[0]


def template_oom(profile: ModelProfile, layout: NodeLayout) -> Declined:
    return Declined(
        Code.OUT_OF_MEMORY,
        f"no template with 1..{profile.layers // layout.stages_per_node} nodes fits device memory",
    )


def plan_nodes(plan: ExecutionPlan, layout: NodeLayout) -> list[NodeList]:
    """Each pipeline's nodes in stage order (rerouted stages borrow other pipelines' groups)."""
    return [
        tuple(
            dict.fromkeys(layout.node_of(d) for s in p.stages if not s.rerouted for d in s.devices)
        )
        for p in plan.pipelines
    ]
