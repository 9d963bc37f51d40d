"""ulysses: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out

from ..collectives import all_to_all


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
