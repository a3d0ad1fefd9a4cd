"""Odyssey's adaptive policy: rerouting or dynamic parallelism, whichever eq. 8 prefers."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.recovery.codes import Option
from controlplane.recovery.model import Candidate, ClusterState, Failure
from controlplane.recovery.policies.base import SteadyCosts
from controlplane.recovery.policies.dynamic import chosen_among, plan_dynamic
from controlplane.recovery.policies.rerouting import plan_rerouting


def choose_family(
    policy: str,
    state: ClusterState,
    *,
    exhaustive: bool = False,
    dominance_cut: bool = True,
    use_spares: bool = False,
) -> Candidate:
    """Compare the best rerouting and the best re-plan by eq. 8 and keep the better one.

    With ``dominance_cut``, a re-plan whose eq. 8 bound cannot beat rerouting is not placed: the
    choice is the same, and at thousands of devices placing it is most of the decision's time.
    With ``use_spares`` the re-plan may place work on the spare devices too; Odyssey's own
    setting is backup-free, so by default a cluster's spares stay idle.
    """
    rerouting = plan_rerouting(policy, state)
    beat = rerouting.objective if dominance_cut and not exhaustive and rerouting.feasible else 0.0
    replan = plan_dynamic(
        policy, state, exhaustive=exhaustive, beat=beat, include_spares=use_spares
    )
    options = [(Option.REROUTE, rerouting), (Option.REPLAN, replan)]
    return chosen_among(policy, options, "rerouting and re-planning")


@dataclass(frozen=True)
class OdysseyPolicy(SteadyCosts):
    """Adaptive selection between data rerouting and dynamic parallelism at every failure.

    ``use_spares`` lets the re-plan use spare devices, so that Odyssey can be compared with
    policies that use spares on the same cluster; it is then registered as ``odyssey_spares``.
    """

    exhaustive: bool = False
    dominance_cut: bool = True
    use_spares: bool = False

    @property
    def name(self) -> str:
        return "odyssey_spares" if self.use_spares else "odyssey"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            choose_family(
                self.name,
                state,
                exhaustive=self.exhaustive,
                dominance_cut=self.dominance_cut,
                use_spares=self.use_spares,
            )
        ]
