"""Rotary position embeddings: frequencies, angles from per-axis positions, and the rotation.

A model gives each row its position on each axis (1-D text: one axis; a video grid: frame,
row, column) and splits head_dim among the axes; the angles of axis a are
position_a * theta^(-2i / dim_a), concatenated over the axes. Where each model puts its rows
(centred, offset, interleaved axes) stays in the model; the arithmetic is here once.

Pair layouts (`apply_rope`'s `pairs`), each a reference's:
  "halves"    channel d rotates with d + D/2 (rotate-half), tables [S, D] holding the D/2
              angles twice (HunyuanImage-3, transformers' Qwen2 / Llama)
  "adjacent"  channels 2i and 2i+1, tables [S, D/2], real arithmetic (diffusers' Wan)
  "complex"   the same pairs as complex numbers, one complex multiply (diffusers' Qwen-Image;
              fewer kernels than the real form, and its rounding); under torch.compile the
              real form, which inductor fuses (it has no code for complex ops: each would
              run as a kernel of its own, 5 more launches a Qwen-Image block on a GPU)
"""
from __future__ import annotations

import torch

PAIRS = ("halves", "adjacent", "complex")


def inv_freq(dim: int, theta: float, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """theta^(-2i / dim) for i < dim / 2, computed in `dtype` (the references use float32, Wan float64)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))


def grid_positions(*axes: torch.Tensor) -> torch.Tensor:
    """[n_0 * n_1 * ..., len(axes)]: every combination of the axes' positions, row-major."""
    return torch.stack([g.flatten() for g in torch.meshgrid(*axes, indexing="ij")], dim=-1)


def rope_angles(positions: torch.Tensor, dims, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """positions [S, n_axes] -> angles [S, sum(dims) / 2] in `dtype`: axis a's positions times its
    own frequencies over dims[a] channels, the axes one after the other."""
    pos = positions.to(dtype)
    return torch.cat([torch.outer(pos[:, a], inv_freq(d, theta, dtype, positions.device))
                      for a, d in enumerate(dims)], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str = "halves",
               upcast: bool = True) -> torch.Tensor:
    """x [..., S, heads, D] rotated by the tables cos/sin [..., S, D] ("halves") or [..., S, D/2]
    (the adjacent layouts), broadcast over the heads. `upcast`: computed in float32 and rounded
    back to x's dtype; otherwise in x's dtype (transformers' Qwen2: the tables cast to it first)."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float() if upcast else x
    if pairs == "halves":
        out = xf * c + rotate_half(xf) * s
    elif pairs == "adjacent" or (pairs == "complex" and torch.compiler.is_compiling()):
        xp = xf.unflatten(-1, (-1, 2))
        x1, x2 = xp[..., 0], xp[..., 1]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    elif pairs == "complex":
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * torch.complex(c, s)).flatten(-2)
    else:
        raise ValueError(f"RoPE pairs must be one of {PAIRS}, got {pairs!r}")
    return out.to(x.dtype)
