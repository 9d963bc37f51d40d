"""Sequence-parallel attention cores (reference implementations on functional collectives).

A core has the model's core signature `core(q, k, v, meta, cache)` with q [B, S_local, Hq, D]
and k, v [B, S_local, Hkv, D] for the rows this rank holds; it returns [B, S_local, Hq, D].
Each wraps the model's own local core, so masks, GQA and the KV cache stay the model's.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out

from .collectives import all_to_all
from .topology import PhaseGroups


def ulysses_kv_heads(q_heads: int, kv_heads: int, sp: int) -> list[list[int]]:
    """KV heads each SP rank needs once query heads are split evenly over `sp` ranks.

    Rank j gets query heads [j*hq, (j+1)*hq). With kv_heads % sp == 0 it needs its own block
    of KV heads; with fewer KV heads than ranks, each rank needs the one KV head of its
    query heads' group (sent to several ranks).
    """
    if q_heads % sp:
        raise ValueError(f"Ulysses: {q_heads} query heads per TP rank are not divisible by the SP size {sp}")
    hq = q_heads // sp
    group = q_heads // kv_heads
    if kv_heads % sp == 0:
        n = kv_heads // sp
        return [list(range(j * n, (j + 1) * n)) for j in range(sp)]
    if group % hq == 0:
        return [[(j * hq) // group] for j in range(sp)]
    raise ValueError(f"Ulysses: cannot split {q_heads} query / {kv_heads} KV heads over {sp} ranks "
                     f"(KV heads must divide evenly, or each rank's query heads must share one KV head)")


class UlyssesAttention(nn.Module):
    """All-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

    Q, K and V travel packed in ONE buffer (one all-to-all in, one out). After the exchange
    every rank holds all (padded) rows for its heads, so the inner core sees the full slot
    vector and writes the full sequence of its heads into the KV cache. The buffers are
    packed and unpacked by the `kernels.ulysses_pack` ops (Triton on CUDA, torch on CPU).
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int):
        super().__init__()
        self.inner = inner
        self.group = group
        self.size = size

    def forward(self, q, k, v, meta, cache):
        P = self.size
        kv_heads = ulysses_kv_heads(q.shape[2], k.shape[2], P)            # plain ints: constants when compiled
        hq, n = q.shape[2] // P, len(kv_heads[0])
        q_heads = [list(range(j * hq, (j + 1) * hq)) for j in range(P)]
        packed = ulysses_pack(q, k, v, q_heads, kv_heads)                 # [P, B, S, hq + 2n, D]
        full = ulysses_unpack(all_to_all(packed, self.group))             # [B, P*S, hq + 2n, D]
        qf, kf, vf = full.split([hq, n, n], dim=2)
        out = self.inner(qf, kf, vf, meta, cache)                         # [B, P*S, hq, D]
        back = all_to_all(ulysses_pack_out(out, P), self.group)           # [P (head block), B, S, hq, D]
        return ulysses_unpack_out(back)                                   # [B, S, Hq, D]


def make_core(kind: str, inner: nn.Module, groups: PhaseGroups) -> nn.Module:
    """The attention core of a phase, wrapping the model's local core `inner`."""
    if kind == "local":
        return inner
    if kind == "ulysses":
        return UlyssesAttention(inner, groups.sp_group, groups.sp_size)
    from .sp_attention import SP_KINDS, RingAttention, build_core  # sp_attention imports this module
    if kind in SP_KINDS:
        return build_core(kind, inner, groups)
    if kind == "ulysses-ring":
        # USP: Ulysses over the second (inner) sp axis, then a ring over the first. After the
        # Ulysses exchange a rank holds the contiguous rows of its ring position, so the ring
        # core sees chunk `ring rank` of the full slot vector, as it expects.
        (ring_axis, (ring_group, ring_size, ring_rank)), (_, (uly_group, uly_size, _)) = groups.sp_axes.items()
        return UlyssesAttention(RingAttention(inner, ring_group, ring_size, ring_rank), uly_group, uly_size)
    raise ValueError(f"unknown attention kind {kind!r}")


def ulysses_size(groups: PhaseGroups) -> int:
    """Ranks the Ulysses exchange spans: the whole SP group, or the inner axis of Ulysses-ring."""
    if groups.layout.attention == "ulysses-ring":
        return list(groups.sp_axes.values())[1][1]
    return groups.sp_size


def cache_kv_heads(kind: str, q_heads: int, kv_heads: int, sp: int) -> int:
    """KV heads per rank that a core of this kind writes into the KV cache.

    Ulysses kinds hold their head-sharded KV heads (full sequence); kv-allgather, ring and
    attn2d keep all local heads (full sequence as well).
    """
    if kind in ("ulysses", "ulysses-pipelined"):
        return len(ulysses_kv_heads(q_heads, kv_heads, sp)[0])
    return kv_heads
