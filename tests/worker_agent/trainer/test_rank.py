"""Two ranks in threads of one process: a step one of them lost is undone by the other.

An abort that lands just as a step's last all-reduce completes can leave one survivor with the
step applied and another without. The next ``Rank.apply`` makes them agree on the step: the one
ahead undoes its update, and both go on from the same weights.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from tests.worker_agent.trainer.reference import pipeline, plan, stage
from worker_agent.trainer.comm import request_abort
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.model import ModelConfig, build_layers
from worker_agent.trainer.rank import Rank

HOST = "127.0.0.1"
CONFIG = TrainConfig(model=ModelConfig(layers=2, d_model=32, heads=2, ffn=64, seq=16), lr=1e-2)
DP2 = plan(pipeline(1, stage(0, 0, 2)), pipeline(1, stage(1, 0, 2)))


@functools.cache
def _master() -> dist.TCPStore:
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


def _wake_watchers(*prefixes: str) -> None:
    """Set the abort keys of finished generations: their stopped watchers wake and end, instead
    of waiting on the store as the test process exits (a rank process ends with os._exit)."""
    for prefix in prefixes:
        request_abort(_master(), prefix)
    time.sleep(0.1)


def _both(ranks: list[Rank], call: Callable[[Rank], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(call, ranks))


def _weights(rank: Rank) -> list[torch.Tensor]:
    return [
        p.detach().clone()
        for k in sorted(rank.worker.layers)
        for p in rank.worker.layers[k].parameters()
    ]


def test_the_rank_ahead_undoes_the_step_its_peer_lost() -> None:
    port = _master().port
    ranks = [Rank(d, HOST, port, CONFIG) for d in (0, 1)]
    _both(ranks, lambda r: r.apply(DP2, "r0/", fresh=True))
    _both(ranks, lambda r: r.train_step())  # step 0, on both
    after_step_0 = _weights(ranks[0])
    _both(ranks, lambda r: r.train_step())  # step 1 ...
    ranks[1].worker.rollback()  # ... which device 1 lost to an abort
    ranks[1].step = 1
    assert ranks[0].step == 2
    assert not all(torch.equal(a, b) for a, b in zip(_weights(ranks[0]), after_step_0, strict=True))
    _both(ranks, lambda r: r.apply(DP2, "r1/"))
    assert [r.step for r in ranks] == [1, 1]
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(_weights(rank), after_step_0, strict=True))
    # and they train on together: one loss, identical replicas
    results = _both(ranks, lambda r: r.train_step())
    assert results[0].loss == results[1].loss
    assert all(
        torch.equal(a, b) for a, b in zip(_weights(ranks[0]), _weights(ranks[1]), strict=True)
    )
    for rank in ranks:
        rank.leave()
    _wake_watchers("r0/", "r1/")


def test_a_rollback_restores_the_weights_and_the_optimizer_state() -> None:
    port = _master().port
    ranks = [Rank(d, HOST, port, CONFIG) for d in (0, 1)]
    _both(ranks, lambda r: r.apply(DP2, "r2/", fresh=True))
    initial = build_layers(CONFIG.model, 0, 2)
    _both(ranks, lambda r: r.train_step())
    worker = ranks[0].worker
    worker.rollback()
    for k, layer in initial.items():
        for a, b in zip(layer.parameters(), worker.layers[k].parameters(), strict=True):
            assert torch.equal(a, b)
        assert not worker.optimizers[k].state  # the first step's moments are gone too
    for rank in ranks:
        rank.leave()
    _wake_watchers("r2/")
