"""The core's data model: model profile, cluster, execution plan, state, failure and candidate."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import accumulate

from controlplane.recovery.codes import Caveat, Code, Option
from controlplane.recovery.errors import InvalidScenario, UnknownDevice

# Korthikanti et al. (2022): a transformer layer keeps about 34·s·b·h bytes of activations for the
# backward pass, while the tensor crossing a stage boundary is 2·s·b·h bytes.
BOUNDARY_FRACTION_OF_ACTIVATIONS = 2 / 34


# Half-open layer range [first, end); a split of the layers into stages; a device group.
LayerRange = tuple[int, int]
Layers = tuple[LayerRange, ...]
Group = tuple[int, ...]


def bytes_per_s(gbps: float | None) -> float:
    """A link or storage bandwidth in gigabits per second as bytes per second; none: infinite."""
    return math.inf if gbps is None else gbps * 1e9 / 8


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    return (0.0, *accumulate(values))


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-layer cost of one micro-batch: forward/backward seconds and memory terms in bytes.

    Times are measured at the job's tensor-parallel degree; memory terms are totals per layer and
    are divided by the tensor-parallel degree to get one device's share. ``update_s`` is the
    optimizer's update of a layer once per step (after the gradient sync); it is not one of
    Odyssey's terms, so it defaults to zero (``()``: zero for every layer).
    """

    name: str
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    m_p: tuple[float, ...]
    m_o: tuple[float, ...]
    m_g: tuple[float, ...]
    m_a: tuple[float, ...]
    boundary_bytes: float | None = None
    update_s: tuple[float, ...] = ()
    _fwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _bwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _static: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _state: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _grads: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _act: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _update: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        if n == 0:
            raise InvalidScenario("a model needs at least one layer", field="model.layers")
        if not self.update_s:
            object.__setattr__(self, "update_s", (0.0,) * n)
        for name in ("bwd_s", "m_p", "m_o", "m_g", "m_a", "update_s"):
            if len(getattr(self, name)) != n:
                raise InvalidScenario(f"expected {n} per-layer values", field=f"model.{name}")
        static = [p + o + g for p, o, g in zip(self.m_p, self.m_o, self.m_g, strict=True)]
        params = [p + o for p, o in zip(self.m_p, self.m_o, strict=True)]
        object.__setattr__(self, "_fwd", _prefix(self.fwd_s))
        object.__setattr__(self, "_bwd", _prefix(self.bwd_s))
        object.__setattr__(self, "_static", _prefix(static))
        object.__setattr__(self, "_state", _prefix(params))
        object.__setattr__(self, "_grads", _prefix(self.m_g))
        object.__setattr__(self, "_act", _prefix(self.m_a))
        object.__setattr__(self, "_update", _prefix(self.update_s))

    @classmethod
    def uniform(
        cls,
        *,
        name: str,
        layers: int,
        fwd_s: float,
        bwd_s: float,
        m_p: float = 0.0,
        m_o: float = 0.0,
        m_g: float = 0.0,
        m_a: float = 0.0,
    ) -> ModelProfile:
        """A profile whose layers all cost the same."""
        return cls(
            name=name,
            fwd_s=(fwd_s,) * layers,
            bwd_s=(bwd_s,) * layers,
            m_p=(m_p,) * layers,
            m_o=(m_o,) * layers,
            m_g=(m_g,) * layers,
            m_a=(m_a,) * layers,
        )

    @property
    def layers(self) -> int:
        return len(self.fwd_s)

    def fwd(self, first: int, end: int) -> float:
        """Forward seconds of layers [first, end) for one micro-batch."""
        return self._fwd[end] - self._fwd[first]

    def bwd(self, first: int, end: int) -> float:
        return self._bwd[end] - self._bwd[first]

    @property
    def has_update(self) -> bool:
        """Whether any layer's optimizer update takes time (a profile measured with it)."""
        return self._update[-1] > 0

    def update(self, first: int, end: int) -> float:
        """Seconds of one optimizer update of layers [first, end), once per step."""
        return self._update[end] - self._update[first]

    def static_bytes(self, first: int, end: int) -> float:
        """Parameters + optimizer state + gradients of layers [first, end)."""
        return self._static[end] - self._static[first]

    def state_bytes(self, first: int, end: int) -> float:
        """Parameters + optimizer state of layers [first, end): what a weight transfer moves."""
        return self._state[end] - self._state[first]

    def grad_bytes(self, first: int, end: int) -> float:
        return self._grads[end] - self._grads[first]

    def activation_bytes(self, first: int, end: int) -> float:
        """Activations kept for one in-flight micro-batch of layers [first, end)."""
        return self._act[end] - self._act[first]

    def boundary_bytes_after(self, layer: int) -> float:
        """Bytes sent between stages per micro-batch when a stage ends after ``layer``."""
        if self.boundary_bytes is not None:
            return self.boundary_bytes
        return self.m_a[layer] * BOUNDARY_FRACTION_OF_ACTIVATIONS


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices (ids 0..devices-1, then spares), their grouping into nodes, memory and links."""

    devices: int
    devices_per_node: int = 8
    device_memory_bytes: float = math.inf
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    failure_rate_per_device_hour: float = 0.0
    spares: int = 0

    @property
    def total_devices(self) -> int:
        return self.devices + self.spares

    @property
    def spare_ids(self) -> range:
        return range(self.devices, self.devices + self.spares)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def check_device(self, device: int, *, field: str) -> None:
        if not 0 <= device < self.total_devices:
            raise UnknownDevice(
                f"device {device} does not exist (ids are 0..{self.total_devices - 1})",
                field=field,
            )

    @property
    def communication_is_free(self) -> bool:
        return self.intra_node_gbps is None and self.inter_node_gbps is None

    def bandwidth_bytes_per_s(self, a: int, b: int) -> float:
        """Link bandwidth between two devices; infinite when the scenario gives none."""
        gbps = self.intra_node_gbps if self.node_of(a) == self.node_of(b) else self.inter_node_gbps
        return bytes_per_s(gbps)

    def group_bandwidth_bytes_per_s(self, devices: Sequence[int]) -> float:
        """Slowest link inside a communication group."""
        nodes = {self.node_of(d) for d in devices}
        gbps = self.intra_node_gbps if len(nodes) <= 1 else self.inter_node_gbps
        return bytes_per_s(gbps)


@dataclass(frozen=True, slots=True)
class Training:
    """Batch configuration: the global batch is kept by every feasible plan."""

    global_batch: int
    micro_batch: int = 1

    def __post_init__(self) -> None:
        if self.global_batch <= 0 or self.micro_batch <= 0:
            raise InvalidScenario("batch sizes must be positive", field="training")
        if self.global_batch % self.micro_batch:
            raise InvalidScenario(
                f"global_batch {self.global_batch} is not a multiple of micro_batch "
                f"{self.micro_batch}",
                field="training.global_batch",
            )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step over all pipelines (N_m in Algorithm 1)."""
        return self.global_batch // self.micro_batch


