"""The ASGI application, the hub's Redis pub/sub and the OpenAPI schema are wired together."""

import asyncio
from typing import Any

import pytest
from channels.layers import get_channel_layer
from channels.routing import ProtocolTypeRouter
from django.test import Client

from controlplane.streaming import hub


def test_asgi_application_routes_http_and_websockets() -> None:
    from controlplane.asgi import application

    assert isinstance(application, ProtocolTypeRouter)
    assert set(application.application_mapping) == {"http", "websocket"}


@pytest.mark.asyncio
async def test_hub_carries_a_message_through_redis_and_no_channel_layer_is_configured() -> None:
    assert get_channel_layer() is None  # nothing uses one (controlplane/settings.py)
    got: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def handler(message: dict[str, Any]) -> None:
        await got.put(message)

    await hub.hub().join(999_001, "node-0", "probe", handler)
    try:
        heard = await asyncio.to_thread(hub.publish, 999_001, "node-0", {"text": "hello"})
        received = await asyncio.wait_for(got.get(), timeout=5)
    finally:
        hub.hub().leave(999_001, "node-0", "probe")
    assert heard >= 1
    assert received == {"text": "hello"}


def test_openapi_schema_is_served(client: Client) -> None:
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "Pitstop control plane API"
