"""The core's stable vocabulary, for Django choices, filters and API schemas."""

from __future__ import annotations

from controlplane.recovery import policies
from controlplane.recovery.causes import COLOURS, Cause
from controlplane.recovery.codes import MEANINGS, Code, Option
from controlplane.recovery.model import FailureKind
from controlplane.recovery.policies.restart import PROCESS_FAULTS

__all__ = [
    "COLOURS",
    "MEANINGS",
    "PROCESS_FAULTS",
    "Cause",
    "Code",
    "FailureKind",
    "Option",
    "describe_policies",
    "policy_names",
]


def policy_names() -> list[str]:
    """Every registered recovery policy, in the registry's order."""
    return policies.names()


def describe_policies() -> list[dict[str, object]]:
    """Every registered policy: its name, one-line summary and options with their defaults."""
    return [
        {"name": info.name, "summary": info.summary, "options": info.options}
        for info in map(policies.describe, policies.names())
    ]


def choices(enum: type[FailureKind] | type[Code] | type[Cause]) -> list[tuple[str, str]]:
    """Django ``choices`` for one of the core's string enums."""
    return [(member.value, member.value.replace("_", " ")) for member in enum]
