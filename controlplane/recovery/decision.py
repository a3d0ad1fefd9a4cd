"""The core's one decision: ask the enabled policies for candidates and choose by eq. 8.

Every caller that recovers a job goes through ``decide``: the command line's ``plan``, the
simulator at each failure, and the control plane's planning task. ``grow`` is its counterpart
when devices come back to a job that runs without them. The candidates it returns are
ready for the codec (``codec.decision_to_dict``), declined ones included, so an operator sees
why each policy that did not apply declined.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.recovery import collector
from controlplane.recovery import policies as registry
from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.base import Policy, unchanged
from controlplane.recovery.superseding import checkpoint, watching

# Options for each policy by name, as its options class takes them (``policies.describe``).
PolicyOptions = Mapping[str, Mapping[str, object]]


@dataclass(frozen=True, slots=True)
class Decision:
    """Every candidate for one failure, in the order the policies were asked, and the choice.

    ``chosen`` indexes the feasible candidate with the highest eq. 8 objective (the first on
    ties, so the order of ``policies`` breaks them); None when no policy can recover the job.
    ``search_s`` is the measured wall time the policies took.
    """

    failure: Failure
    candidates: tuple[Candidate, ...]
    chosen: int | None
    search_s: float

    @property
    def best(self) -> Candidate | None:
        return None if self.chosen is None else self.candidates[self.chosen]


def best_index(candidates: Sequence[Candidate]) -> int | None:
    """Index of the feasible candidate with the highest objective (first one on ties)."""
    best: int | None = None
    for i, c in enumerate(candidates):
        if c.feasible and (best is None or c.objective > candidates[best].objective):
            best = i
    return best


def resolve(names: Sequence[str | Policy], options: PolicyOptions | None = None) -> list[Policy]:
    """Policy objects for registry names (built with their options) or ready-made policies.

    Options for a policy that is not asked, or that its options class does not take, are
    refused (``InvalidOption``), so a typo cannot silently fall back to a default.
    """
    options = options or {}
    asked = {name for name in names if isinstance(name, str)}
    for name in options:
        if name not in asked:
            raise registry.InvalidOption(
                f"options given for policy {name!r}, which is not asked", field=f"options.{name}"
            )
    return [
        registry.get(name, **options.get(name, {})) if isinstance(name, str) else name
        for name in names
    ]


def decide(
    state: ClusterState,
    failure: Failure,
    *,
    policies: Sequence[str | Policy],
    options: PolicyOptions | None = None,
    stale: Callable[[], bool] | None = None,
) -> Decision:
    """Every policy's candidates for ``failure`` on ``state``, and the best one by eq. 8.

    ``state.failed`` lists every device that is down now (``state.with_failure`` adds a new
    failure's; a device repaired since the failure is no longer down). ``policies`` are registry
    names or policy objects (the simulator keeps one per job); ``options`` go to the named ones.
    ``stale``, asked before each policy after the first and within the long ones
    (``superseding``): True raises ``Superseded`` (the failure grew meanwhile, and its caller
    decides again with the devices it has now).
    """
    asked = resolve(policies, options)
    started = time.perf_counter()
    candidates: list[Candidate] = []
    with collector.paused(), watching(stale):
        for i, policy in enumerate(asked):
            if i:
                checkpoint(f"after {i} of {len(asked)} policies")
            candidates.extend(policy.propose(state, failure))
    return Decision(
        failure=failure,
        candidates=tuple(candidates),
        chosen=best_index(candidates),
        search_s=time.perf_counter() - started,
    )


# The candidate that keeps the running plan, first in a decision to grow.
KEEP = "keep"


def grow(
    state: ClusterState,
    failure: Failure,
    *,
    policies: Sequence[str | Policy],
    options: PolicyOptions | None = None,
) -> Decision:
    """Whether a running job takes devices back (a lost node's own, or a replacement's): the
    running plan kept (``KEEP``, first, at no cost) and every policy's growth candidates
    (``Policy.grow``), chosen by eq. 8 as for a failure. A growth is chosen only when its
    objective beats keeping the plan (ties keep it): what the job gains over the next
    inter-fault interval pays for the transition that brings the devices in.

    ``state.failed`` lists the devices still down; those back are healthy and not in the
    running plan (spares). ``failure`` is the one the job lost them to, for the record.
    """
    asked = resolve(policies, options)
    started = time.perf_counter()
    candidates = [unchanged(KEEP, state)]
    with collector.paused():
        for policy in asked:
            candidates.extend(policy.grow(state))
    return Decision(
        failure=failure,
        candidates=tuple(candidates),
        chosen=best_index(candidates),
        search_s=time.perf_counter() - started,
    )
