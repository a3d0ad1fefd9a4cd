"""Time and memory estimators of the cost model (Odyssey eqs. 9-14)."""

from controlplane.recovery.estimator.memory import peak_memory, stage_peak_bytes
from controlplane.recovery.estimator.time import (
    estimate_step_time,
    pipeline_time,
    rerouting_step_time,
    symmetric_step_time,
)

__all__ = [
    "estimate_step_time",
    "peak_memory",
    "pipeline_time",
    "rerouting_step_time",
    "stage_peak_bytes",
    "symmetric_step_time",
]
