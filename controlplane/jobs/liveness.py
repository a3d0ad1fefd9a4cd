"""Heartbeats in Redis: the last time each node was heard from, and its latest metrics.

A heartbeat is one pipelined round trip (the node's metrics hash and its score in the job's
"last seen" sorted set), never a database row. The failure detector asks which nodes have been
silent past the deadline; the dashboard reads the latest metrics.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

PREFIX = "pitstop"
# Seconds between heartbeats and how many missed ones make a node failed (docs/protocol.md).
HEARTBEAT_INTERVAL_S: float = settings.PITSTOP_HEARTBEAT_INTERVAL_S
MISSED_BEATS: int = settings.PITSTOP_MISSED_BEATS


def seen_key(job_id: int) -> str:
    return f"{PREFIX}:job:{job_id}:seen"


def metrics_key(job_id: int, node: str) -> str:
    return f"{PREFIX}:job:{job_id}:node:{node}"


JOBS_KEY = f"{PREFIX}:jobs"  # jobs with a node connected, for the detector's scan
BEATS_KEY = f"{PREFIX}:heartbeats"  # every heartbeat received, for /metrics


def client() -> aioredis.Redis:
    return aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


async def beat(
    redis: aioredis.Redis, job_id: int, node: str, at_s: float, metrics: dict[str, Any]
) -> None:
    """Record a heartbeat heard at ``at_s`` (the server's clock) with its metrics."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(seen_key(job_id), {node: at_s})
        pipe.sadd(JOBS_KEY, job_id)
        pipe.incr(BEATS_KEY)
        pipe.hset(
            metrics_key(job_id, node),
            mapping={"at": at_s, "metrics": json.dumps(metrics, separators=(",", ":"))},
        )
        await pipe.execute()


async def forget(redis: aioredis.Redis, job_id: int, node: str) -> None:
    """The node left (goodbye) or was declared failed: the detector stops watching it."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(seen_key(job_id), node)
        pipe.delete(metrics_key(job_id, node))
        await pipe.execute()


async def silent(
    redis: aioredis.Redis, now_s: float, deadline_s: float
) -> list[tuple[int, str, float]]:
    """(job, node, last heard) of every watched node silent for more than ``deadline_s``."""
    out: list[tuple[int, str, float]] = []
    for job in await redis.smembers(JOBS_KEY):
        found: list[Any] = await redis.zrangebyscore(
            seen_key(int(job)), "-inf", f"({now_s - deadline_s}", withscores=True
        )
        out.extend((int(job), str(pair[0]), float(pair[1])) for pair in found)
    return out


async def latest(redis: aioredis.Redis, job_id: int, node: str) -> dict[str, Any] | None:
    """The node's last heartbeat: when it was heard and its metrics; None if not watched."""
    found = await redis.hgetall(metrics_key(job_id, node))
    if not found:
        return None
    return {"at": float(found["at"]), "metrics": json.loads(found["metrics"])}
