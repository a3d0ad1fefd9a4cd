"""A comparison: every policy over the same trace per seed, for a number of seeds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from controlplane.recovery.decision import PolicyOptions, resolve
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import ClusterState
from controlplane.recovery.policies.base import Policy
from controlplane.recovery.simulator.engine import simulate
from controlplane.recovery.simulator.ideal import IDEAL, ideal_run
from controlplane.recovery.simulator.timeline import Run
from controlplane.recovery.simulator.traces import SECONDS_PER_HOUR, Trace, TraceSpec, generate

# (policy, seed, simulated seconds so far) → None; for progress bars
Progress = Callable[[str, int, float], None]


@dataclass(frozen=True, slots=True)
class Experiment:
    """What to compare: ``policies`` (the first is the reference of the ratios) over ``seeds``
    traces, each drawn from ``trace`` with seed ``base_seed + i``, or one replayed trace.
    ``options`` go to the named policies (a scenario's ``policies`` section)."""

    hours: float
    policies: tuple[str, ...]
    trace: TraceSpec | Trace
    seeds: int = 1
    base_seed: int = 0
    options: PolicyOptions = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.hours > 0:
            raise InvalidScenario(f"must be > 0, got {self.hours}", field="hours")
        if self.seeds < 1:
            raise InvalidScenario(f"must be ≥ 1, got {self.seeds}", field="seeds")
        if not self.policies:
            raise InvalidScenario("names no policy", field="policies")
        if len(set(self.policies)) != len(self.policies):
            raise InvalidScenario("names a policy twice", field="policies")
        # an unknown name or option fails here, listing the known ones
        self.build_policies()

    def build_policies(self) -> list[Policy]:
        """The policies to compare, in order, built with their options."""
        return resolve(self.policies, self.options)

    @property
    def horizon_s(self) -> float:
        return self.hours * SECONDS_PER_HOUR

    def trace_for(self, state: ClusterState, seed: int) -> Trace:
        if isinstance(self.trace, Trace):
            return self.trace.within(self.horizon_s)
        return generate(self.trace, state.cluster, self.horizon_s, seed)

    def parameters(self) -> dict[str, Any]:
        trace: dict[str, Any] = (
            {"replay": len(self.trace.failures)}
            if isinstance(self.trace, Trace)
            else {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(self.trace).items()}
        )
        return {
            "hours": self.hours,
            "policies": list(self.policies),
            "options": {name: dict(given) for name, given in self.options.items()},
            "seeds": self.seeds,
            "base_seed": self.base_seed,
            "trace": trace,
        }


def planning_rate(state: ClusterState, experiment: Experiment) -> ClusterState:
    """The state with the failure rate policies plan with (eq. 8's t_state) set to the trace's.

    A drawn trace's per-device rate replaces the scenario's; a replayed trace keeps it.
    """
    if isinstance(experiment.trace, Trace):
        return state
    rate = 1 / experiment.trace.mean_gap_hours
    return replace(state, cluster=replace(state.cluster, failure_rate_per_device_hour=rate))


def run_experiment(
    state: ClusterState, experiment: Experiment, *, progress: Progress | None = None
) -> tuple[dict[str, list[Run]], list[Trace]]:
    """Runs per policy (in seed order) and the trace of each seed."""
    state = planning_rate(state, experiment)
    runs: dict[str, list[Run]] = {name: [] for name in experiment.policies}
    built = experiment.build_policies()
    traces = []
    for i in range(experiment.seeds):
        seed = experiment.base_seed + i
        trace = experiment.trace_for(state, seed)
        traces.append(trace)
        for name, policy in zip(experiment.policies, built, strict=True):
            tick = None if progress is None else _ticker(progress, name, seed)
            runs[name].append(
                simulate(state, policy, trace, experiment.horizon_s, seed=seed, progress=tick)
            )
    return runs, traces


def run_ideal(
    state: ClusterState,
    experiment: Experiment,
    traces: list[Trace],
    *,
    progress: Progress | None = None,
) -> list[Run]:
    """The ideal (simulator.ideal) over each seed's trace, in seed order: the bound of the
    policies that ran on the same traces."""
    runs = []
    for i, trace in enumerate(traces):
        seed = experiment.base_seed + i
        tick = None if progress is None else _ticker(progress, IDEAL, seed)
        runs.append(ideal_run(state, trace, experiment.horizon_s, seed=seed, progress=tick))
    return runs


def _ticker(progress: Progress, name: str, seed: int) -> Callable[[float], None]:
    return lambda now: progress(name, seed, now)
