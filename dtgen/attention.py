"""The attention contract every model and every sequence-parallel core shares.

A model's attention module projects, normalizes and rotates q, k, v itself, then calls its
*core*: ``core(q, k, v, meta, cache)`` with q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D].
The default core (`LocalAttention`) attends over the rows and heads this process holds
(single process, or TP). Sequence-parallel phases swap in another core with the same
signature (`dtgen.sp`); the model code does not change.

`AttentionMeta` says which rows these are (slots) and what they may see: causal over slots,
except that every block in `image_blocks` attends bidirectionally within itself, and keys in
a `hole` are hidden. A model whose whole sequence is bidirectional (a video DiT) declares one
block that covers its real rows; padding rows then sit at slots past that block, where the
causal rule hides them from every real query. Every core builds exactly this mask, from slots,
so every layout (local rows, gathered rows, ring blocks, cache slots) builds the rows it needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention_key_prefix import attention_key_prefix
from kernels.split_kv_decode import DecodeSchedule, balanced_schedule, default_num_programs

from .sequence import SlotHole

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
                    image_blocks: tuple[tuple[int, int], ...], hole: SlotHole | None = None) -> torch.Tensor:
    """Boolean mask [Sq, Sk], True = may attend; [B, Sq, Sk] for a per-row hole (batched
    requests of one bucket, each row with its own padding: `SlotHole.per_row`).

    Causal over sequence slots, except that every image block is bidirectional within
    itself. Built from slot indices rather than stored, so every sequence-parallel layout
    (local rows, gathered rows, ring blocks, cache slots) builds exactly the rows it needs.
    Padding rows live in slots past the real sequence, so the causal rule already hides
    them from every real query; bucket padding inside the sequence (`hole`) is hidden from all.
    """
    allowed = k_slots.unsqueeze(0) <= q_slots.unsqueeze(1)
    if image_blocks:
        qb = _image_block_id(q_slots, image_blocks)
        kb = _image_block_id(k_slots, image_blocks)
        allowed = allowed | ((qb.unsqueeze(1) == kb.unsqueeze(0)) & (qb.unsqueeze(1) >= 0))
    if hole is not None:
        allowed = allowed & hole.visible(k_slots).unsqueeze(-2)
    return allowed


DECODE_IMPLS = ("auto", "reference", "triton")


@dataclass
class DecodeBatch:
    """A batched decode step: batch row b of the queries is request b's one new token.

    Row b writes its K/V at slot `positions[b]` of cache row b and attends to that row's
    slots 0..positions[b]: every request at its own length, in its own slot range (one
    request is the batch of one). `schedule`: the split-KV kernel's work split
    (`kernels/split_kv_decode.py`), built once per step from the lengths and reused by every
    layer; None on the torch path. `impl` ("auto": the kernels on CUDA, their torch
    references elsewhere; "reference"; "triton") is handed to the prologue and attention ops.
    """

    positions: torch.Tensor          # [B] int64
    lengths: torch.Tensor            # [B] = positions + 1: the keys each row sees
    schedule: DecodeSchedule | None
    impl: str = "auto"


def decode_batch(positions: torch.Tensor, cache_len: int, num_programs: int, impl: str = "auto") -> DecodeBatch:
    """The per-step decode description (no host sync: positions stay on the device).
    num_programs: the split kernel's programs per KV head (`decode_programs`)."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode impl must be one of {DECODE_IMPLS}, got {impl!r}")
    lengths = positions + 1
    kernels = impl == "triton" or (impl == "auto" and positions.is_cuda)
    schedule = balanced_schedule(lengths, cache_len, num_programs) if kernels else None
    return DecodeBatch(positions, lengths, schedule, impl)


def decode_programs(device: torch.device | str, kv_heads: int) -> int:
    """The split kernel's programs per KV head on this device (a host call: once, not per step)."""
    return default_num_programs(torch.device(device), kv_heads)


