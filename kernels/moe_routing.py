"""Routing prep shared by the MoE ops: group the (token, k) pairs by expert.

A token routed to K experts makes K *pairs*; pair ``p = t * K + k`` goes to expert
``topk_ids[t, k]``. Both MoE ops start from the same picture: the T*K pairs sorted by
expert, so that every expert owns one contiguous run of *slots* (rows of the sorted
order), plus the way back from a pair to its slot.

Pure torch and `torch.compile(fullgraph=True)`-friendly: no `.item()`, no data-dependent
Python control flow, and every output has a static shape (T*K rows, E offsets).
"""
from typing import NamedTuple

import torch


class MoeRouting(NamedTuple):
    """The T*K pairs in expert-sorted order.

    pair_of_slot: [T*K] int64. The pair (t * K + k) held by each slot. Within one expert
        the pairs keep token order (stable sort), so the result is deterministic.
    slot_of_pair: [T*K] int64. The inverse permutation: the slot of each pair.
    expert_ends: [E] int32. Cumulative pair counts: expert e owns the slots
        ``[expert_ends[e-1], expert_ends[e])`` (with ``expert_ends[-1] == 0``), so
        ``expert_ends[E-1] == T*K``. Length E, end offsets only: exactly the ``offs``
        argument that `torch._grouped_mm` expects.
    x_sorted: [T*K, H]. ``x[pair_of_slot // K]``: each slot's token row, one gather;
        None when the caller asked for no gather (its GEMM reads x through the index).
    """

    pair_of_slot: torch.Tensor
    slot_of_pair: torch.Tensor
    expert_ends: torch.Tensor
    x_sorted: torch.Tensor | None


def moe_route(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, gather: bool = True) -> MoeRouting:
    """Sort the pairs of ``topk_ids`` ([T, K], expert ids in [0, E)) by expert.

    ids outside [0, E) are not checked (that would need a device sync); such pairs fall
    outside every expert's run and their rows are never computed.
    """
    top_k = topk_ids.shape[1]
    # Radix-sort time grows with the key width: on an H200, 32768 ids sort in 0.08 ms as
    # int64 and 0.02 ms as uint8, so sort the narrowest type that holds every id.
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int32
    flat_ids = topk_ids.reshape(-1).to(key_dtype)
    sorted_ids, pair_of_slot = torch.sort(flat_ids, stable=True)
    # searchsorted(right=True) of e counts the pairs with id <= e: the end of e's run.
    # Static length E (unlike bincount, whose length depends on the largest id).
    experts = torch.arange(num_experts, device=flat_ids.device, dtype=key_dtype)
    expert_ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    slots = torch.arange(flat_ids.numel(), device=flat_ids.device)
    slot_of_pair = torch.empty_like(pair_of_slot).scatter_(0, pair_of_slot, slots)
    x_sorted = x.index_select(0, pair_of_slot // top_k) if gather else None
    return MoeRouting(pair_of_slot, slot_of_pair, expert_ends, x_sorted)
