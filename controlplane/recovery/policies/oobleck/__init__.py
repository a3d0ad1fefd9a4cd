"""Oobleck (SOSP '23): pipeline templates (``templates``), the planner that repairs and
re-instantiates pipelines from them (``planner``), and the policy (``policy``)."""

from controlplane.recovery.policies.oobleck.planner import (
    NodeLayout,
    instantiate,
    node_layout,
    reinstantiate,
    repair_pipelines,
)
from controlplane.recovery.policies.oobleck.policy import OobleckPolicy

__all__ = [
    "NodeLayout",
    "OobleckPolicy",
    "instantiate",
    "node_layout",
    "reinstantiate",
    "repair_pipelines",
]
