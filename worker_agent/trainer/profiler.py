"""Measure the reference model's per-layer costs on this device and write them as a scenario.

``profile_model(config)`` builds every layer of the model alone (``model.build_layer``) and
measures, for one micro-batch of ``config.micro_batch`` samples:

* ``fwd_s``, ``bwd_s``: the forward and backward time of the layer, as the engine runs them (the
  last layer's forward includes the loss; every layer but the first computes its input's
  gradient), the median of ``repeat`` runs after ``warmup`` unmeasured ones;
* ``m_p``, ``m_g``: the bytes of the layer's parameters and of their gradients after a backward;
* ``m_o``: the bytes of the optimizer's state after one update (AdamW: two moments and a step
  count per parameter tensor);
* ``m_a``: the bytes the forward keeps for the backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; the layer's own parameters
  and buffers are not activations), plus the layer's input when the engine keeps it for its
  gradient;
* ``boundary_bytes``: the bytes of the hidden state a stage sends to the next.

``Profile.scenario(...)`` is a scenario in the core's format (``docs/scenario.md``): the
profile, a cluster of the devices measured for, a training batch and a PP × DP plan, which
``python -m controlplane.recovery estimate FILE`` reads. The device is the trainer's choice
(``device.select``: ``--accelerator``, by default CUDA when ``torch.cuda.is_available()``, else an
NPU when ``torch_npu`` sees one, else the CPU); on an accelerator, times are taken between
synchronisations.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from worker_agent.trainer.device import Accelerator, add_option, select
from worker_agent.trainer.engine import TrainConfig, Worker
from worker_agent.trainer.model import Layer, ModelConfig, build_layer, loss_of


def default_device() -> torch.device:
    """The device ``--accelerator auto`` picks (``device.select``)."""
    return select("auto").torch_device


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """One layer's measured costs; times are medians, ``*_spread`` the (min, max) of the runs."""

    fwd_s: float
    bwd_s: float
    m_p: int
    m_o: int
    m_g: int
    m_a: int
    optimizer_s: float  # one update of the layer's optimizer: not a term of the core's model
    fwd_spread: tuple[float, float] = (0.0, 0.0)
    bwd_spread: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Profile:
    """Every layer's costs for one micro-batch of ``config.micro_batch`` samples on ``device``."""

    config: TrainConfig
    device: str
    layers: tuple[LayerProfile, ...]
    boundary_bytes: int
    warmup: int
    repeat: int
    conditions: dict[str, Any] = field(default_factory=dict)

    def model_dict(self, name: str | None = None) -> dict[str, Any]:
        """The scenario's ``model`` section."""
        m = self.config.model
        return {
            "name": name
            or f"reference-l{m.layers}-d{m.d_model}-s{m.seq}-b{self.config.micro_batch}",
            "layers": len(self.layers),
            "fwd_s": [p.fwd_s for p in self.layers],
            "bwd_s": [p.bwd_s for p in self.layers],
            "m_p": [float(p.m_p) for p in self.layers],
            "m_o": [float(p.m_o) for p in self.layers],
            "m_g": [float(p.m_g) for p in self.layers],
            "m_a": [float(p.m_a) for p in self.layers],
            "boundary_bytes": float(self.boundary_bytes),
            "update_s": [p.optimizer_s for p in self.layers],
        }

    def scenario(
        self,
        plan: dict[str, Any] | None = None,
        *,
        devices: int | None = None,
        pp: int = 1,
        micro_batches: int = 4,
        device_memory_bytes: float | None = None,
        gbps: float | None = None,
    ) -> dict[str, Any]:
        """A scenario in the core's format: this profile, a cluster, a batch and a plan.

        Without ``plan``, the plan is PP ``pp`` × DP ``devices // pp`` with layers split as
        evenly as possible and ``micro_batches`` per pipeline. ``gbps`` is the devices' link
        bandwidth (one node: ``intra_node_gbps``; ``link_gbps`` measures it); without it
        communication is free and the estimate is exactly the cost model's compute terms.
        """
        if plan is None:
            plan = even_plan(len(self.layers), devices or pp, pp, micro_batches)
        used = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
        count = max(devices or 0, 1 + max(used))
        total = sum(p["micro_batches"] for p in plan["pipelines"]) * self.config.micro_batch
        cluster: dict[str, Any] = {"devices": count, "devices_per_node": count}
        if device_memory_bytes is not None:
            cluster["device_memory_bytes"] = device_memory_bytes
        if gbps is not None:
            cluster["intra_node_gbps"] = gbps
        return {
            "model": self.model_dict(),
            "cluster": cluster,
            "training": {"global_batch": total, "micro_batch": self.config.micro_batch},
            "plan": plan,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything measured, for a results file (the scenario holds the core's terms only)."""
        m = self.config.model
        return {
            "device": self.device,
            "model": {
                "layers": m.layers,
                "d_model": m.d_model,
                "heads": m.heads,
                "ffn": m.ffn,
                "seq": m.seq,
            },
            "micro_batch": self.config.micro_batch,
            "optimizer": self.config.optimizer,
            "warmup": self.warmup,
            "repeat": self.repeat,
            "conditions": self.conditions,
            "boundary_bytes": self.boundary_bytes,
            "layers": [
                {
                    "fwd_s": p.fwd_s,
                    "bwd_s": p.bwd_s,
                    "fwd_spread": list(p.fwd_spread),
                    "bwd_spread": list(p.bwd_spread),
                    "optimizer_s": p.optimizer_s,
                    "m_p": p.m_p,
                    "m_o": p.m_o,
                    "m_g": p.m_g,
                    "m_a": p.m_a,
                }
                for p in self.layers
            ],
        }


def even_plan(layers: int, devices: int, pp: int, micro_batches: int) -> dict[str, Any]:
    """PP ``pp`` × DP ``devices // pp`` over devices 0.., layers split as evenly as possible."""
    if pp < 1 or devices < pp or pp > layers:
        raise ValueError(f"cannot cut {layers} layers into {pp} stages on {devices} devices")
    bounds = [layers * s // pp for s in range(pp + 1)]
    return {
        "pipelines": [
            {
                "stages": [
                    {"devices": [p * pp + s], "layers": [bounds[s], bounds[s + 1]]}
                    for s in range(pp)
                ],
                "micro_batches": micro_batches,
            }
            for p in range(devices // pp)
        ]
    }


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SavedBytes:
    """Counts the bytes autograd saves for the backward pass, each storage once.

    Tensors whose storage is one of ``excluded`` (the layer's parameters and buffers) are
    skipped: they are the layer's state, not activations.
    """

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.excluded and ptr not in self.storages:
            self.storages[ptr] = storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    @contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        Accelerator(device.type, device.index).synchronize()


def _optimizer(config: TrainConfig, layer: Layer) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(layer.parameters(), lr=config.lr, foreach=False)
    return torch.optim.AdamW(
        layer.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


class _LayerBench:
    """One layer, its optimizer and the inputs of one micro-batch, on ``device``."""

    def __init__(self, config: TrainConfig, index: int, device: torch.device) -> None:
        model = config.model
        self.config, self.device, self.index = config, device, index
        self.first, self.last = index == 0, index == model.layers - 1
        self.layer = build_layer(model, index).to(device)
        self.optimizer = _optimizer(config, self.layer)
        generator = torch.Generator().manual_seed(1234 + index)
        b, s, d = config.micro_batch, model.seq, model.d_model
        tokens = torch.randint(0, model.vocab, (b, s), generator=generator)
        self.tokens = tokens.to(device)
        self.targets = torch.randint(0, model.vocab, (b, s), generator=generator).to(device)
        self.hidden = torch.randn((b, s, d), generator=generator).to(device)
        self.grad_out = (torch.randn((b, s, d), generator=generator) * 1e-3).to(device)
        state = [*self.layer.parameters(), *self.layer.buffers()]
        self.excluded = {t.untyped_storage().data_ptr() for t in state}

    def inputs(self) -> torch.Tensor:
        if self.first:
            return self.tokens
        return self.hidden.detach().clone().requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return loss_of(y, self.targets) if self.last else y

    def backward(self, y: torch.Tensor) -> None:
        if self.last:
            torch.autograd.backward(y)
        else:
            torch.autograd.backward(y, self.grad_out)

    def once(self) -> tuple[float, float]:
        """Forward and backward of one micro-batch, each timed; gradients dropped after."""
        x = self.inputs()
        _synchronize(self.device)
        t0 = time.perf_counter()
        y = self.forward(x)
        _synchronize(self.device)
        t1 = time.perf_counter()
        self.backward(y)
        _synchronize(self.device)
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    def memory(self) -> tuple[int, int, int, int, float]:
        """m_p, m_o, m_g, m_a and the time of one optimizer update."""
        m_p = sum(tensor_bytes(p) for p in self.layer.parameters())
        x = self.inputs()
        saved = SavedBytes(self.excluded)
        with saved.counting():
            y = self.forward(x)
        # The engine keeps a stage's received input for its gradient (``_Pass.inputs``); a layer
        # inside a stage keeps its input only as far as autograd saved it, counted above.
        m_a = saved.total
        self.backward(y)
        m_g = sum(tensor_bytes(p.grad) for p in self.layer.parameters() if p.grad is not None)
        _synchronize(self.device)
        t0 = time.perf_counter()
        self.optimizer.step()
        _synchronize(self.device)
        optimizer_s = time.perf_counter() - t0
        self.optimizer.zero_grad(set_to_none=True)
        return m_p, _state_bytes(self.optimizer), m_g, m_a, optimizer_s


def _chained_times(
    worker: Worker, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[list[float], list[float], list[float]]:
    """Every layer's forward, backward and update within one pass of the whole model.

    ``worker`` holds every layer, as a rank of the trainer holds its stage's: the layers run one
    after another on one micro-batch (the next layer reads what the last one wrote, the caches
    hold what a real step leaves in them). Forward times are taken between layers; backward
    times from a hook on each boundary activation's gradient, which autograd calls when the
    layer after it has finished its backward. A layer's update is what the engine does with it
    once per step after the backward (``Worker.step``): keep its state for a rollback
    (``export_layer``), add its gradients' squares to the norm, step its optimizer.
    """
    n = len(worker.layers)
    device = worker.where
    marks: list[float] = [0.0] * (n + 1)

    def stamp(k: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            _synchronize(device)
            marks[k] = time.perf_counter()

        return hook

    x = tokens
    f = [0.0] * n
    _synchronize(device)
    t = time.perf_counter()
    for k in range(n):
        x = worker.layers[k](x)
        if k == n - 1:
            x = loss_of(x, targets)
        else:
            x.register_hook(stamp(k + 1))  # the gradient of layer k+1's input
        _synchronize(device)
        now = time.perf_counter()
        f[k], t = now - t, now
    marks[n] = time.perf_counter()
    torch.autograd.backward(x)  # the last layer's output is the loss
    _synchronize(device)
    marks[0] = time.perf_counter()
    b = [marks[k] - marks[k + 1] for k in range(n)]
    u = [0.0] * n
    for k in range(n):
        _synchronize(device)
        t0 = time.perf_counter()
        worker.export_layer(k)
        worker.grad_squares(k)
        worker.optimizers[k].step()
        _synchronize(device)
        u[k] = time.perf_counter() - t0
    worker.zero_grad()
    return f, b, u


def profile_model(
    config: TrainConfig | None = None,
    *,
    warmup: int = 3,
    repeat: int = 10,
    device: torch.device | str | None = None,
    progress: bool = False,
    chained: bool = True,
) -> Profile:
    """Measure every layer of ``config.model`` for one micro-batch of ``config.micro_batch``.

    ``chained`` (the default) times the layers inside ``warmup`` unmeasured and ``repeat``
    measured passes of the whole model, each followed by every layer's update
    (``_chained_times``): the times a stage of the trainer sees. Otherwise each layer runs
    alone, round-robin over the rounds, so that a slow spell of the machine spreads over all of
    them (its caches then hold that one layer; the update is then the optimizer's alone, timed
    once, the first). The times are the medians. Sets ``torch.set_num_threads(1)`` on the CPU,
    as every rank does.
    """
    config = config or TrainConfig()
    if warmup < 0 or repeat < 1:
        raise ValueError("warmup must be >= 0 and repeat >= 1")
    where = torch.device(device) if device is not None else default_device()
    if where.type == "cpu":
        torch.set_num_threads(1)
    benches = [_LayerBench(config, k, where) for k in range(config.model.layers)]
    if chained:
        worker = Worker(0, config)
        worker.hold(0, config.model.layers)
        tokens = benches[0].tokens.to(worker.where)
        targets = benches[-1].targets.to(worker.where)
    fwd: list[list[float]] = [[] for _ in benches]
    bwd: list[list[float]] = [[] for _ in benches]
    upd: list[list[float]] = [[] for _ in benches]
    rounds = warmup + repeat
    bar = tqdm(
        total=rounds * len(benches) + len(benches),
        desc="profile",
        unit="pass",
        disable=not progress or not sys.stderr.isatty(),
        file=sys.stderr,
        leave=False,
    )
    started = time.time()
    with torch.enable_grad(), bar:
        memory = []
        for bench in benches:
            memory.append(bench.memory())
            bar.update(1)
        for r in range(rounds):
            times: Iterable[tuple[float, float, float]]
            if chained:
                times = zip(*_chained_times(worker, tokens, targets), strict=True)
            else:
                times = ((*bench.once(), math.nan) for bench in benches)
            for k, (f, b, u) in enumerate(times):
                if r >= warmup:
                    fwd[k].append(f)
                    bwd[k].append(b)
                    upd[k].append(u)
                bar.update(1)
    layers = tuple(
        LayerProfile(
            fwd_s=statistics.median(fwd[k]),
            bwd_s=statistics.median(bwd[k]),
            m_p=m_p,
            m_o=m_o,
            m_g=m_g,
            m_a=m_a,
            optimizer_s=statistics.median(upd[k]) if chained else opt_s,
            fwd_spread=(min(fwd[k]), max(fwd[k])),
            bwd_spread=(min(bwd[k]), max(bwd[k])),
        )
        for k, (m_p, m_o, m_g, m_a, opt_s) in enumerate(memory)
    )
    model = config.model
    element = torch.empty((), dtype=torch.float32).element_size()
    boundary = config.micro_batch * model.seq * model.d_model * element
    conditions: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 3),
        "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "method": "chained" if chained else "isolated",
    }
    return Profile(
        config=config,
        device=str(where),
        layers=layers,
        boundary_bytes=boundary,
        warmup=warmup,
        repeat=repeat,
        conditions=conditions,
    )


def physical_memory_bytes(accelerator: Accelerator | None = None) -> float | None:
    """The accelerator's memory, or this machine's (on the CPU); None when unknown."""
    if accelerator is not None and accelerator.kind != "cpu":
        return accelerator.memory_bytes()
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def table(profile: Profile) -> str:
    """The profile as a plain table: one row per layer, then the totals."""

    def mb(x: float) -> str:
        return f"{x / 2**20:8.3f}"

    head = (
        f"{'layer':>5} {'fwd ms':>8} {'bwd ms':>8} {'bwd/fwd':>7} {'spread %':>8} "
        f"{'m_p MiB':>8} {'m_o MiB':>8} {'m_g MiB':>8} {'m_a MiB':>8} {'opt ms':>7}"
    )
    lines = [head, "-" * len(head)]
    spread: Callable[[tuple[float, float], float], float] = lambda s, m: (  # noqa: E731
        100 * (s[1] - s[0]) / m if m else 0.0
    )
    for k, p in enumerate(profile.layers):
        worst = max(spread(p.fwd_spread, p.fwd_s), spread(p.bwd_spread, p.bwd_s))
        lines.append(
            f"{k:>5} {p.fwd_s * 1e3:>8.3f} {p.bwd_s * 1e3:>8.3f} "
            f"{p.bwd_s / p.fwd_s if p.fwd_s else 0.0:>7.2f} {worst:>8.1f} "
            f"{mb(p.m_p)} {mb(p.m_o)} {mb(p.m_g)} {mb(p.m_a)} {p.optimizer_s * 1e3:>7.3f}"
        )
    ls = profile.layers
    lines.append(
        f"{'all':>5} {sum(p.fwd_s for p in ls) * 1e3:>8.3f} {sum(p.bwd_s for p in ls) * 1e3:>8.3f} "
        f"{'':>7} {'':>8} {mb(sum(p.m_p for p in ls))} {mb(sum(p.m_o for p in ls))} "
        f"{mb(sum(p.m_g for p in ls))} {mb(sum(p.m_a for p in ls))} "
        f"{sum(p.optimizer_s for p in ls) * 1e3:>7.3f}"
    )
    lines.append(f"boundary tensor: {profile.boundary_bytes / 2**20:.3f} MiB per micro-batch")
    return "\n".join(lines)


def model_config(
    layers: int = 8, d_model: int = 64, heads: int = 4, seq: int = 64, seed: int = 0
) -> ModelConfig:
    """The model the trainer's commands build: the SwiGLU width about 8/3 of d_model."""
    ffn = (8 * d_model // 3 + 7) // 8 * 8
    return ModelConfig(layers=layers, d_model=d_model, heads=heads, ffn=ffn, seq=seq, seed=seed)


def _profile_child(
    config: TrainConfig,
    warmup: int,
    repeat: int,
    cpus: set[int] | None,
    chained: bool,
    out: Any,
) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    out.put(profile_model(config, warmup=warmup, repeat=repeat, device="cpu", chained=chained))


def profile_concurrently(
    config: TrainConfig,
    processes: int,
    *,
    warmup: int = 3,
    repeat: int = 10,
    cpus: list[int] | None = None,
    chained: bool = True,
) -> Profile:
    """``profile_model`` in ``processes`` processes at once, process i pinned to ``cpus[i]``.

    The profile of a device of this machine while that many devices compute (they share the
    memory bus and the caches): each layer's time is the median over the processes of their
    medians, its spread the extremes over all their runs. Memory terms are the first process's
    (every process measures the same bytes).
    """
    if processes < 1:
        raise ValueError("processes must be >= 1")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [
            ctx.Process(
                target=_profile_child,
                args=(
                    config,
                    warmup,
                    repeat,
                    {cpus[i % len(cpus)]} if cpus else None,
                    chained,
                    out,
                ),
                daemon=True,
            )
            for i in range(processes)
        ]
        for proc in procs:
            proc.start()
    finally:
        if env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env
    try:
        profiles: list[Profile] = [out.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    first = profiles[0]
    layers = []
    for k, layer in enumerate(first.layers):
        of = [p.layers[k] for p in profiles]
        layers.append(
            LayerProfile(
                fwd_s=statistics.median(x.fwd_s for x in of),
                bwd_s=statistics.median(x.bwd_s for x in of),
                m_p=layer.m_p,
                m_o=layer.m_o,
                m_g=layer.m_g,
                m_a=layer.m_a,
                optimizer_s=statistics.median(x.optimizer_s for x in of),
                fwd_spread=(min(x.fwd_spread[0] for x in of), max(x.fwd_spread[1] for x in of)),
                bwd_spread=(min(x.bwd_spread[0] for x in of), max(x.bwd_spread[1] for x in of)),
            )
        )
    conditions = dict(first.conditions, processes=processes, cpus=cpus)
    return Profile(
        config=config,
        device=first.device,
        layers=tuple(layers),
        boundary_bytes=first.boundary_bytes,
        warmup=warmup,
        repeat=repeat,
        conditions=conditions,
    )


def _link_child(
    rank: int, port: int, nbytes: int, warmup: int, repeat: int, cpu: int | None, out: Any
) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    # typed as Any, as comm.py does: the stubs lack the backend's collectives
    group: Any = dist.ProcessGroupGloo(
        dist.PrefixStore("link/", store), rank, 2, timedelta(seconds=60)
    )
    buf = torch.ones(max(nbytes // 4, 1))
    times = []
    for i in range(warmup + repeat):
        started = time.perf_counter()
        group.allreduce([buf]).wait()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    if rank == 0:
        out.put(statistics.median(times))
    out.close()
    out.join_thread()
    os._exit(0)


def link_gbps(
    nbytes: int, *, warmup: int = 2, repeat: int = 5, cpus: list[int] | None = None
) -> float:
    """The bandwidth of a gloo all-reduce of ``nbytes`` between two processes here, in Gbit/s.

    Given as the core's ring model reads it: a two-member ring all-reduce of n bytes takes
    n / bandwidth (``estimator.time.ring_allreduce_s``), so the bandwidth is n over the median
    time. Two processes on the loopback interface, pinned to ``cpus[0]`` and ``cpus[1]``.
    """
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_link_child,
            args=(
                r,
                store.port,
                nbytes,
                warmup,
                repeat,
                cpus[r % len(cpus)] if cpus else None,
                out,
            ),
            daemon=True,
        )
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        seconds = float(out.get(timeout=300))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return nbytes / seconds * 8 / 1e9


# --- the command: python -m worker_agent.trainer profile ---


def add_parser(commands: Any) -> None:
    """The ``profile`` subcommand's parser, added to the trainer's subcommands."""
    parser = commands.add_parser(
        "profile", help="measure the model's per-layer costs here and write a scenario"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured runs per layer")
    parser.add_argument("--repeat", type=int, default=20, help="measured runs per layer")
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="time every layer alone rather than within passes of the whole model",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="profile in this many processes at once, one CPU each (a device among that many)",
    )
    parser.add_argument("--devices", type=int, default=1, help="the scenario's cluster")
    parser.add_argument("--pp", type=int, default=1, help="the scenario plan's pipeline depth")
    parser.add_argument("--micro-batches", type=int, default=4, help="per pipeline in the plan")
    parser.add_argument(
        "--link", action="store_true", help="measure a loopback all-reduce for the bandwidth"
    )
    parser.add_argument("--out", type=Path, help="write the scenario here")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    add_option(parser)


def run(args: Any) -> int:
    """``python -m worker_agent.trainer profile``: print the table, write the scenario."""
    config = TrainConfig(
        model=model_config(args.layers, args.d_model, args.heads, args.seq),
        micro_batch=args.micro_batch,
        optimizer=args.optimizer,
    )
    if args.devices < args.pp or args.devices % args.pp:
        print("profile: --devices must be a multiple of --pp", file=sys.stderr)
        return 2
    accelerator = select(args.accelerator)  # Unavailable: the command says so in one line
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.processes > 1 and accelerator.kind == "cpu":
        profile = profile_concurrently(
            config, args.processes, warmup=args.warmup, repeat=args.repeat, cpus=cpus
        )
    else:
        profile = profile_model(
            config,
            warmup=args.warmup,
            repeat=args.repeat,
            device=accelerator.torch_device,
            progress=True,
            chained=not args.isolated,
        )
    print(
        f"{profile.device}, {args.layers} layers, micro-batch {args.micro_batch}", file=sys.stderr
    )
    print(table(profile))
    gbps = None
    if args.link:
        gbps = link_gbps(int(sum(p.m_g for p in profile.layers)), cpus=cpus)
        print(f"loopback all-reduce: {gbps:.2f} Gbit/s")
    memory = physical_memory_bytes(accelerator)
    scenario = profile.scenario(
        devices=args.devices,
        pp=args.pp,
        micro_batches=args.micro_batches,
        device_memory_bytes=memory / args.devices if memory else None,
        gbps=gbps,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(scenario, indent=2) + "\n")
        print(f"scenario written to {args.out}")
    else:
        print(json.dumps(scenario))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return 0
