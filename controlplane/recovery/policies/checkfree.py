"""CheckFree and CheckFree+ (003): rebuild a lost stage on spares from its pipeline neighbours."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    ModelProfile,
    TransitionCost,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score, unchanged
from controlplane.recovery.policies.replacement import (
    Copy,
    StageKey,
    broken_stages,
    copy_time_s,
    replace_stages,
)

# CheckFree §2, §6.1: provision a spare and rejoin, about 30 s in the paper's setup.
RESTART_S = 30.0
# CheckFree §6.5: convergence cost of one rebuilt stage in equivalent extra steps, fitted to its
# Table 2: k_cf = 25 for CheckFree, k_cfp = 12.5 for CheckFree+, whose swap schedule inflates the
# steps to converge by s ≈ 0.23 whether or not anything fails (same fit, Fig. 5b).
PENALTY_STEPS = 25.0
PLUS_PENALTY_STEPS = 12.5
PLUS_STEP_INFLATION = 0.23

# CheckFree+ swaps S1 with S2 and S(L-1) with SL on half of the micro-batches (003 §3), which
# needs two swap pairs that do not overlap.
MIN_STAGES_PLUS = 4


def live_shards(state: ClusterState) -> set[tuple[tuple[int, int], int]]:
    """(layers, tensor-parallel rank) of every shard that still has a healthy copy."""
    return {
        (stage.layers, rank)
        for _, _, stage in state.plan.stages()
        if not stage.rerouted
        for rank, device in enumerate(stage.devices)
        if device not in state.failed
    }


def sources(position: int, depth: int, *, plus: bool) -> tuple[int, ...]:
    """Stages of the same pipeline whose weights rebuild the stage at ``position``.

    CheckFree averages both neighbours (§2). CheckFree+ copies an edge stage from its swap
    partner, and the partner from the edge stage (§3, code); the rest average as in CheckFree.
    """
    if plus:
        partners = {0: 1, 1: 0, depth - 2: depth - 1, depth - 1: depth - 2}
        if position in partners:
            return (partners[position],)
    return (position - 1, position + 1)


def same_layout(profile: ModelProfile, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two layer ranges have the same parameter layout, judged by per-layer sizes.

    Averaging and copying go tensor by tensor (§2), so the profile's per-layer parameter bytes
    stand in for the names and shapes that Pitstop does not keep.
    """
    left, right = profile.m_p[a[0] : a[1]], profile.m_p[b[0] : b[1]]
    return len(left) == len(right) and all(
        math.isclose(x, y, rel_tol=1e-9) for x, y in zip(left, right, strict=True)
    )


def parameter_bytes(profile: ModelProfile, layers: tuple[int, int]) -> float:
    """Weights only: the rebuilt stage gets a fresh optimizer (§2, code), so no state is sent."""
    return sum(profile.m_p[layers[0] : layers[1]])


def infeasibility(
    state: ClusterState, broken: tuple[StageKey, ...], *, plus: bool
) -> tuple[Code, str] | None:
    """The first §6.2 rule the lost stages break, as (code, note); None when all pass.

    Rules run in §6.2's order, except that the variant's own structural rule (6 edge_stage, 11
    too_few_stages) runs before 3 shape_mismatch, which needs the sources those rules define.
    Rule 7 (holds_embedding) coincides with 6, because Pitstop's first and last stages hold the
    embedding and LM head; rule 9 (partner_lost) with 2, because swap partners are adjacent; rules
    8, 10 and 12 need job state Pitstop does not keep (the swap schedule is taken as warmed up).
    """
    plan = state.plan
    live = live_shards(state)
    tp = plan.tp
    for p, s in broken:
        stage = plan.pipelines[p].stages[s]
        # §6.1: a stage is lost when some shard has no healthy data-parallel copy left
        if stage.rerouted or all((stage.layers, rank) in live for rank in range(tp)):
            return (
                Code.STAGE_HAS_REPLICA,
                f"stage {s} still has a live data-parallel replica; copy it from the peer "
                "instead (exact)",
            )
    for p, pipeline in enumerate(plan.pipelines):
        lost = sorted(s for q, s in broken if q == p)
        pairs = [(a, b) for a, b in pairwise(lost) if b == a + 1]
        if plus and pipeline.depth > 2 and lost and lost[0] == 0 and lost[-1] == pipeline.depth - 1:
            # CheckFree+ runs the stages as a ring through the embedding and LM head (§3)
            pairs.append((lost[-1], lost[0]))
        if pairs:
            a, b = pairs[0]
            return (
                Code.ADJACENT_STAGES_LOST,
                f"stages {a} and {b} are adjacent and both lost; no neighbour pair remains",
            )
    for p, s in broken:
        depth = plan.pipelines[p].depth
        if plus and depth < MIN_STAGES_PLUS:
            return (
                Code.TOO_FEW_STAGES,
                "swap pairs (S1,S2) and (S(L-1),SL) overlap; "
                f"need at least {MIN_STAGES_PLUS} transformer stages",
            )
        if not plus and s in (0, depth - 1):
            return (
                Code.EDGE_STAGE,
                f"stage {s} is the first/last transformer stage; "
                "CheckFree needs two live neighbours",
            )
    for p, s in broken:
        stages = plan.pipelines[p].stages
        for j in sources(s, len(stages), plus=plus):
            if not same_layout(state.profile, stages[s].layers, stages[j].layers):
                return (
                    Code.SHAPE_MISMATCH,
                    f"stage {s} and neighbour {j} have different parameter layouts; "
                    "averaging/copy undefined",
                )
    return None