@dataclass(frozen=True, slots=True)
class Assumptions:
    """Costs every policy shares that the papers leave unstated (detection, restart, checkpoints).

    A policy's own constants are its options (fields of its class in ``policies/``).
    """

    detection_s: float = 0.0
    # Planning runs ahead of faults (Chameleon caches plans per survivor count), so the critical
    # path pays only this; the CLI reports the measured search time separately.
    search_s: float = 0.0
    restart_s: float = 2.0
    checkpoint_interval_steps: int = 100
    checkpoint_load_s: float | None = None
    storage_gbps: float = 200.0


class Family(StrEnum):
    DYNAMIC = "dynamic"
    REROUTING = "rerouting"


@dataclass(frozen=True, slots=True)
class Stage:
    """Consecutive layers [first, end) on a tensor-parallel group of devices.

    A ``rerouted`` stage lost its own group: its micro-batches run on ``devices``, which are the
    groups of the live replicas of the same layers in other pipelines (Odyssey eq. 12/13).
    """

    devices: tuple[int, ...]
    layers: tuple[int, int]
    rerouted: bool = False

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True, slots=True)
class Pipeline:
    stages: tuple[Stage, ...]
    micro_batches: int

    @property
    def depth(self) -> int:
        return len(self.stages)


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Pipelines of stages; the data-parallel width is the number of pipelines."""

    pipelines: tuple[Pipeline, ...]
    family: Family = Family.DYNAMIC

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree, read off a stage that runs on its own group."""
        return len(next(self.own_groups(), ()))

    @property
    def micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    @property
    def has_rerouted_stages(self) -> bool:
        return any(stage.rerouted for _, _, stage in self.stages())

    @property
    def is_symmetric(self) -> bool:
        """Every pipeline has the same stages and micro-batches, and none borrows a replica."""
        first = self.pipelines[0]
        shape = [s.layers for s in first.stages]
        return not self.has_rerouted_stages and all(
            [s.layers for s in p.stages] == shape and p.micro_batches == first.micro_batches
            for p in self.pipelines
        )

    def stages(self) -> Iterator[tuple[int, int, Stage]]:
        """Every (pipeline index, stage index, stage)."""
        for p, pipeline in enumerate(self.pipelines):
            for s, stage in enumerate(pipeline.stages):
                yield p, s, stage

    def own_groups(self) -> Iterator[tuple[int, ...]]:
        """Device groups that run their own stage (rerouted stages borrow theirs)."""
        for _, _, stage in self.stages():
            if not stage.rerouted:
                yield stage.devices

    def devices(self) -> frozenset[int]:
        return frozenset(d for group in self.own_groups() for d in group)


