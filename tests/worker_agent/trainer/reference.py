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


def one_optimizer(config: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """One optimizer over the whole model, with the trainer's settings (SGD or AdamW)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


def train_reference(config: TrainConfig, global_batch: int, steps: range) -> Reference:
    torch.set_num_threads(1)
    model = config.model
    layers = build_layers(model, 0, model.layers)
    optimizer = one_optimizer(config, [p for k in sorted(layers) for p in layers[k].parameters()])
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


def train_reference_out_of_order(
    config: TrainConfig,
    plan: dict[str, Any],
    steps: range,
    *,
    start: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Reference:
    """CheckFree+'s training, one process, one copy of every parameter: each micro-batch of
    ``plan`` (its samples addressed as the engine does) goes through the blocks of its
    pipeline's stages in order, except the odd micro-batches of a pipeline of 4 stages or more,
    which run stage 1's blocks before stage 0's and the last stage's before the one before it
    (the paper's out-of-order schedule); the embedding first and the LM head last, always. The
    loss is the mean over micro-batches; one AdamW (or SGD) over all parameters, from the
    initial weights or from ``start`` (every layer's parameters by name; a fresh optimizer)."""
    torch.set_num_threads(1)
    model = config.model
    layers = build_layers(model, 0, model.layers)
    with torch.no_grad():
        for k, values in (start or {}).items():
            for name, p in layers[k].named_parameters():
                p.copy_(values[name])
    optimizer = one_optimizer(config, [p for k in sorted(layers) for p in layers[k].parameters()])
    corpus = Corpus.default()
    pipelines = [
        ([tuple(s["layers"]) for s in p["stages"]], p["micro_batches"]) for p in plan["pipelines"]
    ]
    count = sum(m for _, m in pipelines)
    first_layer, last_layer = layers[0], layers[model.layers - 1]
    losses = []
    for step in steps:
        optimizer.zero_grad()
        total = 0.0
        sample = 0
        for ranges, micros in pipelines:
            depth = len(ranges)
            for m in range(micros):
                order = list(range(depth))
                if depth >= 4 and m % 2:
                    order[0], order[1] = 1, 0
                    order[-2], order[-1] = depth - 1, depth - 2
                x, y = corpus.batch(config.data_seed, step, sample, config.micro_batch, model.seq)
                sample += config.micro_batch
                assert first_layer.embed is not None and last_layer.head is not None
                assert last_layer.norm is not None
                h = first_layer.embed(x)
                for s in order:
                    for k in range(*ranges[s]):
                        h = layers[k].block(h)
                logits = last_layer.head(last_layer.norm(h))
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, model.vocab), y.reshape(-1)
                )
                (loss / count).backward()
                total += float(loss.item()) / count
        optimizer.step()
        losses.append(total)
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
