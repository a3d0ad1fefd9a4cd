"""One-shot Redis PING for health checks: bounded by a timeout and never retried."""

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def ping(url: str, *, timeout_s: float) -> None:
    """Return when the server at `url` answers PING; raise redis.RedisError otherwise.

    redis-py retries connection errors with back-off by default, which would turn "down" into
    a multi-second wait; a probe wants the first answer.
    """
    client = redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries=0),
    )
    try:
        client.ping()
    finally:
        client.close()
