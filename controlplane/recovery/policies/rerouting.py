"""Data rerouting (ReCycle-like): keep the plan, send lost micro-batches to live peers."""

from __future__ import annotations

from controlplane.recovery import replicas
from controlplane.recovery.codes import Code
from controlplane.recovery.model import (
    Candidate,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    Family,
    Pipeline,
    Stage,
    TransitionCost,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score


def reroute(
    plan: ExecutionPlan, failed: frozenset[int], cluster: Cluster | None = None
) -> ExecutionPlan | str:
    """The plan with every stage that touches a failed device served by its live peers.

    A peer is a live stage with the identical layer range in another pipeline (after an
    asymmetric re-plan there may be none). Returns a reason string when some stage has no peer.
    Given the cluster, a plan whose pipelines share one split is rerouted from its ``Replicas``
    in the time of the stages that change, to the same plan.
    """
    known = None if cluster is None else replicas.of(plan, cluster)
    if known is not None:
        assert cluster is not None
        found = replicas.rerouted(plan, known, failed)
        if isinstance(found, str):
            return found
        replicas.remember(found[0], cluster, found[1])
        return found[0]
    live: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for _, _, stage in plan.stages():
        if not stage.rerouted and not failed & set(stage.devices):
            live.setdefault(stage.layers, []).append(stage.devices)
    pipelines = []
    for pipeline in plan.pipelines:
        stages = []
        for stage in pipeline.stages:
            if stage.rerouted or failed & set(stage.devices):
                peers = live.get(stage.layers)
                if not peers:
                    return (
                        f"layers {list(stage.layers)} lost every replica; "
                        "no peer to reroute their micro-batches to"
                    )
                devices = tuple(d for group in peers for d in group)
                stage = Stage(devices=devices, layers=stage.layers, rerouted=True)
            stages.append(stage)
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=pipeline.micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines), family=Family.REROUTING)


def plan_rerouting(policy: str, state: ClusterState) -> Candidate:
    plan = reroute(state.plan, state.failed, state.cluster)
    if isinstance(plan, str):
        return Candidate.declined(policy, Code.NO_LIVE_REPLICA, plan)
    # Odyssey §IV-A: rerouting switches on the fly, so only the interrupted step is lost.
    cost = TransitionCost(
        detection_s=state.assumptions.detection_s, lost_work_s=interrupted_work_s(state)
    )
    return score(policy, state, plan, cost)


class ReroutingPolicy(SteadyCosts):
    """Always reroute: no transition, a slower step after every failure (Odyssey eq. 12/13)."""

    name = "rerouting"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [plan_rerouting(self.name, state)]
