"""attn2d (Attention2D): the SP ranks as a rows x cols grid.

The P SP ranks form an R x C grid: the phase's first sp axis is the rows axis (R = its
size), the second the cols axis. A phase with ONE sp axis is treated as 1 x P (that axis
is the cols axis; with GQA it moves fewer bytes than P x 1, which gathers queries and
returns outputs; P x 1 is a plan with a size-1 second axis). Rank (p, g) holds
chunk(p, g), its SP rank. Q is all-gathered along the rows axis (ranks of column g):
Q-block g = chunks {chunk(p', g)}; packed K/V along the cols axis (ranks of row p):
KV-block p = chunks {chunk(p, g')}. Rank (p, g) computes Q-block g against KV-block p
and gets a partial (out, lse) for R query chunks. ONE all-to-all along the rows axis
sends the partial of chunk(p', g) to rank (p', g) (out and lse in one buffer: the fp32
lse travels as two bf16 lanes behind the head_dim); each rank then holds, for its own
chunk, the partials against KV-blocks 0..R-1 = every key, and merges them by LSE
(Triton `lse_merge`, read straight from the receive buffer). 2 x 2, rows = 'r', cols = 'c':

                  cols axis ->
                  g = 0                 g = 1
    p = 0   rank0: chunk 0        rank1: chunk 1       KV-block 0 = {0, 1}
    p = 1   rank2: chunk 2        rank3: chunk 3       KV-block 1 = {2, 3}
            Q-block 0 = {0, 2}    Q-block 1 = {1, 3}

    rank0: Q{0,2} x KV{0,1}   rank1: Q{1,3} x KV{0,1}
    rank2: Q{0,2} x KV{2,3}   rank3: Q{1,3} x KV{2,3}
    all-to-all in column 0: rank0 <-> rank2; chunk 0 = merge(rank0's, rank2's partial)

Per rank: (R-1) chunks of Q and of output+lse, (C-1) chunks of K/V; compute S^2/P.
Cache: same idea as ring. Static (cached) slots are attended locally and LSE-merged with
the grid result. Fresh rows reach a rank only through its KV-block, so to keep every
cache complete (later calls may read these rows without rewriting them, e.g. AR decode)
the KV-block is all-gathered once more along the rows axis, issued right after the
cols gather (before the attention, which hides it; on NCCL it shares the rows
communicator with the all-to-all, so issued later it would delay it) and consumed only
at the end. It moves the fresh rows only, never the text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from kernels.attention_lse import attention_lse
from kernels.lse_merge import lse_merge

from ..attention import structured_mask
from .common import bshd, check_rows, gather_seq_async, merge_partials, static_part, wait

if TYPE_CHECKING:
    from ..topology import PhaseGroups


@dataclass(frozen=True)
class GridAxis:
    """One axis of the Attention2D grid as this rank sees it."""

    group: dist.ProcessGroup | None   # None when the axis has size 1
    members: tuple[int, ...]          # global ranks, in group order
    index: int                        # this rank's position in `members`

    @property
    def size(self) -> int:
        return len(self.members)


def _pack_out_lse(out: torch.Tensor, lse: torch.Tensor, parts: int) -> torch.Tensor:
    """out [B, H, R*S, D] and lse [B, H, R*S] -> ONE send buffer [R, B, S, H, D + e]: the lse
    rides behind head_dim as e = 4 / itemsize lanes of out's dtype (its float32 bits)."""
    B, H, RS, D = out.shape
    S = RS // parts
    o = out.transpose(1, 2).reshape(B, parts, S, H, D).transpose(0, 1)
    lanes = lse.transpose(1, 2).reshape(B, parts, S, H, 1).transpose(0, 1).contiguous().view(out.dtype)
    return torch.cat([o, lanes], dim=-1)


