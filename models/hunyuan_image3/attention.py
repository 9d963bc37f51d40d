"""Attention pieces: 2-D RoPE, the structured mask, the static KV cache and the local core.

The decoder layer calls an *attention core* with q, k, v that are already projected, rotated
and QK-normed. The default core below computes plain (single-process / tensor-parallel)
attention. Sequence-parallel phases swap in another core with the same call signature
(Ulysses, ring, ...); the model code does not change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# Mask
# --------------------------------------------------------------------------------------
def _image_block_id(slots: torch.Tensor, image_blocks: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Index of the image block holding each slot, -1 for slots outside every block."""
    block = torch.full_like(slots, -1)
    for b, (start, end) in enumerate(image_blocks):
        block = torch.where((slots >= start) & (slots < end), torch.full_like(slots, b), block)
    return block


def structured_mask(q_slots: torch.Tensor, k_slots: torch.Tensor,
                    image_blocks: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Boolean mask [Sq, Sk], True = may attend.

    Causal over sequence slots, except that every image block is bidirectional within
    itself. Built from slot indices rather than stored, so every sequence-parallel layout
    (local rows, gathered rows, ring blocks, cache slots) builds exactly the rows it needs.
    Padding rows live in slots past the real sequence, so the causal rule already hides
    them from every real query.
    """
    allowed = k_slots.unsqueeze(0) <= q_slots.unsqueeze(1)
    if image_blocks:
        qb = _image_block_id(q_slots, image_blocks)
        kb = _image_block_id(k_slots, image_blocks)
        allowed = allowed | ((qb.unsqueeze(1) == kb.unsqueeze(0)) & (qb.unsqueeze(1) >= 0))
    return allowed


@dataclass
class AttentionMeta:
    """What every attention core needs besides q, k, v.

    slots: [S] int64, the sequence slot (KV-cache index, mask coordinate) of every row of the
        sequence being processed, in full (padded) order. Under sequence parallelism rank r
        holds rows chunk r of it; a core derives what it needs from this one vector.
    image_blocks: half-open slot ranges whose tokens attend bidirectionally.
    kv_slots: slots of the k/v rows handed to a core when they differ from the query rows'
        (a core that gathers keys from other ranks passes its own); None means `slots`.
    """

    slots: torch.Tensor
    image_blocks: tuple[tuple[int, int], ...] = ()
    kv_slots: torch.Tensor | None = None


# --------------------------------------------------------------------------------------
# Static KV cache
# --------------------------------------------------------------------------------------
class LayerKVCache:
    """One layer's static cache: k, v [B, kv_heads, length, D], written at slot indices.

    Shapes never change, so compiled decode steps see the same graph every token. The
    buffers start at zero: masked-out slots must hold finite values (0 * NaN is NaN).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k
        self.v = v

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, S, kv_heads, D] for the rows at `slots` [S]."""
        self.k.index_copy_(2, slots, k.transpose(1, 2).to(self.k.dtype))
        self.v.index_copy_(2, slots, v.transpose(1, 2).to(self.v.dtype))


class KVCache:
    """Static KV cache for every layer."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, kv_heads, length, head_dim)
        self.layers = [LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length


# --------------------------------------------------------------------------------------
# Cores
# --------------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] (GQA: Hq a multiple of Hkv), mask [Sq, Sk]."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda:
        # On CUDA, SDPA's masked fast path (memory-efficient) does not take enable_gqa and
        # would fall back to the math kernel; expanding K/V keeps it on the fast path.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        group = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)


def attend_with_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                      cache: LayerKVCache | None) -> torch.Tensor:
    """Attention of the query rows at `meta.slots`, with keys either the given rows or the whole cache.

    q: [B, Sq, Hq, D], k/v: [B, Sk, Hkv, D] -> [B, Sq, Hq, D].
    """
    kv_slots = meta.slots if meta.kv_slots is None else meta.kv_slots
    if cache is not None:
        cache.write(kv_slots, k, v)
        keys, values = cache.k, cache.v
        k_slots = torch.arange(cache.length, device=kv_slots.device)
    else:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
        k_slots = kv_slots
    mask = structured_mask(meta.slots, k_slots, meta.image_blocks)
    out = attend(q.transpose(1, 2), keys, values, mask)
    return out.transpose(1, 2)


class LocalAttention(nn.Module):
    """Attention over the heads and rows this process holds (single process, or TP)."""

    def forward(self, q, k, v, meta: AttentionMeta, cache: LayerKVCache | None):
        return attend_with_cache(q, k, v, meta, cache)
