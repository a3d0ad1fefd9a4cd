"""Pitstop's adaptive policy: eq. 8 over every family's best candidate, spares included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.dynamic import DOMINATED, chosen_among, plan_dynamic
from controlplane.recovery.policies.flashrecovery import plan_flashrecovery
from controlplane.recovery.policies.rerouting import plan_rerouting

# The options, as a chosen candidate's reason starts: which one eq. 8 picked at a failure.
REROUTE = "rerouting"
SWAP = "swap onto spares"
REPLAN = "re-plan over survivors"
REPLAN_WITH_SPARES = "re-plan with spares"
OPTIONS = (REROUTE, SWAP, REPLAN, REPLAN_WITH_SPARES)


def choose_any_family(
    policy: str, state: ClusterState, failure: Failure, *, exhaustive: bool = False
) -> Candidate:
    """The best of four options by Odyssey's own eq. 8, where Odyssey weighs only two.

    * rerouting onto live peers (Odyssey's first family);
    * FlashRecovery's swap of the broken groups for spares, restored from a live replica (the
      same plan and step time, no re-plan: one stage's state moves, and an in-place restart);
    * re-planning over the survivors *and the spares* (Odyssey's setting is backup-free, so
      ``odyssey`` leaves a cluster's spares idle; ``odyssey_spares`` re-plans onto them too);
    * re-planning over the surviving groups of the job (Odyssey's second family).

    The swap is what Odyssey with spares lacks: it wins when a re-plan's restart costs more than
    the in-place one, or when rerouting is slow and a re-plan expensive (docs/reproduction/
    odyssey.md measures where). Oobleck's template re-plans are a subset of the asymmetric
    re-plans (and lose whole nodes); checkpoint restart onto spares gives the swap's plan at a
    higher cost: neither can win, so neither is asked. The cheap options are scored first, then
    the re-plan with spares (the larger pool usually steps faster), then the one without: each
    re-plan is placed only when its eq. 8 bound can beat the best option so far (the dominance
    cut of ``plan_dynamic``).
    """
    options = [
        (REROUTE, plan_rerouting(policy, state)),
        (SWAP, plan_flashrecovery(policy, state, failure)),
    ]
    idle_spares = set(state.cluster.spare_ids) & (state.healthy - state.plan.devices())
    replans = [(REPLAN_WITH_SPARES, True)] if idle_spares else []
    replans.append((REPLAN, False))
    for label, include_spares in replans:
        beat = 0.0 if exhaustive else best_objective(options)
        replan = plan_dynamic(
            policy, state, exhaustive=exhaustive, beat=beat, include_spares=include_spares
        )
        options.append((label, replan))
    feasible = [(label, c) for label, c in options if c.feasible]
    if not feasible:
        reasons = "; ".join(c.reason for _, c in options if not c.reason.startswith(DOMINATED))
        return Candidate.infeasible(policy, reasons or "no option is feasible")
    # ties keep the earlier option, the one that disturbs the job least
    label, best = max(feasible, key=lambda option: option[1].objective)
    others = ", ".join(f"{name} {c.objective:.4g}" for name, c in feasible if c is not best)
    note = (
        f"{label} chosen by eq. 8 ({best.objective:.4g} samples/s effective) over "
        f"{len(options) - 1} other options (feasible: {others or 'none'})"
    )
    return chosen_among(best, (c for _, c in options), note)


def best_objective(options: list[tuple[str, Candidate]]) -> float:
    """The highest eq. 8 objective among the feasible options (0 when none is)."""
    return max((c.objective for _, c in options if c.feasible), default=0.0)


@dataclass(frozen=True)
class PitstopPolicy:
    """Odyssey's eq. 8 applied to rerouting, re-planning with or without spares, and swapping."""

    exhaustive: bool = False
    name: ClassVar[str] = "pitstop"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [choose_any_family(self.name, state, failure, exhaustive=self.exhaustive)]
