"""HunyuanImage-3's 2-D RoPE tables: image tokens rotate by (y, x), text tokens by their position.

The rotation itself is `dtgen.layers.rope.apply_rope(x, cos, sin, pairs="halves")`.
"""
from __future__ import annotations

import torch

from dtgen.layers.rope import inv_freq

# --------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------
def image_rope_positions(start: int, h: int, w: int) -> torch.Tensor:
    """(y, x) of an h x w image starting at sequence index `start`, row-major, [h*w, 2]."""
    y0 = start + (h * w - h) // 2
    x0 = start + (h * w - w) // 2
    ys = torch.arange(h).repeat_interleave(w) + y0
    xs = torch.arange(w).repeat(h) + x0
    return torch.stack([ys, xs], dim=-1)


def rope_cos_sin(pos_yx: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., S, head_dim] (float32) for positions pos_yx [..., S, 2] = (y, x).

    Frequency i uses y when i is even and x when i is odd; text tokens have y == x == p,
    which makes this ordinary 1-D RoPE for them. The D/2 angles are repeated twice, to be
    applied with rotate-half (dim d pairs with d + D/2).
    """
    half = head_dim // 2
    freqs = inv_freq(head_dim, theta, torch.float32, pos_yx.device)
    use_x = (torch.arange(half, device=pos_yx.device) % 2).bool()
    pos = torch.where(use_x, pos_yx[..., 1:2], pos_yx[..., 0:1]).to(torch.float32)  # [..., S, half]
    angles = pos * freqs
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()
