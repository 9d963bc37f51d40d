"""Parameters built without initialisation, and the linear layers built from them.

A model is built on the meta device and the loader assigns every parameter a view of its
resident tensor, so an init pass would be wasted work (and on a real device, memory).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A frozen parameter of `shape` on whatever device is current (meta at load time)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """nn.Linear's parameters (weight [out, in], bias [out] or None) without its initialisation.

    `defer_bias` is the phase controller's, never the model's: while a plan splits this
    linear by rows (its output a partial sum, all-reduced after it), each rank must leave the
    bias out and the controller's reduce hook adds it once, after the sum. Otherwise the bias
    rides in the matmul (cuBLAS adds it in the GEMM's epilogue: no separate pass)."""

    defer_bias = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, None if self.defer_bias else self.bias)


class ProductSite(nn.Module):
    """The identity on a product y = x W^T that its module computes itself from a weight that is
    no linear's own (a micro-packed gate/up, say): `site(x, y)` returns y. The module names it in
    its `lora_sites` (weight attribute -> site child), so that a LoRA pair on that weight
    (dtgen/lora) has a module to join, as a linear's delta joins the linear's output."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


class GeluProj(nn.Module):
    """diffusers' `GELU(approximate="tanh")` module (a feed-forward's `net.0`): proj, then GELU-tanh."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """diffusers' `FeedForward(activation_fn="gelu-approximate")`: [GELU-tanh proj, Dropout,
    Linear], so the keys are net.0.proj and net.2 (Wan's and Qwen-Image's blocks)."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, inner), nn.Identity(), Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))