@dataclass
class AttentionMeta:
    """What every attention core needs besides q, k, v.

    slots: [S] int64, the sequence slot (KV-cache index, mask coordinate) of every row of the
        sequence being processed, in full (padded) order. Under sequence parallelism rank r
        holds rows chunk r of it; a core derives what it needs from this one vector.
    image_blocks: half-open slot ranges whose tokens attend bidirectionally.
    kv_slots: slots of the k/v rows handed to a core when they differ from the query rows'
        (a core that gathers keys from other ranks passes its own); None means `slots`.
    slot_runs: `slots` as static runs (SlotRuns below) when the caller knows them, else None.
        A core that hands a different row set to an inner core must drop it (None).
    hole: bucket padding inside the sequence (`dtgen.sequence.SlotHole`): keys no query sees.
    decode: a batched decode step (`DecodeBatch`): one row per request, each at its own
        position in its own cache row; `slots` then holds those positions. The model's
        attention then runs its fused decode path (local heads only: no sequence parallelism).
    """

    slots: torch.Tensor
    image_blocks: tuple[tuple[int, int], ...] = ()
    kv_slots: torch.Tensor | None = None
    slot_runs: tuple[tuple[int, int], ...] | None = None
    hole: SlotHole | None = None
    decode: DecodeBatch | None = None


# Static description of `slots`: half-open runs of consecutive slots, in row order, e.g.
# ((0, 5608),) for a whole denoise sequence. Optional; with it a core can split attention
# into pieces that need no mask (see `plan_segments`). Being static (Python ints), it is part
# of a compiled graph's key: leave it None where the slots move every call (AR decode).
SlotRuns = tuple[tuple[int, int], ...]


