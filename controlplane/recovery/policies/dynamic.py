"""Dynamic parallelism: re-plan DP and PP over every surviving device group (Odyssey Alg. 1)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from controlplane.recovery import replicas
from controlplane.recovery.codes import Caveat, Code, Option
from controlplane.recovery.estimator.time import (
    gradient_sync_floor_s,
    pipeline_floor_s,
    split_sync_floor_s,
)
from controlplane.recovery.model import Candidate, ClusterState, Failure, Layers, TransitionCost
from controlplane.recovery.objective import expected_time_to_failure_s
from controlplane.recovery.planner import (
    PlanShape,
    dp_window,
    every_shape_reaches,
    realize,
    search,
    usable_groups,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score
from controlplane.recovery.superseding import checkpoint

# Shapes scored with their weight transfer once the fastest is known. The window they come from
# is exact (see plan_dynamic); the caps bound the work when many shapes tie, as at scale, and a
# candidate they cut short says so (Caveat.SEARCH_INCOMPLETE).
WINDOW_NODE_BUDGET = 50_000
# At 16,384 groups a placement takes 0.3 s: with the window search proven where its node budget
# used to stop it at three shapes, eight would triple a control plane's planning at 2,048 nodes.
WINDOW_MIN_SCORED = 3
# Device groups placed in all, over the shapes scored (each placement costs O(groups)).
WINDOW_PLACED_GROUPS = 8_192


class _Floors(threading.local):
    splits = True


_FLOORS = _Floors()


@contextlib.contextmanager
def without_split_floors() -> Iterator[None]:
    """Within it, this thread's re-plans place every shape the uniform sync floor lets through
    and search for the others, as they did before a shape's own splits and the longest
    pipeline's sends bounded them: for the tests that hold the choices equal and the benchmark
    that compares their speed."""
    earlier, _FLOORS.splits = _FLOORS.splits, False
    try:
        yield
    finally:
        _FLOORS.splits = earlier


def plan_dynamic(
    policy: str,
    state: ClusterState,
    *,
    exhaustive: bool = False,
    beat: float = 0.0,
    include_spares: bool = False,
) -> Candidate:
    """The re-plan with the best eq. 8 objective, weight transfer included.

    Eq. 8 is at most ``B/t_step × D/(D + fixed costs)``, so once one shape is scored, only shapes
    whose step time (compute plus a floor on gradient sync) could still beat it need their
    Kuhn-Munkres placement. When even the fastest shape's bound is at most ``beat`` (another
    option's objective), nothing is placed and the candidate is declined as ``Code.DOMINATED``.
    A shape whose pipelines mix layer splits syncs its gradients in rounds; the floor of its own
    splits (``split_sync_floor_s``) rules it out without a placement too, the fastest included,
    and a re-plan none of whose shapes survive that is declined the same way. When every
    shape's slowest pipeline with its sends, plus its gradient sync, is proven too slow
    (``planner.every_shape_reaches``), the other shapes are not searched for at all.
    ``include_spares`` lets the re-plan use the spare devices too.
    """
    count = replicas.usable_group_count(
        state.plan, state.cluster, state.failed, include_spares=include_spares
    )
    # listed when a shape is placed: at scale the count alone often decides (the cut below)
    listed: list[tuple[int, ...]] = []
    if count is None:
        listed = usable_groups(state, include_spares=include_spares)
        count = len(listed)
    if not count:
        return Candidate.declined(policy, Code.NO_DEVICE_GROUP, "no healthy device group left")
    fixed = TransitionCost(
        detection_s=state.assumptions.detection_s,
        search_s=state.assumptions.search_s,
        restart_s=state.assumptions.restart_s,
        lost_work_s=interrupted_work_s(state),
    )
    widths = dp_window(state.plan.dp, count)
    # counted from replicas, every group has tp devices (so has every regrouped one)
    in_groups = sum(len(g) for g in listed) if listed else count * state.plan.tp
    t_state = expected_time_to_failure_s(state.cluster.failure_rate_per_device_hour, in_groups)
    ratio = 1.0 if math.isinf(t_state) else t_state / (t_state + fixed.total_s)
    if beat > 0 and _FLOORS.splits and not exhaustive:
        # Most decisions at scale end here: no shape, whatever its pipelines, can beat ``beat``
        # (the slowest pipeline's sends and the splits' sync prove it), so none is searched.
        cut = state.training.global_batch / beat * ratio
        if every_shape_falls_short(state, count, widths, cut):
            return Candidate.declined(
                policy,
                Code.DOMINATED,
                f"no re-plan beats {beat:.4g} samples/s (every re-plan's slowest pipeline with "
                f"its sends, plus its gradient sync, takes {cut:.4g} s or more)",
            )
    kwargs = {
        "groups": count,
        "tp": state.plan.tp,
        "dp_options": widths,
        "exhaustive": exhaustive,
    }
    checkpoint("before the re-plan's first search")
    first = search(state.profile, state.cluster, state.training, top_k=1, **kwargs)  # type: ignore[arg-type]
    # False once a budget cut a search short or a cap left a shape unscored that could win
    complete = first.complete
    if not first.shapes:
        return Candidate.declined(
            policy,
            Code.NO_FITTING_PLAN,
            f"no plan over {count} device groups fits memory and the batch "
            f"({state.training.micro_batches} micro-batches)",
        )

    # Every shape's step is at least its compute time plus the gradient sync all shapes pay.
    sync_floor_s = min(
        gradient_sync_floor_s(state.profile, state.cluster, groups=count, dp=dp, tp=state.plan.tp)
        for dp in widths
    )

    def at_step(floor_s: float) -> float:
        """Eq. 8 at a step of ``floor_s``, with no weight transfer: a shape's bound."""
        return state.training.global_batch / floor_s * ratio if floor_s > 0 else math.inf

    def objective_bound(shape: PlanShape) -> float:
        """Eq. 8 at the least step the shape can have, with no weight transfer."""
        return at_step(shape.compute_time_s + sync_floor_s)

    # by splits and width: the ring's factor 2(dp - 1)/dp differs between widths
    split_floors: dict[tuple[frozenset[Layers], int], float] = {}

    def shape_bound(shape: PlanShape) -> float:
        """Eq. 8 at the least step of this shape wherever it is placed, with no weight transfer:
        its slowest pipeline with its sends at the fastest link, plus its own layer splits' sync.

        Tighter than ``objective_bound`` where pipelines mix layer splits (their gradient sync
        takes rounds) or a long pipeline's sends weigh, and cheap: it needs no placement.
        """
        if not _FLOORS.splits:
            return math.inf
        key = (shape.splits, len(shape.pipelines))
        if key not in split_floors:
            split_floors[key] = split_sync_floor_s(
                state.profile, state.cluster, key[0], dp=key[1], tp=state.plan.tp
            )
        compute = max(
            pipeline_floor_s(state.profile, state.cluster, p.layers, p.micro_batches, state.plan.tp)
            for p in shape.kinds
        )
        return at_step(max(compute, shape.compute_time_s) + split_floors[key])

    floor_s = first.shapes[0].compute_time_s + sync_floor_s
    bound = at_step(floor_s)
    # an incomplete search has not proven its first shape the fastest, so it bounds nothing
    if complete and bound <= beat:
        return Candidate.declined(
            policy,
            Code.DOMINATED,
            f"no re-plan beats {beat:.4g} samples/s (a re-plan's step is at least "
            f"{floor_s:.4g} s, compute plus gradient sync: at most {bound:.4g})",
        )
    scored: dict[PlanShape, Candidate] = {}

    def evaluate(shape: PlanShape) -> Candidate:
        # the window search finds the first shape again: place and score each shape once
        if shape not in scored:
            checkpoint("before a re-plan's placement")
            if not listed:
                listed.extend(usable_groups(state, include_spares=include_spares))
            plan, placement = realize(state, shape, listed)
            scored[shape] = score(
                policy,
                state,
                plan,
                replace(fixed, weight_transfer_s=placement.transfer_s),
            )
        return scored[shape]

    # The fastest shape is placed first, to bound the others, unless its own splits already
    # show it cannot beat ``beat``: then the others need only beat that (the choice is the same).
    best: Candidate | None = None
    if beat <= 0 or shape_bound(first.shapes[0]) > beat * (1 + 1e-12):
        best = evaluate(first.shapes[0])
        if not best.feasible or best.objective <= 0:
            return with_caveat(best, complete)
    to_beat = beat if best is None else best.objective
    cut = state.training.global_batch / to_beat * ratio
    if (
        best is not None  # else ``to_beat`` is ``beat``, whose proof failed above
        and _FLOORS.splits
        and not exhaustive
        and every_shape_falls_short(state, count, widths, cut)
    ):
        # Every shape's slowest pipeline, sends included, plus its gradient sync takes ``cut`` or
        # more: no shape the window could hold beats the placed one, so none is searched.
        return with_caveat(best, complete)
    # Placements cost O(groups) and more at scale, so at most ``limit`` shapes are scored; the
    # window holds one more, to tell whether the cap left out a shape that could still win.
    limit = None if exhaustive else max(WINDOW_MIN_SCORED, WINDOW_PLACED_GROUPS // count)
    checkpoint("before the re-plan's window search")
    window = search(
        state.profile,
        state.cluster,
        state.training,
        top_k=10**9 if limit is None else limit + 1,
        max_step_time_s=cut * (1 + 1e-9),
        node_budget=None if exhaustive else WINDOW_NODE_BUDGET,
        **kwargs,  # type: ignore[arg-type]
    )
    complete = complete and window.complete
    for index, shape in enumerate(window.shapes):  # fastest first: bounds only fall
        if objective_bound(shape) <= to_beat * (1 + 1e-12):
            break
        if index == limit:
            complete = False  # a shape the cap leaves unscored could still win
            break
        if shape_bound(shape) <= to_beat * (1 + 1e-12):
            continue  # its own splits' sync already rules it out: no placement
        candidate = evaluate(shape)
        if candidate.feasible and candidate.objective > to_beat * (1 + 1e-12):
            best = candidate
            to_beat = candidate.objective
    if best is None:
        declined = Candidate.declined(
            policy,
            Code.DOMINATED,
            f"no re-plan beats {beat:.4g} samples/s (each shape's compute plus its layer "
            f"splits' gradient sync rules it out)",
        )
        return with_caveat(declined, complete)
    return with_caveat(best, complete)


def every_shape_falls_short(
    state: ClusterState, count: int, widths: Sequence[int], step_s: float
) -> bool:
    """Whether every re-plan over ``count`` groups, at every width, takes ``step_s`` or more a
    step once placed, sends and gradient sync included (``planner.every_shape_reaches``)."""
    return all(
        every_shape_reaches(
            state.profile,
            state.cluster,
            state.training,
            groups=count,
            tp=state.plan.tp,
            dp=dp,
            step_s=step_s,
        )
        is True
        for dp in widths
    )


def chosen_among(
    policy: str, options: Sequence[tuple[Option, Candidate]], describe: str
) -> Candidate:
    """The option an adaptive policy chooses by eq. 8, with every option's caveats.

    Ties keep the earlier option, the one that disturbs the job least. A choice is only as proven
    as the searches behind the options it weighed, so it carries all their caveats. When none is
    feasible the policy declines with ``Code.NO_OPTION``, its note giving each option's code
    (a dominated re-plan says nothing more, as something else beat it). ``describe`` names what
    the policy weighs, for the note.
    """
    feasible = [(option, c) for option, c in options if c.feasible]
    if not feasible:
        notes = "; ".join(f"{option}: [{c.code}] {c.note}" for option, c in options)
        return Candidate.declined(policy, Code.NO_OPTION, f"no option applies ({notes})")
    option, best = max(feasible, key=lambda pair: pair[1].objective)
    others = ", ".join(
        f"{name} {c.objective:.4g}" if c.feasible else f"{name} [{c.code}]"
        for name, c in options
        if c is not best
    )
    caveats = tuple(dict.fromkeys(c for _, candidate in options for c in candidate.caveats))
    note = (
        f"{option} chosen by eq. 8 ({best.objective:.4g} samples/s effective) among {describe} "
        f"(others: {others or 'none'})"
    )
    return replace(best, note=note, caveats=caveats, option=option)


def with_caveat(candidate: Candidate, complete: bool) -> Candidate:
    """The candidate, marked when the search behind it did not prove it the best."""
    if complete:
        return candidate
    return replace(candidate, caveats=(*candidate.caveats, Caveat.SEARCH_INCOMPLETE))


@dataclass(frozen=True)
class DynamicPolicy(SteadyCosts):
    """Always re-plan: pay a transition for the fastest step the survivors allow."""

    exhaustive: bool = False
    name: ClassVar[str] = "dynamic"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [plan_dynamic(self.name, state, exhaustive=self.exhaustive)]
