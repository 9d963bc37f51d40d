"""HunyuanImage-3's 2-D RoPE: image tokens rotate by (y, x), text tokens by their position."""
from __future__ import annotations

import torch

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
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=pos_yx.device) / head_dim))
    use_x = (torch.arange(half, device=pos_yx.device) % 2).bool()
    pos = torch.where(use_x, pos_yx[..., 1:2], pos_yx[..., 0:1]).to(torch.float32)  # [..., S, half]
    angles = pos * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, heads, D]; cos/sin: [S, D] or [B, S, D]. Computed in float32."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
