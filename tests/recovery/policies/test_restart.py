"""The launcher's policy, ``restart`` (and ``restart_shrink``): every rank restarted from the
script's checkpoint, in place for a process's fault, on spares, or on the surviving replicas.
The expectations are written from the plan's devices, not from the policy's code."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery import policies
from controlplane.recovery.codes import Code
from controlplane.recovery.model import Failure, FailureKind
from tests.recovery.builders import examples, grid_state

PROCESS = [FailureKind.CRASH, FailureKind.HANG, FailureKind.NAN]
LOST = [FailureKind.NODE_LOST, FailureKind.NEVER_JOINED, FailureKind.LINK]


def devices_of(plan: object) -> set[int]:
    return {d for p in plan.pipelines for s in p.stages for d in s.devices}  # type: ignore[attr-defined]


@settings(max_examples=examples(30), deadline=None)
@given(dp=st.integers(2, 6), pp=st.integers(1, 3), kind=st.sampled_from(PROCESS), data=st.data())
def test_a_process_fault_restarts_every_rank_in_place(
    dp: int, pp: int, kind: FailureKind, data: st.DataObject
) -> None:
    device = data.draw(st.integers(0, dp * pp - 1))
    state = grid_state(layers=6, pp=pp, dp=dp, micro_batches=dp, failed=[device])
    failure = Failure(kind=kind, devices=frozenset([device]))
    (in_place,) = [
        c for c in policies.get("restart").propose(state, failure) if c.plan == state.plan
    ]
    assert in_place.feasible and in_place.policy == "restart"
    t = in_place.transition
    # the restart and the steps since the checkpoint: never free (the test profile holds no
    # state, so the checkpoint loads in no time)
    assert t.restart_s > 0 and t.lost_work_s > 0 and t.weight_transfer_s == 0


@settings(max_examples=examples(30), deadline=None)
@given(dp=st.integers(2, 6), kind=st.sampled_from(LOST), data=st.data())
def test_lost_devices_are_never_reused_and_shrinking_keeps_the_whole_replicas(
    dp: int, kind: FailureKind, data: st.DataObject
) -> None:
    pp = 2
    lost = data.draw(st.sets(st.integers(0, dp * pp - 1), min_size=1, max_size=dp * pp))
    state = grid_state(layers=6, pp=pp, dp=dp, micro_batches=dp, failed=sorted(lost))
    failure = Failure(kind=kind, devices=frozenset(lost))
    assert not [
        c for c in policies.get("restart").propose(state, failure) if c.feasible
    ]  # no spares, no shrinking: nothing to restart on
    shrunk = [c for c in policies.get("restart_shrink").propose(state, failure) if c.feasible]
    # the replicas (pipelines) with no lost device, each whole
    whole = [p for p in state.plan.pipelines if not lost & devices_of_pipeline(p)]
    if not whole:
        declined = policies.get("restart_shrink").propose(state, failure)
        assert [c.code for c in declined if not c.feasible] == [Code.NO_SPARE, Code.NO_LIVE_REPLICA]
        return
    (candidate,) = shrunk
    assert candidate.policy == "restart_shrink" and candidate.plan is not None
    assert devices_of(candidate.plan) == set().union(*map(devices_of_pipeline, whole))
    assert candidate.plan.micro_batches == state.plan.micro_batches  # the global batch kept


def devices_of_pipeline(pipeline: object) -> set[int]:
    return {d for s in pipeline.stages for d in s.devices}  # type: ignore[attr-defined]


def test_a_crash_beside_a_device_down_for_another_reason_is_not_restarted_in_place() -> None:
    # device 3 never joined; device 0 crashes: in place would put a rank on device 3 again
    state = grid_state(layers=6, pp=2, dp=2, micro_batches=2, failed=[0, 3], spares=0)
    failure = Failure(kind=FailureKind.CRASH, devices=frozenset([0]))
    candidates = policies.get("restart").propose(state, failure)
    assert not [c for c in candidates if c.feasible and c.plan == state.plan]


def test_spares_take_the_lost_replicas_place() -> None:
    state = grid_state(layers=6, pp=2, dp=2, micro_batches=2, failed=[2], spares=2)
    failure = Failure(kind=FailureKind.NODE_LOST, devices=frozenset([2]))
    (candidate,) = [c for c in policies.get("restart").propose(state, failure) if c.feasible]
    assert candidate.plan is not None
    used = devices_of(candidate.plan)
    assert 2 not in used and used - {0, 1, 3} <= {4, 5} and len(used) == 4


def test_only_jobs_that_ask_for_it_by_name_get_it() -> None:
    assert "restart" in policies.names() and "restart" not in policies.default_names()


@settings(max_examples=examples(30), deadline=None)
@given(dp=st.integers(2, 6), minimum=st.integers(1, 6), data=st.data())
def test_shrinking_stops_at_the_jobs_minimum(dp: int, minimum: int, data: st.DataObject) -> None:
    # one device a replica, as the launcher's jobs have: a lost device takes its replica out
    lost = data.draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp - 1))
    state = grid_state(layers=4, pp=1, dp=dp, micro_batches=dp, failed=sorted(lost))
    failure = Failure(kind=FailureKind.NODE_LOST, devices=frozenset(lost))
    policy = policies.get("restart_shrink", min_replicas=minimum)
    candidates = policy.propose(state, failure)
    left = dp - len(lost)
    shrunk = [c for c in candidates if c.feasible]
    if left >= minimum:
        (candidate,) = shrunk
        assert candidate.plan is not None and len(devices_of(candidate.plan)) == left
    else:
        assert not shrunk
        assert Code.TOO_FEW_REPLICAS in [c.code for c in candidates]


@settings(max_examples=examples(20), deadline=None)
@given(dp=st.integers(2, 6), kind=st.sampled_from(LOST), data=st.data())
def test_a_lost_device_up_again_restarts_the_whole_world_in_place(
    dp: int, kind: FailureKind, data: st.DataObject
) -> None:
    # the failure named it, but its node joined again: nothing is down any more
    lost = data.draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp))
    state = grid_state(layers=4, pp=1, dp=dp, micro_batches=dp, failed=[])
    failure = Failure(kind=kind, devices=frozenset(lost))
    (candidate,) = [c for c in policies.get("restart").propose(state, failure) if c.feasible]
    assert candidate.plan == state.plan and candidate.transition.restart_s > 0
