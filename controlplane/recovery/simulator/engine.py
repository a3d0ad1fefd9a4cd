"""The discrete-event engine (simpy): one policy's job living through one failure trace."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from enum import Enum
from typing import Any

import simpy

from controlplane.recovery import policies, replicas
from controlplane.recovery.causes import Cause
from controlplane.recovery.decision import decide
from controlplane.recovery.model import (
    Candidate,
    ClusterState,
    Failure,
    FailureKind,
    TransitionCost,
)
from controlplane.recovery.policies.base import Policy, interrupted_work_s
from controlplane.recovery.simulator.overheads import effective_step_s, starting_step_s
from controlplane.recovery.simulator.timeline import Recovery, Run, Segment
from controlplane.recovery.simulator.traces import Trace, TraceFailure

# At equal times a repair runs before a failure, so a device may come back and fail at once.
REPAIR, FAIL = 0, 1

Progress = Callable[[float], None]


class _Mode(Enum):
    RUNNING = "running"
    TRANSITION = "transition"
    WAITING = "waiting"


def trace_events(trace: Trace) -> list[tuple[float, int, int, TraceFailure]]:
    """Failures and the repairs they imply, in the order the engine applies them."""
    events = []
    for i, f in enumerate(trace.failures):
        events.append((f.time_s, FAIL, i, f))
        if f.repair_s is not None:
            events.append((f.repaired_at_s, REPAIR, i, f))
    events.sort(key=lambda e: e[:3])
    return events


def transition_pieces(cost: TransitionCost) -> list[tuple[Cause, float]]:
    """A transition split for the timeline, in the order it happens: the fault goes unnoticed,
    then the plan is searched, weights move and the job restarts; lost work comes last, as the
    redone steps run after the restart."""
    return [
        (Cause.DETECTION, cost.detection_s),
        (Cause.PLANNING, cost.search_s),
        (Cause.WEIGHT_TRANSFER, cost.weight_transfer_s),
        (Cause.RESTART, cost.restart_s),
        (Cause.LOST_WORK, cost.lost_work_s),
    ]


class _Job:
    """The training job under one policy: runs its plan, stops for transitions or waits.

    The job counts its steps (``steps``, the fraction being the step in flight) to tell a policy
    what a fault threw away: the part of the running step, and the steps completed since the
    last checkpoint. A checkpoint is taken whenever the count reaches a multiple of
    ``checkpoint_interval_steps``, the first at step 0. A transition leaves the count where the
    fault found it: its lost work is the time spent redoing what the fault threw away, after a
    restart from a checkpoint too, so the next checkpoint comes at the next multiple. A fault
    during the restart finds nothing more to lose; a fault during the redo stops it, and the
    next decision owes the whole redo again.
    """

    def __init__(self, env: simpy.Environment, state: ClusterState, policy: Policy) -> None:
        self.env = env
        self.name = policy.name
        self.policy = policy
        self.state = state
        self.plan_devices = replicas.devices(state.plan, state.cluster)
        self.step_s = starting_step_s(self.policy, state)
        self.effective_s = effective_step_s(self.policy, state, self.step_s)
        self.mode = _Mode.RUNNING
        self.since = 0.0
        self.steps = 0.0
        # When the current transition redoes the work a fault threw away, and that work as the
        # policy was told it: a fault then stops the redo, and all of it is owed again.
        self.redo_window_s = (math.inf, math.inf)
        self.redoing = (0.0, 0.0)
        self.segments: list[Segment] = []
        self.recoveries: list[Recovery] = []
        # failed devices of the plan not handled yet, and the trace failures they came with
        self.hit: set[int] = set()
        self.hit_by: list[TraceFailure] = []
        self.unresolved: Failure | None = None
        self.wake = env.event()

    # --- events from the trace -------------------------------------------------------------

    def fail(self, f: TraceFailure) -> None:
        self.state = replace(self.state, failed=self.state.failed.union(f.devices))
        touched = {d for d in f.devices if d in self.plan_devices}
        if not touched:
            return  # a spare or idle device: it just leaves the pool
        self.hit |= touched
        self.hit_by.append(f)
        # during a transition only a fault that stops the redo of lost work acts at once
        if (
            self.mode is not _Mode.TRANSITION
            or self.redo_window_s[0] <= self.env.now <= self.redo_window_s[1]
        ):
            self._wake()

    def repair(self, f: TraceFailure) -> None:
        self.state = replace(self.state, failed=self.state.failed.difference(f.devices))
        self.hit.difference_update(f.devices)
        if self.mode is _Mode.WAITING:
            self._wake()

    def _wake(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    # --- the job's life --------------------------------------------------------------------

    def life(self) -> Generator[simpy.Event, Any, None]:
        while True:
            yield self.wake
            self.wake = self.env.event()
            after_wait = self.mode is _Mode.WAITING
            if after_wait:
                assert self.unresolved is not None
                failure = self._merge(self.unresolved)
            else:
                self._close(Cause.RUNNING)
                self.state = self._with_lost_work()
                failure = self._merge(None)
            while failure is not None:
                candidate = self._decide(failure, after_wait=after_wait)
                if candidate is None:
                    if not after_wait:
                        self.mode, self.since = _Mode.WAITING, self.env.now
                    self.unresolved = failure  # with whatever joined it while waiting
                    break
                if after_wait:
                    self._close(Cause.INFEASIBLE)
                    self.unresolved = None
                end = self._start_transition(candidate, failure, after_wait=after_wait)
                if end > self.env.now:
                    yield self.env.timeout(end - self.env.now) | self.wake
                if self.wake.triggered:
                    self.wake = self.env.event()
                    end = self._stop_redo(end)
                    if end > self.env.now:  # the rest of the lost work is not a redo
                        yield self.env.timeout(end - self.env.now)
                self.mode, self.since = _Mode.RUNNING, self.env.now
                # failures that hit the new plan during the transition are handled now
                failure, after_wait = self._merge(None), False

    def _with_lost_work(self) -> ClusterState:
        """The state told what a fault now throws away: the running step's part, and the steps
        completed since the last checkpoint (which only a checkpoint restart loses)."""
        interval = max(self.state.assumptions.checkpoint_interval_steps, 1)
        completed = math.floor(self.steps)
        return replace(
            self.state,
            interrupted_step_s=(self.steps - completed) * self.step_s,
            completed_since_checkpoint_s=(completed % interval) * self.step_s,
        )

    def _rollback_s(self) -> float:
        """Completed steps the fault throws away on top of the interrupted one: those since the
        checkpoint for a checkpoint restart, none for the policies that keep the job's state."""
        if self.policy.rolls_back:
            return self.state.completed_since_checkpoint_s or 0.0
        return 0.0

    def _stop_redo(self, end: float) -> float:
        """A fault stopped the redo of lost work: cut what is left of it, and owe all of it again.

        The job goes back to its checkpoint (or the start of its step) as at the fault that asked
        for the transition, so the next decision is told the same lost work. Returns when the
        transition now ends.
        """
        cut = self.redo_window_s[1] - self.env.now
        self.redo_window_s = (math.inf, math.inf)
        if cut > 0:
            last = self.segments[-1]
            self.segments[-1] = replace(last, end_s=last.end_s - cut)
            record = self.recoveries[-1]
            pieces = tuple(
                (cause, seconds - cut if cause is Cause.LOST_WORK else seconds)
                for cause, seconds in record.transition
            )
            self.recoveries[-1] = replace(record, transition=pieces)
        interrupted, completed = self.redoing
        self.state = replace(
            self.state,
            interrupted_step_s=interrupted,
            completed_since_checkpoint_s=completed,
        )
        return end - max(cut, 0.0)

    def _merge(self, pending: Failure | None) -> Failure | None:
        """One failure for the policy: ``pending`` plus the plan's devices hit since."""
        hit = {d for d in self.hit if d in self.state.failed}
        if not hit and pending is None:
            self.hit_by.clear()
            return None
        devices = set(pending.devices) if pending else set()
        kinds = {pending.kind} if pending else set()
        for f in self.hit_by:
            devices.update(d for d in f.devices if d in self.state.failed)
            kinds.add(f.kind)
        self.hit.clear()
        self.hit_by.clear()
        return Failure(
            kind=kinds.pop() if len(kinds) == 1 else FailureKind.CRASH,
            devices=frozenset(devices),
            detected_at_s=self.env.now,
            detected_by="simulator",
        )

    def _decide(self, failure: Failure, *, after_wait: bool) -> Candidate | None:
        decision = decide(self.state, failure, policies=[self.policy])
        if decision.best is None:
            if not after_wait:  # one infeasible state per wait, however many repairs it sees
                notes = "; ".join(
                    dict.fromkeys(f"[{c.code}] {c.note}" for c in decision.candidates)
                )
                self.recoveries.append(
                    Recovery(
                        at_s=self.env.now,
                        devices=tuple(sorted(failure.devices)),
                        kind=failure.kind.value,
                        feasible=False,
                        code=decision.candidates[0].code,
                        note=notes,
                        step_before_s=self.step_s,
                    )
                )
            return None
        return decision.best

    def _start_transition(
        self, candidate: Candidate, failure: Failure, *, after_wait: bool
    ) -> float:
        """Switch to the candidate's plan; the job is down until the returned time."""
        assert candidate.plan is not None
        cost = candidate.transition
        if after_wait and cost.total_s == 0:
            # The repair gave the plan its own devices back, so the policy sees nothing to do;
            # the stopped job still restarts and redoes its interrupted step, and a checkpoint
            # restart the steps since its checkpoint (docs/simulator.md).
            cost = TransitionCost(
                detection_s=self.state.assumptions.detection_s,
                restart_s=self.state.assumptions.restart_s,
                lost_work_s=interrupted_work_s(self.state) + self._rollback_s(),
            )
        pieces = transition_pieces(cost)
        plan_devices = replicas.devices(candidate.plan, self.state.cluster)
        now = self.env.now
        self.recoveries.append(
            Recovery(
                at_s=now,
                devices=tuple(sorted(failure.devices)),
                kind=failure.kind.value,
                feasible=True,
                code=candidate.code,
                note=candidate.note,
                option=candidate.option,
                family=candidate.plan.family.value,
                transition=tuple(pieces),
                step_before_s=self.step_s,
                step_after_s=candidate.est_step_time_s,
                plan_devices=len(plan_devices),
                after_wait=after_wait,
            )
        )
        # The transition charges what the fault threw away, so a failure that lands during it
        # finds no step running and no work since the checkpoint left to lose, unless it stops
        # the redo (_stop_redo).
        self.redoing = (
            self.state.interrupted_step_s or 0.0,
            self.state.completed_since_checkpoint_s or 0.0,
        )
        # The lost work starts with the redo; other policies' extra lost work (CheckFree's
        # penalty, Varuna's expected rollback) is not tied to the job's clock.
        redo = self.redoing[0] + self._rollback_s()
        self.state = replace(
            self.state.with_plan(candidate.plan),
            interrupted_step_s=0.0,
            completed_since_checkpoint_s=0.0,
        )
        self.plan_devices = plan_devices
        self.step_s = candidate.est_step_time_s
        self.effective_s = effective_step_s(self.policy, self.state, self.step_s)
        self.mode = _Mode.TRANSITION
        t = now
        self.redo_window_s = (math.inf, math.inf)
        for cause, seconds in pieces:
            if seconds > 0:
                self.segments.append(Segment(t, t + seconds, cause))
                if cause is Cause.LOST_WORK and redo > 0:
                    self.redo_window_s = (t, t + min(redo, seconds))
                t += seconds
        return t

    def _close(self, cause: Cause) -> None:
        now = self.env.now
        if now > self.since:
            step = self.effective_s if cause is Cause.RUNNING else math.inf
            if cause is Cause.RUNNING:
                self.steps += (now - self.since) / self.step_s
            self.segments.append(Segment(self.since, now, cause, step))
        self.since = now

    def finish(self, horizon_s: float, seed: int) -> Run:
        if self.mode is _Mode.RUNNING:
            self._close(Cause.RUNNING)
        elif self.mode is _Mode.WAITING:
            self._close(Cause.INFEASIBLE)
        clipped = tuple(
            replace(s, end_s=min(s.end_s, horizon_s))
            for s in self.segments
            if s.start_s < horizon_s
        )
        return Run(
            policy=self.name,
            seed=seed,
            horizon_s=horizon_s,
            global_batch=self.state.training.global_batch,
            segments=clipped,
            recoveries=tuple(r for r in self.recoveries if r.at_s < horizon_s),
        )


def _feed(
    env: simpy.Environment,
    job: _Job,
    events: Iterator[tuple[float, int, int, TraceFailure]],
    progress: Progress | None,
) -> Generator[simpy.Event, Any, None]:
    for time_s, what, _, failure in events:
        if time_s > env.now:
            yield env.timeout(time_s - env.now)
        if what == FAIL:
            job.fail(failure)
        else:
            job.repair(failure)
        if progress is not None:
            progress(env.now)


def simulate(
    state: ClusterState,
    policy: str | Policy,
    trace: Trace,
    horizon_s: float,
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> Run:
    """Run ``policy`` from the scenario's plan, every device healthy, through ``trace``.

    ``policy`` is a registered name or a policy object (e.g. one built with options). Nothing
    here is random or reads a clock: the same inputs give the same run.
    """
    env = simpy.Environment()
    chosen = policies.get(policy) if isinstance(policy, str) else policy
    job = _Job(env, replace(state, failed=frozenset()), chosen)
    env.process(job.life())
    events = (e for e in trace_events(trace) if e[0] < horizon_s)
    env.process(_feed(env, job, events, progress))
    env.run(until=horizon_s)
    if progress is not None:
        progress(horizon_s)
    return job.finish(horizon_s, seed)
