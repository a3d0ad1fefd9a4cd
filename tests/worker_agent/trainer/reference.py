"""What the distributed runs are checked against: the whole model on the whole batch, one process.

Written without the engine: plain forward and backward of every layer over the full global
batch, one AdamW over all parameters. It shares with the engine only the model's layers, the
corpus and the hyperparameters, which are what both must agree on by definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker_agent.trainer.data import Corpus
from worker_agent.trainer.engine import TrainConfig
from worker_agent.trainer.model import build_layers

Weights = dict[int, dict[str, np.ndarray]]


@dataclass
class Reference:
    losses: list[float]
    weights: Weights


def train_reference(config: TrainConfig, global_batch: int, steps: range) -> Reference:
    torch.set_num_threads(1)
    model = config.model
    layers = build_layers(model, 0, model.layers)
    params = [p for k in sorted(layers) for p in layers[k].parameters()]
    optimizer: torch.optim.Optimizer
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=config.lr)
    else:
        optimizer = torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    corpus = Corpus.default()
    losses = []
    for step in steps:
        x, y = corpus.batch(config.data_seed, step, 0, global_batch, model.seq)
        h = x
        for k in range(model.layers):
            h = layers[k](h)
        loss = torch.nn.functional.cross_entropy(h.reshape(-1, model.vocab), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
    weights = {
        k: {name: p.detach().numpy().copy() for name, p in layer.named_parameters()}
        for k, layer in layers.items()
    }
    return Reference(losses=losses, weights=weights)


def stage(device: int, first: int, end: int, *, rerouted: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": [device], "layers": [first, end]}
    if rerouted:
        out["rerouted"] = True
    return out


def rerouted(devices: list[int], first: int, end: int) -> dict[str, Any]:
    return {"devices": devices, "layers": [first, end], "rerouted": True}


def pipeline(micro_batches: int, *stages: dict[str, Any]) -> dict[str, Any]:
    return {"stages": list(stages), "micro_batches": micro_batches}


def plan(*pipelines: dict[str, Any], family: str = "dynamic") -> dict[str, Any]:
    return {"family": family, "pipelines": list(pipelines)}


def assert_weights_close(
    got: dict[int, Weights], want: Weights, *, rtol: float, atol: float
) -> None:
    """Every device's every layer (``got[device][layer]``) against the reference."""
    seen = set()
    for device, layers in got.items():
        for k, params in layers.items():
            seen.add(k)
            for name, value in params.items():
                np.testing.assert_allclose(
                    value,
                    want[k][name],
                    rtol=rtol,
                    atol=atol,
                    err_msg=f"device {device}, layer {k}, {name}",
                )
    assert seen == set(want), f"layers held by no device: {sorted(set(want) - seen)}"
