"""Pieces several sequence-parallel cores share (see each core's file for what it does).

Conventions: P is the SP size; rank r holds chunk r of the tail-padded sequence; `meta.slots`
is the FULL padded slot vector (chunk r = rows of SP rank r). Every mask is the contract's
`structured_mask`, built from slots.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kernels.attention_lse import attention_lse
from kernels.lse_merge import lse_merge

from ..attention import structured_mask
from ..sequence import SlotHole

# torch 2.13 renamed all_gather_tensor to all_gather_single (same signature); 2.11 has only the old name.
_all_gather_async = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def check_rows(meta, q: torch.Tensor, parts: int, kind: str) -> torch.Tensor:
    """The full slot vector as [parts, S_l] (chunk r = SP rank r's rows)."""
    if getattr(meta, "kv_slots", None) is not None:
        raise ValueError(f"{kind}: meta.kv_slots must be None (keys are this rank's rows)")
    rows = q.shape[1]
    if meta.slots.dim() != 1 or meta.slots.shape[0] != parts * rows:
        raise ValueError(f"{kind}: meta.slots must hold every SP rank's rows, {parts} x {rows} = "
                         f"{parts * rows}, got shape {tuple(meta.slots.shape)}")
    return meta.slots.view(parts, rows)


def gather_seq_async(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Issue an all-gather of x [B, S, H, D] along the sequence; the (async) result is
    sequence-major [G*S, B, H, D] (no copy for B == 1; read with `.transpose(0, 1)`)."""
    return _all_gather_async(x.transpose(0, 1).contiguous(), 0, group)


def wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x)


def bshd(x_seq_major: torch.Tensor) -> torch.Tensor:
    return wait(x_seq_major).transpose(0, 1)


def merge_partials(parts_out: list[torch.Tensor], parts_lse: list[torch.Tensor], out_dtype: torch.dtype):
    """LSE merge of a few partials given as lists (stacked: one small copy)."""
    dtype = torch.float32 if len({p.dtype for p in parts_out}) > 1 else parts_out[0].dtype
    return lse_merge(torch.stack([p.to(dtype) for p in parts_out]), torch.stack(parts_lse), out_dtype)


def static_part(q: torch.Tensor, q_slots: torch.Tensor, fresh_slots: torch.Tensor, image_blocks: tuple,
                 cache_k: torch.Tensor, cache_v: torch.Tensor, hole: SlotHole | None):
    """Local queries against the cache slots this call does not rewrite: (out, lse) in
    [B, S_l, Hq, D] / [B, S_l, Hq] layout, or None when every slot is fresh.

    Fresh slots are distinct and inside the cache, so L - len(fresh_slots) slots are static:
    a shape fact, which keeps this free of host syncs. A stable sort of the fresh flags puts
    the static slots first, in ascending order.
    """
    length = cache_k.shape[2]
    count = length - fresh_slots.shape[0]
    if count < 0:
        raise ValueError(f"KV cache of length {length} is shorter than the {fresh_slots.shape[0]} rows fed")
    if count == 0:
        return None
    fresh = torch.zeros(length, dtype=torch.int32, device=fresh_slots.device)
    fresh.index_fill_(0, fresh_slots, 1)
    static = torch.sort(fresh, stable=True).indices[:count]
    keys = cache_k.index_select(2, static).to(q.dtype)
    values = cache_v.index_select(2, static).to(q.dtype)
    out, lse = attention_lse(q.transpose(1, 2), keys, values, structured_mask(q_slots, static, image_blocks, hole))
    return out.transpose(1, 2), lse.transpose(1, 2)
