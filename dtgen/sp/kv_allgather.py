"""kv-allgather: queries stay local, K/V are all-gathered.

Queries stay local. K and V travel packed ([S_l, B, 2*Hkv, D]) in ONE all-gather, so
every rank holds the whole sequence's K/V for its heads; the model's own core attends
the local rows to them (``meta.kv_slots`` = the full slot vector). Sends (P-1)/P of the
K/V; the cache holds the full sequence for the local heads, written by the inner core.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from .common import bshd, check_rows, gather_seq_async


class KVAllGatherAttention(nn.Module):
    """Local queries, K/V all-gathered (one collective, packed); the model's core attends."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, size: int, rank: int):
        super().__init__()
        self.inner, self.group, self.size, self.rank = inner, group, size, rank

    def forward(self, q, k, v, meta, cache):
        chunks = check_rows(meta, q, self.size, "kv-allgather")
        Hkv = k.shape[2]
        full = bshd(gather_seq_async(torch.cat([k, v], dim=2), self.group))  # [B, P*S_l, 2Hkv, D]
        local = dataclasses.replace(meta, slots=chunks[self.rank], kv_slots=meta.slots, slot_runs=None)
        return self.inner(q, full[:, :, :Hkv], full[:, :, Hkv:], local, cache)
