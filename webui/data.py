"""What the dashboard pages show, read in a fixed number of queries whatever the job's size.

Every function here reads; the pages' actions go through the apps' services
(``controlplane.incidents.decisions``, ``controlplane.simulations.sweeps``).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
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
from controlplane.incidents import accuracy
from controlplane.incidents.models import (
    OPEN,
    DecisionStatus,
    EventKind,
    RecoveryDecision,
    TimelineEvent,
)
from controlplane.jobs import lifecycle
from controlplane.jobs.models import Device, DeviceState, Job, JobStatus, Node, NodeStatus, heavy

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


# The jobs list's sorts: the first needs an operator first, then the newest.
JOB_SORTS: dict[str, tuple[str, ...]] = {
    "attention": ("-needs_approval", "-created_at"),
    "newest": ("-created_at",),
    "oldest": ("created_at",),
    "name": ("name",),
    "status": ("status", "name"),
}
FINISHED = (JobStatus.STOPPED, JobStatus.FAILED)  # the archive holds these


def jobs_overview(
    *,
    name: str = "",
    status: str = "",
    sort: str = "attention",
    archived: bool | None = False,
) -> QuerySet[Job]:
    """Jobs with their devices by state, their current policy and their open decision, in one
    query: ``name`` (part of it), ``status``, the running ones or the archive of finished ones
    (``archived``; None for both), in ``JOB_SORTS[sort]`` order."""
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
        .filter(**({"name__icontains": name} if name else {}))
        .filter(**({"status": status} if status else {}))
        .exclude(**({"status__in": FINISHED} if archived is False else {}))
        .filter(**({"status__in": FINISHED} if archived else {}))
        .order_by(*JOB_SORTS[sort], "-pk")
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


# --- what a plan changes, and what it trades ------------------------------------------------

# Pipelines up to this many have their layer cuts listed; beyond, only counted.
CUTS_LISTED = 4


def _holding(plan: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """Each device of ``plan`` -> the layers [from, to) its stage holds."""
    return {
        d: (s["layers"][0], s["layers"][1])
        for p in plan.get("pipelines", [])
        for s in p["stages"]
        for d in s["devices"]
    }


def _shapes(plan: dict[str, Any]) -> str:
    """ "2 pipelines of 4 stages, 1 of 3": the pipelines counted by their stage count."""
    counts = Counter(len(p["stages"]) for p in plan.get("pipelines", []))
    parts = [
        f"{n} of {stages} stage{'s' if stages != 1 else ''}" for stages, n in sorted(counts.items())
    ]
    total = sum(counts.values())
    return f"{total} pipeline{'s' if total != 1 else ''} ({', '.join(parts)})"


def plan_changes(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[str]:
    """What applying ``after`` over ``before`` changes, in a few sentences: the devices dropped
    and added, the pipelines and their stages, the devices that keep their layers and those
    that take others, and for a few pipelines where the layers are cut."""
    if not before or not after or not before.get("pipelines") or not after.get("pipelines"):
        return []
    held, holds = _holding(before), _holding(after)
    dropped = sorted(set(held) - set(holds))
    added = sorted(set(holds) - set(held))
    both = sorted(set(held) & set(holds))
    moved = [d for d in both if held[d] != holds[d]]
    said = [
        f"Devices dropped: {_short(dropped) or 'none'}; devices added: {_short(added) or 'none'}.",
        f"Pipelines: {_shapes(before)} → {_shapes(after)}.",
        f"Of the {len(both)} devices in both, {len(both) - len(moved)} keep their layers and "
        f"{len(moved)} take others" + (f" ({_short(moved)})." if moved else "."),
    ]
    if len(before["pipelines"]) <= CUTS_LISTED and len(after["pipelines"]) <= CUTS_LISTED:

        def cuts(plan: dict[str, Any]) -> str:
            return "; ".join(
                " | ".join(f"{s['layers'][0]}–{s['layers'][1]}" for s in p["stages"])
                for p in plan["pipelines"]
            )

        if cuts(before) != cuts(after):
            said.append(f"Layers by stage: {cuts(before)} → {cuts(after)}.")
    return said


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def tradeoff(rows: list[dict[str, Any]], marked: dict[str, Any] | None) -> str:
    """The marked candidate's trade in words: the seconds without training against the
    throughput after, beside the best other plan (equal plans are one choice)."""
    if marked is None or not marked["ok"] or not marked["transition"] or not marked["throughput"]:
        return ""
    down, rate = marked["transition"]["total_s"], marked["throughput"]
    text = (
        f"#{marked['index']} ({marked['policy']}) stops training for about {down:.2f} s, then "
        f"trains at {rate:.2f} samples/s."
    )
    same = {marked["index"]} | ({marked["same_as"]} if marked["same_as"] is not None else set())
    others = [
        r
        for r in rows
        if r["ok"] and r["throughput"] and r["transition"]
        and r["index"] not in same and r["same_as"] not in same
    ]  # fmt: skip
    if not others:
        return text + " No other policy's plan applies."
    other = max(others, key=lambda r: r["objective"] or 0)
    o_down, o_rate = other["transition"]["total_s"], other["throughput"]
    name = f"#{other['index']} ({other['policy']})"
    gain = o_rate / rate - 1
    if o_rate > rate and o_down > down:
        # the time from the failure after which the other plan has trained more samples
        even = (o_rate * o_down - rate * down) / (o_rate - rate)
        return text + (
            f" {name} would stop it {o_down - down:.2f} s longer for {gain:.0%} more throughput "
            f"after: it has trained more only {_minutes(even)} after the failure. The objective "
            "(eq. 8) weighs that against the expected time to the next fault."
        )
    if o_rate < rate and o_down < down:
        return text + (
            f" {name} would stop it {down - o_down:.2f} s less but train {-gain:.0%} slower "
            "after: over the expected time to the next fault the slower steps cost more than "
            "the seconds saved (eq. 8)."
        )
    worse = o_rate <= rate and o_down >= down
    return text + (
        f" {name} would stop it for {o_down:.2f} s and train at {o_rate:.2f} samples/s: "
        + ("no better either way." if worse else "better both ways.")
    )


def plan_before(decision: RecoveryDecision) -> Any:
    """The plan the job ran when ``decision``'s failure came: the job's plan while nobody has
    chosen, else the plan of the last recovery applied before it, else the job's first plan."""
    job = Job.objects.only("plan", "scenario").get(pk=decision.job_id)
    if decision.status in WAITING:
        return job.plan
    earlier = (
        RecoveryDecision.objects.filter(
            job_id=decision.job_id,
            status=DecisionStatus.RECOVERED,
            created_at__lt=decision.created_at,
        )
        .order_by("-created_at", "-pk")
        .values_list("plan", flat=True)
        .first()
    )
    return earlier or job.scenario.get("plan")


