"""ring: K/V blocks rotate around the SP group, LSE-merged.

K/V (packed [B, S_l, 2*Hkv, D]) rotate around the SP group: at step i rank r holds
block (r - i) mod P, posts ``batch_isend_irecv`` (send to r+1, receive from r-1) BEFORE
computing on that block, computes the local queries against it with `attention_lse`,
merges into a float32 accumulator by log-sum-exp (`lse_merge`; a block the queries
cannot see gives lse = -inf and weight 0), then waits. Each rank sends and receives
P-1 blocks; no rank ever holds more than two blocks. Blocks keep sequence order (no
zigzag reordering): a rank whose rows are causal text computes (masked) blocks it cannot
see; in denoise most rows are one bidirectional image block, so little is wasted.
Cache: every block that passes through a rank is written into its cache at the block's
slots as it arrives. That is the same data an all-gather would deliver, at no extra
communication, so after the first (fill) call every cache holds the full sequence for
the local heads, exactly like the single-process cache. On later calls the text K/V are
NOT sent again: the rows this call feeds (``meta.slots``) are fresh, every other cache
slot is static (text, cached at step 0). The local queries attend (a) to the static
slots, selected by slot (a sort of a fresh-slot flag vector; count L - P*S_l is known
from shapes, so no host sync), and (b) ring over the fresh rows only; (a) and (b) are
merged by LSE. A denoise step therefore moves only the <timestep> + image K/V.
c10d P2P cannot be traced by torch.compile, so the ring is registered as ONE custom op,
``dtgen::ring_attention`` (cache tensors declared mutated): a compiled phase keeps it as
one node, and inside it the sends are still posted before each block's compute.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group

from kernels.attention_lse import attention_lse

from ..attention import structured_mask
from ..sequence import SlotHole
from .common import check_rows, merge_partials, static_part


def _ring_attention(q, k, v, slots, cache_k, cache_v, image_blocks: tuple, hole: SlotHole | None,
                    group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """The ring (module docstring); q [B, S_l, Hq, D] -> [B, S_l, Hq, D], cache written in place."""
    P, r = size, rank
    chunks = slots.view(P, q.shape[1])
    Hkv = k.shape[2]
    members = dist.get_process_group_ranks(group)   # P2P peers are global ranks
    send_to, recv_from = members[(r + 1) % P], members[(r - 1) % P]
    q_slots, qh = chunks[r], q.transpose(1, 2)
    outs, lses = [], []
    if cache_k is not None:
        static = static_part(q, q_slots, slots, image_blocks, cache_k, cache_v, hole)
        if static is not None:
            outs, lses = [static[0]], [static[1]]
    block = torch.cat([k, v], dim=2)                              # [B, S_l, 2Hkv, D], contiguous
    for step in range(P):
        source = (r - step) % P
        incoming, works = None, []
        if step < P - 1:  # post the exchange of the next block before computing on this one
            incoming = torch.empty_like(block)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, peer=send_to, group=group),
                                            dist.P2POp(dist.irecv, incoming, peer=recv_from, group=group)])
        kb, vb = block[:, :, :Hkv], block[:, :, Hkv:]
        if cache_k is not None:  # every block passes through: the cache fills at no extra cost
            cache_k.index_copy_(2, chunks[source], kb.transpose(1, 2).to(cache_k.dtype))
            cache_v.index_copy_(2, chunks[source], vb.transpose(1, 2).to(cache_v.dtype))
        mask = structured_mask(q_slots, chunks[source], image_blocks, hole)
        out, lse = attention_lse(qh, kb.transpose(1, 2), vb.transpose(1, 2), mask)
        outs.append(out.transpose(1, 2))
        lses.append(lse.transpose(1, 2))
        if len(outs) == 2:  # online: the accumulator stays float32 until the last block
            acc, acc_lse = merge_partials(outs, lses, q.dtype if step == P - 1 else torch.float32)
            outs, lses = [acc], [acc_lse]
        for work in works:
            work.wait()
        if incoming is not None:
            block = incoming
    return outs[0].to(q.dtype).contiguous()


@torch.library.custom_op("dtgen::ring_attention", mutates_args=("cache_k", "cache_v"))
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                       cache_k: torch.Tensor | None, cache_v: torch.Tensor | None, image_blocks: list[int],
                       hole_start: torch.Tensor | None, hole_end: int, group_name: str, rank: int,
                       size: int) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    blocks = tuple(zip(image_blocks[0::2], image_blocks[1::2]))
    hole = None if hole_start is None else SlotHole(hole_start, hole_end)
    return _ring_attention(q, k, v, slots, cache_k, cache_v, blocks, hole, group, rank, size)


@_ring_attention_op.register_fake
def _(q, k, v, slots, cache_k, cache_v, image_blocks, hole_start, hole_end, group_name, rank, size):
    return q.new_empty(q.shape)


class RingAttention(nn.Module):
    """K/V blocks rotate around the SP group over P2P; LSE-merged in float32 (module docstring).

    The loop runs inside the ``dtgen::ring_attention`` op (one node under torch.compile).
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int, rank: int):
        super().__init__()
        self.inner, self.group, self.size, self.rank = inner, group, size, rank
        self.group_name = group.group_name

    def forward(self, q, k, v, meta, cache):
        check_rows(meta, q, self.size, "ring")
        blocks = [int(x) for block in meta.image_blocks for x in block]
        hole = getattr(meta, "hole", None)
        return torch.ops.dtgen.ring_attention(q, k, v, meta.slots, None if cache is None else cache.k,
                                              None if cache is None else cache.v, blocks,
                                              None if hole is None else hole.start,
                                              -1 if hole is None else hole.end, self.group_name,
                                              self.rank, self.size)
