"""Daphne's websocket transport: a connection it fails is closed with a code, never dropped.

Daphne's autobahn factory fails a connection (a message over ``--websocket-max-message-size``,
1 MiB by default, or a broken frame) by dropping its TCP connection: the agent sees a reset and
no reason, where the protocol promises a close code (docs/protocol.md). With ``failByDrop`` off,
autobahn sends a close frame first (1009, message too big; 1002, protocol error) and reads
nothing more of the message. Daphne sets the factory's other options in ``Server.run`` and
leaves this one at autobahn's default, so the factory class it builds is replaced here, before
``Server.run`` builds it (``controlplane.asgi``, which Daphne's command line imports first).
Its protocol is replaced too, by one that reads each frame without building autobahn's debug
line first.
"""

from __future__ import annotations

from typing import Any


def close_failed_connections() -> None:
    """Make Daphne's websocket factory close a failed connection with a code, and read frames
    without autobahn's debug line (idempotent; a process served by another ASGI server is left
    alone)."""
    try:
        from daphne import server, ws_protocol
    except ImportError:
        return
    base: Any = server.WebSocketFactory
    if getattr(base, "closes_failed_connections", False):
        return
    protocol: Any = ws_protocol.WebSocketProtocol

    class QuietProtocol(protocol):
        def dataReceived(self, data: bytes) -> None:  # Twisted's name
            # autobahn's own formats a debug line for every read, the method's name styled
            # for a terminal, whether or not debug is logged: 9 µs a read, about 2 % of a
            # server's time at 2,048 agents' heartbeats
            self._dataReceived(data)

    class ClosingFactory(base):
        closes_failed_connections = True
        protocol = QuietProtocol

        def resetProtocolOptions(self) -> None:  # autobahn's name
            super().resetProtocolOptions()
            self.failByDrop = False

    server.WebSocketFactory = ClosingFactory
