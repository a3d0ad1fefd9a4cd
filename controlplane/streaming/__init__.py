"""Streaming: Channels consumers and websocket routing (agent socket, dashboard socket)."""
