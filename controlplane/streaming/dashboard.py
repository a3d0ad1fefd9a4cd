"""The dashboard's socket, ``/ws/dashboard/jobs/<id>/``: a job's live picture for browsers.

A logged-in user with a role (the session, through Channels' auth middleware) gets, every
``PERIOD_S``:

- ``{"type": "live", ...}``: the job's snapshot (``jobs/snapshot.py``, shared by every reader,
  at most 0.5 s old) with the nodes' device states folded into one letter a device
  (``beats``: ``h`` training, ``r`` paused or restoring, ``f`` failed, ``s`` a node whose
  heartbeat is late, ``.`` not heard from or idle), so 16,384 devices cost 16 KB, not a tree;
- ``{"type": "devices", ...}``, when it starts and whenever the job's failures, decisions,
  drills or device rows change: every device's stored state as one letter (``h`` healthy,
  ``s`` suspect, ``f`` failed, ``p`` spare, ``r`` recovering), the job's status and its latest
  decision and failure. The page fetches its server-drawn parts again on each (the plan, the
  recoveries, the drills: ``webui.views.job_parts``);
- ``{"type": "expired", ...}`` and a close with code 4401 when the browser's session ended (a
  logout in another tab, an expiry, a password change), checked every ``SESSION_CHECK_S``.

The change check is one small query a period; the device rows are read only when it changes.
The consumer owns no channel-layer channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from typing import Any

import structlog
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.db.models import Count, OuterRef, Subquery
from django.utils.crypto import constant_time_compare
from redis.exceptions import RedisError

from controlplane.incidents.models import Drill, Failure, RecoveryDecision
from controlplane.jobs import liveness, snapshot
from controlplane.jobs.models import Device, DeviceState, Job

log = structlog.get_logger(__name__)

PERIOD_S = 0.5
# How often a socket asks whether its browser's session still stands (one small query).
SESSION_CHECK_S = 2.0
# The close code of a socket whose session ended; the page says so and does not reconnect.
SESSION_ENDED = 4401
# The roles (Django groups) that may read; controlplane.api.roles defines them.
READERS = ("viewer", "operator", "admin")
LETTER: dict[str, str] = {
    DeviceState.HEALTHY: "h",
    DeviceState.SUSPECT: "s",
    DeviceState.FAILED: "f",
    DeviceState.SPARE: "p",
    DeviceState.RECOVERING: "r",
}
BEAT_LETTER: dict[str, str] = {"training": "h", "paused": "r", "restoring": "r", "failed": "f"}


def may_watch(user: Any, job_id: int) -> int | None:
    """The job's device count if ``user`` may watch it, else None."""
    if user is None or not user.is_authenticated:
        return None
    if not (user.is_superuser or user.groups.filter(name__in=READERS).exists()):
        return None
    if not Job.objects.filter(pk=job_id).exists():
        return None
    return Device.objects.filter(job_id=job_id).count()


def signature(job_id: int) -> tuple[Any, ...] | None:
    """What changes when a failure, a decision, a drill or the devices' stored states do: one
    query."""
    decisions = RecoveryDecision.objects.filter(job=OuterRef("pk")).order_by("-updated_at", "-pk")
    failures = Failure.objects.filter(job=OuterRef("pk")).order_by("-pk")
    drills = Drill.objects.filter(job=OuterRef("pk")).order_by("-created_at")
    by_state = (
        Device.objects.filter(job=OuterRef("pk"))
        .exclude(state=DeviceState.HEALTHY)
        .values("job")
        .annotate(n=Count("pk"))
    )
    found = (
        Job.objects.filter(pk=job_id)
        .annotate(
            decision=Subquery(decisions.values("pk")[:1]),
            decision_status=Subquery(decisions.values("status")[:1]),
            decision_at=Subquery(decisions.values("updated_at")[:1]),
            failure=Subquery(failures.values("pk")[:1]),
            failure_devices=Subquery(failures.values("devices")[:1]),
            unhealthy=Subquery(by_state.values("n")[:1]),
            failed=Subquery(
                by_state.filter(state=DeviceState.FAILED).values("n")[:1],
            ),
            drill=Subquery(drills.values("pk")[:1]),
            drill_acked=Subquery(drills.values("acked_at")[:1]),
        )
        .values_list(
            "status",
            "decision",
            "decision_status",
            "decision_at",
            "failure",
            "failure_devices",
            "unhealthy",
            "failed",
            "drill",
            "drill_acked",
        )
        .first()
    )
    return None if found is None else tuple(str(v) for v in found)


