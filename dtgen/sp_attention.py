"""Sequence-parallel attention cores: kv-allgather, ring, Attention2D and pipelined Ulysses.

Every core keeps the model's core contract, ``core(q, k, v, meta, cache)``: q [B, S_l, Hq, D]
and k, v [B, S_l, Hkv, D] are this rank's rows (chunk ``r`` of the tail-padded sequence,
TP-local heads); ``meta.slots`` is the FULL padded slot vector (chunk r = rows of SP rank
r); ``cache`` is this rank's static KV cache ([B, H, L, D], written at slots) or None. Each
returns [B, S_l, Hq, D] equal (to fp32 rounding) to single-process attention. P below is the
SP size. The mask is always built from slots (`slot_mask`: causal over slots, image blocks
bidirectional; padding rows sit at spare slots past the sequence, so causality hides them).

kv-allgather
    Queries stay local. K and V travel packed ([S_l, B, 2*Hkv, D]) in ONE all-gather, so
    every rank holds the whole sequence's K/V for its heads; the model's own core attends
    the local rows to them (``meta.kv_slots`` = the full slot vector). Sends (P-1)/P of the
    K/V; the cache holds the full sequence for the local heads, written by the inner core.

ring
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

attn2d (Attention2D)
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

ulysses-pipelined
    Plain Ulysses (one all-to-all of packed q/k/v, attention on full rows for hq heads, one
    all-to-all back) split into G head groups: group g carries, for every destination rank,
    the query heads [g*hq/G, (g+1)*hq/G) of its block and their KV heads. The exchange of
    group g+1 is issued before the attention of group g (functional collectives return
    async tensors that are waited on only when read), and the return exchanges are waited
    on at the end. Automatic G: the largest divisor of n (KV heads per destination, so each
    group keeps whole GQA groups) with G <= max_groups (4) and every group's send buffer
    >= min_group_bytes (1 MiB; below that a collective is latency-bound and splitting it
    only adds launches); G = 1 is exactly the plain path. HunyuanImage-3 at TP2 x SP2 (8 q
    + 2+2 KV heads per destination, 2674 rows, bf16: 8 MiB per group) gets G = 2. Each
    group writes its KV heads' slice of the cache, so the cache equals plain Ulysses'.

All cores take their groups and chunk maps at construction (``build_core`` reads them from
a phase's `PhaseGroups`) and read nothing global in forward. All trace with
``torch.compile(fullgraph=True)`` (functional collectives, custom ops).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group

from kernels.attention_lse import attention_lse
from kernels.lse_merge import lse_merge
from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out

from .attention import ulysses_kv_heads
from .sequence import SlotHole
from .topology import PhaseGroups

SP_KINDS = ("ulysses-pipelined", "kv-allgather", "ring", "attn2d")

# torch 2.13 renamed all_gather_tensor to all_gather_single (same signature); 2.11 has only the old name.
_all_gather_async = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


# ------------------------------------------------------------------------------ helpers


def slot_mask(q_slots: torch.Tensor, k_slots: torch.Tensor, image_blocks: tuple,
              hole: SlotHole | None = None) -> torch.Tensor:
    """[Sq, Sk] bool, True = may attend: causal over slots, each image block bidirectional,
    keys in the `hole` (bucket padding inside the sequence) hidden from every query.

    The rule the attention-meta contract states (`AttentionMeta.image_blocks`); tests check it
    against the model's own `structured_mask`.
    """
    allowed = k_slots.unsqueeze(0) <= q_slots.unsqueeze(1)
    for start, end in image_blocks:
        q_in = (q_slots >= start) & (q_slots < end)
        k_in = (k_slots >= start) & (k_slots < end)
        allowed = allowed | (q_in.unsqueeze(1) & k_in.unsqueeze(0))
    if hole is not None:
        allowed = allowed & hole.visible(k_slots).unsqueeze(0)
    return allowed


def _check_rows(meta, q: torch.Tensor, parts: int, kind: str) -> torch.Tensor:
    """The full slot vector as [parts, S_l] (chunk r = SP rank r's rows)."""
    if getattr(meta, "kv_slots", None) is not None:
        raise ValueError(f"{kind}: meta.kv_slots must be None (keys are this rank's rows)")
    rows = q.shape[1]
    if meta.slots.dim() != 1 or meta.slots.shape[0] != parts * rows:
        raise ValueError(f"{kind}: meta.slots must hold every SP rank's rows, {parts} x {rows} = "
                         f"{parts * rows}, got shape {tuple(meta.slots.shape)}")
    return meta.slots.view(parts, rows)


def _gather_seq_async(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Issue an all-gather of x [B, S, H, D] along the sequence; the (async) result is
    sequence-major [G*S, B, H, D] (no copy for B == 1; read with `.transpose(0, 1)`)."""
    return _all_gather_async(x.transpose(0, 1).contiguous(), 0, group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x)


def _bshd(x_seq_major: torch.Tensor) -> torch.Tensor:
    return _wait(x_seq_major).transpose(0, 1)


def _merge(parts_out: list[torch.Tensor], parts_lse: list[torch.Tensor], out_dtype: torch.dtype):
    """LSE merge of a few partials given as lists (stacked: one small copy)."""
    dtype = torch.float32 if len({p.dtype for p in parts_out}) > 1 else parts_out[0].dtype
    return lse_merge(torch.stack([p.to(dtype) for p in parts_out]), torch.stack(parts_lse), out_dtype)


def _static_part(q: torch.Tensor, q_slots: torch.Tensor, fresh_slots: torch.Tensor, image_blocks: tuple,
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
    out, lse = attention_lse(q.transpose(1, 2), keys, values, slot_mask(q_slots, static, image_blocks, hole))
    return out.transpose(1, 2), lse.transpose(1, 2)


# ---------------------------------------------------------------------------- kv-allgather


class KVAllGatherAttention(nn.Module):
    """Local queries, K/V all-gathered (one collective, packed); the model's core attends."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int, rank: int):
        super().__init__()
        self.inner, self.group, self.size, self.rank = inner, group, size, rank

    def forward(self, q, k, v, meta, cache):
        chunks = _check_rows(meta, q, self.size, "kv-allgather")
        Hkv = k.shape[2]
        full = _bshd(_gather_seq_async(torch.cat([k, v], dim=2), self.group))  # [B, P*S_l, 2Hkv, D]
        local = dataclasses.replace(meta, slots=chunks[self.rank], kv_slots=meta.slots, slot_runs=None)
        return self.inner(q, full[:, :, :Hkv], full[:, :, Hkv:], local, cache)


# ------------------------------------------------------------------------------------ ring


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
        static = _static_part(q, q_slots, slots, image_blocks, cache_k, cache_v, hole)
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
        mask = slot_mask(q_slots, chunks[source], image_blocks, hole)
        out, lse = attention_lse(qh, kb.transpose(1, 2), vb.transpose(1, 2), mask)
        outs.append(out.transpose(1, 2))
        lses.append(lse.transpose(1, 2))
        if len(outs) == 2:  # online: the accumulator stays float32 until the last block
            acc, acc_lse = _merge(outs, lses, q.dtype if step == P - 1 else torch.float32)
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
        _check_rows(meta, q, self.size, "ring")
        blocks = [int(x) for block in meta.image_blocks for x in block]
        hole = getattr(meta, "hole", None)
        return torch.ops.dtgen.ring_attention(q, k, v, meta.slots, None if cache is None else cache.k,
                                              None if cache is None else cache.v, blocks,
                                              None if hole is None else hole.start,
                                              -1 if hole is None else hole.end, self.group_name,
                                              self.rank, self.size)


# ------------------------------------------------------------------------------ Attention2D


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
        chunks = _check_rows(meta, q, R * C, "attn2d")
        Hkv, D = k.shape[2], q.shape[3]
        kv = torch.cat([k, v], dim=2)
        # Issue both gathers before waiting on either (different groups).
        q_all = _gather_seq_async(q, self.rows.group) if R > 1 else None
        kv_all = _gather_seq_async(kv, self.cols.group) if C > 1 else None
        static = None
        if cache is not None:
            static = _static_part(q, chunks[self.my_chunk], meta.slots, meta.image_blocks, cache.k, cache.v,
                                  getattr(meta, "hole", None))
        qg = _bshd(q_all) if R > 1 else q                                 # [B, R*S_l, Hq, D]
        kvg = _bshd(kv_all) if C > 1 else kv                              # [B, C*S_l, 2Hkv, D]
        persist = None
        if cache is not None and R > 1:  # the rest of the fresh K/V, for the cache only; before the attention
            persist = _gather_seq_async(kvg, self.rows.group)
        mask = slot_mask(self._slots(chunks, self.q_chunks), self._slots(chunks, self.kv_chunks),
                         meta.image_blocks, getattr(meta, "hole", None))
        out, lse = attention_lse(qg.transpose(1, 2), kvg[:, :, :Hkv].transpose(1, 2),
                                 kvg[:, :, Hkv:].transpose(1, 2), mask)   # [B, Hq, R*S_l, D]
        if R > 1:
            recv = _wait(funcol.all_to_all_single(_pack_out_lse(out, lse, R), None, None, self.rows.group))
            outs, lses = _unpack_out_lse(recv, D)                         # [R, B, S_l, Hq, (D)]
            last = static is None
            out, lse = lse_merge(outs, lses, q.dtype if last else torch.float32)
        else:
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)
        if static is not None:
            out, lse = _merge([out, static[0]], [lse, static[1]], q.dtype)
        if cache is not None:
            fresh = _bshd(persist) if persist is not None else kvg        # [B, P*S_l, 2Hkv, D]
            cache.write(self._slots(chunks, self.full_chunks), fresh[:, :, :Hkv], fresh[:, :, Hkv:])
        return out.to(q.dtype)


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


# ----------------------------------------------------------------------- ulysses-pipelined


def pipeline_groups(kv_per_rank: int, send_bytes: int, max_groups: int, min_group_bytes: int) -> int:
    """Head groups for pipelined Ulysses: the largest G dividing the KV heads per destination,
    G <= max_groups, with every group's send buffer >= min_group_bytes; 1 = the plain path."""
    for g in range(min(max_groups, kv_per_rank), 1, -1):
        if kv_per_rank % g == 0 and send_bytes // g >= min_group_bytes:
            return g
    return 1


class UlyssesPipelinedAttention(nn.Module):
    """Ulysses in head groups; group g+1's exchange overlaps group g's attention (module docstring)."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int, max_groups: int = 4,
                 min_group_bytes: int = 1 << 20):
        super().__init__()
        self.inner, self.group, self.size = inner, group, size
        self.max_groups, self.min_group_bytes = max_groups, min_group_bytes

    def head_groups(self, q: torch.Tensor, k: torch.Tensor) -> int:
        """G for these shapes (the rule of `pipeline_groups`)."""
        B, S, Hq, D = q.shape
        n = len(ulysses_kv_heads(Hq, k.shape[2], self.size)[0])
        send_bytes = self.size * B * S * (Hq // self.size + 2 * n) * D * q.element_size()
        return pipeline_groups(n, send_bytes, self.max_groups, self.min_group_bytes)

    def _heads(self, Hq: int, Hkv: int, G: int) -> list[tuple[list[list[int]], list[list[int]]]]:
        """(q_heads [P][hq/G], kv_heads [P][n/G]) of every group: plain ints, constants when compiled."""
        P, hq = self.size, Hq // self.size
        kv_all = ulysses_kv_heads(Hq, Hkv, P)
        hq_g, n_g = hq // G, len(kv_all[0]) // G
        return [([list(range(j * hq + g * hq_g, j * hq + (g + 1) * hq_g)) for j in range(P)],
                 [row[g * n_g:(g + 1) * n_g] for row in kv_all]) for g in range(G)]

    def _issue(self, q, k, v, index) -> torch.Tensor:
        return funcol.all_to_all_single(ulysses_pack(q, k, v, *index), None, None, self.group)

    def forward(self, q, k, v, meta, cache):
        P = self.size
        B, S, Hq, D = q.shape
        G = self.head_groups(q, k)
        index = self._heads(Hq, k.shape[2], G)
        hq_g, n_g = len(index[0][0][0]), len(index[0][1][0])
        pending = self._issue(q, k, v, index[0])
        backs = []
        for g in range(G):
            following = self._issue(q, k, v, index[g + 1]) if g + 1 < G else None  # before group g's attention
            full = ulysses_unpack(_wait(pending))                                  # [B, P*S, hq_g + 2n_g, D]
            qf, kf, vf = full.split([hq_g, n_g, n_g], dim=2)
            part_cache = None if cache is None else type(cache)(cache.k.narrow(1, g * n_g, n_g),
                                                                cache.v.narrow(1, g * n_g, n_g))
            out = self.inner(qf, kf, vf, meta, part_cache)                        # [B, P*S, hq_g, D]
            backs.append(funcol.all_to_all_single(ulysses_pack_out(out, P).contiguous(), None, None, self.group))
            pending = following
        if G == 1:
            back = _wait(backs[0])
        else:  # [P, B, S, G, hq_g, D]: rank j's heads are its G groups in order
            back = torch.stack([_wait(b) for b in backs], dim=3).view(P, B, S, G * hq_g, D)
        return ulysses_unpack_out(back)


# ----------------------------------------------------------------------------- factory


def build_core(kind: str, inner: nn.Module, groups: PhaseGroups) -> nn.Module:
    """The core of one of `SP_KINDS` for a phase, wrapping the model's local core `inner`."""
    if kind == "kv-allgather":
        return KVAllGatherAttention(inner, groups.sp_group, groups.sp_size, groups.sp_rank)
    if kind == "ring":
        return RingAttention(inner, groups.sp_group, groups.sp_size, groups.sp_rank)
    if kind == "attn2d":
        return attention2d_from_groups(inner, groups)
    if kind == "ulysses-pipelined":
        return UlyssesPipelinedAttention(inner, groups.sp_group, groups.sp_size)
    raise ValueError(f"unknown sequence-parallel attention kind {kind!r}; known: {SP_KINDS}")
