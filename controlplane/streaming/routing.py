"""Websocket routes served by Channels (the agent and dashboard consumers will be added here)."""

from django.urls import URLPattern, URLResolver

websocket_urlpatterns: list[URLPattern | URLResolver] = []
