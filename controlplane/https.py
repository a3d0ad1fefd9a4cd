"""Serving behind a TLS-terminating proxy: its settings read from the environment, and the
content security policy every response carries."""

from __future__ import annotations

import re
from inspect import iscoroutinefunction
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.utils.decorators import sync_and_async_middleware

# A header name as a proxy sends it; Django reads it as HTTP_ + the name upper-cased, "-" as "_".
_HEADER_NAME = re.compile(r"[A-Za-z0-9]+(-[A-Za-z0-9]+)*")
_HEADER_VALUE = re.compile(r"[!-~]+")  # visible ASCII, no spaces

# Every page's scripts and styles are files of this server (webui/static, plotly.js from its
# package); the dashboard's sockets go back to the same host (CSP3's 'self' covers ws: and wss:).
# Inline styles stay allowed: plotly.js adds its own (Chromium blocks them otherwise, and the
# charts lose their layout), and the admin's and DRF's pages carry style attributes.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; connect-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
# drf-spectacular's Swagger UI page starts Swagger UI with an inline script.
_INLINE_SCRIPTS = CONTENT_SECURITY_POLICY.replace(
    "script-src 'self'", "script-src 'self' 'unsafe-inline'"
)
_POLICY_BY_VIEW = {"api:docs": _INLINE_SCRIPTS}


def proxy_ssl_header(value: str, *, variable: str = "SECURE_PROXY_SSL_HEADER") -> tuple[str, str]:
    """``"X-Forwarded-Proto: https"``, the header a TLS-terminating proxy sets on the requests it
    received over https, as Django's SECURE_PROXY_SSL_HEADER (``("HTTP_X_FORWARDED_PROTO",
    "https")``). A malformed value is an ImproperlyConfigured naming ``variable``."""
    name, colon, expected = (part.strip() for part in value.partition(":"))
    if not colon or not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(expected):
        raise ImproperlyConfigured(
            f"{variable}={value!r}: expected 'HEADER: VALUE', the header and value the TLS proxy"
            " sets on https requests, e.g. 'X-Forwarded-Proto: https' (a header name of"
            " letters, digits and '-')"
        )
    return "HTTP_" + name.upper().replace("-", "_"), expected


def trusted_origins(values: list[str], *, variable: str = "CSRF_TRUSTED_ORIGINS") -> list[str]:
    """Origins (``https://pitstop.example``, ``https://*.example.com:8443``) from which a
    browser may POST although the server sees another host; a malformed one is an
    ImproperlyConfigured naming ``variable``."""
    origins = []
    for value in filter(None, (value.strip() for value in values)):
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
        except ValueError as error:
            raise _bad_origin(variable, value, f"a malformed host or port ({error})") from None
        if parts.scheme not in ("http", "https"):
            raise _bad_origin(variable, value, "the scheme must be http or https")
        if not parts.hostname or "@" in parts.netloc:
            raise _bad_origin(variable, value, "a host is needed, without a user")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise _bad_origin(variable, value, "an origin has no path, query or fragment")
        origins.append(f"{parts.scheme}://{parts.netloc.lower()}")
    return origins


def _bad_origin(variable: str, value: str, why: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(
        f"{variable}: {value!r} is not an origin like https://pitstop.example: {why}"
    )


def seconds(value: str, *, variable: str, most: int = 2**31 - 1) -> int:
    """A whole number of seconds from 0 to ``most``; anything else an ImproperlyConfigured."""
    digits = value.strip()
    if not (digits.isascii() and digits.isdecimal() and len(digits) <= 10 and int(digits) <= most):
        raise ImproperlyConfigured(
            f"{variable}={value!r}: expected a whole number of seconds from 0 to {most}"
        )
    return int(digits)


@sync_and_async_middleware
def content_security_policy(get_response: Any) -> Any:
    """Django middleware: every response says which sources its page may load
    (``Content-Security-Policy``), unless the view set its own."""

    def apply(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        if "Content-Security-Policy" not in response:
            match = request.resolver_match
            view = match.view_name if match is not None else ""
            response["Content-Security-Policy"] = _POLICY_BY_VIEW.get(view, CONTENT_SECURITY_POLICY)
        return response

    if iscoroutinefunction(get_response):

        async def serve_async(request: HttpRequest) -> Any:
            return apply(request, await get_response(request))

        return serve_async

    def serve(request: HttpRequest) -> Any:
        return apply(request, get_response(request))

    return serve
