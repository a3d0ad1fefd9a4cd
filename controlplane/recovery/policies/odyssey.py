"""Odyssey's adaptive policy: rerouting or dynamic parallelism, whichever eq. 8 prefers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.dynamic import plan_dynamic
from controlplane.recovery.policies.rerouting import plan_rerouting


def choose_family(policy: str, state: ClusterState, *, exhaustive: bool = False) -> Candidate:
    """Compare the best rerouting and the best re-plan by eq. 8 and keep the better one."""
    options = [
        plan_rerouting(policy, state),
        plan_dynamic(policy, state, exhaustive=exhaustive),
    ]
    feasible = [c for c in options if c.feasible]
    if not feasible:
        reasons = "; ".join(
            f"{c.plan.family if c.plan else family}: {c.reason}"
            for c, family in zip(options, ("rerouting", "dynamic"), strict=True)
        )
        return Candidate.infeasible(policy, reasons)
    best = max(feasible, key=lambda c: c.objective)
    other = next(c for c in options if c is not best)
    family = best.plan.family.value if best.plan else "?"
    note = f"{family} chosen by eq. 8 ({best.objective:.4g} samples/s effective) over " + (
        f"{other.objective:.4g}" if other.feasible else f"an infeasible option: {other.reason}"
    )
    return replace(best, reason=note)


@dataclass(frozen=True)
class OdysseyPolicy:
    """Adaptive selection between data rerouting and dynamic parallelism at every failure."""

    exhaustive: bool = False
    name: ClassVar[str] = "odyssey"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [choose_family(self.name, state, exhaustive=self.exhaustive)]
