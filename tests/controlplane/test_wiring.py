"""The ASGI application, the channel layer and the OpenAPI schema are wired together."""

import asyncio

import pytest
from channels.layers import get_channel_layer
from channels.routing import ProtocolTypeRouter
from django.test import Client


def test_asgi_application_routes_http_and_websockets() -> None:
    from controlplane.asgi import application

    assert isinstance(application, ProtocolTypeRouter)
    assert set(application.application_mapping) == {"http", "websocket"}


@pytest.mark.asyncio
async def test_channel_layer_carries_a_message_through_redis() -> None:
    layer = get_channel_layer()
    assert layer is not None
    channel = await layer.new_channel()
    try:
        await layer.send(channel, {"type": "probe.message", "text": "hello"})
        received = await asyncio.wait_for(layer.receive(channel), timeout=5)
    finally:
        await layer.close_pools()
    assert received == {"type": "probe.message", "text": "hello"}


def test_openapi_schema_is_served(client: Client) -> None:
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "Pitstop control plane API"
