"""The hub: one subscription per event loop, delivering each node's messages to its handlers."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import pytest
import redis
from django.conf import settings
from redis import asyncio as aioredis

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


async def read_raw(pubsub: Any, count: int) -> list[tuple[str, Any]]:
    """The next ``count`` messages a plain subscriber reads: (channel, body)."""
    found: list[tuple[str, Any]] = []
    for _ in range(200):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if message is not None:
            found.append((message["channel"].decode(), json.loads(message["data"])))
        if len(found) >= count:
            break
    return found


async def test_a_jobs_messages_to_several_nodes_go_as_one_bundle_each_to_its_node() -> None:
    """A command to each node of a job is one message through Redis, not one per node; every
    server's hub hands each node its own, and a job's lone message still goes to its node."""
    seen: dict[str, list[Any]] = {"node-0": [], "node-1": [], "node-2": [], "other": []}

    def recorder(node: str) -> Any:
        async def handler(body: dict[str, Any]) -> None:
            seen[node].append(body)

        return handler

    mine = hub.Hub()
    raw = aioredis.Redis.from_url(settings.REDIS_URL)
    watcher = raw.pubsub()
    await watcher.psubscribe(hub.PATTERN)
    for node in ("node-0", "node-1", "node-2"):
        await mine.join(9902, node, "owner", recorder(node))
    await mine.join(9903, "other", "owner", recorder("other"))
    try:
        hub.publish_each(
            [(9902, "node-0", {"n": 0}), (9902, "node-1", {"n": 1}), (9903, "other", {"n": 9}),
             (9902, "node-0", {"n": 2}), (9902, "node-9", {"n": 3})]
        )  # fmt: skip
        through_redis = await read_raw(watcher, 2)
        assert await watcher.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
        assert sorted(channel for channel, _ in through_redis) == sorted(
            [hub.bundle_channel(9902), hub.channel(9903, "other")]
        )
        for _ in range(200):
            if sum(map(len, seen.values())) == 4:
                break
            await asyncio.sleep(0.01)
        # node-9 has no socket here: its message is nobody's, as a lone one would be
        assert seen == {"node-0": [{"n": 0}, {"n": 2}], "node-1": [{"n": 1}], "node-2": [],
                        "other": [{"n": 9}]}  # fmt: skip
    finally:
        for node in ("node-0", "node-1", "node-2"):
            mine.leave(9902, node, "owner")
        mine.leave(9903, "other", "owner")
        await watcher.aclose()
        await raw.aclose()


@pytest.mark.parametrize("data", ["not json", '{"each": 5}', '{"each": [["node-0"]]}', "[1]"])
async def test_a_bundle_that_cannot_be_read_is_dropped_and_the_next_message_delivered(
    data: str,
) -> None:
    seen: list[Any] = []

    async def handler(body: dict[str, Any]) -> None:
        seen.append(body)

    mine = hub.Hub()
    await mine.join(9904, "node-0", "owner", handler)
    publisher = redis.Redis.from_url(settings.REDIS_URL)
    try:
        publisher.publish(hub.bundle_channel(9904), data)
        hub.publish(9904, "node-0", {"after": True})
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [{"after": True}]
        assert mine.reader is not None and not mine.reader.done()
    finally:
        mine.leave(9904, "node-0", "owner")
        publisher.close()
