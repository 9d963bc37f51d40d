"""The cores of the attention kinds: one `SPKind` per kind, each core in a file of its own.

A kind wraps the model's local core (`dtgen.attention.LocalAttention` or the model's own) in a
core with the same signature, built from a phase's `PhaseGroups` at construction; it reads
nothing global in forward. The kinds' names and sp-axis rules are plan data
(`dtgen.plan.ATTENTION_KINDS`, which `dtgen.plan.resolve` checks plans against, with no
attention code loaded); this table gives each of those names its core, and a test holds the
two tables equal. The build checks head counts with `check_heads`, and the controller builds
the cores with `make_core`. To add a kind: add its name and sp-axis rules to
`dtgen.plan.ATTENTION_KINDS`, write its core in a new file here and add one `SPKind`.

| kind | what moves | file |
|---|---|---|
| local | nothing (the rows and heads this process holds) | - |
| ulysses | q/k/v all-to-all to head shards, and back | ulysses.py |
| ulysses-pipelined | the same in head groups, overlapped with attention | ulysses_pipelined.py |
| kv-allgather | K/V all-gathered; queries stay | kv_allgather.py |
| ring | K/V blocks around a P2P ring, LSE-merged | ring.py |
| attn2d | Q along grid rows, K/V along grid cols, partials all-to-all | attn2d.py |
| ulysses-ring | Ulysses over the inner sp axis, then a ring over the outer | ulysses.py + ring.py |
| ulysses-attn2d | Ulysses over the inner sp axis, then Attention2D 1 x P over the outer | ulysses.py + attn2d.py |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist
from torch import nn

from .attn2d import attention2d_from_groups, attention2d_one_axis
from .kv_allgather import KVAllGatherAttention
from .ring import RingAttention
from .ulysses import UlyssesAttention, ulysses_kv_heads
from .ulysses_pipelined import UlyssesPipelinedAttention

if TYPE_CHECKING:
    from ..plan import PhaseLayout
    from ..topology import PhaseGroups


@dataclass(frozen=True)
class SPKind:
    """The core of one attention kind (its name and sp-axis rules: `dtgen.plan.ATTENTION_KINDS`).

    build: (the model's local core, the phase's groups) -> the phase's core.
    ulysses_span: for kinds that exchange heads, how many ranks the head split spans in a
        layout (query and KV heads must split over them); None for kinds that keep all heads.
    """

    name: str
    build: Callable[[nn.Module, "PhaseGroups"], nn.Module]
    ulysses_span: Callable[["PhaseLayout"], int] | None = None


def _whole_sp(layout: "PhaseLayout") -> int:
    return layout.sp_size


def _inner_sp_axis(layout: "PhaseLayout") -> int:
    return len(layout.sp_axis_groups[1][1][0])


def _ulysses_ring(inner: nn.Module, groups: "PhaseGroups") -> nn.Module:
    # USP: Ulysses over the second (inner) sp axis, then a ring over the first. After the
    # Ulysses exchange a rank holds the contiguous rows of its ring position, so the ring
    # core sees chunk `ring rank` of the full slot vector, as it expects.
    (_, (ring_group, ring_size, ring_rank)), (_, (uly_group, uly_size, _)) = groups.sp_axes.items()
    return UlyssesAttention(RingAttention(inner, ring_group, ring_size, ring_rank), uly_group, uly_size)


def _ulysses_attn2d(inner: nn.Module, groups: "PhaseGroups") -> nn.Module:
    # Ulysses over the second (inner) sp axis, then Attention2D 1 x P over the first: after the
    # Ulysses exchange a rank holds the rows of its position on the outer axis (as in USP).
    (outer_name, (outer_group, _, outer_rank)), (_, (uly_group, uly_size, _)) = groups.sp_axes.items()
    me = dist.get_rank()
    members = next(g for name, axis in groups.layout.sp_axis_groups if name == outer_name for g in axis if me in g)
    return UlyssesAttention(attention2d_one_axis(inner, outer_group, tuple(members), outer_rank), uly_group, uly_size)


SP_KINDS: dict[str, SPKind] = {k.name: k for k in (
    SPKind("local", lambda inner, groups: inner),
    SPKind("ulysses", lambda inner, g: UlyssesAttention(inner, g.sp_group, g.sp_size), ulysses_span=_whole_sp),
    SPKind("ulysses-pipelined", lambda inner, g: UlyssesPipelinedAttention(inner, g.sp_group, g.sp_size),
           ulysses_span=_whole_sp),
    SPKind("kv-allgather", lambda inner, g: KVAllGatherAttention(inner, g.sp_group, g.sp_size, g.sp_rank)),
    SPKind("ring", lambda inner, g: RingAttention(inner, g.sp_group, g.sp_size, g.sp_rank)),
    SPKind("attn2d", attention2d_from_groups),
    SPKind("ulysses-ring", _ulysses_ring, ulysses_span=_inner_sp_axis),
    SPKind("ulysses-attn2d", _ulysses_attn2d, ulysses_span=_inner_sp_axis),
)}


def get_kind(name: str) -> SPKind:
    if name not in SP_KINDS:
        raise ValueError(f"unknown attention kind {name!r}; known: {tuple(SP_KINDS)}")
    return SP_KINDS[name]


def make_core(kind: str, inner: nn.Module, groups: "PhaseGroups") -> nn.Module:
    """The attention core of a phase, wrapping the model's local core `inner`."""
    return get_kind(kind).build(inner, groups)


def check_heads(kind: str, layout: "PhaseLayout", q_heads: int, kv_heads: int) -> None:
    """Raise ValueError (with the numbers) when a kind cannot split these heads over the layout.

    q_heads / kv_heads: per TP rank of the layout."""
    span = get_kind(kind).ulysses_span
    if span is not None:
        ulysses_kv_heads(q_heads, kv_heads, span(layout))


def cache_kv_heads(kind: str, layout: "PhaseLayout", q_heads: int, kv_heads: int) -> int:
    """KV heads per rank that a core of this kind, over this layout, writes into a KV cache.

    Ulysses kinds hold their head-sharded KV heads (full sequence); kv-allgather, ring and
    attn2d keep all local heads (full sequence as well). Ulysses-ring's cache sits inside the
    ring, behind the Ulysses split."""
    span = get_kind(kind).ulysses_span
    if span is None:
        return kv_heads
    return len(ulysses_kv_heads(q_heads, kv_heads, span(layout))[0])


__all__ = ["SPKind", "SP_KINDS", "get_kind", "make_core", "check_heads", "cache_kv_heads", "ulysses_kv_heads"]
