"""The hub: one subscription per event loop, delivering each node's messages to its handlers."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from controlplane.streaming import hub

pytestmark = pytest.mark.asyncio


async def test_messages_that_come_together_leave_the_event_loop_turns_among_them() -> None:
    """A plan applied on 2,048 nodes is 2,048 messages that arrive together, read from one
    buffer; delivered without a pause they held a server's event loop 12 s, and it read no
    heartbeat meanwhile. The hub delivers for at most ``TURN_S`` (and one message) at a time."""
    turns = 0

    async def other_work() -> None:  # the rest of a server's loop: sockets, heartbeats
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen: list[int] = []
    send_s = 0.002

    async def handler(body: dict[str, Any]) -> None:  # a command sent to a socket: no wait
        seen.append(turns)
        time.sleep(send_s)

    mine = hub.Hub()
    await mine.join(9901, "node-0", "owner", handler)
    ticker = asyncio.create_task(other_work())
    try:
        hub.publish_each((9901, "node-0", {"n": n}) for n in range(300))
        for _ in range(1000):
            if len(seen) == 300:
                break
            await asyncio.sleep(0.01)
        assert len(seen) == 300
        longest = max(len(list(run)) for _, run in itertools.groupby(seen))
        assert longest <= hub.TURN_S / send_s + 2
    finally:
        ticker.cancel()
        mine.leave(9901, "node-0", "owner")
