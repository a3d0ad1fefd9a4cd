"""Why a job is not training: the cause of every stretch of a recovery timeline, and its colour.

The simulator's timeline, the control plane's recovery timeline and the dashboard speak the same
words and draw them in the same colours, so the vocabulary lives here, in the core, with no
library behind it.
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    """What the job does during a stretch of time: it runs, or it is down for one of these."""

    RUNNING = "running"
    DETECTION = "detection"
    PLANNING = "planning"
    WEIGHT_TRANSFER = "weight_transfer"
    RESTART = "restart"
    LOST_WORK = "lost_work"
    INFEASIBLE = "infeasible"


DOWN_CAUSES = tuple(c for c in Cause if c is not Cause.RUNNING)

# One colour per cause (CSS hex), the same in every chart that shows a timeline.
COLOURS: dict[Cause, str] = {
    Cause.RUNNING: "#59a14f",
    Cause.DETECTION: "#e15759",
    Cause.PLANNING: "#f28e2b",
    Cause.WEIGHT_TRANSFER: "#4e79a7",
    Cause.RESTART: "#b07aa1",
    Cause.LOST_WORK: "#9c755f",
    Cause.INFEASIBLE: "#333333",
}
