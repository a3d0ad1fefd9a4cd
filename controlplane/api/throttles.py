"""Per-user limits on the API calls whose cost the caller controls: what-if, creating jobs and
agent tokens, launchers' nodes asking for their job, starting simulation sweeps, sending
drills. A view names the scope of each such action in ``throttle_scopes``; the rate of a scope
is the setting ``PITSTOP_API_RATE_<SCOPE>`` (e.g. ``30/min``). The counts live in Django's
cache (Redis, under the deployment's prefix), so every server process shares them; one call too
many is a 429 ``throttled`` with Retry-After."""

from __future__ import annotations

from typing import Any

import structlog
from django.conf import settings
from redis.exceptions import RedisError
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.throttling import ScopedRateThrottle

log = structlog.get_logger(__name__)

SCOPES = ("whatif", "jobs", "launches", "simulations", "drills")


class CostThrottle(ScopedRateThrottle):
    """Per user (per address for a caller without a login), per scope, over a sliding window;
    reads are never counted."""

    def allow_request(self, request: Request, view: Any) -> bool:
        scopes: dict[str, str] = getattr(view, "throttle_scopes", {})
        scope = scopes.get(getattr(view, "action", None) or "")
        if scope is None or request.method in SAFE_METHODS:
            return True
        self.scope = scope
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        try:
            return super(ScopedRateThrottle, self).allow_request(request, view)
        except RedisError as exc:  # the call goes on without Redis; the lapse is logged
            log.warning("api.throttle_unavailable", scope=scope, error=str(exc))
            return True

    def get_rate(self) -> str:
        """Read from the settings at each call, so that a changed setting (a test's) counts."""
        rate: str = getattr(settings, f"PITSTOP_API_RATE_{str(self.scope).upper()}")
        return rate
