"""Oobleck (SOSP '23): repair damaged pipelines from pipeline templates, copying lost layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from controlplane.recovery.codes import Code, Declined
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    LayerRange,
    TransitionCost,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score, unchanged
from controlplane.recovery.policies.oobleck.planner import (
    Draft,
    NodeLayout,
    NodeList,
    assign_nodes,
    finish,
    layer_lost,
    node_layout,
    plan_nodes,
    reinstantiate,
    repair_pipelines,
    template_oom,
)
from controlplane.recovery.policies.oobleck.templates import TemplateSet, build_templates
from controlplane.recovery.restorer import Placement, held_ranges


@dataclass(frozen=True)
class OobleckPolicy(SteadyCosts):
    """Oobleck: reinstantiate, borrow or merge the damaged pipelines from templates (§5).

    ``f``: failures to tolerate, f + 1 pipelines kept (Oobleck §3, §7.1; the paper leaves f
    unstated, its code defaults to 3). ``regroup_s``: the communication teardown and rebuild
    after a repair; the paper reports no reconfiguration time, so 2 s, the low end of its
    artifact's 2-10 s per failure. ``replan``: also propose the best re-instantiation (§4.2).
    """

    f: int = 1
    regroup_s: float = 2.0
    replan: bool = False
    name: ClassVar[str] = "oobleck"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        profile, cluster, plan = state.profile, state.cluster, state.plan
        f = self.f
        layout = node_layout(cluster, plan.tp)
        if isinstance(layout, Declined):
            return [Candidate.declined(self.name, *layout)]
        templates = build_templates(
            profile,
            layout.whole_nodes(cluster.devices),
            layout.stages_per_node,
            f,
            layout.tp,
            cluster.device_memory_bytes,
        )
        if templates is None:
            return [Candidate.declined(self.name, *template_oom(profile, layout))]

        # §8 item 10: a node with any failed device is lost as a whole
        lost = {layout.node_of(d) for d in state.failed}
        pipelines = plan_nodes(plan, layout)
        if not any(
            lost.intersection(nodes) or any(s.rerouted for s in p.stages)
            for nodes, p in zip(pipelines, plan.pipelines, strict=True)
        ):
            return [unchanged(self.name, state)]
        whole = layout.whole_nodes(cluster.total_devices)
        in_plan = {n for nodes in pipelines for n in nodes}
        # a node cut short by the end of the cluster cannot host a template's node of stages
        dropped = lost | {n for n in in_plan if n >= whole}
        damaged = [
            bool(dropped.intersection(nodes)) or any(s.rerouted for s in p.stages)
            for nodes, p in zip(pipelines, plan.pipelines, strict=True)
        ]
        kept = sorted(in_plan - dropped)
        joiners = [n for n in range(whole) if n not in in_plan and n not in lost]
        healthy = len(kept) + len(joiners)
        if healthy < (f + 1) * templates.n0:
            return [
                Candidate.declined(
                    self.name,
                    Code.TOO_FEW_NODES,
                    f"{healthy} healthy nodes < (f+1)·n0 = "
                    f"{(f + 1) * templates.n0}; Oobleck saves progress and stops until a "
                    "checkpoint restart",
                )
            ]
        missing = unheld_layers(profile.layers, plan, layout, set(kept))
        if missing:
            return [Candidate.declined(self.name, *layer_lost(missing))]

        notes = []
        hit = {layout.node_of(d) for d in failure.devices}
        if len(hit) > f:
            notes.append(
                f"beyond_f: {len(hit)} simultaneous node failures > f={f}; recovered because "
                "every layer kept a replica"
            )
        if any(set(layout.devices(n)) - state.failed for n in lost & in_plan if n < whole):
            notes.append(
                "partial node loss: Oobleck works per node (§3), so it drops the whole node"
            )

        candidates: list[Candidate] = []
        repaired = self._repair(state, layout, templates, pipelines, damaged, dropped)
        if isinstance(repaired, tuple):
            candidates.append(self._score(state, *repaired, notes=notes))
        if isinstance(repaired, str) or self.replan:
            why = [] if not isinstance(repaired, str) else [f"re-instantiated: {repaired}"]
            again = reinstantiate(
                profile, cluster, state.training, layout, templates, kept + joiners, f, plan
            )
            if isinstance(again, Declined):
                note = again.note
                if isinstance(repaired, str):
                    note = f"{note} (local repair: {repaired})"
                candidates.append(Candidate.declined(self.name, again.code, note))
            else:
                candidates.append(self._score(state, *again, notes=[*why, *notes]))
        return candidates

    def _repair(
        self,
        state: ClusterState,
        layout: NodeLayout,
        templates: TemplateSet,
        pipelines: list[NodeList],
        damaged: list[bool],
        lost: set[int],
    ) -> tuple[ExecutionPlan, Placement] | str:
        """§5.1 on the current pipelines; why not when the paper's repair falls short (the
        re-instantiation is tried next)."""
        f = self.f
        flat = [n for nodes in pipelines for n in nodes]
        if len(flat) != len(set(flat)):
            return "pipelines of the current plan share nodes; Oobleck repairs whole-node pipelines"
        try:
            repaired = repair_pipelines(pipelines, lost, templates.n0)
        except InfeasiblePlan as exc:
            return f"merge impossible: {exc}"
        if len(repaired) < f + 1:
            # §8 item 5: borrowing and merging never split a big pipeline
            return f"local repair leaves {len(repaired)} pipelines < f+1 = {f + 1}"
        unchanged = {
            frozenset(nodes): p
            for nodes, p, hurt in zip(pipelines, state.plan.pipelines, damaged, strict=True)
            if not hurt
        }
        drafts = []
        for index, nodes in enumerate(repaired):
            same = unchanged.get(frozenset(nodes))
            if same is not None:
                # treated as it is: the scenario's pipelines need not come from templates
                drafts.append(Draft(nodes=nodes, stages=same.stages, from_template=False))
                continue
            template = templates.get(len(nodes))
            if template is None:
                return (
                    f"no_template: no pipeline template fits the {len(nodes)} nodes of "
                    f"pipeline {index}"
                )
            drafts.extend(assign_nodes(state.profile, layout, state.plan, nodes, [template]))
        done = finish(state.profile, state.cluster, state.training, state.plan, drafts)
        return done.note if isinstance(done, Declined) else done

    def _score(
        self,
        state: ClusterState,
        plan: ExecutionPlan,
        placement: Placement,
        *,
        notes: Sequence[str],
    ) -> Candidate:
        transition = TransitionCost(
            detection_s=state.assumptions.detection_s,
            # Repair and batch split take milliseconds at fault time (templates were built at
            # job start); charged like every policy's search so candidates stay deterministic.
            search_s=state.assumptions.search_s,
            weight_transfer_s=placement.transfer_s,
            restart_s=self.regroup_s,
            # §7.4.2: at most the interrupted iteration is lost
            lost_work_s=interrupted_work_s(state),
        )
        candidate = score(self.name, state, plan, transition)
        text = "; ".join([*notes, "batch split by water-filling over eq. 11 step times, not eq. 6"])
        return replace(candidate, note=text) if candidate.feasible else candidate


def unheld_layers(
    layers: int, plan: ExecutionPlan, layout: NodeLayout, kept: set[int]
) -> list[LayerRange]:
    """Layer ranges no group on a kept node holds: their state is gone (§4 step 6)."""
    covered = sorted(
        r
        for g, r in held_ranges(plan).items()
        if len({layout.node_of(d) for d in g}) == 1 and layout.node_of(g[0]) in kept
    )
    gaps: list[LayerRange] = []
    reach = 0
    for first, end in covered:
        if first > reach:
            gaps.append((reach, first))
        reach = max(reach, end)
    if reach < layers:
        gaps.append((reach, layers))
    return gaps
