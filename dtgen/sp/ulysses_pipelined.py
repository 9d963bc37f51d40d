"""ulysses-pipelined: Ulysses in head groups, exchanges overlapped with attention.

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
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out

from .common import wait
from .ulysses import ulysses_kv_heads


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
            full = ulysses_unpack(wait(pending))                                  # [B, P*S, hq_g + 2n_g, D]
            qf, kf, vf = full.split([hq_g, n_g, n_g], dim=2)
            part_cache = None if cache is None else type(cache)(cache.k.narrow(1, g * n_g, n_g),
                                                                cache.v.narrow(1, g * n_g, n_g))
            out = self.inner(qf, kf, vf, meta, part_cache)                        # [B, P*S, hq_g, D]
            backs.append(funcol.all_to_all_single(ulysses_pack_out(out, P).contiguous(), None, None, self.group))
            pending = following
        if G == 1:
            back = wait(backs[0])
        else:  # [P, B, S, G, hq_g, D]: rank j's heads are its G groups in order
            back = torch.stack([wait(b) for b in backs], dim=3).view(P, B, S, G * hq_g, D)
        return ulysses_unpack_out(back)
