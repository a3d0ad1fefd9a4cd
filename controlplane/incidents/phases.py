"""A recovery's phases from its timeline: detect, plan, approve, transfer, restart, first step,
each its start, end and seconds (the REST API's timeline, the recovery page, the cost model's
measured transition: ``incidents.accuracy``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from controlplane.incidents.models import EventKind, RecoveryDecision, TimelineEvent

# The phases of a recovery as the timeline records them: (phase, from event, to events); a
# phase ends at the first of its end events, or, for the agents' acknowledgements, the last.
PHASES: Sequence[tuple[str, str, tuple[str, ...]]] = (
    ("plan", EventKind.PLANNING_STARTED, (EventKind.PROPOSED, EventKind.FAILED)),
    (
        "approve",
        EventKind.PROPOSED,
        (EventKind.APPROVED, EventKind.OVERRIDDEN, EventKind.AUTO_APPLIED),
    ),
    ("transfer", EventKind.APPLYING, (EventKind.COMMAND_ACKED,)),  # every agent has the plan
    ("restart", EventKind.COMMAND_ACKED, (EventKind.RESUMED,)),  # every agent trains again
    ("first_step", EventKind.RESUMED, (EventKind.FIRST_STEP,)),  # every agent made a step
)
LAST = frozenset({EventKind.COMMAND_ACKED})


def phases(decision: RecoveryDecision, events: Sequence[TimelineEvent]) -> list[dict[str, Any]]:
    """Detect, plan, approve, transfer, restart, first step: each phase's start, end and seconds
    (null while it has not happened)."""
    failure = decision.failure
    out = [_phase("detect", failure.occurred_at, failure.detected_at)]
    seen: dict[str, dt.datetime] = {}
    for event in events:
        if event.kind in LAST or event.kind not in seen:
            seen[event.kind] = event.at
    for name, start_kind, end_kinds in PHASES:
        start = seen.get(start_kind)
        ends = [seen[k] for k in end_kinds if k in seen]
        out.append(_phase(name, start, min(ends) if ends and start else None))
    return out


def _phase(name: str, start: dt.datetime | None, end: dt.datetime | None) -> dict[str, Any]:
    seconds = None if start is None or end is None else max((end - start).total_seconds(), 0.0)
    return {"phase": name, "start": start, "end": end, "seconds": seconds}
