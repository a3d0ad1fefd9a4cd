"""Dashboard pages."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def index(request: HttpRequest) -> HttpResponse:
    """Landing page: what runs here and where to look next."""
    return render(request, "webui/index.html")
