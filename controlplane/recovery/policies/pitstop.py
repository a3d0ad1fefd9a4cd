"""Pitstop's adaptive policy: eq. 8 over every family's best candidate, spares included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.codes import Option
from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.base import SteadyCosts
from controlplane.recovery.policies.dynamic import chosen_among, plan_dynamic
from controlplane.recovery.policies.flashrecovery import (
    RESTART_S,
    RESTORE_SETUP_S,
    plan_flashrecovery,
)
from controlplane.recovery.policies.rerouting import plan_rerouting

# What pitstop weighs at a failure; the chosen candidate names its option (``Candidate.option``).
OPTIONS = (Option.REROUTE, Option.SWAP, Option.REPLAN_WITH_SPARES, Option.REPLAN)


def choose_any_family(
    policy: str,
    state: ClusterState,
    failure: Failure,
    *,
    exhaustive: bool = False,
    swap_restart_s: float = RESTART_S,
    swap_restore_setup_s: float = RESTORE_SETUP_S,
) -> Candidate:
    """The best of four options by Odyssey's own eq. 8, where Odyssey weighs only two.

    * rerouting onto live peers (Odyssey's first family);
    * FlashRecovery's swap of the broken groups for spares, restored from a live replica (the
      same plan and step time, no re-plan: one stage's state moves, and an in-place restart);
    * re-planning over the survivors *and the spares* (Odyssey's setting is backup-free, so
      ``odyssey`` leaves a cluster's spares idle; ``odyssey_spares`` re-plans onto them too);
    * re-planning over the surviving groups of the job (Odyssey's second family).

    The swap is what Odyssey with spares lacks: it wins when a re-plan's restart costs more than
    the in-place one, or when rerouting is slow and a re-plan expensive
    (docs/reproduction/odyssey.md measures where). Oobleck's template re-plans are a subset of the
    asymmetric
    re-plans (and lose whole nodes); checkpoint restart onto spares gives the swap's plan at a
    higher cost: neither can win, so neither is asked. The cheap options are scored first, then
    the re-plan with spares (the larger pool usually steps faster), then the one without: each
    re-plan is placed only when its eq. 8 bound can beat the best option so far (the dominance
    cut of ``plan_dynamic``).
    """
    options = [
        (Option.REROUTE, plan_rerouting(policy, state)),
        (
            Option.SWAP,
            plan_flashrecovery(
                policy,
                state,
                failure,
                restart_s=swap_restart_s,
                restore_setup_s=swap_restore_setup_s,
            ),
        ),
    ]
    idle_spares = set(state.cluster.spare_ids) & (state.healthy - state.plan.devices())
    replans = [(Option.REPLAN_WITH_SPARES, True)] if idle_spares else []
    replans.append((Option.REPLAN, False))
    for label, include_spares in replans:
        beat = 0.0 if exhaustive else best_objective(options)
        replan = plan_dynamic(
            policy, state, exhaustive=exhaustive, beat=beat, include_spares=include_spares
        )
        options.append((label, replan))
    return chosen_among(policy, options, "rerouting, swapping onto spares and re-planning")


def best_objective(options: list[tuple[Option, Candidate]]) -> float:
    """The highest eq. 8 objective among the feasible options (0 when none is)."""
    return max((c.objective for _, c in options if c.feasible), default=0.0)


@dataclass(frozen=True)
class PitstopPolicy(SteadyCosts):
    """Odyssey's eq. 8 applied to rerouting, re-planning with or without spares, and swapping.

    The swap costs what FlashRecovery's do (``flashrecovery``'s options of the same names).
    """

    exhaustive: bool = False
    swap_restart_s: float = RESTART_S
    swap_restore_setup_s: float = RESTORE_SETUP_S
    name: ClassVar[str] = "pitstop"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            choose_any_family(
                self.name,
                state,
                failure,
                exhaustive=self.exhaustive,
                swap_restart_s=self.swap_restart_s,
                swap_restore_setup_s=self.swap_restore_setup_s,
            )
        ]
