"""Messages to connected agents: one Redis pub/sub subscription per server process.

An agent's consumer owns no channel-layer channel. With one per socket, every consumer waits on
the layer's receive loop, and at 2,048 sockets that loop is the main cause of second-long tail
stalls in heartbeat ingest (docs/architecture.md). Instead each process subscribes once, to
``PATTERN`` (the deployment's ``PREFIX:agent:*``); a message published to a node's channel
(``publish``) reaches the handler of that node's consumer, in whichever process holds its socket;
a job's messages to several nodes at once travel as one bundle on the job's channel
(``publish_each``), which each hub hands out to the nodes it holds.

Publishing is fire-and-forget: a message sent while a node has no socket, or lost to a Redis
restart, is gone. Commands therefore live in the database and are sent again until their agent
acknowledges them (``incidents.commands``); only what may be lost travels here alone.

Pub/sub ignores the database number: the deployment's prefix (``PITSTOP_REDIS_PREFIX``, which
holds the number and ``PITSTOP_NAMESPACE``) keeps deployments on one Redis server from hearing
each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog
from django.conf import settings
from redis.exceptions import RedisError

from controlplane.jobs import liveness

log = structlog.get_logger(__name__)

# What a process subscribes to: every node channel of this deployment, and only of this one.
PATTERN = f"{settings.PITSTOP_REDIS_PREFIX}:agent:*"
Handler = Callable[[dict[str, Any]], Awaitable[None]]
# The longest the hub delivers messages before the rest of its event loop has a turn.
TURN_S = 0.02


def channel(job_id: int, node: str) -> str:
    return f"{settings.PITSTOP_REDIS_PREFIX}:agent:{job_id}:{node}"


def bundle_channel(job_id: int) -> str:
    """The job's messages to several of its nodes at once (``publish_each``), within
    ``PATTERN``: a node's channel always names its node after the job."""
    return f"{settings.PITSTOP_REDIS_PREFIX}:agent:{job_id}"


_BUNDLES = re.compile(re.escape(f"{settings.PITSTOP_REDIS_PREFIX}:agent:") + r"(\d+)")


_publisher: redis.Redis | None = None


def _client() -> redis.Redis:
    global _publisher
    if _publisher is None:
        _publisher = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    return _publisher


def publish(job_id: int, node: str, message: dict[str, Any]) -> int:
    """Send ``message`` to the node's consumer (from sync code: views, tasks); returns how many
    server processes heard it. Raises ``RedisError`` when Redis is down."""
    return int(_client().publish(channel(job_id, node), json.dumps(message)))


def publish_each(messages: Iterable[tuple[int, str, dict[str, Any]]]) -> None:
    """``publish`` each (job, node, message), in one round trip: a job's messages to several
    nodes (a command to each of its nodes) as one bundle, ``{"each": [[node, message], ...]}``
    on ``bundle_channel``, that each server's hub hands out to the nodes it holds. One message
    each was 2,047 messages through Redis to every server and 2,047 reads of its subscription,
    a tenth of a server's event loop while a 2,048-node job's plan was applied. Raises
    ``RedisError`` when Redis is down."""
    by_job: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for job_id, node, message in messages:
        by_job.setdefault(job_id, []).append((node, message))
    pipe = _client().pipeline(transaction=False)
    for job_id, each in by_job.items():
        if len(each) == 1:
            [(node, message)] = each
            pipe.publish(channel(job_id, node), json.dumps(message))
        else:
            pipe.publish(bundle_channel(job_id), json.dumps({"each": each}))
    pipe.execute()


async def apublish(client: aioredis.Redis, job_id: int, node: str, message: dict[str, Any]) -> int:
    """``publish`` from a consumer, on its own client."""
    return int(await client.publish(channel(job_id, node), json.dumps(message)))


class Hub:
    """This event loop's subscription and the handlers of the nodes connected to it."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, Handler]] = {}  # channel -> owner -> handler
        self.subscribed = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None

    async def join(self, job_id: int, node: str, owner: str, handler: Handler) -> None:
        """Deliver the node's messages to ``owner``'s ``handler`` from now on (waits for the
        subscription, at most a few seconds: a message published after ``join`` is heard)."""
        self.handlers.setdefault(channel(job_id, node), {})[owner] = handler
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.subscribed.wait(), timeout=5)

    def leave(self, job_id: int, node: str, owner: str) -> None:
        key = channel(job_id, node)
        mine = self.handlers.get(key, {})
        mine.pop(owner, None)
        if not mine:
            self.handlers.pop(key, None)
        if not self.handlers and self.reader is not None:
            self.reader.cancel()  # nobody left to deliver to: the next join subscribes again
            self.reader = None
            self.subscribed.clear()

    async def _read(self) -> None:
        """Read the subscription for as long as a handler is joined; reconnect after a Redis
        restart (messages published meanwhile are lost, which the senders allow for)."""
        backoff = 0.1
        while self.handlers:
            liveness.stop_if_cancelled()
            client = aioredis.Redis.from_url(
                settings.REDIS_URL, socket_connect_timeout=liveness.CONNECT_TIMEOUT_S
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(PATTERN)
                self.subscribed.set()
                backoff = 0.1
                loop = asyncio.get_running_loop()
                turn_ends = loop.time() + TURN_S
                while self.handlers:
                    liveness.stop_if_cancelled()
                    message = await pubsub.get_message(timeout=1.0)
                    for key, body in [] if message is None else _addressed(message):
                        await self._deliver(key, body)
                        if loop.time() > turn_ends:
                            # messages that came together (a bundle, or a buffer's worth), and
                            # a handler that sends to its socket never waits: without a turn for
                            # the rest of the loop, a plan's commands to 2,048 nodes held it
                            # 12 s, and no heartbeat was read meanwhile (a turn after each
                            # message made the commands' delivery three times slower)
                            await asyncio.sleep(0)
                            turn_ends = loop.time() + TURN_S
                    if loop.time() > turn_ends:
                        await asyncio.sleep(0)
                        turn_ends = loop.time() + TURN_S
            except RedisError as exc:
                log.warning("hub.redis_lost", error=str(exc), retry_in_s=backoff)
                self.subscribed.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
                    await client.aclose()
        self.subscribed.clear()

    async def _deliver(self, key: str, body: Any) -> None:
        for handler in list(self.handlers.get(key, {}).values()):
            try:
                await handler(body)
            except Exception:  # one consumer's failure must not stop the others' messages
                log.exception("hub.handler_failed", channel=key)


def _addressed(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """A message read from the subscription as (node channel, body) pairs: one, or a bundle's
    each; none, logged, for one that cannot be read."""
    key = message["channel"].decode()
    try:
        body = json.loads(message["data"])
    except ValueError:
        log.warning("hub.malformed", channel=key)
        return []
    bundle = _BUNDLES.fullmatch(key)
    if bundle is None:
        return [(key, body)]
    job_id = int(bundle.group(1))
    try:
        return [(channel(job_id, node), each) for node, each in body["each"]]
    except (KeyError, TypeError, ValueError):
        log.warning("hub.malformed", channel=key)
        return []


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


def hub() -> Hub:
    """The running event loop's hub (a server process has one loop; tests may have several)."""
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None:
        found = _hubs[loop] = Hub()
    return found
