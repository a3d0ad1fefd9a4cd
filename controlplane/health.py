"""Liveness and dependency check: GET /healthz answers whether the database and Redis respond."""

from collections.abc import Callable

import structlog
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from controlplane import redis_probe

log = structlog.get_logger(__name__)

CHECK_TIMEOUT_S = 2.0


def _check_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


def _check_redis() -> None:
    redis_probe.ping(settings.REDIS_URL, timeout_s=CHECK_TIMEOUT_S)


CHECKS: dict[str, Callable[[], None]] = {"database": _check_database, "redis": _check_redis}


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 with every part "ok", or 503 naming the part that failed (details go to the log)."""
    parts: dict[str, str] = {}
    for part, check in CHECKS.items():
        try:
            check()
        except Exception as error:  # any failure of a dependency means "unavailable"
            log.warning("health.check_failed", part=part, error=repr(error))
            parts[part] = "error"
        else:
            parts[part] = "ok"
    healthy = all(state == "ok" for state in parts.values())
    return JsonResponse(
        {"status": "ok" if healthy else "error", **parts}, status=200 if healthy else 503
    )