# --- the cost model against what happened ----------------------------------------------------

MEASURED_LABELS = {
    "transition_s": "Transition: from the fault to every agent's first step, without the wait "
    "for an operator",
    "step_time_s": f"Step time after: the job's, {accuracy.SETTLE_S:.0f} s after it recovered",
}


def estimate_rows(decision: RecoveryDecision) -> list[dict[str, Any]]:
    """A recovered decision's estimates beside what was measured (``incidents.accuracy``):
    stored once settled; before, the transition from its phases and the step time pending."""
    if decision.status != DecisionStatus.RECOVERED:
        return []
    record = decision.accuracy
    if record is None:
        estimated = accuracy.estimates(decision) or {}
        record = {
            "transition_s": {
                "estimated": estimated.get("transition_s"),
                "measured": accuracy.measured_transition(decision),
            },
            "step_time_s": {"estimated": estimated.get("step_time_s"), "measured": None},
        }
    return [
        {
            "what": MEASURED_LABELS[metric],
            "estimated": record[metric]["estimated"],
            "measured": record[metric]["measured"],
            "error": accuracy.error(record, metric),
        }
        for metric in accuracy.METRICS
    ]


def model_error(decisions: list[RecoveryDecision]) -> str:
    """The cost model's running error over ``decisions`` that were measured, in a sentence."""
    records = [d.accuracy for d in decisions if d.accuracy is not None]
    summary = accuracy.running_error(records)
    if not summary:
        return ""
    said = []
    for metric, name in (("transition_s", "transitions"), ("step_time_s", "step times")):
        if metric in summary:
            e = summary[metric]
            said.append(
                f"{name} {'longer' if e['median'] >= 0 else 'shorter'} than estimated by "
                f"{abs(e['median']):.0%} (median of {e['n']}; mean absolute error "
                f"{e['mean_abs']:.0%})"
            )
    return "The cost model against what happened: " + "; ".join(said) + "."