def slots_of_runs(runs: SlotRuns, device=None) -> torch.Tensor:
    """The slot vector [sum of run lengths] that `runs` describes."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


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

    def rows(self, start: int, end: int) -> "KVCache":
        """Batch rows [start, end) of every layer as a cache of their own (views: writes land here)."""
        view = KVCache.__new__(KVCache)
        view.layers = [LayerKVCache(layer.k[start:end], layer.v[start:end]) for layer in self.layers]
        return view

    def select_rows(self, rows: torch.Tensor) -> "KVCache":
        """A new cache holding batch rows `rows` of this one (requests that left a batch drop theirs)."""
        kept = KVCache.__new__(KVCache)
        kept.layers = [LayerKVCache(layer.k.index_select(0, rows), layer.v.index_select(0, rows))
                       for layer in self.layers]
        return kept


class KVCachePool:
    """Static KV caches, zeroed on every request; those asked for with a `role` are kept and
    reused by the next request of the same shape, so compiled graphs see the same addresses
    every request and a CUDA-graph step is recorded once, not per request.

    `static_addresses`: tell the compiler the buffers never move (they are written in place
    by compiled graphs); on for compiled pipelines."""

    def __init__(self, static_addresses: bool = False):
        self.static_addresses = static_addresses
        self._kept: dict[str, KVCache] = {}

    def get(self, num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
            device: torch.device | str, role: str | None = None) -> KVCache:
        kept = self.kept(role) if role is not None else None
        if kept is not None and (kept.layers[0].k.shape == (batch, kv_heads, length, head_dim)
                                 and kept.layers[0].k.dtype == dtype and len(kept) == num_layers):
            for layer in kept.layers:
                layer.k.zero_()
                layer.v.zero_()
            return kept
        cache = KVCache(num_layers, batch, kv_heads, length, head_dim, dtype, device)
        if role is not None:
            self._kept[role] = cache
        if self.static_addresses:
            for layer in cache.layers:
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
        return cache

    def kept(self, role: str) -> KVCache | None:
        return self._kept.get(role)

    def clear(self) -> None:
        """Drop the kept caches (after an out-of-memory error: the next request allocates again)."""
        self._kept.clear()

    def drop(self, prefix: str) -> None:
        """Drop the kept caches whose role starts with `prefix` (a phase's, when it ends)."""
        for role in [r for r in self._kept if r.startswith(prefix)]:
            del self._kept[role]

    @property
    def nbytes(self) -> int:
        """Bytes of the caches kept."""
        return sum(layer.k.nbytes + layer.v.nbytes for c in self._kept.values() for layer in c.layers)


# --------------------------------------------------------------------------------------
# Cores
# --------------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] (GQA: Hq a multiple of Hkv), mask [Sq, Sk] or
    [B, Sq, Sk] (one per batch row)."""
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)   # the same for every head
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda:
        # On CUDA, SDPA's masked fast path (memory-efficient) does not take enable_gqa and
        # would fall back to the math kernel; expanding K/V keeps it on the fast path.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        group = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)


@dataclass(frozen=True)
class AttentionSegment:
    """Query rows [row_lo, row_hi) attending to key rows [0, keys).

    kind: "dense" (every one of those keys is allowed: no mask), "dense-hole" (every one but
    a `SlotHole`'s: attention over a key prefix of data-dependent length, after moving the
    hole's keys to the end; `kernels/attention_key_prefix.py`), "causal" (a
    square block, query row i sees key rows <= i: flash attention's is_causal), "masked" (the
    structured mask of those rows, built from their slots).
    """

    row_lo: int
    row_hi: int
    keys: int
    kind: str


def plan_segments(q_runs: SlotRuns, k_runs: SlotRuns, image_blocks: tuple[tuple[int, int], ...],
                  hole_end: int | None = None) -> tuple[AttentionSegment, ...]:
    """Split the structured mask into pieces that mostly need no mask at all.

    The mask has one key limit per query: a query at slot q may see keys at slots <= q, or
    <= end - 1 when q is in an image block [start, end). So the rows of an image block see
    a whole key prefix (dense), a text run that starts where the keys start is a causal
    square, and anything else (a lone <timestep> row, <eoi>, padding: a few rows) keeps the
    explicit mask. Dense and causal pieces run on flash attention, which takes no mask:
    the image rows, almost all of a denoise step's attention FLOPs, leave the slower masked
    kernel. Pure Python on static ints: it costs nothing at run time under torch.compile.
    Keys must be one run (the cache, or the query rows themselves); otherwise one masked piece.
    `hole_end`: the end of a `SlotHole` in the keys. A dense piece (image rows) over it
    becomes "dense-hole"; text rows past it are masked (a few: the image head, <eoi>); a causal
    text piece before it stays, since causality hides the hole from every real row there
    (only the padding rows inside it see it, and what they compute is never read).
    """
    total_rows = sum(b - a for a, b in q_runs)
    if len(k_runs) != 1:
        return (AttentionSegment(0, total_rows, sum(b - a for a, b in k_runs), "masked"),)
    k_lo, k_hi = k_runs[0]
    segments: list[AttentionSegment] = []
    row = 0
    for a, b in q_runs:
        # Cut the run at image block edges: each piece is all-image or all-text.
        edges = [x for blk in image_blocks for x in blk] + ([hole_end] if hole_end is not None else [])
        cuts = sorted({a, b, *(x for x in edges if a < x < b)})
        for lo, hi in zip(cuts, cuts[1:]):
            block = next(((s, e) for s, e in image_blocks if s <= lo < e), None)
            rows = (row + lo - a, row + hi - a)
            sees_hole = hole_end is not None and k_lo < hole_end and (lo >= hole_end or block is not None)
            if block is not None and k_lo <= block[1] <= k_hi:
                # (keys counted from slot 0: the hole's slots index them directly)
                kind = ("dense" if not sees_hole else
                        "dense-hole" if k_lo == 0 and hole_end <= block[1] else "masked")
                segments.append(AttentionSegment(*rows, block[1] - k_lo, kind))
            elif sees_hole:
                segments.append(AttentionSegment(*rows, k_hi - k_lo, "masked"))
            elif block is None and lo == k_lo and hi <= k_hi:
                segments.append(AttentionSegment(*rows, hi - k_lo, "causal"))
            else:
                segments.append(AttentionSegment(*rows, k_hi - k_lo, "masked"))
        row += b - a
    return tuple(segments)


def _attend_unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], no mask (flash attention's path)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.dtype == torch.float32:
        # float32 is not flash's: the fallback kernels need equal head counts.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        group = 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)


def attend_segments(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_slots: torch.Tensor,
                    k_slots: torch.Tensor, image_blocks: tuple, segments: tuple[AttentionSegment, ...],
                    hole: SlotHole | None = None, dense=None) -> torch.Tensor:
    """q [B, Hq, Sq, D], keys/values [B, Hkv, Sk, D] -> [B, Hq, Sq, D], piece by piece.
    `dense`: what attends the "dense" pieces (q, k, v as here; flash attention's SDPA when
    None), e.g. kernels/fp8_attention.py."""
    outs = []
    for seg in segments:
        qs = q[:, :, seg.row_lo:seg.row_hi]
        k, v = keys[:, :, :seg.keys], values[:, :, :seg.keys]
        if seg.kind == "masked":
            mask = structured_mask(q_slots[seg.row_lo:seg.row_hi], k_slots[:seg.keys], image_blocks, hole)
            outs.append(attend(qs, k, v, mask))
        elif seg.kind == "dense-hole":
            # The hole's keys move to the end (attention without a causal mask does not care
            # about key order); the rows then see a prefix whose length is data.
            k = torch.cat([keys[:, :, hole.end:seg.keys], keys[:, :, :hole.end]], dim=2)
            v = torch.cat([values[:, :, hole.end:seg.keys], values[:, :, :hole.end]], dim=2)
            # (a per-row hole gives each batch row its own count)
            outs.append(attention_key_prefix(qs, k, v, (seg.keys - hole.end) + hole.start))
        elif seg.kind == "dense" and dense is not None:
            outs.append(dense(qs, k, v))
        else:
            outs.append(_attend_unmasked(qs, k, v, causal=seg.kind == "causal"))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def attend_with_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                      cache: LayerKVCache | None, dense=None) -> torch.Tensor:
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
    qt = q.transpose(1, 2)
    if meta.slot_runs is not None and meta.kv_slots is None:
        rows = sum(b - a for a, b in meta.slot_runs)
        if rows != q.shape[1]:
            raise ValueError(f"AttentionMeta.slot_runs {meta.slot_runs} describe {rows} rows, but the "
                             f"queries have {q.shape[1]}")
        k_runs = ((0, cache.length),) if cache is not None else meta.slot_runs
        hole_end = None if meta.hole is None else meta.hole.end
        segments = plan_segments(meta.slot_runs, k_runs, meta.image_blocks, hole_end)
        out = attend_segments(qt, keys, values, meta.slots, k_slots, meta.image_blocks, segments, meta.hole,
                              dense)
    else:
        # Without image blocks every row is causal text: no piece is dense, so the masked
        # kernel is what the dense-capable core runs too (HunyuanImage-3's AR decode step fed
        # at moving slots: on the CPU, and under a sequence-parallel AR phase). With image
        # blocks, their rows would silently miss the dense kernel: refused.
        if dense is not None and meta.image_blocks:
            raise ValueError("this attention core attends its dense pieces with another kernel (FP8 attention), "
                             "which needs AttentionMeta.slot_runs (static runs of slots); this meta has none")
        out = attend(qt, keys, values, structured_mask(meta.slots, k_slots, meta.image_blocks, meta.hole))
    return out.transpose(1, 2)


class LocalAttention(nn.Module):
    """Attention over the heads and rows this process holds (single process, or TP).
    `dense`: the kernel for the pieces where every query sees a whole key prefix (see
    `attend_segments`); None: SDPA."""

    def __init__(self, dense=None):
        super().__init__()
        self.dense = dense

    def forward(self, q, k, v, meta: AttentionMeta, cache: LayerKVCache | None):
        return attend_with_cache(q, k, v, meta, cache, self.dense)
