"""Generations and their aborts, two members in threads of one process over a real TCPStore."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from worker_agent.trainer.comm import (
    Aborted,
    AbortWatcher,
    Generation,
    abort_key,
    connect,
    request_abort,
)

HOST = "127.0.0.1"
LONG = timedelta(seconds=60)


@functools.cache
def _master() -> dist.TCPStore:
    # Kept until the process ends: an aborted rendezvous goes on waiting on it in a daemon thread.
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def store() -> dist.TCPStore:
    return _master()


def _pair(store: dist.TCPStore, prefix: str) -> tuple[Generation, Generation]:
    """Devices 3 and 7 of one generation, each with its own abort event and store client."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(
            lambda d: Generation(
                connect(HOST, store.port), prefix, d, [7, 3], threading.Event(), timeout=LONG
            ),
            [3, 7],
        )
    return a, b


def test_devices_are_ranked_by_sorted_id(store: dist.TCPStore) -> None:
    a, b = _pair(store, "g0/")
    assert (a.rank, b.rank, a.members) == (0, 1, (3, 7))
    x, y = torch.ones(3), torch.full((3,), 2.0)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda gt: gt[0].all_reduce([3, 7], gt[1]), [(a, x), (b, y)]))
    assert x.tolist() == y.tolist() == [3.0, 3.0, 3.0]


# Each test below lets the silent peer catch up at its end, so that no thread of gloo is left
# waiting when the test process exits (a rank process ends with os._exit instead).


def test_a_receive_from_a_silent_peer_leaves_at_once_when_aborted(store: dist.TCPStore) -> None:
    a, silent = _pair(store, "g1/")
    stream = a.stream("receives")
    index = a.recv(stream, torch.empty(4), src=7, tag=1)
    threading.Timer(0.2, a.abort.set).start()
    started = time.monotonic()
    with pytest.raises(Aborted):
        stream.wait_for(index + 1, a.abort)
    waited = time.monotonic() - started
    assert 0.15 < waited < 0.3  # blocked until the abort, out right after it (timeout: 60 s)
    late = silent.stream("sends")
    silent.send(late, torch.ones(4), dst=3, tag=1)
    late.wait_for(1, silent.abort)
    stream.close()
    late.close()


def test_an_all_reduce_without_its_peer_leaves_at_once_when_aborted(
    store: dist.TCPStore,
) -> None:
    a, silent = _pair(store, "g2/")
    threading.Timer(0.2, a.abort.set).start()
    started = time.monotonic()
    with pytest.raises(Aborted):
        a.all_reduce([3, 7], torch.ones(8))
    assert 0.15 < time.monotonic() - started < 0.3
    silent.all_reduce([3, 7], torch.ones(8))


def test_the_watcher_sets_the_event_when_the_abort_key_appears(store: dist.TCPStore) -> None:
    event = threading.Event()
    watcher = AbortWatcher(HOST, store.port, "g3/", event)
    time.sleep(0.1)
    assert not event.is_set()
    started = time.monotonic()
    request_abort(store, "g3/", "device 7 failed")
    assert event.wait(1.0)
    assert time.monotonic() - started < 0.1
    assert store.get(abort_key("g3/")) == b"device 7 failed"
    watcher.stop()
    assert not watcher.alive(1.0)


def test_a_stopped_watcher_leaves_the_event_alone(store: dist.TCPStore) -> None:
    event = threading.Event()
    watcher = AbortWatcher(HOST, store.port, "g4/", event)
    watcher.stop()
    request_abort(store, "g4/")  # wakes the stopped watcher, which ends without a word
    assert not event.wait(0.3)
    assert not watcher.alive(1.0)


def test_a_generation_being_built_leaves_when_aborted(store: dist.TCPStore) -> None:
    """A member whose peers never come is not stuck in the rendezvous for the store's timeout."""
    abort = threading.Event()
    threading.Timer(0.2, abort.set).start()
    started = time.monotonic()
    with pytest.raises(Aborted):
        Generation(connect(HOST, store.port), "g5/", 3, [3, 7], abort, timeout=LONG)
    assert time.monotonic() - started < 0.5
    Generation(connect(HOST, store.port), "g5/", 7, [3, 7], threading.Event(), timeout=LONG)
