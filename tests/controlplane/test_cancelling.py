"""A loop that awaits Redis stops when it is cancelled, at whatever moment the cancellation lands
(real Redis). On Python 3.11, redis-py's ``asyncio.wait_for`` around each command's write loses
a cancellation that arrives as the write completes; a loop that ran on then held its event
loop's close forever (a test's teardown waited 900 s for ``watch_loop``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from controlplane.jobs import detector, liveness

pytestmark = pytest.mark.asyncio

TRIES = 40  # one cancellation in two was lost in a loop of commands, before the fix


async def ends_on_cancel(start: Callable[[], Coroutine[Any, Any, None]], after_s: float) -> bool:
    """Whether the loop ``start`` makes ends cancelled within 2 s of a cancellation sent
    ``after_s`` after it began."""
    task = asyncio.get_running_loop().create_task(start())
    await asyncio.sleep(after_s)
    task.cancel()
    # not ``asyncio.wait_for``: on 3.11 it is what loses cancellations
    await asyncio.wait({task}, timeout=2)
    if not task.done():  # a loop that ran on: stop it for good, and say so
        for _ in range(100):
            task.cancel()
            await asyncio.sleep(0.001)
            if task.done():
                break
        return False
    return task.cancelled()


def spread(tries: int) -> list[float]:
    """Cancellation moments from 0 to 4 ms after the start, a few commands into the loop."""
    return [0.004 * n / tries for n in range(tries)]


async def test_the_event_loop_watcher_stops_at_any_cancellation(monkeypatch: Any) -> None:
    monkeypatch.setattr(liveness, "LOOP_PERIOD_S", 0.0)  # a command each turn, no pause
    clients = []

    async def watcher() -> None:
        client = liveness.client(size=1)
        clients.append(client)
        await liveness.watch_loop(client, "test-cancelling")

    try:
        ended = [await ends_on_cancel(watcher, after_s) for after_s in spread(TRIES)]
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
    assert ended.count(False) == 0, f"{ended.count(False)} of {TRIES} loops ran on"


@pytest.mark.django_db(transaction=True)
async def test_the_detector_loop_stops_at_any_cancellation() -> None:
    async def run() -> None:
        # a period of a millisecond: a lease, a sweep and its database work each turn
        await detector.run(0.001, lease_ttl_s=1.0)

    ended = [await ends_on_cancel(run, after_s) for after_s in spread(TRIES // 2)]
    assert ended.count(False) == 0, f"{ended.count(False)} of {TRIES // 2} loops ran on"
