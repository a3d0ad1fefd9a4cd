"""What the dashboard pages show, read in a fixed number of queries whatever the job's size.

Every function here reads; the pages' actions go through the apps' services
(``controlplane.incidents.decisions``, ``controlplane.simulations.sweeps``).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from django.db.models import (
    Case,
    CharField,
    Count,
    Exists,
    OuterRef,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.fields.json import KT

from controlplane.bridge.vocabulary import MEANINGS
from controlplane.incidents.models import (
    OPEN,
    DecisionStatus,
    EventKind,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs import lifecycle
from controlplane.jobs.models import Device, DeviceState, Job, Node, NodeStatus, heavy

# One letter a device in the grid's state strings (the browser's job.js reads the same).
STATE_LETTER: dict[str, str] = {
    DeviceState.HEALTHY: "h",
    DeviceState.SUSPECT: "s",
    DeviceState.FAILED: "f",
    DeviceState.SPARE: "p",
    DeviceState.RECOVERING: "r",
}
# A device whose node is expected and has not said hello yet: not yet heard, whatever its row.
UNHEARD, UNHEARD_LETTER = "unheard", "u"
# Statuses in which a decision's plan is, or is becoming, the one the job runs.
CHOSEN = (
    DecisionStatus.APPROVED,
    DecisionStatus.OVERRIDDEN,
    DecisionStatus.AUTO_APPLIED,
    DecisionStatus.APPLYING,
    DecisionStatus.RECOVERED,
)
OPEN_STATUSES = frozenset(OPEN)
# A decision has one candidate per policy asked; the registry has fewer than this.
MAX_CANDIDATES = 16


def _chosen_policy() -> Case:
    """The policy of a decision's chosen candidate, read inside the database (no candidate's
    plan, megabytes at scale, leaves it); "edited plan" for an operator's own plan."""
    return Case(
        *(
            When(chosen=i, then=KT(f"decision__candidates__{i}__policy"))
            for i in range(MAX_CANDIDATES)
        ),
        default=Value("edited plan"),
        output_field=CharField(),
    )


def jobs_overview() -> QuerySet[Job]:
    """Every job with its devices by state, its current policy and its open decision, in one
    query."""
    decisions = RecoveryDecision.objects.filter(job=OuterRef("pk"))
    current = decisions.filter(status__in=CHOSEN).order_by("-created_at", "-pk")
    open_ = decisions.filter(status__in=OPEN).order_by("-created_at", "-pk")
    return (
        Job.objects.defer(*heavy())
        .annotate(
            **lifecycle.device_counts(),
            policy=Subquery(current.annotate(policy=_chosen_policy()).values("policy")[:1]),
            open_decision=Subquery(open_.values("pk")[:1]),
            open_status=Subquery(open_.values("status")[:1]),
            needs_approval=Exists(decisions.filter(status=DecisionStatus.PROPOSED)),
        )
        .order_by("-needs_approval", "-created_at")
    )


def grid(job: Job) -> dict[str, Any]:
    """The device grid's layout and states: nodes as (name, first device, device count, status)
    in index order, and every device's state as one letter (``STATE_LETTER``; ``UNHEARD_LETTER``
    for a device not failed on a node still expected)."""
    nodes = list(
        Node.objects.filter(job=job)
        .annotate(count=Count("devices"))
        .order_by("index")
        .values_list("name", "count", "status")
    )
    firsts = itertools.accumulate((count for _, count, _ in nodes), initial=0)
    states = Device.objects.filter(job=job).order_by("index").values_list("state", "node__status")
    return {
        "nodes": [
            [name, first, count, status]
            for (name, count, status), first in zip(nodes, firsts, strict=False)
        ],
        "states": "".join(
            UNHEARD_LETTER
            if node == NodeStatus.EXPECTED and state != DeviceState.FAILED
            else STATE_LETTER.get(state, "h")
            for state, node in states
        ),
    }


def device_counts(states: str) -> dict[str, int]:
    letters = {letter: state for state, letter in STATE_LETTER.items()}
    letters[UNHEARD_LETTER] = UNHEARD
    counts = dict.fromkeys([*DeviceState.values, UNHEARD], 0)
    for letter in states:
        counts[letters[letter]] += 1
    return counts


def plan_rows(plan: Any, limit: int = 64) -> dict[str, Any]:
    """The plan as pipelines × stages, each stage its layer range and devices (the first
    ``limit`` pipelines; the rest are counted)."""
    pipelines = list((plan or {}).get("pipelines", []))
    rows = [
        {
            "micro_batches": pipeline.get("micro_batches"),
            "stages": [
                {
                    "layers": stage["layers"],
                    "devices": _short(stage["devices"]),
                    "rerouted": bool(stage.get("rerouted")),
                }
                for stage in pipeline["stages"]
            ],
        }
        for pipeline in pipelines[:limit]
    ]
    width = max((len(r["stages"]) for r in rows), default=0)
    for row in rows:  # a shorter pipeline's row ends in empty cells, so the columns line up
        row["pad"] = range(width - len(row["stages"]))
    return {
        "rows": rows,
        "width": range(width),
        "more": max(len(pipelines) - limit, 0),
        "pipelines": len(pipelines),
        "family": (plan or {}).get("family", ""),
    }


def _short(devices: list[int], shown: int = 8) -> str:
    text = ", ".join(map(str, devices[:shown]))
    return text + (f" … (+{len(devices) - shown})" if len(devices) > shown else "")


