"""A stalled control plane does not blame the nodes: the detector holds off and records a stall
(real agent sockets, Redis and database); a single silent node is still a failure."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st
from redis import asyncio as aioredis

from controlplane.incidents.models import Failure
from controlplane.jobs import detector, liveness
from controlplane.jobs.models import Job
from tests.controlplane.test_lifecycle import NODES, goodbye, join, new_job
from worker_agent import protocol

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("eager_planning"),
    pytest.mark.serial,  # they block this process's loop and time what it says meanwhile
]


async def all_joined(redis: Any) -> tuple[Job, dict[str, WebsocketCommunicator], float]:
    """A job whose four nodes said hello and beat; when the newest of them was heard."""
    job, token = await new_job()
    sockets = {node: await join(job, token, node) for node in NODES}
    for _ in range(200):  # the writer lingers a few milliseconds before it writes
        if await redis.zcard(liveness.seen_key(job.pk)) == len(NODES):
            break
        await asyncio.sleep(0.01)
    beats = await redis.zrange(liveness.seen_key(job.pk), 0, -1, withscores=True)
    assert len(beats) == len(NODES)
    return job, sockets, max(at for _, at in beats)


async def stalls(redis: Any, reason: str) -> int:
    return int(await redis.hget(detector.STALLS_KEY, reason) or 0)


@database_sync_to_async
def failures(job: Job) -> list[Failure]:
    return list(Failure.objects.filter(job=job))


@pytest.mark.asyncio
async def test_no_node_heard_while_several_are_watched_is_a_stall_not_a_failure(
    redis: Any,
) -> None:
    job, sockets, newest = await all_joined(redis)
    before = await stalls(redis, "none_heard")
    # the detector's clock past the deadline of every node, the newest beat equally old: the
    # view of a detector whose ingest stopped, not of four nodes stopping together
    assert await detector.sweep(redis, now_s=newest + detector.deadline_s() + 1) == []
    assert await failures(job) == []
    assert await stalls(redis, "none_heard") == before + 1
    assert await redis.zcard(liveness.seen_key(job.pk)) == len(NODES)  # still watched
    text = (await database_sync_to_async(Client().get)("/metrics")).content.decode()
    assert f'pitstop_detector_stalls_total{{reason="none_heard"}} {before + 1}.0' in text
    for socket in sockets.values():
        await goodbye(socket)


@pytest.mark.asyncio
async def test_one_silent_node_among_beating_ones_is_still_a_failure(redis: Any) -> None:
    job, sockets, newest = await all_joined(redis)
    now = newest + 0.5  # the others were heard within the deadline
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": now - detector.deadline_s() - 1})
    before = await stalls(redis, "none_heard")
    decided = await detector.sweep(redis, now_s=now)
    assert len(decided) == 1
    [failure] = await failures(job)
    assert (failure.kind, failure.devices, failure.source) == ("hang", NODES["node-1"], "heartbeat")
    assert await stalls(redis, "none_heard") == before
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


@pytest.mark.asyncio
async def test_a_node_heard_after_the_pass_listed_it_silent_is_not_failed(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass lists the silent nodes, then records each failure in turn (a database write
    each): with hundreds listed, the last are reached seconds later. One heard meanwhile is
    watched on, not failed; the others listed are."""
    job, sockets, newest = await all_joined(redis)
    now = newest + 0.5
    old = now - detector.deadline_s() - 1
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": old, "node-2": old})
    listed = await liveness.silent(redis, now, detector.deadline_s())
    assert {node for _, node, _ in listed} == {"node-1", "node-2"}
    await redis.zadd(liveness.seen_key(job.pk), {"node-2": now})  # heard again, after the list

    async def as_listed(*_: Any) -> list[tuple[int, str, float]]:
        return listed

    monkeypatch.setattr(liveness, "silent", as_listed)
    assert len(await detector.sweep(redis, now_s=now)) == 1
    [failure] = await failures(job)
    assert failure.devices == NODES["node-1"]
    assert await redis.zscore(liveness.seen_key(job.pk), "node-2") == now
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


@pytest.mark.asyncio
async def test_a_silence_of_every_node_past_the_hold_window_is_judged(redis: Any) -> None:
    """The hold-off does not blind the detector: all nodes silent for longer than the deadline
    and the hold window after it are failures (a control plane stalled that long lost them)."""
    job, sockets, newest = await all_joined(redis)
    window_s = detector.deadline_s() * (1 + detector.STALL_HOLD_DEADLINES)
    decided = await detector.sweep(redis, now_s=newest + window_s + 1)
    assert decided
    recorded = sorted(d for f in await failures(job) for d in f.devices)
    assert recorded == sorted(d for devices in NODES.values() for d in devices)
    for socket in sockets.values():
        await socket.disconnect()


