"""A small decoder-only transformer cut into the core's layers.

Llama-style blocks: RMSNorm, causal self-attention with rotary position embedding, SwiGLU MLP.
The model has ``layers`` layers exactly as the core counts them (``ModelProfile.layers``):
layer 0 is the token embedding and block 0, layer L-1 is block L-1, the final norm and the LM
head, every other layer is one block; with L = 1 the one layer holds all of it.

``build_layers(config, first, end)`` builds layers [first, end). Each layer's initial weights
come from its own seed (the model seed and the layer index), so every rank that builds layer k
gets the same weights whichever other layers it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model; the defaults make a step on one CPU core take tens of milliseconds."""

    layers: int = 8
    vocab: int = 256  # bytes
    d_model: int = 64
    heads: int = 4
    ffn: int = 176  # SwiGLU hidden width, about 8/3 of d_model
    seq: int = 64
    seed: int = 0
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError("a model needs at least one layer")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError("d_model must split into heads of even width")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary embedding, each (seq, head_dim / 2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last axis of x (batch, heads, seq, head_dim)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.d_model // config.heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        cos, sin = rotary_tables(config.seq, self.head_dim, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (
            t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).split(dim, dim=-1)
        )
        cos, sin = self.get_buffer("cos")[:seq], self.get_buffer("sin")[:seq]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.ffn, bias=False)
        self.up = nn.Linear(config.d_model, config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))  # type: ignore[no-any-return]


class Layer(nn.Module):
    """One of the core's layers: a block, with the embedding on layer 0 and the head on the last.

    Layer 0 takes token ids (batch, seq); the others take hidden states (batch, seq, d_model).
    The last layer returns logits (batch, seq, vocab), the others hidden states.
    """

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.embed = nn.Embedding(config.vocab, config.d_model) if index == 0 else None
        self.block = Block(config)
        last = index == config.layers - 1
        self.norm = RMSNorm(config.d_model, config.norm_eps) if last else None
        self.head = nn.Linear(config.d_model, config.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def layer_seed(config: ModelConfig, index: int) -> int:
    """The seed of layer ``index``'s initial weights: the same on every rank."""
    return config.seed * 1_000_003 + index


def build_layer(config: ModelConfig, index: int) -> Layer:
    """Layer ``index`` with its initial weights, from its own seed only.

    Linear and embedding weights are drawn from N(0, init_std²), output projections of the
    residual branches scaled down by sqrt(2 · layers) (GPT-2); norms start at one.
    """
    if not 0 <= index < config.layers:
        raise ValueError(f"layer {index} is not one of the model's {config.layers}")
    layer = Layer(config, index)
    generator = torch.Generator().manual_seed(layer_seed(config, index))
    residual_std = config.init_std / math.sqrt(2 * config.layers)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = residual_std if name.endswith(("out.weight", "down.weight")) else config.init_std
            param.normal_(0.0, std, generator=generator)
    return layer


def edge_parts(config: ModelConfig, index: int) -> tuple[str, ...]:
    """The parts of layer ``index`` outside its block: ``embed`` on layer 0, ``norm`` and
    ``head`` on the last (CheckFree+ keeps copies of them next to the edge stages)."""
    parts = ("embed",) if index == 0 else ()
    return parts + (("norm", "head") if index == config.layers - 1 else ())


def build_edge(config: ModelConfig, index: int) -> nn.ModuleDict:
    """Layer ``index``'s ``edge_parts`` with their initial weights (those of ``build_layer``),
    named as in the layer (``embed.weight``, ``norm.weight``, ``head.weight``)."""
    layer = build_layer(config, index)
    return nn.ModuleDict({part: getattr(layer, part) for part in edge_parts(config, index)})


def build_layers(config: ModelConfig, first: int, end: int) -> dict[int, Layer]:
    """Layers [first, end) by index, each built from its own seed."""
    if not 0 <= first < end <= config.layers:
        raise ValueError(f"[{first}, {end}) is not a range of the model's {config.layers} layers")
    return {k: build_layer(config, k) for k in range(first, end)}


def run_layers(layers: dict[int, Layer], first: int, end: int, x: torch.Tensor) -> torch.Tensor:
    """Forward of layers [first, end) in order (token ids in if first is 0, logits out if last)."""
    for k in range(first, end):
        x = layers[k](x)
    return x


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over every position of every sample."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
