"""A job's live picture from its heartbeats, computed at most twice a second however many read it.

The dashboard and ``GET /api/v1/jobs/{id}/live/`` read one aggregate per job: the nodes heard
from, each one's step and device states, and the job's step, loss, throughput and step time.
It is built from Redis (never the database) and kept there for ``MAX_AGE_S``; a reader that
finds it stale rebuilds it under a short lock, so a thousand viewers of a 2,048-node job cost
the same as one: a snapshot per half second, not a fan-out of every heartbeat.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from typing import Any

import redis as redis_sync
from redis.exceptions import RedisError

from controlplane.jobs import liveness

MAX_AGE_S = 0.5


def snapshot_key(job_id: int) -> str:
    return f"{liveness.PREFIX}:job:{job_id}:snapshot"


def build(redis: redis_sync.Redis, job_id: int, now_s: float | None = None) -> dict[str, Any]:
    """The job's picture now: every watched node's latest heartbeat, and their aggregate."""
    now_s = time.time() if now_s is None else now_s
    pipe = redis.pipeline(transaction=False)
    pipe.zrange(liveness.seen_key(job_id), 0, -1, withscores=True)
    pipe.hgetall(liveness.frames_key(job_id))
    seen, frames = pipe.execute()
    frames = {_text(k): v for k, v in frames.items()}
    nodes, states = [], Counter[str]()
    steps, losses, rates, step_times = [], [], [], []
    for name, heard in seen:
        raw = frames.get(_text(name))
        metrics = json.loads(raw) if raw else {}
        devices = {str(d["device"]): d["state"] for d in metrics.get("devices", [])}
        states.update(devices.values())
        nodes.append(
            {
                "node": _text(name),
                "age_s": round(now_s - float(heard), 3),
                "step": metrics.get("step"),
                "devices": devices,
            }
        )
        if metrics.get("step") is not None:
            steps.append(metrics["step"])
        losses.extend(_finite(metrics.get("loss")))
        rates.extend(_finite(metrics.get("samples_per_s")))
        step_times.extend(_finite(metrics.get("step_time_s")))
    return {
        "job": job_id,
        "at": now_s,
        "nodes_connected": len(nodes),
        "device_states": dict(states),
        "step": max(steps, default=None),
        "loss": _mean(losses),
        "samples_per_s": _clamp(sum(rates)) if rates else None,
        "step_time_s": _median(step_times),
        "nodes": nodes,
    }


def latest(redis: redis_sync.Redis, job_id: int) -> dict[str, Any]:
    """The job's snapshot, at most ``MAX_AGE_S`` old: the cached one, or one built now by
    whichever reader takes the lock (the others keep the previous one meanwhile)."""
    key = snapshot_key(job_id)
    cached = redis.get(key)
    if cached is not None:
        found: dict[str, Any] = json.loads(cached)
        return found
    if not redis.set(f"{key}:lock", 1, nx=True, px=int(MAX_AGE_S * 1000)):
        stale = redis.get(f"{key}:last")
        if stale is not None:
            previous: dict[str, Any] = json.loads(stale)
            return previous
    built = build(redis, job_id)
    text = json.dumps(built, separators=(",", ":"))
    pipe = redis.pipeline(transaction=False)
    pipe.set(key, text, px=int(MAX_AGE_S * 1000))
    pipe.set(f"{key}:last", text, ex=60)
    pipe.execute()
    return built


def job_step(job_id: int, *, known: int | None = None) -> int | None:
    """The job's last reported step: the highest of its nodes' latest heartbeats (``Writer``
    keeps them, scored, in ``liveness.steps_key``), and a step ``known`` otherwise (a node that
    just failed, which may be forgotten by now); None when none is known. One read, not the
    picture of every node: at 2,048 nodes, building that took 0.1 s of a failure's record.
    Redis out of reach counts as nothing known: what asks (a failure being recorded) goes on
    without."""
    steps = [known]
    try:
        highest = liveness.sync_client().zrange(liveness.steps_key(job_id), -1, -1, withscores=True)
        steps.extend(int(pair[1]) for pair in highest)
    except (RedisError, OSError):
        pass
    return max((s for s in steps if s is not None), default=None)


# The aggregates of finite reports stay finite, so the picture is always valid JSON (which has
# no inf or NaN): no sum or mean overflows, a sum beyond a float is the largest float.


def _finite(value: Any) -> list[float]:
    """The value as a one-item list when it is a finite number, else nothing."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value) if abs(value) <= sys.float_info.max else math.inf
        return [number] if math.isfinite(number) else []
    return []


def _clamp(value: float) -> float:
    return max(-sys.float_info.max, min(sys.float_info.max, value))


def _mean(values: list[float]) -> float | None:
    if not values:
        return None
    mean = _clamp(sum(v / len(values) for v in values))  # divided first: no overflow
    return max(min(values), min(max(values), mean))  # and no rounding outside the values


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered, middle = sorted(values), len(values) // 2
    if len(values) % 2:
        return ordered[middle]
    low, high = ordered[middle - 1], ordered[middle]
    return max(low, min(high, low / 2 + high / 2))  # halved first: no overflow


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
