"""Coordinated restart of every rank from the script's own checkpoint, as torchrun restarts.

For a job whose ranks are an unmodified script under the launcher (``worker_agent launch``):
nothing survives in memory, so every candidate stops every rank and starts the script again, and
the script reloads its last checkpoint. Where it runs again:

- **in place**, on the same devices, when the fault was a process's (``crash``, ``hang``,
  ``nan``): the device is still there, as torchrun's ``--max-restarts`` assumes. Only devices
  down by a process's fault (this failure's, or ``ClusterState.restartable``: an earlier one's,
  such as the peers a rank's death took down with it) may be down in the plan: a device down
  for another reason (a node lost, one that never joined) is not reused while it is down.
  Once its node joins again (the lost host restarted, or a replacement in its place) the
  device is up, and the whole world restarts in place with it.
- on **spares**, the broken replicas' devices swapped for idle ones (``replacement``).
- with ``shrink``, on the **surviving replicas** alone, the data-parallel world made smaller
  (torchrun's ``--nnodes MIN:MAX``), never below ``min_replicas`` (the launcher sets MIN's);
  the global batch is kept by the survivors' micro-batches.

Each pays the restart (``FullRestart``), the checkpoint's load and the steps since it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.recovery.codes import Code
from controlplane.recovery.errors import InfeasiblePlan
from controlplane.recovery.estimator import estimate_step_time
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    Family,
    Pipeline,
    TransitionCost,
)
from controlplane.recovery.policies.base import (
    SteadyCosts,
    interrupted_work_s,
    score,
    unchanged,
)
from controlplane.recovery.policies.checkpoint import FullRestart, checkpoint_load_s, rollback_s
from controlplane.recovery.policies.replacement import broken_stages, replace_stages

# Faults of a process, not of its device: the device can run the restarted process.
PROCESS_FAULTS = frozenset({FailureKind.CRASH, FailureKind.HANG, FailureKind.NAN})


def reusable(state: ClusterState, failure: Failure) -> frozenset[int]:
    """Devices whose process may start again where it ran: those of this failure when it is a
    process's fault (crash, hang, NaN), and those of an earlier one on a node still heard
    (``state.restartable``)."""
    mine = failure.devices if failure.kind in PROCESS_FAULTS else frozenset()
    return mine | state.restartable


def shrunk(plan: ExecutionPlan, failed: frozenset[int]) -> ExecutionPlan | None:
    """The replicas (pipelines) of ``plan`` that lost no device, the global batch's
    micro-batches shared out among them again; None when none is left."""
    kept = [p for p in plan.pipelines if failed.isdisjoint(d for s in p.stages for d in s.devices)]
    if not kept:
        return None
    total = plan.micro_batches
    share, extra = divmod(total, len(kept))
    return ExecutionPlan(
        pipelines=tuple(
            Pipeline(stages=p.stages, micro_batches=share + (1 if i < extra else 0))
            for i, p in enumerate(kept)
        ),
        family=Family.DYNAMIC,
    )


@dataclass(frozen=True)
class RestartPolicy(SteadyCosts):
    """Restart every rank from the script's checkpoint: in place, on spares, or shrunk.

    In place only for a process's fault (crash, hang, NaN); ``shrink`` also offers the world
    made of the replicas that lost nothing. The restart is ``FullRestart``'s.
    """

    shrink: bool = False
    min_replicas: int = 1  # shrink no further (the launcher's --nnodes MIN × --nproc-per-node)
    restart_s_per_device: float = FullRestart.s_per_device
    restart_offset_s: float = FullRestart.offset_s
    restart_min_s: float = FullRestart.min_s
    rolls_back: ClassVar[bool] = True
    restarts_in_place: ClassVar[bool] = True  # may run again on a process's failed device

    @property
    def name(self) -> str:
        return "restart_shrink" if self.shrink else "restart"

    def propose(self, state: ClusterState, failure: Failure) -> list[Candidate]:
        restart = FullRestart(self.restart_s_per_device, self.restart_offset_s, self.restart_min_s)
        plan_devices = set(state.plan.devices())
        candidates: list[Candidate] = []
        # in place: only devices down by a process's fault (this failure's, or an earlier
        # one's on a node still heard: ``state.restartable``) may be down in the plan; the
        # failure's other devices may be up again (a node joined in a lost one's place)
        if state.failed & plan_devices <= reusable(state, failure):
            candidates.append(self._restart(state, state.plan, restart))
        broken = broken_stages(state)
        if broken:
            try:
                replacement = replace_stages(state, broken)
            except InfeasiblePlan as exc:  # too few spares
                candidates.append(Candidate.declined(self.name, exc.decline, str(exc)))
            else:
                candidates.append(self._restart(state, replacement.plan, restart))
        if self.shrink:
            smaller = shrunk(state.plan, state.failed)
            if smaller is None:
                note = "every replica lost a device: no smaller world is left"
                candidates.append(Candidate.declined(self.name, Code.NO_LIVE_REPLICA, note))
            elif smaller.dp < self.min_replicas:
                note = f"{smaller.dp} replicas would be left, fewer than {self.min_replicas}"
                candidates.append(Candidate.declined(self.name, Code.TOO_FEW_REPLICAS, note))
            elif smaller.dp < state.plan.dp:
                candidates.append(self._restart(state, smaller, restart))
        if not candidates:  # the fault hit no device of the plan: nothing to restart
            candidates.append(unchanged(self.name, state))
        return candidates

    def _restart(self, state: ClusterState, plan: ExecutionPlan, restart: FullRestart) -> Candidate:
        assumptions = state.assumptions
        step_s = estimate_step_time(state.profile, state.cluster, state.plan)
        transition = TransitionCost(
            detection_s=assumptions.detection_s,
            weight_transfer_s=checkpoint_load_s(state.profile, plan, assumptions),
            restart_s=restart.seconds(len(plan.devices())),
            lost_work_s=interrupted_work_s(state) + rollback_s(state, step_s),
        )
        return score(self.name, state, plan, transition)
