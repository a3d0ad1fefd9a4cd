"""Per-request log context: every event logged while serving a request carries its id."""

from __future__ import annotations

import uuid
from inspect import iscoroutinefunction
from typing import Any

import structlog
from django.http import HttpRequest
from django.utils.decorators import sync_and_async_middleware

# Request ids: a caller's own (a proxy's X-Request-ID, up to this length) or a new one.
REQUEST_ID_HEADER = "X-Request-ID"
MAX_REQUEST_ID = 64


@sync_and_async_middleware
def request_context(get_response: Any) -> Any:
    """Django middleware: every event logged while serving a request carries its request id,
    method and path (and the response says the id back, in ``X-Request-ID``)."""

    def bind(request: HttpRequest) -> str:
        given = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = given if 0 < len(given) <= MAX_REQUEST_ID else uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=request_id, method=request.method, path=request.path
        )
        return request_id

    if iscoroutinefunction(get_response):

        async def serve_async(request: HttpRequest) -> Any:
            request_id = bind(request)
            try:
                response = await get_response(request)
                response[REQUEST_ID_HEADER] = request_id
                return response
            finally:
                structlog.contextvars.clear_contextvars()

        return serve_async

    def serve(request: HttpRequest) -> Any:
        request_id = bind(request)
        try:
            response = get_response(request)
            response[REQUEST_ID_HEADER] = request_id
            return response
        finally:
            structlog.contextvars.clear_contextvars()

    return serve
