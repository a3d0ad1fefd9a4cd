"""The dashboard's socket: readers only, the stored device states when they change and the live
snapshot twice a second, one letter a device."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser, User
from django.contrib.sessions.backends.db import SessionStore
from django.db import connections
from django.test import Client
from django.utils import timezone

from controlplane.incidents import decisions
from controlplane.incidents.models import FailureSource
from controlplane.jobs import liveness, snapshot
from controlplane.jobs.services import create_job
from controlplane.streaming import dashboard
from controlplane.streaming.routing import browser_urlpatterns
from tests.controlplane.test_api import SCENARIO, user
from tests.controlplane.test_live import beat

pytestmark = pytest.mark.django_db(transaction=True)


def communicator(job_id: int, who: Any) -> WebsocketCommunicator:
    found = WebsocketCommunicator(URLRouter(browser_urlpatterns), f"/ws/dashboard/jobs/{job_id}/")
    found.scope["user"] = who
    return found


async def next_of(socket: WebsocketCommunicator, kind: str) -> dict[str, Any]:
    for _ in range(20):
        message: dict[str, Any] = await socket.receive_json_from(timeout=3)
        if message["type"] == kind:
            return message
    raise AssertionError(f"no {kind} message")


def test_a_viewer_gets_device_states_and_the_live_snapshot() -> None:
    job, _ = create_job("socket", copy.deepcopy(SCENARIO))
    viewer = user("viewer")

    key = snapshot.snapshot_key(job.pk)  # a job id of an earlier test run may have left these
    stale = (liveness.seen_key(job.pk), liveness.frames_key(job.pk), key, f"{key}:last",
             f"{key}:lock")  # fmt: skip
    liveness.sync_client().delete(*stale)

    async def scenario() -> None:
        await beat(job.pk, [("node-0", 7, ["training"] * 3 + ["paused"])])
        socket = communicator(job.pk, viewer)
        connected, _ = await socket.connect()
        assert connected
        devices = await next_of(socket, "devices")
        assert devices["states"] == "h" * 8 + "pp" and devices["decision"] is None
        live = await next_of(socket, "live")
        assert live["step"] == 7 and live["beats"] == "hhhr......"
        await sync_to_async(decisions.record_failure)(
            job, kind="crash", devices=[2], source=FailureSource.AGENT,
            occurred_at=timezone.now(),
        )  # fmt: skip
        changed = await next_of(socket, "devices")  # within a period (0.5 s)
        assert changed["states"][2] == "f" and changed["decision"]["status"] == "planning"
        await socket.disconnect()
        await sync_to_async(connections.close_all)()  # the database thread's, before teardown

    asyncio.run(scenario())


@pytest.mark.parametrize("who", ["anonymous", "no role"])
def test_only_readers_may_watch(who: str) -> None:
    job, _ = create_job("socket-closed", copy.deepcopy(SCENARIO))
    person = AnonymousUser() if who == "anonymous" else user(None)

    async def scenario() -> None:
        socket = communicator(job.pk, person)
        connected, _ = await socket.connect()
        assert not connected
        await sync_to_async(connections.close_all)()

    asyncio.run(scenario())


@pytest.mark.parametrize("ended_by", ["logout", "password change"])
def test_a_socket_closes_when_its_browsers_session_ends(ended_by: str) -> None:
    """A logout in another tab flushes the session; a password change voids its hash: either
    way the socket says so and closes with 4401 (the page then stops reconnecting)."""
    job, _ = create_job(f"socket-session-{ended_by}", copy.deepcopy(SCENARIO))
    viewer = user("viewer")
    browser = Client()
    browser.force_login(viewer)
    key = browser.session.session_key

    async def scenario() -> None:
        socket = communicator(job.pk, viewer)
        socket.scope["session"] = SessionStore(key)
        connected, _ = await socket.connect()
        assert connected
        await next_of(socket, "devices")
        await asyncio.sleep(dashboard.SESSION_CHECK_S + 0.5)  # a check passed: still open
        assert (await next_of(socket, "live"))["type"] == "live"
        if ended_by == "logout":
            await sync_to_async(browser.logout)()
        else:
            stored = await User.objects.aget(pk=viewer.pk)  # not the socket's own copy
            stored.set_password("a-new-password-2")
            await stored.asave()
        expired = await next_of(socket, "expired")
        assert "session ended" in expired["message"]
        closed = await socket.receive_output(timeout=dashboard.SESSION_CHECK_S + 2)
        assert closed == {"type": "websocket.close", "code": dashboard.SESSION_ENDED}
        await sync_to_async(connections.close_all)()

    asyncio.run(scenario())