@pytest.mark.asyncio
async def test_a_detector_that_came_late_to_its_pass_holds_it_off(redis: Any) -> None:
    """This process's previous pass long ago (SIGSTOPped, starved of CPU): one pass is held off,
    the next judges again."""
    job, sockets, _ = await all_joined(redis)
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": time.time() - 60})
    before = await stalls(redis, "detector_lag")
    detector._last_pass_s = time.monotonic() - 10 * detector.deadline_s()
    assert await detector.sweep(redis) == []
    assert await failures(job) == []
    assert await stalls(redis, "detector_lag") == before + 1
    assert len(await detector.sweep(redis)) == 1  # the next pass, on time, finds node-1
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


@pytest.mark.asyncio
async def test_a_server_behind_on_heartbeats_delays_the_judgement_of_a_silent_node(
    redis: Any,
) -> None:
    """A server whose event loop was blocked reports itself behind (``liveness.watch_loop``);
    while it counts, a node silent past the deadline is not judged, one silent past the deadline
    and the hold window after it is."""
    job, sockets, newest = await all_joined(redis)
    now = newest + 0.5
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": now - detector.deadline_s() - 1})
    before = await stalls(redis, "ingest_behind")
    watcher = liveness.shared()[1].watching
    assert watcher is not None and not watcher.done()
    time.sleep(detector.deadline_s() * liveness.LOOP_BEHIND_DEADLINES + liveness.LOOP_PERIOD_S)
    for _ in range(100):  # the watcher wakes late, and says so
        if await redis.zcount(liveness.BEHIND_KEY, time.time(), "+inf"):
            break
        await asyncio.sleep(0.01)
    assert await detector.sweep(redis, now_s=now) == []
    assert await failures(job) == []
    assert await stalls(redis, "ingest_behind") == before + 1
    window_s = detector.deadline_s() * (1 + detector.STALL_HOLD_DEADLINES)
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": now - window_s - 1})
    assert len(await detector.sweep(redis, now_s=now)) == 1
    [failure] = await failures(job)
    assert failure.devices == NODES["node-1"]
    await redis.delete(liveness.BEHIND_KEY)
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


def test_a_beat_is_late_by_its_wait_beyond_its_sockets_fastest_transit_whatever_the_clocks() -> (
    None
):
    late_s = liveness.LOOP_BEHIND_DEADLINES * liveness.deadline_s()
    for offset in (-100.0, 0.0, 3600.0):  # the agent's clock behind, with, ahead of the server's
        transit = liveness.Transit()
        sent = 1_000.0
        assert not transit.late(sent, sent + offset + 0.05)  # the first beat: nothing to go by
        assert not transit.late(sent + 1, sent + 1 + offset + 0.01)  # faster: the new fastest
        assert not transit.late(sent + 2, sent + 2 + offset + 0.01 + late_s * 0.9)
        assert transit.late(sent + 3, sent + 3 + offset + 0.01 + late_s * 1.1)


def test_an_agent_clock_set_back_once_stops_making_its_beats_late() -> None:
    transit = liveness.Transit()
    for k in range(10):
        assert not transit.late(float(k), k + 0.01)
    back_s = 1.0  # the agent's clock now reads a second behind: every beat a second "late"
    beats = [transit.late(k - back_s, k + 0.01) for k in range(10, 3_000)]
    assert beats[0]
    # the fastest transit creeps up DRIFT_S a beat: late no more once it has crept most of it
    caught_up = beats.index(False)
    expected = back_s - liveness.LOOP_BEHIND_DEADLINES * liveness.deadline_s()
    assert caught_up == pytest.approx(expected / liveness.Transit.DRIFT_S, abs=2)
    assert not any(beats[caught_up:])


