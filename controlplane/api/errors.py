"""Every API error as one JSON shape with a stable code: ``{"code", "message", "field"}``.

A bad scenario or plan is a 400 naming the field the core found at fault; an illegal move of a
decision is a 409; DRF's own errors keep their status with their code. Nothing becomes a 500.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.bridge.rows import RecoveryError
from controlplane.incidents.decisions import IllegalTransition


def body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "field": field}


def _first(detail: Any, path: str | None = None) -> tuple[str | None, str, str]:
    """The first (field path, message, code) of DRF's nested validation detail."""
    if isinstance(detail, dict):
        key, value = next(iter(detail.items()))
        inner = path if key == "non_field_errors" else f"{path}.{key}" if path else str(key)
        return _first(value, inner)
    if isinstance(detail, list) and detail:
        return _first(detail[0], path)
    return path, str(detail), str(getattr(detail, "code", None) or "invalid")


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, RecoveryError):
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        return Response(body(exc.code, message, exc.field), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, IllegalTransition):
        return Response(body(exc.code, str(exc)), status=status.HTTP_409_CONFLICT)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, ValidationError):
        field, message, code = _first(exc.detail)
        response.data = body(code, message, field)
    elif isinstance(response.data, dict) and "detail" in response.data:
        # every other DRF error (Http404 and PermissionDenied arrive converted) has one detail
        detail = response.data["detail"]
        response.data = body(str(getattr(detail, "code", "error")), str(detail))
    return response


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 404 for a URL no route matches (``handler404``): under /api/ the API's one JSON
    shape (an id with a dot or a slash in it), elsewhere the usual page."""
    if request.path.startswith("/api/"):
        return JsonResponse(body("not_found", "no such URL in the API"), status=404)
    return defaults.page_not_found(request, exception)
