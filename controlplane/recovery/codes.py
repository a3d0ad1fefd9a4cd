"""Stable codes the core attaches to its answers, for callers that branch on them."""

from __future__ import annotations

from enum import StrEnum


class Caveat(StrEnum):
    """Why a feasible candidate's numbers are less certain than usual.

    A candidate without caveats is what its policy promises: for the planning policies, the best
    plan of their search space, proven so.
    """

    # A node or placement budget ended the planner's search before it proved its plan optimal:
    # the plan is valid and estimated like any other, but a faster one may exist.
    SEARCH_INCOMPLETE = "search_incomplete"