@pytest.mark.asyncio
async def test_beats_read_late_from_several_sockets_say_behind_and_one_late_agent_does_not(
    redis: Any,
) -> None:
    """A server busy to its last cycle writes promptly and its loop wakes on time, yet reads its
    sockets late: at 2,048 nodes its beats came up to 1.8 s after their agents sent them, and
    the deadline failed nodes that never stopped. Late beats from a few sockets in one batch say
    the process is behind; one late agent (a slow link, a clock that lies) says nothing."""
    writer = liveness.Writer(redis, name="reading-late")
    now = time.time()

    async def written(late: list[bool]) -> bool:
        for i, is_late in enumerate(late):
            writer.beat(1, f"node-{i}", now, "{}", now, None, late=is_late)
        await writer.settle()
        found = await redis.zscore(liveness.BEHIND_KEY, "reading-late") is not None
        await redis.zrem(liveness.BEHIND_KEY, "reading-late")
        return found

    try:
        assert not await written([True])
        assert not await written([False] * 50)
        assert await written([True, True])
        assert await written([True, False, False, True])
        # a share of the batch too: 2 late among 300 beats is a few agents, not the server
        assert not await written([True, True] + [False] * 298)
        assert await written([True, True, True] + [False] * 297)
    finally:
        await redis.delete(liveness.seen_key(1), liveness.frames_key(1), liveness.steps_key(1))


@pytest.mark.asyncio
async def test_beats_that_keep_coming_are_written_a_batch_a_linger_not_back_to_back(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady stream of beats is written a batch every ``LINGER_S``: written back to back as
    they came, batches held three beats each at 2,048 agents, and their round trips were a
    seventh of the server's time. Every beat is still written."""
    monkeypatch.setattr(liveness, "LINGER_S", 0.05)
    writer = liveness.Writer(redis, name="steady")
    batches: list[int] = []
    write = writer._write

    async def counted(batch: Any, sent: list[float], *rest: Any) -> None:
        batches.append(len(sent))
        await write(batch, sent, *rest)

    monkeypatch.setattr(writer, "_write", counted)
    started, sent = time.monotonic(), 0
    try:
        while time.monotonic() - started < 0.5:
            now = time.time()
            writer.beat(1, f"node-{sent}", now, "{}", now, sent)
            sent += 1
            await asyncio.sleep(0.001)
        await writer.settle()
        elapsed = time.monotonic() - started
        assert sum(batches) == sent > 100
        assert await redis.zcard(liveness.seen_key(1)) == sent
        assert len(batches) <= elapsed / liveness.LINGER_S + 2, batches
    finally:
        await redis.delete(liveness.seen_key(1), liveness.frames_key(1), liveness.steps_key(1))


@pytest.mark.asyncio
async def test_who_waits_for_a_write_the_closing_loop_cancelled_is_told_not_left_waiting(
    redis: Any,
) -> None:
    """The event loop closing cancels the writer while a beat lingers: a goodbye waiting for
    that write (``settle``) is cancelled with it, not left awaiting a write no task will make,
    which would hold the loop's close (it waits for every cancelled task) forever."""
    writer = liveness.Writer(redis, name="cancelled")
    writer.beat(1, "node-0", time.time(), "{}", time.time(), None)
    waiting = asyncio.create_task(writer.settle())
    await asyncio.sleep(0)  # settle waits for the queue as it stands
    assert writer.flushing is not None and writer.queued_done is not None
    writer.flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, timeout=2)
    assert writer.flushing is None
    writer.beat(1, "node-0", time.time(), "{}", time.time(), None)  # a later beat is written
    try:
        await asyncio.wait_for(writer.settle(), timeout=2)
        assert await redis.zscore(liveness.seen_key(1), "node-0") is not None
    finally:
        await redis.delete(liveness.seen_key(1), liveness.frames_key(1), liveness.steps_key(1))


