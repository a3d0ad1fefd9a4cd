"""Process groups of one generation, and waits that an abort ends at once.

A **generation** is the set of process groups a job trains with under one plan. Its groups
are built over a ``torch.distributed.TCPStore`` under the generation's key prefix, never as the
global default group, so that after a fault the survivors build a fresh generation under a new
prefix while the old one is simply abandoned. A device id (the core numbers devices 0..n-1) is a
rank's identity across generations; inside a generation the rank of a device is its position in
the sorted list of members.

Point-to-point messages always go over a gloo group of all the members: gloo matches them by
tag, so every receive of a step can be posted when the step starts. On the CPU the collectives
(gradient sync, the loss) use gloo groups too. On an accelerator (``device.Accelerator``) they use
its backend, nccl or hccl, and a message's device tensor is copied to the host before it is sent
and into its device buffer once received (gloo sends no CUDA tensor; nccl matches messages by
order alone, with a receive posted early blocking the later sends to the same peer). An
accelerator's groups are connected when the generation is built (a one-element all-reduce,
polled), so that no step waits in a communicator's setup; an aborted generation's accelerator
groups are aborted (``Backend.abort``, in a daemon thread), which ends their stuck kernels.

No call here blocks inside a collective. Collectives are issued async and waited on by polling
their completion together with an abort event (a ``threading.Event`` set from outside, normally
by an ``AbortWatcher`` that waits on the store key ``prefix + "abort"``). Gloo's point-to-point
works report completion only through a blocking ``wait()``, so a ``Stream`` waits on them in a
daemon thread, in the order the caller will need them, and the caller polls the stream. When
the abort event is set every wait raises ``Aborted`` within a few milliseconds; when a peer's
failure surfaces as an error of the transport, the generation sets its abort key first, so that
every other member leaves too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker_agent.trainer.device import CPU, Accelerator

# How often a wait looks at the abort event when nothing completes meanwhile.
POLL_S = 0.002
# How long an AbortWatcher's wait on the store lasts before it looks whether it was stopped
# (each timeout logs a warning of c10d's socket layer, so not often).
WATCH_S = 30.0
DEFAULT_TIMEOUT = timedelta(seconds=60)

# Aborted generations, kept alive: destroying a gloo group joins threads that may still be
# blocked on a dead peer until the group's timeout.
_abandoned: list[object] = []


class Aborted(RuntimeError):
    """The generation was aborted: a peer failed, or the agent or another rank asked."""


class TransportError(RuntimeError):
    """A send, receive or collective failed in gloo (a peer's socket closed, a timeout)."""


def abort_key(prefix: str) -> str:
    return prefix + "abort"


def request_abort(store: dist.Store, prefix: str, reason: str = "abort") -> None:
    """Ask every member of the generation under ``prefix`` to leave its collectives."""
    store.set(abort_key(prefix), reason)


def connect(host: str, port: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """A client of the job's TCPStore."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


class AbortWatcher:
    """Sets ``event`` when the store key ``prefix + "abort"`` appears.

    It waits on its own store connection (a blocking wait would hold a shared client), in a
    daemon thread; ``stop()`` returns at once, the thread ends within ``WATCH_S`` and never
    touches the event after ``stop()``.
    """

    def __init__(self, host: str, port: int, prefix: str, event: threading.Event) -> None:
        self.event = event
        self._key = abort_key(prefix)
        self._store = connect(host, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"abort-watch {prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._store.wait([self._key], timedelta(seconds=WATCH_S))
            except RuntimeError:  # the wait timed out (DistStoreError), or the store went away
                if time.monotonic() - started < 1.0:  # an error at once: do not spin on it
                    self._stop.wait(1.0)
                continue
            if not self._stop.is_set():
                self.event.set()
            return

    def stop(self) -> None:
        self._stop.set()

    def alive(self, timeout: float = 0.0) -> bool:
        """Whether the thread still runs after waiting up to ``timeout`` for it to end."""
        self._thread.join(timeout)
        return self._thread.is_alive()


class Stream:
    """Point-to-point works waited on in order by a daemon thread; the caller polls ``done``.

    A work may come with a ``then``, run by the thread once the work completed (the copy of a
    received host tensor into its device buffer); its error is the work's.
    """

    def __init__(self, name: str) -> None:
        self._works: list[Any] = []
        self._tensors: list[torch.Tensor] = []  # kept alive until their work completes
        self._thens: list[Callable[[], object] | None] = []
        self._cond = threading.Condition()
        self.done = 0
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, work: Any, tensor: torch.Tensor, then: Callable[[], object] | None = None) -> int:
        with self._cond:
            self._works.append(work)
            self._tensors.append(tensor)
            self._thens.append(then)
            self._cond.notify_all()
            return len(self._works) - 1

    @property
    def count(self) -> int:
        with self._cond:
            return len(self._works)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._works) and not self._closed:
                    self._cond.wait()
                if i >= len(self._works):
                    return
                work, then = self._works[i], self._thens[i]
            try:
                work.wait()
                if then is not None:
                    then()
            except BaseException as exc:  # handed to the polling thread
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            i += 1
            with self._cond:
                self.done = i
                self._cond.notify_all()

    def wait_for(self, count: int, abort: threading.Event) -> None:
        """Return once ``count`` works completed; raise ``Aborted`` or the transport's error."""
        with self._cond:
            while self.done < count:
                if self.error is not None:
                    raise TransportError(str(self.error)) from self.error
                if abort.is_set():
                    raise Aborted("aborted while waiting on a peer")
                self._cond.wait(POLL_S)


def wait_collective(work: Any, abort: threading.Event) -> None:
    """Wait for an async collective by polling; raise ``Aborted`` as soon as ``abort`` is set."""
    cond = threading.Condition()

    def wake(_: Any) -> None:
        with cond:
            cond.notify_all()

    work.get_future().add_done_callback(wake)
    try:
        with cond:
            while not work.is_completed():  # nccl: an event query, and raises a failed work's error
                if abort.is_set():
                    raise Aborted("aborted while waiting on a collective")
                cond.wait(POLL_S)
        work.wait()  # completed: returns at once, or raises the transport's error
    except Aborted:
        raise
    except RuntimeError as exc:
        raise TransportError(str(exc)) from exc


def _gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def _accelerator_group(
    accelerator: Accelerator,
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    timeout: timedelta,
    abort: threading.Event,
) -> Any:
    """A group of the accelerator's backend (nccl, hccl), connected: its first all-reduce, of
    one element, is polled to completion here (nccl sets its communicator up at the first
    collective, blocking the calling thread until every member comes). Run in a daemon thread
    by ``run_abortable``; stops polling once ``abort`` is set."""
    accelerator.activate()  # the current device is per thread
    prefixed = dist.PrefixStore(prefix, store)
    if accelerator.backend == "nccl":
        nccl: Any = dist.ProcessGroupNCCL  # absent from torch builds without CUDA
        options = nccl.Options()
        options._timeout = timeout
        group = nccl(prefixed, rank, size, options)
    else:
        group = _plugin_group(accelerator.backend, prefixed, prefix, rank, size, timeout)
    work = group.allreduce([torch.zeros(1, device=accelerator.torch_device)])
    while not work.is_completed():
        if abort.is_set():
            return group
        time.sleep(POLL_S)
    work.wait()  # completed: raises the backend's error, if any
    return group


def _plugin_group(
    backend: str, store: dist.Store, name: str, rank: int, size: int, timeout: timedelta
) -> Any:
    """A group of a backend a package registered with ``torch.distributed`` (``torch_npu``
    registers hccl when it imports), created as ``torch.distributed.new_group`` creates it."""
    plugins: dict[str, Any] = getattr(dist.Backend, "_plugins", {})
    plugin = plugins.get(backend.upper())
    if plugin is None:
        raise RuntimeError(f"no {backend} backend is registered with torch.distributed")
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    options: Any = dist.distributed_c10d._DistributedBackendOptions()
    options.store = store
    options.group_rank = rank
    options.group_size = size
    options.timeout = timeout
    options.group_id = name
    options.global_ranks_in_group = list(range(size))
    return plugin.creator_fn(options, None)


def _abort_groups(groups: Sequence[Any]) -> None:
    """``abort()`` each group (nccl: ``ncclCommAbort``, which ends kernels stuck on a dead
    peer); best effort, in the caller's daemon thread."""
    for group in groups:
        with contextlib.suppress(Exception):
            group.abort()


def run_abortable(fn: Callable[[], Any], abort: threading.Event, what: str) -> Any:
    """Run a blocking call (a group's rendezvous) in a daemon thread; leave it on abort."""
    result: list[Any] = []
    error: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the waiting thread
            error.append(exc)
        done.set()

    threading.Thread(target=target, name=what, daemon=True).start()
    while not done.wait(POLL_S):
        if abort.is_set():
            raise Aborted(f"aborted during {what}")
    if error:
        raise error[0]
    return result[0]


class Generation:
    """One generation's groups among ``members``: the whole set and the given subsets.

    ``subsets`` are the device sets that need a collective of their own (gradient-sync
    segments); every member builds the same list, each only the groups it belongs to, in
    sorted order so that no two members wait on each other's rendezvous. ``accelerator`` is
    where the member's tensors are: the whole set always has a gloo group (point-to-point, and
    the CPU's collectives); on an accelerator the whole set and the subsets also have groups of
    its backend, which carry the collectives.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        device: int,
        members: Sequence[int],
        abort: threading.Event,
        *,
        subsets: Sequence[Sequence[int]] = (),
        timeout: timedelta = DEFAULT_TIMEOUT,
        accelerator: Accelerator = CPU,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.device = device
        self.members = tuple(sorted(set(members)))
        if device not in self.members:
            raise ValueError(f"device {device} is not a member of generation {prefix!r}")
        self.abort = abort
        self.accelerator = accelerator
        backend = accelerator.backend
        self._rank = {d: r for r, d in enumerate(self.members)}
        started = time.perf_counter()
        self.world = run_abortable(
            functools.partial(
                _gloo, store, prefix + "pg/all/", self.rank, len(self.members), timeout
            ),
            abort,
            "building the generation's group",
        )

        # the accelerator's groups built so far: aborted with the generation
        self._accelerated: list[Any] = []

        def build(name: str, rank: int, size: int) -> Any:
            if backend == "gloo":
                return _gloo(store, f"{prefix}pg/{name}/", rank, size, timeout)
            group = _accelerator_group(
                accelerator, store, f"{prefix}pg/{name}/", rank, size, timeout, abort
            )
            self._accelerated.append(group)
            return group

        # the whole set's collectives: the gloo group on the CPU, else one of the backend's
        self._collectives = self.world
        self._groups: dict[tuple[int, ...], Any] = {}
        try:
            if backend != "gloo":
                self._collectives = run_abortable(
                    functools.partial(build, f"all-{backend}", self.rank, len(self.members)),
                    abort,
                    f"building the generation's {backend} group",
                )
            for subset in sorted({tuple(sorted(set(s))) for s in subsets if len(set(s)) > 1}):
                if device not in subset or subset == self.members:
                    continue
                if not set(subset) <= set(self.members):
                    raise ValueError(f"group {list(subset)} is not within the generation's members")
                name = "-".join(map(str, subset))
                self._groups[subset] = run_abortable(
                    functools.partial(build, name, subset.index(device), len(subset)),
                    abort,
                    f"building group {name}",
                )
        except Aborted:
            self.abandon()
            raise
        self.build_s = time.perf_counter() - started

    @property
    def rank(self) -> int:
        return self._rank[self.device]

    def rank_of(self, device: int) -> int:
        return self._rank[device]

    def group(self, devices: Sequence[int]) -> Any:
        """The collectives' group of a subset built at construction (all members: the whole
        set)."""
        key = tuple(sorted(set(devices)))
        return self._collectives if key == self.members else self._groups[key]

    def fail(self, reason: str) -> None:
        """A transport error: ask every member to leave, and leave."""
        self.abort.set()
        with contextlib.suppress(RuntimeError):  # the store is gone too; the agent sees it
            request_abort(self.store, self.prefix, reason)
        self.abandon()

    def abandon(self) -> None:
        """Keep the groups alive, never destroyed: threads may be blocked in them. An
        accelerator's groups are aborted (once, in a daemon thread): a kernel of theirs may be
        stuck on a dead peer, and would hold the device."""
        if any(g is self for g in _abandoned):
            return
        _abandoned.append(self)
        if self._accelerated:
            threading.Thread(
                target=_abort_groups,
                args=(list(self._accelerated),),
                name=f"abort {self.prefix}",
                daemon=True,
            ).start()

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; an error of the transport aborts the generation and raises ``Aborted``.

        Any other error (a bug, a bad shape) goes through unchanged.
        """
        try:
            return fn()
        except Aborted:
            self.abandon()
            raise
        except TransportError as exc:
            self.fail(f"device {self.device}: {exc}")
            raise Aborted(f"a peer failed: {exc}") from exc

    def stream(self, name: str) -> Stream:
        return Stream(f"{name} {self.prefix}")

    def send(self, stream: Stream, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send ``tensor`` to device ``dst`` (over gloo: a device tensor goes through the host)."""
        if tensor.device.type == "cpu":
            tensor = tensor.contiguous()
        else:
            tensor = tensor.detach().to("cpu").contiguous()
        try:
            work = self.world.send([tensor], self.rank_of(dst), tag)
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        stream.add(work, tensor)

    def recv(self, stream: Stream, tensor: torch.Tensor, src: int, tag: int) -> int:
        """Receive into ``tensor`` from device ``src``; the index of the work in ``stream``.
        A device tensor is filled from a host buffer by the stream's thread, once received."""
        host = tensor
        if tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
        try:
            work = self.world.recv([host], self.rank_of(src), tag)
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        if host is tensor:
            return stream.add(work, tensor)
        return stream.add(work, host, then=functools.partial(tensor.copy_, host))

    def broadcast(
        self, tensor: torch.Tensor, source: int, devices: Sequence[int] | None = None
    ) -> None:
        """``tensor`` as device ``source`` holds it, in place on every member of ``devices``
        (a subset built at construction; None: every member)."""
        key = self.members if devices is None else tuple(sorted(set(devices)))
        if len(key) < 2:
            return
        options = dist.BroadcastOptions()
        options.rootRank = key.index(source)
        try:
            work = self.group(key).broadcast([tensor], options)
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        wait_collective(work, self.abort)

    def all_reduce(self, devices: Sequence[int], tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the group of ``devices`` (nothing to do for one)."""
        if len(set(devices)) < 2:
            return
        group = self.group(devices)
        try:
            work = group.allreduce([tensor])
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        wait_collective(work, self.abort)
