"""Timestep embeddings: the sinusoid and the two-layer MLP that embeds it (or a text vector)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0, scale: float = 1.0,
                      freqs_dtype: torch.dtype | None = None) -> torch.Tensor:
    """t [...] -> [..., dim] float32 as [cos | sin] (diffusers' Timesteps with flip_sin_to_cos=True,
    downscale_freq_shift=0; HunyuanImage-3's timestep embedder), zero-padded when dim is odd.

    `scale`: multiplies the arguments (diffusers' Timesteps(scale=...): Qwen-Image's 1000).
    `freqs_dtype`: the frequencies rounded to it before the product (diffusers rounds them to
    t's dtype: bf16 in Qwen-Image's bf16 run); None keeps them float32.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    if freqs_dtype is not None:
        freqs = freqs.to(freqs_dtype)
    args = t.float().unsqueeze(-1) * freqs
    if scale != 1.0:
        args = scale * args
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class TwoLayerMLP(nn.Module):
    """linear_2(act(linear_1(x))), act "silu" or "gelu_tanh": diffusers' TimestepEmbedding (the
    time embedders of Wan and Qwen-Image) and PixArtAlphaTextProjection (Wan's text projection)."""

    def __init__(self, in_features: int, hidden: int, act: str):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"TwoLayerMLP act must be 'silu' or 'gelu_tanh', got {act!r}")
        self.linear_1 = Linear(in_features, hidden)
        self.linear_2 = Linear(hidden, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return self.linear_2(h)