@pytest.mark.asyncio
async def test_a_socket_read_late_makes_its_server_behind_and_the_detector_holds(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent sockets end to end: beats that arrive later than their sockets' usual transit
    put the server in ``BEHIND_KEY``, and a pass then judges no short silence."""
    monkeypatch.setattr(liveness, "LINGER_S", 0.3)  # the four late beats in one batch
    job, sockets, _ = await all_joined(redis)
    name = liveness.shared()[1].name
    await redis.zrem(liveness.BEHIND_KEY, name)
    wait_s = 2 * liveness.LOOP_BEHIND_DEADLINES * detector.deadline_s()
    for node, socket in sockets.items():
        beat = protocol.Heartbeat(
            seq=2,
            at=time.time() - wait_s,  # sent that long before the server reads it
            step=1,
            devices=[
                protocol.DeviceReport(device=d, state=protocol.DeviceState.TRAINING)
                for d in NODES[node]
            ],
        )
        await socket.send_to(protocol.encode(beat))
    for _ in range(200):
        if await redis.zscore(liveness.BEHIND_KEY, name) is not None:
            break
        await asyncio.sleep(0.01)
    assert await redis.zscore(liveness.BEHIND_KEY, name) is not None
    now = time.time()
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": now - detector.deadline_s() - 1})
    assert await detector.sweep(redis, now_s=now) == []
    assert await failures(job) == []
    await redis.zrem(liveness.BEHIND_KEY, name)
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


@pytest.mark.asyncio
async def test_beats_waiting_on_a_redis_that_does_not_answer_say_behind_before_a_deadline(
    redis: Any,
) -> None:
    """A writer whose Redis does not answer (a peer that accepts and stays silent): its process
    is behind while the beats still wait, said on another connection, within a deadline of the
    first beat, so the detector holds off before their nodes look silent. Said only with the
    late beats, it came after the detector had already failed them."""

    async def silent_peer(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes

    peer = await asyncio.start_server(silent_peer, "127.0.0.1", 0)
    port = peer.sockets[0].getsockname()[1]
    stuck = liveness.Writer(aioredis.Redis(host="127.0.0.1", port=port), name="stuck-writer")
    watcher = asyncio.create_task(liveness.watch_loop(redis, "stuck-writer", stuck))
    began = time.monotonic()
    stuck.beat(1, "node-0", time.time(), "{}", time.time(), None)
    said = None
    while time.monotonic() - began < detector.deadline_s():
        if await redis.zscore(liveness.BEHIND_KEY, "stuck-writer") is not None:
            said = time.monotonic() - began
            break
        await asyncio.sleep(0.02)
    watcher.cancel()
    assert stuck.flushing is not None
    stuck.flushing.cancel()
    peer.close()
    await redis.zrem(liveness.BEHIND_KEY, "stuck-writer")
    assert said is not None, f"not said behind within the {detector.deadline_s()} s deadline"
    assert said >= liveness.LOOP_BEHIND_DEADLINES * detector.deadline_s()  # not before it waited


@pytest.mark.asyncio
async def test_a_server_whose_redis_connections_are_all_taken_still_says_it_is_behind(
    redis: Any,
) -> None:
    """Every connection of the process's pool busy (a burst of hellos) and its loop blocked: the
    word that it is behind still goes out at once, on the watcher's own connection. From the
    pool, it waited for a connection as long as the burst lasted."""
    pool, writer = liveness.shared()
    await redis.zrem(liveness.BEHIND_KEY, writer.name)
    never = f"{liveness.PREFIX}:test:never-pushed"
    taken = [asyncio.ensure_future(pool.blpop([never], 5)) for _ in range(liveness.POOL_SIZE)]
    await asyncio.sleep(0.3)  # each holds a connection of the pool for 5 s
    time.sleep(detector.deadline_s() * liveness.LOOP_BEHIND_DEADLINES + liveness.LOOP_PERIOD_S)
    began, said = time.monotonic(), None
    while time.monotonic() - began < 3:
        if await redis.zscore(liveness.BEHIND_KEY, writer.name) is not None:
            said = time.monotonic() - began
            break
        await asyncio.sleep(0.02)
    for task in taken:
        task.cancel()
    await asyncio.gather(*taken, return_exceptions=True)
    await redis.zrem(liveness.BEHIND_KEY, writer.name)
    assert said is not None, "not said behind while the pool's connections were taken"


class Freezable:
    """A TCP relay to the control plane's Redis that stops relaying while frozen: the
    connections of a server process whose loop is blocked, or held by a burst, as the rest of
    the control plane sees them (nothing said, nothing refused)."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.upstream = liveness.client().connection_pool.connection_kwargs
        self.server: asyncio.Server | None = None

    async def client(self) -> aioredis.Redis:
        """A client of the control plane's Redis (its database, its credentials) through the
        relay."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        pool = aioredis.ConnectionPool(**{**self.upstream, "host": "127.0.0.1", "port": port})
        return aioredis.Redis(connection_pool=pool)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = await asyncio.open_connection(self.upstream["host"], self.upstream["port"])

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                await self.thawed.wait()
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up[1]), pipe(up[0], writer))

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()


@pytest.mark.asyncio
async def test_a_server_too_blocked_to_say_so_is_behind_by_its_silence(redis: Any) -> None:
    """A server process whose every connection is held (or whose loop is blocked) says nothing,
    not even that it is behind: its nodes' beats stop with its word that it is on time, and the
    detector, reading that silence, judges only the long silences. Waiting for its word, the
    detector failed live nodes whenever thousands of agents joined at once."""
    job, sockets, _ = await all_joined(redis)
    relay = Freezable()
    watcher = asyncio.create_task(liveness.watch_loop(await relay.client(), "blocked-server"))
    for _ in range(100):
        if await redis.zscore(liveness.SERVERS_KEY, "blocked-server") is not None:
            break
        await asyncio.sleep(0.02)
    assert await redis.zscore(liveness.SERVERS_KEY, "blocked-server") is not None
    # node-1 silent just past the deadline (as every node of the blocked server would be soon)
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": time.time() - detector.deadline_s() - 1})
    relay.freeze()
    await asyncio.sleep(liveness.quiet_s() + 2 * liveness.LOOP_PERIOD_S)
    before = await stalls(redis, "ingest_behind")
    assert await redis.zscore(liveness.BEHIND_KEY, "blocked-server") is None  # it said nothing
    detector._last_pass_s = None  # this detector on time: its previous pass was another test's
    assert await detector.sweep(redis) == []
    assert await failures(job) == []
    assert await stalls(redis, "ingest_behind") == before + 1
    # not blinded: a silence past the hold window is judged while the server stays quiet
    window_s = detector.deadline_s() * (1 + detector.STALL_HOLD_DEADLINES)
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": time.time() - window_s - 1})
    assert len(await detector.sweep(redis)) == 1
    relay.thaw()  # on time again: its word comes, and the detector judges at the deadline
    await redis.zadd(liveness.seen_key(job.pk), {"node-2": time.time() - detector.deadline_s() - 1})
    await asyncio.sleep(2 * liveness.LOOP_PERIOD_S)
    assert len(await detector.sweep(redis)) == 1
    assert sorted(d for f in await failures(job) for d in f.devices) == sorted(
        NODES["node-1"] + NODES["node-2"]
    )
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert await redis.zscore(liveness.SERVERS_KEY, "blocked-server") is None  # it said goodbye
    for node in ("node-0", "node-3"):
        await goodbye(sockets[node])
    for node in ("node-1", "node-2"):
        await sockets[node].disconnect()


@pytest.mark.asyncio
async def test_a_server_silent_past_the_hold_window_stopped_and_holds_nothing(
    redis: Any,
) -> None:
    """A server process that stopped without its goodbye (killed) is quiet for a hold window at
    most: after it, its word is removed and the detector judges at the deadline again."""
    job, sockets, newest = await all_joined(redis)
    window_s = detector.deadline_s() * (1 + detector.STALL_HOLD_DEADLINES)
    await redis.zadd(liveness.SERVERS_KEY, {"killed-server": time.time() - window_s - 1})
    now = newest + 0.5
    await redis.zadd(liveness.seen_key(job.pk), {"node-1": now - detector.deadline_s() - 1})
    assert len(await detector.sweep(redis, now_s=now)) == 1
    assert await redis.zscore(liveness.SERVERS_KEY, "killed-server") is None
    for node in ("node-0", "node-2", "node-3"):
        await goodbye(sockets[node])
    await sockets["node-1"].disconnect()


DEADLINE_S = 3.0


@given(
    gap=st.floats(0, 100),
    rtt=st.floats(0, 100),
    age=st.none() | st.floats(0, 100),
    recent=st.integers(0, 10_000),
    behind=st.integers(0, 3),
    quiet=st.integers(0, 3),
)
def test_a_pass_is_held_off_exactly_when_a_sign_of_our_own_stall_shows(
    gap: float, rtt: float, age: float | None, recent: int, behind: int, quiet: int
) -> None:
    view = detector.View(
        gap_s=gap, rtt_s=rtt, newest_age_s=age, recent=recent, behind=behind, quiet=quiet
    )
    held = detector.stall(view, DEADLINE_S)
    signs = [
        gap > DEADLINE_S * detector.STALL_GAP_DEADLINES,
        rtt > DEADLINE_S * detector.STALL_RTT_DEADLINES,
        age is not None and age > DEADLINE_S and recent >= detector.STALL_MIN_WATCHED,
        behind > 0 or quiet > 0,
    ]
    assert (held is not None) == any(signs)
    if held is not None:
        assert held.reason == detector.STALL_REASONS[signs.index(True)]
