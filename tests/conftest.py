"""Fixtures every test directory shares."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
import pytest_timeout  # type: ignore[import-untyped]


def _and_the_loops_tasks(dump: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """pytest-timeout's report of a test that hangs, after what its event loop waits on: the
    threads' stacks it prints show a loop idle in its poll, not which task never ends."""

    def reported(item: Any, settings: Any) -> None:
        __tracebackhide__ = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            for task in asyncio.all_tasks(loop):
                print(f"--- pending {task!r}", file=sys.stderr)
                task.print_stack(limit=12, file=sys.stderr)
        dump(item, settings)

    return reported


pytest_timeout.timeout_sigalrm = _and_the_loops_tasks(pytest_timeout.timeout_sigalrm)


@pytest.fixture(autouse=True)
def no_watch_left_from_earlier_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test with the database starts with no node watched in Redis. The database is emptied
    between tests and job ids come back, but Redis keeps what an earlier test's agents left:
    job 1's node-0 would be connected, its old heartbeats in job 1's live picture."""
    uses_db = request.node.get_closest_marker("django_db") is not None or any(
        name in request.fixturenames for name in ("db", "transactional_db", "live_server")
    )
    if uses_db:
        from redis.exceptions import RedisError

        from controlplane.jobs import liveness

        with contextlib.suppress(RedisError, OSError):
            redis = liveness.sync_client()
            # and the word of servers an earlier test's event loops ran, stopped with them
            stale = [liveness.JOBS_KEY, liveness.SERVERS_KEY, liveness.BEHIND_KEY]
            stale += redis.scan_iter(f"{liveness.PREFIX}:job:*", count=1000)
            redis.delete(*stale)
    yield


@pytest.fixture
def eager_planning() -> Iterator[None]:
    """Celery tasks (planning among them) run in this process, at once: for tests whose point
    is what calls them, not the worker (the worker's own tests run a real one)."""
    from controlplane.celery import app

    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


@pytest_asyncio.fixture
async def redis() -> AsyncIterator[Any]:
    """An asyncio client of the control plane's Redis (``liveness.client``), closed after."""
    from controlplane.jobs import liveness

    client = liveness.client()
    yield client
    await client.aclose()
