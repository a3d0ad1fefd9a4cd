"""FlashRecovery (002): spare groups in place, state copied from a live data-parallel replica."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
    TransitionCost,
)
from controlplane.recovery.policies.base import SteadyCosts, interrupted_work_s, score, unchanged
from controlplane.recovery.policies.replacement import (
    Copy,
    Replacement,
    StageKey,
    broken_stages,
    copy_time_s,
    replace_stages,
)
from controlplane.recovery.policies.rerouting import reroute
from controlplane.recovery.policies.restart import reusable

# FlashRecovery §6's measured costs: the in-place restart whatever the scale (Table III: 78-116 s,
# median 90; 85 s plus the restore reproduces it), and the ~1 s setup of the peer-to-peer copy.
RESTART_S = 85.0
RESTORE_SETUP_S = 1.0

# a tensor-parallel shard of a layer range: (layers, rank within the group)
Shard = tuple[tuple[int, int], int]


def shard_holders(state: ClusterState) -> dict[Shard, list[int]]:
    """Healthy devices holding each shard of the current plan.

    Survivors of a broken group count: FlashRecovery §3 stops and resets them in place, and their
    weights survive the reset because they are the source of the restore. Rerouted stages hold
    nothing of their own.
    """
    holders: dict[Shard, list[int]] = {}
    for _, _, stage in state.plan.stages():
        if stage.rerouted:
            continue
        for rank, device in enumerate(stage.devices):
            if device not in state.failed:
                holders.setdefault((stage.layers, rank), []).append(device)
    return holders


def in_place(state: ClusterState, failure: Failure, broken: Sequence[StageKey]) -> Replacement:
    """The same plan on the same devices, each broken stage's group its own replacement: the
    processes of a process's fault (crash, hang, NaN: this failure's, or an earlier one's on a
    node still heard, ``state.restartable``) start again where they ran. InfeasiblePlan
    (``NO_SPARE``) when a device of the plan is down for another reason."""
    down = state.failed & set(state.plan.devices())
    lost = sorted(down - reusable(state, failure))
    if lost:
        raise InfeasiblePlan(
            f"devices {lost} are down, not their processes: a replica cannot start again there",
            decline=Code.NO_SPARE,
        )
    plan = state.plan
    groups = {(p, s): plan.pipelines[p].stages[s].devices for p, s in broken}
    return Replacement(plan=plan, groups=groups)


def plan_flashrecovery(
    policy: str,
    state: ClusterState,
    failure: Failure,
    *,
    restart_s: float = RESTART_S,
    restore_setup_s: float = RESTORE_SETUP_S,
    same_devices: bool = False,
) -> Candidate:
    """The same plan on spare groups (or, ``same_devices``, on the devices whose processes
    failed, started again: ``in_place``), each new device filled from a replica of its shard.

    Checks run in FlashRecovery §6's order (runtime support is assumed of every Pitstop job):
    spares, then a live replica of every lost shard, then whether the replicas can be trusted.
    """
    broken = broken_stages(state)
    if not broken:
        return unchanged(policy, state)
    try:
        if same_devices:
            replacement = in_place(state, failure, broken)
        else:
            replacement = replace_stages(state, broken)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))
    unreplicated = _without_replica(policy, state, broken)
    if unreplicated is not None:
        return unreplicated
    if failure.kind is FailureKind.NAN:
        # FlashRecovery §5: a NaN may already have reached every replica through the gradient
        # all-reduce, and copying it would restore the fault.
        return Candidate.declined(
            policy,
            Code.UNTRUSTED_STATE,
            "a NaN fault may have spread to the data-parallel replicas; restore from a checkpoint",
        )
    return _restored(
        policy,
        state,
        replacement,
        restart_s=restart_s,
        restore_setup_s=restore_setup_s,
        detection_s=state.assumptions.detection_s,
    )


def grow_flashrecovery(
    policy: str,
    state: ClusterState,
    *,
    restart_s: float = RESTART_S,
    restore_setup_s: float = RESTORE_SETUP_S,
) -> list[Candidate]:
    """A running job's rerouted stages given groups of their own again, from the spares (a
    lost node's devices back, a replacement node), each new device filled from a live replica:
    the job grows back towards its plan's width, as many stages (in plan order) as the spares
    make whole groups for. Nothing failed, so nothing is detected; the survivors leave the
    step they are in. No candidate when no stage is rerouted."""
    every = tuple((p, s) for p, s, stage in state.plan.stages() if stage.rerouted)
    if not every:
        return []
    groups = len(state.spare_devices()) // state.plan.tp
    rerouted = every[: max(groups, 1)]  # none: declined below, naming the shortage
    try:
        replacement = replace_stages(state, rerouted)
    except InfeasiblePlan as exc:
        return [Candidate.declined(policy, exc.decline, str(exc))]
    unreplicated = _without_replica(policy, state, rerouted)
    if unreplicated is not None:
        return [unreplicated]
    if len(rerouted) < len(every):
        # the stages still rerouted borrow the grown replicas too
        spread = reroute(replacement.plan, state.failed)
        assert not isinstance(spread, str)  # every stage has a live replica: it did before
        replacement = Replacement(plan=spread, groups=replacement.groups)
    return [
        _restored(
            policy,
            state,
            replacement,
            restart_s=restart_s,
            restore_setup_s=restore_setup_s,
            detection_s=0.0,
        )
    ]


def _without_replica(
    policy: str, state: ClusterState, broken: Sequence[StageKey]
) -> Candidate | None:
    """Declined when a broken stage has a tensor-parallel rank with no live replica to copy."""
    plan = state.plan
    holders = shard_holders(state)
    for p, s in broken:
        layers = plan.pipelines[p].stages[s].layers
        for rank in range(plan.tp):
            if not holders.get((layers, rank)):
                return Candidate.declined(
                    policy,
                    Code.NO_LIVE_REPLICA,
                    f"layers {list(layers)} (stage {s} of pipeline {p}) have no "
                    f"live data-parallel replica of tensor-parallel rank {rank}; "
                    "restore from a checkpoint",
                )
    return None


def _restored(
    policy: str,
    state: ClusterState,
    replacement: Replacement,
    *,
    restart_s: float,
    restore_setup_s: float,
    detection_s: float,
) -> Candidate:
    """``replacement``'s plan, each new group's state copied from live replicas."""
    # FlashRecovery §3: each replaced rank pulls from a peer with the same (stage, TP rank);
    # spread the copies over the holders, then prefer the fastest link and the lower id.
    plan = state.plan
    tp = plan.tp
    holders = shard_holders(state)
    cluster = state.cluster
    sends: Counter[int] = Counter()
    copies = []
    for (p, s), group in replacement.groups.items():
        layers = plan.pipelines[p].stages[s].layers
        nbytes = state.profile.state_bytes(*layers) / tp
        for rank, target in enumerate(group):
            source = min(
                holders[(layers, rank)],
                key=lambda d: (sends[d], -cluster.bandwidth_bytes_per_s(d, target), d),
            )
            sends[source] += 1
            copies.append(Copy(source=source, target=target, nbytes=nbytes))
    try:
        restore_s = copy_time_s(cluster, copies)
    except InfeasiblePlan as exc:
        return Candidate.declined(policy, exc.decline, str(exc))
    transition = TransitionCost(
        detection_s=detection_s,
        # FlashRecovery §6: T_restore = max_r bytes_state(r)·k / bw(src(r) → r) + ~1 s setup,
        # bytes_state = weights + optimizer state (m_p + m_o; gradients are not copied)
        weight_transfer_s=restore_s + restore_setup_s,
        # FlashRecovery §3, §6: survivors reset in place, only the new ranks start, the ranktable
        # is read from a shared file: the restart does not grow with the number of devices
        restart_s=restart_s,
        # FlashRecovery §3: at most the interrupted step is redone (k0 = 0, no checkpoint);
        # detection and that step are charged as for every policy
        lost_work_s=interrupted_work_s(state),
    )
    return score(policy, state, replacement.plan, transition)


@dataclass(frozen=True)
class FlashRecoveryPolicy(SteadyCosts):
    """Swap failed groups for spares in place and restore them from a live replica in one step."""

    restart_s: float = RESTART_S  # in-place restart (FlashRecovery §6)
    restore_setup_s: float = RESTORE_SETUP_S  # setup of the peer-to-peer state copy
    # the failed processes start again on their own devices, no spare (a process's fault:
    # worker_agent.elastic under pitstop-run --elastic); off, spares as in the paper
    same_devices: bool = False
    name: ClassVar[str] = "flashrecovery"
    grows: ClassVar[bool] = True

    @property
    def restarts_in_place(self) -> bool:
        """May run again on a process's failed device (``same_devices``)."""
        return self.same_devices

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        return [
            plan_flashrecovery(
                self.name,
                state,
                failure,
                restart_s=self.restart_s,
                restore_setup_s=self.restore_setup_s,
                same_devices=self.same_devices,
            )
        ]

    def grow(self, state: ClusterState) -> list[Candidate]:
        return grow_flashrecovery(
            self.name, state, restart_s=self.restart_s, restore_setup_s=self.restore_setup_s
        )
