"""Pitstop's adaptive policy: eq. 8 over every family's best candidate, spares included."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.dynamic import DOMINATED, plan_dynamic
from controlplane.recovery.policies.flashrecovery import plan_flashrecovery
from controlplane.recovery.policies.rerouting import plan_rerouting


def choose_any_family(
    policy: str, state: ClusterState, failure: Failure, *, exhaustive: bool = False
) -> Candidate:
    """The best of four options by Odyssey's own eq. 8, where Odyssey weighs only two.

    * rerouting onto live peers (Odyssey's first family);
    * re-planning over the surviving groups of the job (Odyssey's second family);
    * re-planning over the survivors *and the spares* (Odyssey never touches a spare: its
      setting is backup-free, so a cluster that has spares leaves them idle under Odyssey);
    * FlashRecovery's swap of the broken groups for spares, restored from a live replica (the
      same plan and step time, no re-plan; transfer of one stage's state plus its restart).

    Oobleck's template re-plans are a subset of the asymmetric re-plans (and lose whole nodes);
    checkpoint restart onto spares gives the same plan as the swap at a higher cost: neither can
    win, so neither is asked. Cheap options are scored first, so the re-plans are placed only
    when their eq. 8 bound can beat them (the dominance cut of ``plan_dynamic``).
    """
    cheap = [plan_rerouting(policy, state)]
    if state.spare_devices():
        cheap.append(plan_flashrecovery(policy, state, failure))
    beat = 0.0 if exhaustive else max((c.objective for c in cheap if c.feasible), default=0.0)
    options = [*cheap, plan_dynamic(policy, state, exhaustive=exhaustive, beat=beat)]
    if any(d in state.healthy for d in state.cluster.spare_ids):
        options.append(
            plan_dynamic(policy, state, exhaustive=exhaustive, beat=beat, include_spares=True)
        )
    feasible = [c for c in options if c.feasible]
    if not feasible:
        reasons = "; ".join(c.reason for c in options if not c.reason.startswith(DOMINATED))
        return Candidate.infeasible(policy, reasons or "no option is feasible")
    # ties keep the earlier option: the one that disturbs the job least
    best = max(feasible, key=lambda c: c.objective)
    family = best.plan.family.value if best.plan else "?"
    spares = len(best.plan.devices() & set(state.cluster.spare_ids)) if best.plan else 0
    others = ", ".join(f"{c.objective:.4g}" for c in feasible if c is not best) or "none"
    note = (
        f"{family} on {spares} spare devices chosen by eq. 8 ({best.objective:.4g} samples/s "
        f"effective) over {len(options) - 1} other options (feasible: {others})"
    )
    return replace(best, reason=note)


@dataclass(frozen=True)
class PitstopPolicy:
    """Odyssey's eq. 8 applied to rerouting, re-planning with or without spares, and swapping."""

    exhaustive: bool = False
    name: ClassVar[str] = "pitstop"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [choose_any_family(self.name, state, failure, exhaustive=self.exhaustive)]