def session_stands(session_key: str | None, user: Any) -> bool:
    """Whether the session the socket was opened with is still ``user``'s: not flushed by a
    logout, not expired, its user active and its password unchanged (the checks of Django's
    ``get_user``)."""
    if session_key is None:
        return False
    engine = importlib.import_module(settings.SESSION_ENGINE)
    stored = engine.SessionStore(session_key).load()  # {} once flushed or expired
    if str(stored.get(SESSION_KEY)) != str(user.pk):
        return False
    now = get_user_model().objects.filter(pk=user.pk, is_active=True).first()  # as stored now
    return now is not None and constant_time_compare(
        stored.get(HASH_SESSION_KEY, ""), now.get_session_auth_hash()
    )


def devices_message(job_id: int) -> dict[str, Any]:
    states = Device.objects.filter(job_id=job_id).order_by("index").values_list("state", flat=True)
    status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
    decision = (
        RecoveryDecision.objects.filter(job_id=job_id)
        .order_by("-created_at", "-pk")
        .values("pk", "status", "failure_id", "failure__kind", "failure__detected_at")
        .first()
    )
    return {
        "type": "devices",
        "states": "".join(LETTER.get(s, "h") for s in states),
        "job_status": status,
        "decision": None
        if decision is None
        else {
            "id": decision["pk"],
            "status": decision["status"],
            "failure": decision["failure_id"],
            "kind": decision["failure__kind"],
            "detected_at": decision["failure__detected_at"].isoformat(),
        },
    }


def live_message(job_id: int, devices: int) -> dict[str, Any]:
    found = snapshot.latest(liveness.sync_client(), job_id)
    beats = ["."] * devices
    late = 2.5 * liveness.HEARTBEAT_INTERVAL_S
    for node in found["nodes"]:
        for device, state in node["devices"].items():
            index = int(device)
            if 0 <= index < devices:
                letter = BEAT_LETTER.get(state, ".")
                beats[index] = "s" if node["age_s"] > late and letter != "f" else letter
    return {
        "type": "live",
        **{k: found.get(k) for k in ("at", "step", "loss", "samples_per_s", "step_time_s")},
        "nodes_connected": found["nodes_connected"],
        "beats": "".join(beats),
    }


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    channel_layer_alias = None  # it only sends, from its own loop

    async def connect(self) -> None:
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        devices = await database_sync_to_async(may_watch)(self.scope.get("user"), self.job_id)
        if devices is None:
            await self.close(code=4403)
            return
        self.devices = devices
        # None where the socket came without a session (tests that set the user themselves)
        session = self.scope.get("session")
        self.session_key = None if session is None else session.session_key
        await self.accept()
        self.loop_task = asyncio.create_task(self.run())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "loop_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        pass  # browsers only listen

    async def session_ended(self) -> bool:
        if "session" not in self.scope:
            return False
        user = self.scope.get("user")
        return not await database_sync_to_async(session_stands)(self.session_key, user)

    async def run(self) -> None:
        seen: tuple[Any, ...] | None = None
        checked = asyncio.get_running_loop().time()
        while True:
            if asyncio.get_running_loop().time() - checked >= SESSION_CHECK_S:
                checked = asyncio.get_running_loop().time()
                if await self.session_ended():
                    message = "your session ended (logged out, or expired): log in again"
                    await self.send_json({"type": "expired", "message": message})
                    await self.close(code=SESSION_ENDED)
                    return
            try:
                now = await database_sync_to_async(signature)(self.job_id)
                if now is None:
                    await self.close(code=4404)
                    return
                if now != seen:
                    message = await database_sync_to_async(devices_message)(self.job_id)
                    self.devices = len(message["states"])
                    await self.send_json(message)
                    seen = now
                await self.send_json(
                    await asyncio.to_thread(live_message, self.job_id, self.devices)
                )
            except RedisError as exc:
                await self.send_json({"type": "error", "message": f"live data: {exc}"})
            await asyncio.sleep(PERIOD_S)
