"""The dashboard's static files gzipped, once per file and process.

WhiteNoise serves the files where Django's finders find them (no ``collectstatic`` step), so it
has no precompressed copies to offer. This middleware, above it, answers a browser that accepts
gzip with the file compressed: plotly.js goes from 4.8 MB to 1.4 MB. Each file is compressed
once per process and kept in memory (the files are a fixed, small set), keyed by its path and
the ``Last-Modified`` WhiteNoise gives it, so an edited file is compressed again. Only complete
answers (200) to GET are touched: ranges, 304s and HEAD pass as WhiteNoise made them.

Caching is WhiteNoise's: plotly.js sits under a path carrying the plotly package's version
(``settings.PLOTLY_JS``), so it is marked immutable (``WHITENOISE_IMMUTABLE_FILE_TEST``) and a
browser fetches it once per version; the project's own files are revalidated after a minute.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.cache import patch_vary_headers

# What gzip shrinks; images other than SVG and fonts are compressed already.
COMPRESSIBLE = ("text/", "application/javascript", "application/json", "image/svg+xml")
SMALLEST = 1024  # bytes: below, the header costs more than it saves
ACCEPTS_GZIP = re.compile(r"\bgzip\b")

# path -> (Last-Modified, the gzipped bytes)
_gzipped: dict[str, tuple[str, bytes]] = {}


def _compressible(request: HttpRequest, response: HttpResponseBase) -> bool:
    return (
        request.method == "GET"
        and response.status_code == 200
        and not response.has_header("Content-Encoding")
        and response.get("Content-Type", "").startswith(COMPRESSIBLE)
        and int(response.get("Content-Length") or 0) >= SMALLEST
        and bool(ACCEPTS_GZIP.search(request.headers.get("Accept-Encoding", "")))
    )


def gzipped(path: str, stamp: str, response: HttpResponseBase) -> bytes:
    """``response``'s body gzipped, from memory when this path and stamp were seen before."""
    known = _gzipped.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    raw = b"".join(response.streaming_content)  # type: ignore[attr-defined]
    body = gzip.compress(raw, compresslevel=6, mtime=0)
    _gzipped[path] = (stamp, body)
    return body


def compressed_static(get_response: Callable[[HttpRequest], HttpResponseBase]) -> Callable:
    prefix = "/" + settings.STATIC_URL.lstrip("/")

    def middleware(request: HttpRequest) -> HttpResponseBase:
        response = get_response(request)
        if not request.path.startswith(prefix) or not _compressible(request, response):
            return response
        try:
            body = gzipped(request.path, response.get("Last-Modified", ""), response)
        finally:
            response.close()
        answer = HttpResponse(body, status=200)
        for name, value in response.items():
            if name.lower() != "content-length":
                answer[name] = value
        answer["Content-Encoding"] = "gzip"
        answer["Content-Length"] = str(len(body))
        patch_vary_headers(answer, ("Accept-Encoding",))
        return answer

    return middleware
