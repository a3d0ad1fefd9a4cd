"""The objective of Odyssey eq. 8: throughput over the next inter-fault interval."""

from __future__ import annotations

import math

SECONDS_PER_HOUR = 3600.0


def expected_time_to_failure_s(failure_rate_per_device_hour: float, devices_alive: int) -> float:
    """Mean time to the next fault with independent per-device Poisson failures (t_state)."""
    rate_per_s = failure_rate_per_device_hour * devices_alive / SECONDS_PER_HOUR
    return math.inf if rate_per_s <= 0 else 1.0 / rate_per_s


def objective(
    *, global_batch: int, step_time_s: float, transition_s: float, t_state_s: float
) -> float:
    """Odyssey eq. 8: ``B / t_step × t_state / (t_transition + t_state)`` in samples per second.

    A slower step is worth taking when it saves a transition that would eat into the expected
    productive time before the next fault.
    """
    if step_time_s <= 0 or math.isinf(step_time_s):
        return 0.0
    throughput = global_batch / step_time_s
    if math.isinf(t_state_s):
        return throughput
    return throughput * t_state_s / (transition_s + t_state_s)
