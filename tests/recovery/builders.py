"""Small constructors of profiles, plans and states for the core's tests."""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import strategies as st

from controlplane.recovery.model import (
    Assumptions,
    Cluster,
    ClusterState,
    ExecutionPlan,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)


def examples(default: int) -> int:
    """Hypothesis examples for the expensive properties; PITSTOP_DEEP=N multiplies them."""
    return default * int(os.environ.get("PITSTOP_DEEP", "1"))


def uniform_profile(
    layers: int, fwd_s: float = 1.0, bwd_s: float = 2.0, **memory: float
) -> ModelProfile:
    return ModelProfile.uniform(name="test", layers=layers, fwd_s=fwd_s, bwd_s=bwd_s, **memory)


def grid_plan(
    layers: int,
    pp: int,
    dp: int,
    micro_batches: int,
    tp: int = 1,
    splits: Sequence[int] | None = None,
) -> ExecutionPlan:
    """DP × PP pipelines, device ids row by row; ``splits`` gives layers per stage."""
    if splits is None:
        base, extra = divmod(layers, pp)
        splits = [base + (s < extra) for s in range(pp)]
    pipelines = []
    for p in range(dp):
        stages = []
        first = 0
        for s, count in enumerate(splits):
            start = (p * pp + s) * tp
            stages.append(
                Stage(devices=tuple(range(start, start + tp)), layers=(first, first + count))
            )
            first += count
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=micro_batches))
    return ExecutionPlan(pipelines=tuple(pipelines))


def grid_state(
    *,
    layers: int = 8,
    pp: int = 2,
    dp: int = 2,
    tp: int = 1,
    micro_batches: int = 4,
    failed: Sequence[int] = (),
    profile: ModelProfile | None = None,
    spares: int = 0,
    devices_per_node: int = 8,
    memory_bytes: float = float("inf"),
    failure_rate: float = 0.1,
    bandwidth_gbps: tuple[float, float] | None = None,
    assumptions: Assumptions | None = None,
) -> ClusterState:
    intra, inter = bandwidth_gbps if bandwidth_gbps else (None, None)
    return ClusterState(
        profile=profile or uniform_profile(layers),
        cluster=Cluster(
            devices=pp * dp * tp,
            devices_per_node=devices_per_node,
            device_memory_bytes=memory_bytes,
            intra_node_gbps=intra,
            inter_node_gbps=inter,
            failure_rate_per_device_hour=failure_rate,
            spares=spares,
        ),
        training=Training(global_batch=micro_batches * dp),
        plan=grid_plan(layers, pp, dp, micro_batches, tp),
        failed=frozenset(failed),
        assumptions=assumptions or Assumptions(),
    )


@st.composite
def small_profiles(draw: st.DrawFn, max_layers: int = 8) -> ModelProfile:
    """Random small integer costs per layer (zeros included), for exhaustive comparisons."""
    layers = draw(st.integers(1, max_layers))
    ints = st.lists(st.integers(0, 5), min_size=layers, max_size=layers)
    return ModelProfile(
        name="random",
        fwd_s=tuple(float(x) for x in draw(ints)),
        bwd_s=tuple(float(x) for x in draw(ints)),
        m_p=tuple(float(x) for x in draw(ints)),
        m_o=(0.0,) * layers,
        m_g=(0.0,) * layers,
        m_a=tuple(float(x) for x in draw(ints)),
    )
