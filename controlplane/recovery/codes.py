"""Stable codes the core attaches to its answers, for callers that branch on them.

Every candidate carries one ``Code`` (``ok``, or why its policy declines) and a human ``note``;
callers key on the code, never on the note's words. docs/scenario.md lists them for users.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Code(StrEnum):
    """What a candidate is: ``OK`` when its plan applies, otherwise why its policy declines.

    The values are part of the interface (REST bodies, decision rows, dashboard filters): add new
    ones, never rename one.
    """

    OK = "ok"
    # --- the survivors cannot hold a plan ---
    # a device would need more memory than it has (the candidate may still show the plan)
    OUT_OF_MEMORY = "out_of_memory"
    # no healthy device group (tensor-parallel width) is left at all
    NO_DEVICE_GROUP = "no_device_group"
    # no plan of the policy's shape over the surviving groups fits memory and the batch
    NO_FITTING_PLAN = "no_fitting_plan"
    # fewer healthy nodes than the policy's smallest pipeline needs (Oobleck's templates)
    TOO_FEW_NODES = "too_few_nodes"
    # --- the state to continue from is gone ---
    # some layers lost every live data-parallel replica: nothing to reroute to or copy from
    NO_LIVE_REPLICA = "no_live_replica"
    # a NaN fault may have spread to every replica through the gradient all-reduce
    UNTRUSTED_STATE = "untrusted_state"
    # --- the policy's own preconditions ---
    # the policy replaces lost devices with spares, and too few spares are healthy
    NO_SPARE = "no_spare"
    # a copy the recovery needs has no usable link (the scenario gives no bandwidth for it)
    NO_LINK = "no_link"
    # two lost stages are neighbours, so neither can be rebuilt from (or shadowed by) the other
    ADJACENT_STAGES_LOST = "adjacent_stages_lost"
    # a first or last stage was lost and CheckFree needs two live neighbours
    EDGE_STAGE = "edge_stage"
    # CheckFree+'s swap pairs overlap: the pipeline has too few stages
    TOO_FEW_STAGES = "too_few_stages"
    # neighbouring stages have different parameter layouts, so averaging them is undefined
    SHAPE_MISMATCH = "shape_mismatch"
    # the lost stage still has a live data-parallel replica: copy it instead of rebuilding it
    STAGE_HAS_REPLICA = "stage_has_replica"
    # --- an adaptive policy's options ---
    # a re-plan not placed, because another option's objective beats the best it could reach
    DOMINATED = "dominated"
    # none of an adaptive policy's options applies; the note gives each option's code
    NO_OPTION = "no_option"
    # a smaller world would keep fewer replicas than the job's minimum (torchrun's --nnodes MIN)
    TOO_FEW_REPLICAS = "too_few_replicas"


# What each code means, for people (docs/scenario.md's table, which a test holds equal).
MEANINGS: dict[Code, str] = {
    Code.OK: "the plan applies",
    Code.OUT_OF_MEMORY: "some device would need more memory than it has (the plan is still shown)",
    Code.NO_DEVICE_GROUP: "no healthy device group of the tensor-parallel width is left",
    Code.NO_FITTING_PLAN: (
        "no plan of the policy's shape over the survivors fits memory and the batch"
    ),
    Code.TOO_FEW_NODES: "fewer healthy nodes than the policy's smallest pipeline needs (Oobleck)",
    Code.NO_LIVE_REPLICA: (
        "some layers lost every live data-parallel replica: nothing to reroute to or copy from"
    ),
    Code.UNTRUSTED_STATE: (
        "a NaN fault may have spread to every replica (FlashRecovery §5): restore from a checkpoint"
    ),
    Code.NO_SPARE: "the policy replaces lost devices with spares, and too few are healthy",
    Code.NO_LINK: (
        "a copy the recovery needs has no usable link (the scenario gives no bandwidth for it)"
    ),
    Code.ADJACENT_STAGES_LOST: (
        "two lost stages are neighbours, so neither can be rebuilt from (CheckFree) or shadowed "
        "by (Bamboo) the other"
    ),
    Code.EDGE_STAGE: "CheckFree lost a first or last stage, which has only one neighbour",
    Code.TOO_FEW_STAGES: "CheckFree+'s swap pairs overlap: the pipeline has too few stages",
    Code.SHAPE_MISMATCH: (
        "neighbouring stages have different parameter layouts, so averaging them is undefined"
    ),
    Code.STAGE_HAS_REPLICA: (
        "CheckFree: the lost stage still has a live replica, to copy exactly instead"
    ),
    Code.DOMINATED: (
        "a re-plan not placed, because another option's objective beats the best it could reach"
    ),
    Code.NO_OPTION: (
        "none of an adaptive policy's options applies; the note gives each option's code"
    ),
    Code.TOO_FEW_REPLICAS: (
        "restart_shrink: the smaller world would keep fewer replicas than the job's min_replicas "
        "(torchrun's --nnodes MIN)"
    ),
}


class Option(StrEnum):
    """Which of its options an adaptive policy (odyssey, pitstop) chose; empty for the others."""

    REROUTE = "reroute"  # the failed stages' micro-batches go to live replicas (Odyssey eq. 12/13)
    SWAP = "swap"  # the lost groups are replaced by spares, restored from a live replica
    REPLAN = "replan"  # a new plan over the surviving groups of the job (Odyssey Algorithm 1)
    REPLAN_WITH_SPARES = "replan_with_spares"  # the same over survivors and idle spares


class Declined(NamedTuple):
    """Why a step of a policy's search found nothing: the candidate's code and note to be."""

    code: Code
    note: str


class Caveat(StrEnum):
    """Why a feasible candidate's numbers are less certain than usual.

    A candidate without caveats is what its policy promises: for the planning policies, the best
    plan of their search space, proven so.
    """

    # A node or placement budget ended the planner's search before it proved its plan optimal:
    # the plan is valid and estimated like any other, but a faster one may exist.
    SEARCH_INCOMPLETE = "search_incomplete"
