"""Sequence-parallel attention cores (reference implementations on functional collectives).

A core has the model's core signature `core(q, k, v, meta, cache)` with q [B, S_local, Hq, D]
and k, v [B, S_local, Hkv, D] for the rows this rank holds; it returns [B, S_local, Hq, D].
Each wraps the model's own local core, so masks, GQA and the KV cache stay the model's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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
    vector and writes the full sequence of its heads into the KV cache.
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int):
        super().__init__()
        self.inner = inner
        self.group = group
        self.size = size

    def forward(self, q, k, v, meta, cache):
        P = self.size
        B, S, Hq, D = q.shape
        kv_index = ulysses_kv_heads(Hq, k.shape[2], P)
        hq, n = Hq // P, len(kv_index[0])
        idx = torch.tensor(kv_index, device=q.device).flatten()
        packed = torch.cat([
            q.reshape(B, S, P, hq, D),
            k.index_select(2, idx).view(B, S, P, n, D),
            v.index_select(2, idx).view(B, S, P, n, D),
        ], dim=3)                                    # [B, S, P, hq + 2n, D]
        received = all_to_all(packed.permute(2, 0, 1, 3, 4), self.group)  # [P(source), B, S, hq+2n, D]
        full = received.permute(1, 0, 2, 3, 4).reshape(B, P * S, hq + 2 * n, D)
        qf, kf, vf = full.split([hq, n, n], dim=2)
        out = self.inner(qf, kf, vf, meta, cache)    # [B, P*S, hq, D]
        back = all_to_all(out.reshape(B, P, S, hq, D).permute(1, 0, 2, 3, 4), self.group)  # [P(head grp), B, S, hq, D]
        return back.permute(1, 2, 0, 3, 4).reshape(B, S, Hq, D)


def make_core(kind: str, inner: nn.Module, groups: PhaseGroups) -> nn.Module:
    """The attention core of a phase, wrapping the model's local core `inner`."""
    if kind == "local":
        return inner
    if kind == "ulysses":
        return UlyssesAttention(inner, groups.sp_group, groups.sp_size)
    raise ValueError(f"unknown attention kind {kind!r}")


def cache_kv_heads(kind: str, q_heads: int, kv_heads: int, sp: int) -> int:
    """KV heads per rank that a core of this kind writes into the KV cache."""
    if kind == "ulysses":
        return len(ulysses_kv_heads(q_heads, kv_heads, sp)[0])
    return kv_heads