def _unpack_out_lse(recv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a received [R, B, S, H, D + e] buffer: outs [R, B, S, H, D], lses [R, B, S, H]."""
    lanes = recv[..., head_dim:]
    if recv.dtype != torch.float32 and head_dim % 2:  # float32 view needs even offsets
        lanes = lanes.contiguous()
    return recv[..., :head_dim], lanes.view(torch.float32).squeeze(-1)


class Attention2D(nn.Module):
    """Q along rows, K/V along cols, one all-to-all of (out, lse) back (module docstring)."""

    def __init__(self, inner: nn.Module, rows: GridAxis, cols: GridAxis, my_chunk: int,
                 q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...], full_chunks: tuple[int, ...]):
        super().__init__()
        P = rows.size * cols.size
        if sorted(full_chunks) != list(range(P)) or len(q_chunks) != rows.size or len(kv_chunks) != cols.size:
            raise ValueError(f"attn2d: inconsistent chunk maps for a {rows.size} x {cols.size} grid: "
                             f"Q {q_chunks}, KV {kv_chunks}, all {full_chunks}")
        self.inner, self.rows, self.cols = inner, rows, cols
        self.my_chunk, self.q_chunks, self.kv_chunks, self.full_chunks = my_chunk, q_chunks, kv_chunks, full_chunks

    @staticmethod
    def _slots(chunks: torch.Tensor, which: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([chunks[c] for c in which]) if len(which) > 1 else chunks[which[0]]

    def forward(self, q, k, v, meta, cache):
        R, C = self.rows.size, self.cols.size
        chunks = check_rows(meta, q, R * C, "attn2d")
        Hkv, D = k.shape[2], q.shape[3]
        kv = torch.cat([k, v], dim=2)
        # Issue both gathers before waiting on either (different groups).
        q_all = gather_seq_async(q, self.rows.group) if R > 1 else None
        kv_all = gather_seq_async(kv, self.cols.group) if C > 1 else None
        static = None
        if cache is not None:
            static = static_part(q, chunks[self.my_chunk], meta.slots, meta.image_blocks, cache.k, cache.v,
                                  getattr(meta, "hole", None))
        qg = bshd(q_all) if R > 1 else q                                 # [B, R*S_l, Hq, D]
        kvg = bshd(kv_all) if C > 1 else kv                              # [B, C*S_l, 2Hkv, D]
        persist = None
        if cache is not None and R > 1:  # the rest of the fresh K/V, for the cache only; before the attention
            persist = gather_seq_async(kvg, self.rows.group)
        mask = structured_mask(self._slots(chunks, self.q_chunks), self._slots(chunks, self.kv_chunks),
                         meta.image_blocks, getattr(meta, "hole", None))
        out, lse = attention_lse(qg.transpose(1, 2), kvg[:, :, :Hkv].transpose(1, 2),
                                 kvg[:, :, Hkv:].transpose(1, 2), mask)   # [B, Hq, R*S_l, D]
        if R > 1:
            recv = wait(funcol.all_to_all_single(_pack_out_lse(out, lse, R), None, None, self.rows.group))
            outs, lses = _unpack_out_lse(recv, D)                         # [R, B, S_l, Hq, (D)]
            last = static is None
            out, lse = lse_merge(outs, lses, q.dtype if last else torch.float32)
        else:
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)
        if static is not None:
            out, lse = merge_partials([out, static[0]], [lse, static[1]], q.dtype)
        if cache is not None:
            fresh = bshd(persist) if persist is not None else kvg        # [B, P*S_l, 2Hkv, D]
            cache.write(self._slots(chunks, self.full_chunks), fresh[:, :, :Hkv], fresh[:, :, Hkv:])
        return out.to(q.dtype)


def attention2d_one_axis(inner: nn.Module, group: dist.ProcessGroup, members: tuple[int, ...],
                         index: int) -> Attention2D:
    """Attention2D 1 x P over one group (members: its global ranks; this rank is members[index]);
    chunk c = the rows of the group's c-th member. For nesting inside another core."""
    me = members[index]
    every = tuple(range(len(members)))
    return Attention2D(inner, GridAxis(None, (me,), 0), GridAxis(group, tuple(members), index), my_chunk=index,
                       q_chunks=(index,), kv_chunks=every, full_chunks=every)


def attention2d_from_groups(inner: nn.Module, groups: PhaseGroups) -> Attention2D:
    """Lay the phase's SP ranks out as rows x cols (one sp axis: 1 x P; see the module docstring)."""
    layout = groups.layout
    me = dist.get_rank()
    chunk = layout.sp_rank  # chunk index (SP rank) of every global rank
    if len(layout.sp_axis_groups) > 2:
        names = [a for a, _ in layout.sp_axis_groups]
        raise ValueError(f"attn2d: phase '{layout.name}' has {len(names)} sp axes {names}; it takes one or two")
    if layout.sp_axis_groups:
        (rows_name, rows_groups), (cols_name, cols_groups) = layout.sp_axis_groups

        def axis(name, all_groups):
            mine = next(g for g in all_groups if me in g)
            return GridAxis(groups.sp_axes[name][0] if len(mine) > 1 else None, tuple(mine), mine.index(me))

        rows, cols = axis(rows_name, rows_groups), axis(cols_name, cols_groups)

        def cols_of(rank):
            return next(g for g in cols_groups if rank in g)
    else:
        members = layout.sp_group_of(me)
        rows = GridAxis(None, (me,), 0)
        cols = GridAxis(groups.sp_group, tuple(members), members.index(me))

        def cols_of(rank):
            return members
    return Attention2D(inner, rows, cols, my_chunk=chunk[me],
                       q_chunks=tuple(chunk[m] for m in rows.members),
                       kv_chunks=tuple(chunk[m] for m in cols.members),
                       full_chunks=tuple(chunk[x] for m in rows.members for x in cols_of(m)))
