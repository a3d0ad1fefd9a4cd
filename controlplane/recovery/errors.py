"""Domain exceptions of the recovery core, each with a stable error code."""

from __future__ import annotations

from controlplane.recovery.codes import Code


class RecoveryError(Exception):
    """Base of every error the core raises on purpose; ``code`` is stable at every edge."""

    code = "recovery_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        self.message = message  # without the field, for callers that show it apart
        super().__init__(f"{field}: {message}" if field else message)


class InvalidScenario(RecoveryError):
    """The scenario, profile or plan given to the core is malformed or inconsistent."""

    code = "invalid_scenario"


class UnknownDevice(InvalidScenario):
    """A device id names no device of the cluster."""

    code = "unknown_device"


class InfeasiblePlan(RecoveryError):
    """No plan exists that satisfies the constraints (memory, batch, surviving replicas).

    ``decline`` says why in the stable vocabulary a declined candidate carries.
    """

    code = "infeasible_plan"

    def __init__(self, message: str, *, decline: Code = Code.NO_FITTING_PLAN) -> None:
        self.decline = decline
        super().__init__(message)


class UnknownPolicy(RecoveryError):
    """A policy name is not registered."""

    code = "unknown_policy"


class Superseded(RecoveryError):
    """The failure being decided changed while its policies ran (``decide``'s ``stale``): an
    answer for the failure as it was would be thrown away, so the rest is not computed."""

    code = "superseded"
