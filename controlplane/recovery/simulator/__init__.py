"""Discrete-event simulator: every policy over the same failure traces, samples and downtime.

The typed entry point is ``run(state, experiment, out_dir=...)``; an ``Experiment`` names the
policies, the hours, the seeds and a ``TraceSpec`` to draw traces from (or a replayed ``Trace``).
"""

from controlplane.recovery.simulator.command import progress_bar, run
from controlplane.recovery.simulator.experiment import Experiment
from controlplane.recovery.simulator.traces import (
    Distribution,
    RepairDistribution,
    Trace,
    TraceSpec,
    load_csv,
)

__all__ = [
    "Distribution",
    "Experiment",
    "RepairDistribution",
    "Trace",
    "TraceSpec",
    "load_csv",
    "progress_bar",
    "run",
]
