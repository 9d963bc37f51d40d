"""Sequence sharding for sequence-parallel phases: tail padding, local chunks, gathers."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_gather


class SlotHole(NamedTuple):
    """Slots [start, end) of bucket padding inside a sequence: no query may see a key there.

    A prompt padded to its bucket puts its padding rows between the text and what follows it
    (the image head), so that everything after the text sits at fixed slots. Those rows are
    hidden by this rule rather than by causality. `start` is a 0-d int64 tensor (it moves
    with the prompt length: data, so prompts of one bucket share a graph); `end` is a static
    int (the bucket's edge), which tells attention planners which rows lie past the hole.
    Rows inside the hole are padding too: what they compute is never read.

    Batched requests of one bucket (rows of one batch, each with its own text length) give
    `start` as [B], one per batch row; `end` is the bucket's, the same for every row.
    """

    start: torch.Tensor
    end: int

    @property
    def per_row(self) -> bool:
        """Whether each batch row has its own start ([B]) rather than one for all (0-d)."""
        return self.start.dim() == 1

    def visible(self, k_slots: torch.Tensor) -> torch.Tensor:
        """[Sk] bool (or [B, Sk] for a per-row hole): False for keys in the hole."""
        start = self.start.unsqueeze(-1) if self.per_row else self.start
        return (k_slots < start) | (k_slots >= self.end)


class SequenceLayout:
    """How a phase lays a sequence over its SP group (size 1: the identity).

    A sequence of n rows is padded at the tail to a multiple of the SP size; rank r holds
    chunk r. Padding rows get slots past the real sequence (`pad_slots`), where the causal
    mask hides them from every real query and cache writes land in spare slots.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, size: int = 1, rank: int = 0):
        self.group = group
        self.size = size
        self.rank = rank

    def padded_length(self, n: int) -> int:
        return -(-n // self.size) * self.size

    def spare_slots(self) -> int:
        """Cache slots to reserve past the sequence for padding rows."""
        return self.size - 1

    def pad_slots(self, slots: torch.Tensor, first_spare: int) -> torch.Tensor:
        """Full padded slot vector: the real slots, then spare slots first_spare, first_spare+1, ..."""
        pad = self.padded_length(slots.shape[0]) - slots.shape[0]
        if pad == 0:
            return slots
        spare = torch.arange(first_spare, first_spare + pad, dtype=slots.dtype, device=slots.device)
        return torch.cat([slots, spare])

    def pad_runs(self, runs: tuple[tuple[int, int], ...], first_spare: int) -> tuple[tuple[int, int], ...]:
        """`pad_slots` for a static run description of the slots (half-open (start, end) runs)."""
        n = sum(b - a for a, b in runs)
        pad = self.padded_length(n) - n
        if pad == 0:
            return tuple(runs)
        if runs and runs[-1][1] == first_spare:   # the padding continues the last run
            return (*runs[:-1], (runs[-1][0], first_spare + pad))
        return (*runs, (first_spare, first_spare + pad))

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk of `x` along `dim`, after zero tail padding."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        n = x.shape[dim]
        pad = self.padded_length(n) - n
        if pad:
            widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
            x = F.pad(x, widths)
        return x.chunk(self.size, dim=dim)[self.rank]

    def gather(self, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        """Inverse of `shard`: every rank's chunk, concatenated, padding removed."""
        if self.size == 1:
            return x
        return all_gather(x, dim, self.group).narrow(dim % x.dim(), 0, length)