def plan_checkfree(
    policy: str,
    state: ClusterState,
    *,
    plus: bool,
    restart_s: float = RESTART_S,
    penalty_steps: float = PENALTY_STEPS,
    embedding_bytes: float = 0.0,
) -> Candidate:
    """The same plan with every lost stage rebuilt on spares from its neighbours' weights.

    Every rebuilt layer range costs ``penalty_steps`` extra steps to converge; CheckFree+ keeps
    ``embedding_bytes`` of embedding and LM head next to its edge stages.
    """
    assumptions = state.assumptions
    tp = state.plan.tp
    # CheckFree+ keeps a copy of the embedding / LM head next to the edge stages (§3, §6.6);
    # score() charges it on every device, an upper bound for the two partner stages it sits on.
    extra_memory = embedding_bytes / tp if plus else 0.0
    broken = broken_stages(state)
    if not broken:
        return unchanged(policy, state, extra_memory_bytes=extra_memory)
    broken_rule = infeasibility(state, broken, plus=plus)
    if broken_rule is not None:
        return Candidate.declined(policy, *broken_rule)
    try:
        replacement = replace_stages(state, broken)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))

    # §6.4: each replacement pulls from the neighbours in its own pipeline, rank by rank, all in
    # parallel (its DP peers hold the same weights after the all-reduce)
    plan: ExecutionPlan = state.plan
    copies = []
    for (p, s), group in replacement.groups.items():
        stages = plan.pipelines[p].stages
        for j in sources(s, len(stages), plus=plus):
            nbytes = parameter_bytes(state.profile, stages[j].layers) / tp
            for rank, target in enumerate(group):
                copies.append(Copy(source=stages[j].devices[rank], target=target, nbytes=nbytes))
    try:
        transfer_s = copy_time_s(state.cluster, copies)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))
    try:
        step_s = estimate_step_time(state.profile, state.cluster, replacement.plan)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))

    # §6.4-6.5: a rebuilt stage costs k extra steps to converge, once per layer range however
    # many data-parallel replicas were rebuilt with the same coefficients
    rebuilt = len({plan.pipelines[p].stages[s].layers for p, s in broken})
    transition = TransitionCost(
        detection_s=assumptions.detection_s,
        weight_transfer_s=transfer_s,
        restart_s=restart_s,
        # §2: no rollback, training resumes from the current batch; the interrupted step and
        # detection are charged as for every policy, the convergence penalty on top (§6.4)
        lost_work_s=interrupted_work_s(state) + penalty_steps * step_s * rebuilt,
    )
    return score(policy, state, replacement.plan, transition, extra_memory_bytes=extra_memory)


@dataclass(frozen=True)
class CheckFreePolicy(SteadyCosts):
    """Rebuild a lost intermediate stage as the gradient-weighted average of its neighbours."""

    restart_s: float = RESTART_S  # provision a spare and rejoin (§2, §6.1)
    penalty_steps: float = PENALTY_STEPS  # extra steps to converge per rebuilt stage (§6.5)
    name: ClassVar[str] = "checkfree"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            plan_checkfree(
                self.name,
                state,
                plus=False,
                restart_s=self.restart_s,
                penalty_steps=self.penalty_steps,
            )
        ]


@dataclass(frozen=True)
class CheckFreePlusPolicy(SteadyCosts):
    """CheckFree, with edge stages copied from their out-of-order swap partners."""

    restart_s: float = RESTART_S
    penalty_steps: float = PLUS_PENALTY_STEPS  # k_cfp (§6.5), the swap's overhead paid all along
    # the swap schedule's standing inflation of the steps to converge, s (§6.5, Fig. 5b)
    step_inflation: float = PLUS_STEP_INFLATION
    # bytes of the embedding / LM head replicated next door (§3, §6.6); the profile does not
    # single them out, so 0 unless given
    embedding_bytes: float = 0.0
    name: ClassVar[str] = "checkfree_plus"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            plan_checkfree(
                self.name,
                state,
                plus=True,
                restart_s=self.restart_s,
                penalty_steps=self.penalty_steps,
                embedding_bytes=self.embedding_bytes,
            )
        ]

    def convergence_factor(self, state: ClusterState) -> float:
        """1 + s, failures or not: the out-of-order swap costs no iteration time (§3, Table 1)
        but slows convergence (Fig. 5b), so each step yields fewer useful samples."""
        return 1 + self.step_inflation
