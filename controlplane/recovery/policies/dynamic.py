"""Dynamic parallelism: re-plan DP and PP over every surviving device group (Odyssey Alg. 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.model import Candidate, ClusterState, Failure, TransitionCost
from controlplane.recovery.objective import expected_time_to_failure_s
from controlplane.recovery.planner import (
    PlanShape,
    dp_window,
    realize,
    search,
    usable_groups,
)
from controlplane.recovery.policies.base import interrupted_work_s, score

# Shapes scored with their weight transfer once the fastest is known. The window they come from
# is exact (see plan_dynamic); the caps bound the work when many shapes tie, as at scale.
WINDOW_TOP_K = 256
WINDOW_NODE_BUDGET = 5_000
WINDOW_MIN_SCORED = 8


def plan_dynamic(policy: str, state: ClusterState, *, exhaustive: bool = False) -> Candidate:
    """The re-plan with the best eq. 8 objective, weight transfer included.

    Eq. 8 is at most ``B/t_step × D/(D + fixed costs)``, so once one shape is scored, only shapes
    whose step time could still beat it need their Kuhn-Munkres placement.
    """
    groups = usable_groups(state)
    if not groups:
        return Candidate.infeasible(policy, "no healthy device group left")
    fixed = TransitionCost(
        search_s=state.assumptions.search_s,
        restart_s=state.assumptions.restart_s,
        lost_work_s=interrupted_work_s(state),
    )
    kwargs = {
        "groups": len(groups),
        "tp": state.plan.tp,
        "dp_options": dp_window(state.plan.dp, len(groups)),
        "exhaustive": exhaustive,
    }
    first = search(state.profile, state.cluster, state.training, top_k=1, **kwargs)  # type: ignore[arg-type]
    if not first.shapes:
        return Candidate.infeasible(
            policy,
            f"no plan over {len(groups)} device groups fits memory and the batch "
            f"({state.training.micro_batches} micro-batches)",
        )

    def evaluate(shape: PlanShape) -> Candidate:
        plan, placement = realize(state, shape, groups)
        return score(
            policy,
            state,
            plan,
            TransitionCost(
                search_s=fixed.search_s,
                weight_transfer_s=placement.transfer_s,
                restart_s=fixed.restart_s,
                lost_work_s=fixed.lost_work_s,
            ),
        )

    best = evaluate(first.shapes[0])
    if not best.feasible or best.objective <= 0:
        return best
    t_state = expected_time_to_failure_s(
        state.cluster.failure_rate_per_device_hour, sum(len(g) for g in groups)
    )
    ratio = 1.0 if math.isinf(t_state) else t_state / (t_state + fixed.total_s)
    cut = state.training.global_batch / best.objective * ratio
    window = search(
        state.profile,
        state.cluster,
        state.training,
        top_k=10**9 if exhaustive else WINDOW_TOP_K,
        max_step_time_s=cut * (1 + 1e-9),
        node_budget=None if exhaustive else WINDOW_NODE_BUDGET,
        **kwargs,  # type: ignore[arg-type]
    )
    # Placements cost O(groups) and more at scale; small clusters score the whole window.
    limit = len(window.shapes) if exhaustive else max(WINDOW_MIN_SCORED, 4096 // len(groups))
    for shape in window.shapes[:limit]:  # fastest first
        bound = state.training.global_batch / shape.compute_time_s * ratio
        if bound <= best.objective * (1 + 1e-12):
            break
        candidate = evaluate(shape)
        if candidate.feasible and candidate.objective > best.objective * (1 + 1e-12):
            best = candidate
    return best


@dataclass(frozen=True)
class DynamicPolicy:
    """Always re-plan: pay a transition for the fastest step the survivors allow."""

    exhaustive: bool = False
    name: ClassVar[str] = "dynamic"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [plan_dynamic(self.name, state, exhaustive=self.exhaustive)]
