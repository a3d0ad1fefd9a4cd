"""What every dashboard template may name: the address of plotly.js (its folder carries the
plotly package's version, ``settings.PLOTLY_JS``)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def assets(request: HttpRequest) -> dict[str, str]:
    return {"plotly_js": settings.PLOTLY_JS}