class FailureKind(StrEnum):
    CRASH = "crash"
    HANG = "hang"
    STRAGGLER = "straggler"
    NAN = "nan"
    LINK = "link"
    NODE_LOST = "node_lost"
    NEVER_JOINED = "never_joined"  # expected in the job, not heard within the join deadline


@dataclass(frozen=True, slots=True)
class Failure:
    kind: FailureKind
    devices: frozenset[int]
    detected_at_s: float = 0.0
    detected_by: str = "scenario"


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Everything a policy decides from: profile, cluster, batch, current plan and failed devices.

    ``failed`` holds every device that is down now, including those of the failure being handled.

    The last two fields say how much work the failure threw away, which only a caller with a
    clock knows (the simulator); left at None, policies charge the expectation instead: a whole
    interrupted step and (n − 1)/2 completed steps of an n-step checkpoint interval.
    """

    profile: ModelProfile
    cluster: Cluster
    training: Training
    plan: ExecutionPlan
    failed: frozenset[int] = frozenset()
    assumptions: Assumptions = Assumptions()
    # Seconds into the step the failure interrupted; 0 when no step was running (the job was
    # restarting after an earlier failure, whose lost work is charged already).
    interrupted_step_s: float | None = None
    # Seconds of steps completed since the last checkpoint that no earlier recovery charged:
    # what a rollback to that checkpoint throws away on top of the interrupted step.
    completed_since_checkpoint_s: float | None = None
    # Failed devices whose fault was their process's (a crash, hang or NaN on a node still
    # heard): a restart may run a new process on them (the ``restart`` policy's in place).
    restartable: frozenset[int] = frozenset()

    @property
    def healthy(self) -> frozenset[int]:
        return frozenset(range(self.cluster.total_devices)) - self.failed

    def spare_devices(self) -> list[int]:
        """Healthy devices that the current plan does not use (spares and idle leftovers)."""
        used = self.plan.devices()
        return sorted(d for d in self.healthy if d not in used)

    def with_failure(self, failure: Failure) -> ClusterState:
        return replace(self, failed=self.failed | failure.devices)

    def with_plan(self, plan: ExecutionPlan) -> ClusterState:
        return replace(self, plan=plan)


@dataclass(frozen=True, slots=True)
class TransitionCost:
    """Seconds a move to a new plan costs, broken down as the objective and the timeline need.

    In the order they happen: the fault goes unnoticed (detection), the plan is searched, weights
    move, the job restarts, then redoes the work the fault threw away (lost work).
    """

    detection_s: float = 0.0
    search_s: float = 0.0
    weight_transfer_s: float = 0.0
    restart_s: float = 0.0
    lost_work_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.detection_s
            + self.search_s
            + self.weight_transfer_s
            + self.restart_s
            + self.lost_work_s
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """A plan a policy proposes, with its estimates.

    ``code`` is ``Code.OK`` when the plan applies, otherwise why the policy declines (a plan over
    memory is still shown); ``note`` says the same for a person, and callers never parse it.
    """

    policy: str
    code: Code = Code.OK
    note: str = ""
    plan: ExecutionPlan | None = None
    est_step_time_s: float = math.inf
    transition: TransitionCost = TransitionCost()
    peak_memory_bytes: Mapping[int, float] = field(default_factory=dict)
    objective: float = 0.0
    caveats: tuple[Caveat, ...] = ()
    # which of its options an adaptive policy chose (None for the others)
    option: Option | None = None

    @property
    def feasible(self) -> bool:
        return self.code is Code.OK

    @classmethod
    def declined(cls, policy: str, code: Code, note: str) -> Candidate:
        return cls(policy=policy, code=code, note=note)
