"""Normalisations: one RMSNorm for every model, the Wan VAE's channel norm, FP32 LayerNorm.

The RMS norms of the references agree on the math, w * x / sqrt(mean(x^2) + eps), and differ
in where they round. `rounding` names the convention, so each model keeps its reference's
bits (under bf16 these differ in the last place, which a parity test would show):

  "input"        statistics and normalisation in float32, rounded to x's dtype, then scaled
                 (HunyuanImage-3; transformers' Qwen2RMSNorm / LlamaRMSNorm)
  "weight"       the same, rounded to the weight's dtype instead (transformers' T5LayerNorm)
  "half_weight"  rounded to the weight's dtype only when that is fp16 / bf16, else left in
                 float32 (diffusers' RMSNorm: Qwen-Image's MMDiT)
  "torch"        torch's own F.rms_norm in x's dtype (torch.nn.RMSNorm: diffusers' Wan DiT)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import empty_param

ROUNDINGS = ("input", "weight", "half_weight", "torch")
_HALF = (torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str = "input") -> torch.Tensor:
    """RMS norm over the last dim with `rounding`'s convention (see the module docstring)."""
    if rounding == "torch":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "input":
        h = h.to(x.dtype)
    elif rounding == "weight" or (rounding == "half_weight" and weight.dtype in _HALF):
        h = h.to(weight.dtype)
    elif rounding != "half_weight":
        raise ValueError(f"RMS norm rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return weight * h


class RMSNorm(nn.Module):
    """`rms_norm` with a `weight` [dim] (the checkpoints' name) and a fixed `eps` and `rounding`."""

    def __init__(self, dim: int, eps: float = 1e-6, rounding: str = "input"):
        super().__init__()
        if rounding not in ROUNDINGS:
            raise ValueError(f"RMS norm rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.eps = eps
        self.rounding = rounding
        self.weight = empty_param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.rounding)


class ChannelRMSNorm(nn.Module):
    """diffusers' `WanRMS_norm` (the Wan VAE's): each position's channel vector (dim 1)
    L2-normalised, times sqrt(C) * gamma. Not `RMSNorm`: the normalisation is F.normalize
    (x / max(||x||, 1e-12), no eps inside a root), over dim 1 of a [N, C, ...] map, and the
    checkpoint calls the scale `gamma` [C, 1, 1(, 1)]. Per position: no statistics across
    space or time (a split decode runs it unchanged). Half-precision inputs are normalised in
    fp32 and rounded back before the scaling, as in diffusers. (Its `bias` is off in every Wan
    VAE norm: no parameter.)"""

    def __init__(self, channels: int, spatial_dims: int):
        super().__init__()
        self.scale = channels ** 0.5
        # [C, 1, 1(, 1)]: the checkpoint's shape (2 trailing ones in the per-frame attention,
        # 3 in the video blocks).
        self.gamma = nn.Parameter(torch.ones(channels, *(1,) * spatial_dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.normalize(x.float() if x.element_size() < 4 else x, dim=1).to(x.dtype)
        return y * self.scale * self.gamma


def layer_norm_f32(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' FP32LayerNorm: input, weight and bias in float32; returns float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(),
                        None if bias is None else bias.float(), eps)