def candidate_rows(
    answer: dict[str, Any] | None,
    *,
    chosen: int | None,
    capacity: float | None,
    global_batch: float | None,
) -> list[dict[str, Any]]:
    """Every candidate of a decision (the codec's dict), side by side: its policy, estimated
    step time, throughput and share of the fastest, transition cost by part, peak memory
    against the device capacity, objective, code and note; which one is chosen and which the
    core proposed."""
    if not answer:
        return []
    candidates = answer["candidates"]
    rates = [
        global_batch / c["est_step_time_s"]
        if global_batch and c.get("est_step_time_s") and c["code"] == "ok"
        else None
        for c in candidates
    ]
    fastest = max((r for r in rates if r is not None), default=None)
    first_with: dict[str, int] = {}  # a plan (as JSON) -> the first feasible candidate with it
    rows = []
    for i, (c, rate) in enumerate(zip(candidates, rates, strict=True)):
        same_as = None
        if c["code"] == "ok" and c.get("plan") is not None:
            same_as = first_with.setdefault(json.dumps(c["plan"], sort_keys=True), i)
            same_as = None if same_as == i else same_as
        memory = c.get("peak_memory_bytes") or {}
        device, peak = max(memory.items(), key=lambda kv: kv[1], default=(None, None))
        rows.append(
            {
                "index": i,
                "policy": c["policy"],
                "option": c.get("option"),
                "ok": c["code"] == "ok",
                "code": c["code"],
                "meaning": MEANINGS.get(c["code"], ""),
                "note": c.get("note", ""),
                "caveats": c.get("caveats", []),
                "step_time_s": c.get("est_step_time_s"),
                "throughput": rate,
                "share": rate / fastest if rate and fastest else None,
                "transition": c.get("transition") or {},
                "peak_bytes": peak,
                "peak_device": device,
                "capacity": capacity,
                "memory_share": peak / capacity if peak and capacity else None,
                "objective": c.get("objective"),
                "chosen": i == chosen,
                "proposed": i == answer.get("chosen"),
                # the same plan as an earlier candidate: choosing one or the other is the same
                "same_as": same_as,
                "same_as_policy": None if same_as is None else candidates[same_as]["policy"],
            }
        )
    return rows


def why(rows: list[dict[str, Any]], decision: RecoveryDecision | None = None) -> str:
    """In a sentence, why the marked candidate is the one."""
    chose = decision is not None and decision.chosen_by_id is not None
    if chose and decision is not None and overridden(decision):
        who = decision.chosen_by.get_username() if decision.chosen_by else "an operator"
        what = "an edited plan" if decision.chosen is None else "this candidate"
        return f"{who} overrode the proposal with {what}: {decision.reason or 'no reason given'}"
    proposed = next((r for r in rows if r["proposed"]), None)
    if proposed is None:
        return "No candidate applies: every policy declined (codes below)."
    others = sorted(
        (r for r in rows if r["ok"] and not r["proposed"]),
        key=lambda r: -(r["objective"] or 0),
    )
    text = (
        f"{proposed['policy']} has the highest objective (eq. 8: throughput over the expected "
        f"time to the next fault): {proposed['objective']:.4g}"
    )
    if others:
        text += f", ahead of {others[0]['policy']} at {others[0]['objective']:.4g}"
    if proposed["note"]:
        text += f". {proposed['note']}"
    if chose and decision is not None:
        who = decision.chosen_by.get_username() if decision.chosen_by else "an operator"
        text += f". Approved by {who}" + (f": {decision.reason}" if decision.reason else "")
    return text + "."


def overridden(decision: RecoveryDecision) -> bool:
    """Whether an operator applied something other than the core's proposal."""
    proposal = (decision.decision or {}).get("chosen")
    return decision.chosen_by_id is not None and decision.chosen != proposal


# The statuses of a decision nobody has chosen for yet, and the events that end that wait.
WAITING = frozenset({DecisionStatus.PLANNING, DecisionStatus.PROPOSED})
ENDING = (
    EventKind.APPROVED,
    EventKind.OVERRIDDEN,
    EventKind.AUTO_APPLIED,
    EventKind.DISMISSED,
    EventKind.SUPERSEDED,
    EventKind.FAILED,
)


def decided(decision_id: int) -> str | None:
    """Who ended the decision's wait for an operator, how and when, in a sentence ("ops
    overrode the proposal with #2 (dynamic) at 12:01:03 UTC: its reason"); None while open."""
    found = (
        RecoveryDecision.objects.filter(pk=decision_id)
        .annotate(policy=_chosen_policy())
        .values("status", "chosen", "policy", "reason", "superseded_by")
        .first()
    )
    event = (
        TimelineEvent.objects.filter(decision_id=decision_id, kind__in=ENDING)
        .order_by("at", "pk")  # the first: what ended the wait
        .values("kind", "actor", "at")
        .first()
    )
    if found is None or event is None or found["status"] in WAITING:
        return None
    chosen = found["chosen"]
    what = "an edited plan" if chosen is None else f"#{chosen} ({found['policy']})"
    who, kind = event["actor"], event["kind"]
    told: dict[str, str] = {
        EventKind.APPROVED: f"{who} approved {what}",
        EventKind.OVERRIDDEN: f"{who} overrode the proposal with {what}",
        EventKind.AUTO_APPLIED: (
            f"the job's deadline passed and {what} was applied"
            if who == "timeout"
            else f"the job's mode applied {what}"
        ),
        EventKind.DISMISSED: f"{who} dismissed it",
        EventKind.SUPERSEDED: f"a later failure superseded it (decision #{found['superseded_by']})",
        EventKind.FAILED: "it failed",
    }
    text = told[kind] + f" at {event['at']:%H:%M:%S} UTC"
    if found["reason"] and kind in (EventKind.APPROVED, EventKind.OVERRIDDEN, EventKind.DISMISSED):
        text += f": {found['reason']}"
    return text
