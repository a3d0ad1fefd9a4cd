"""What one simulated run records: running and down segments, recoveries, samples trained."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from controlplane.recovery.causes import DOWN_CAUSES, Cause
from controlplane.recovery.codes import Code, Option


@dataclass(frozen=True, slots=True)
class Segment:
    """[start_s, end_s) spent on ``cause``; a running segment yields B / ``step_s`` samples/s."""

    start_s: float
    end_s: float
    cause: Cause
    step_s: float = math.inf

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def samples(self, global_batch: int) -> float:
        if self.cause is not Cause.RUNNING or math.isinf(self.step_s):
            return 0.0
        return global_batch * self.duration_s / self.step_s


@dataclass(frozen=True, slots=True)
class Recovery:
    """One decision: the failure that asked for it, the candidate applied and what it cost.

    ``feasible`` is False for a decision that found no candidate (the job then waits); a later
    decision after a repair is a new record with ``after_wait`` set. ``code``, ``note`` and
    ``option`` are the applied candidate's (for a failed decision, the first candidate's code and
    every candidate's note).
    """

    at_s: float
    devices: tuple[int, ...]
    kind: str
    feasible: bool
    code: Code
    note: str
    option: Option | None = None
    family: str | None = None
    transition: tuple[tuple[Cause, float], ...] = ()
    step_before_s: float = math.inf
    step_after_s: float = math.inf
    plan_devices: int = 0
    after_wait: bool = False

    @property
    def downtime_s(self) -> float:
        return sum(seconds for _, seconds in self.transition)

    def to_dict(self) -> dict[str, Any]:
        return {
            "at_s": self.at_s,
            "devices": list(self.devices),
            "kind": self.kind,
            "feasible": self.feasible,
            "code": str(self.code),
            "note": self.note,
            "option": None if self.option is None else str(self.option),
            "family": self.family,
            "transition_s": {cause.value: seconds for cause, seconds in self.transition},
            "step_before_s": _finite(self.step_before_s),
            "step_after_s": _finite(self.step_after_s),
            "plan_devices": self.plan_devices,
            "after_wait": self.after_wait,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recovery:
        """The recovery ``to_dict`` wrote."""
        return cls(
            at_s=data["at_s"],
            devices=tuple(data["devices"]),
            kind=data["kind"],
            feasible=data["feasible"],
            code=Code(data["code"]),
            note=data["note"],
            option=None if data["option"] is None else Option(data["option"]),
            family=data["family"],
            transition=tuple((Cause(c), s) for c, s in data["transition_s"].items()),
            step_before_s=_infinite(data["step_before_s"]),
            step_after_s=_infinite(data["step_after_s"]),
            plan_devices=data["plan_devices"],
            after_wait=data["after_wait"],
        )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _infinite(x: float | None) -> float:
    return math.inf if x is None else x


@dataclass(frozen=True, slots=True)
class Run:
    """One policy over one trace up to ``horizon_s``; segments tile [0, horizon_s) in order."""

    policy: str
    seed: int
    horizon_s: float
    global_batch: int
    segments: tuple[Segment, ...]
    recoveries: tuple[Recovery, ...]

    @property
    def samples(self) -> float:
        return sum(s.samples(self.global_batch) for s in self.segments)

    @property
    def throughput(self) -> float:
        """Mean samples per second over the whole horizon, downtime included."""
        return self.samples / self.horizon_s if self.horizon_s > 0 else 0.0

    @property
    def downtime_s(self) -> float:
        return sum(s.duration_s for s in self.segments if s.cause is not Cause.RUNNING)

    def downtime_by_cause_s(self) -> dict[str, float]:
        out = dict.fromkeys((c.value for c in DOWN_CAUSES), 0.0)
        for s in self.segments:
            if s.cause is not Cause.RUNNING:
                out[s.cause.value] += s.duration_s
        return out

    @property
    def recovery_count(self) -> int:
        """Decisions that moved the job to a new plan (infeasible ones excluded)."""
        return sum(1 for r in self.recoveries if r.feasible)

    @property
    def infeasible_count(self) -> int:
        return sum(1 for r in self.recoveries if not r.feasible)

    def cumulative_samples(self, times_s: list[float]) -> list[float]:
        """Samples trained by each of ``times_s`` (piecewise linear between segment ends)."""
        ends = [s.end_s for s in self.segments]
        done = [0.0]
        for s in self.segments:
            done.append(done[-1] + s.samples(self.global_batch))
        out = []
        for t in times_s:
            i = bisect_right(ends, t)
            if i >= len(self.segments):
                out.append(done[-1])
                continue
            s = self.segments[i]
            partial = Segment(s.start_s, max(s.start_s, t), s.cause, s.step_s)
            out.append(done[i] + partial.samples(self.global_batch))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "seed": self.seed,
            "horizon_s": self.horizon_s,
            "samples": self.samples,
            "segments": [
                [s.start_s, s.end_s, s.cause.value, _finite(s.step_s)] for s in self.segments
            ],
            "recoveries": [r.to_dict() for r in self.recoveries],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], global_batch: int) -> Run:
        """The run ``to_dict`` wrote (it leaves the batch out: the scenario has it)."""
        return cls(
            policy=data["policy"],
            seed=data["seed"],
            horizon_s=data["horizon_s"],
            global_batch=global_batch,
            segments=tuple(
                Segment(start, end, Cause(cause), _infinite(step))
                for start, end, cause, step in data["segments"]
            ),
            recoveries=tuple(Recovery.from_dict(r) for r in data["recoveries"]),
        )
