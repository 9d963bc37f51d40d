"""Where a model's token rows are split over a phase's sequence-parallel ranks, and gathered back.

A DiT pipeline runs its model in pieces: `embed` (the blocks' inputs, for the whole sequence),
the blocks, and a final layer that works row by row. Under sequence parallelism every rank
runs the blocks on its chunk of the rows, so the per-row inputs (the tokens, their RoPE rows,
a per-token modulation) are split along their row dim, and the final layer's rows are
gathered back. The model declares which, as data beside its modules (a `SeqSplits`, e.g.
`WanTransformer.seq_splits`), as diffusers' `_cp_plan` does for its hooks; `split_inputs` and
`gather_output` apply that declaration to a phase's `SequenceLayout` (`rt.seq`), and
`embed_split` / `final_gathered` run the model's own pieces with it, so no model pipeline
shards by hand.

Every attention kind (ulysses, ring, kv-allgather, attn2d and their nestings) takes the same
rows: each split field is tail-padded to a multiple of the SP size and rank r keeps chunk r.
The kinds differ only in their cores (dtgen/sp), which find each row's place in the sequence
from the `AttentionMeta` built here. Without SP (size 1) every split and gather is the identity.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch

from .attention import AttentionMeta
from .sequence import SequenceLayout, SlotHole


@dataclass(frozen=True)
class SplitRows:
    """A field of `embed`'s output, split along `dim` (a tuple field, e.g. RoPE's (cos, sin):
    each member). `only_per_row`: split only when `dim` holds one entry per row; a size-1 dim
    is one value for every row (one timestep for all tokens) and stays whole on every rank."""

    dim: int
    only_per_row: bool = False


@dataclass(frozen=True)
class GatherRows:
    """The final layer's output, every rank's rows gathered along `dim`, padding rows dropped."""

    dim: int


@dataclass(frozen=True)
class SeqSplits:
    """A model's split and gather points.

    inputs: field of `embed`'s output (a NamedTuple) -> how it is split; fields not named
        here (the text of a cross-attention, a global time embedding) stay whole on every rank.
    attention: the split fields whose rows the attention sees as one sequence, in its order
        (a joint attention over [text, image] names both): the meta's slots follow it.
    output: how `final_layer`'s output is gathered.
    """

    inputs: Mapping[str, SplitRows]
    attention: tuple[str, ...]
    output: GatherRows

    def __post_init__(self):
        unsplit = [name for name in self.attention if name not in self.inputs]
        if unsplit:
            raise ValueError(f"SeqSplits: the attention's fields {unsplit} are not split (inputs: {sorted(self.inputs)})")


class LocalInputs(NamedTuple):
    """This rank's share of `embed`'s output, and where its rows sit in the whole sequence."""

    inputs: NamedTuple      # embed's output, each split field holding this rank's rows
    meta: AttentionMeta


def split_input(seq: SequenceLayout, splits: SeqSplits, name: str, value):
    """This rank's part of one field of `embed`'s output (the whole of it when not split)."""
    how = splits.inputs.get(name)
    if how is None:
        return value
    if isinstance(value, tuple):
        return tuple(split_input(seq, splits, name, member) for member in value)
    if how.only_per_row and value.shape[how.dim] == 1:
        return value
    return seq.shard(value, how.dim)


def split_inputs(seq: SequenceLayout, splits: SeqSplits, embedded: NamedTuple) -> LocalInputs:
    """`embed`'s output with every split field cut to this rank's rows, and the attention meta
    of the whole sequence (from the real row counts of the fields in `splits.attention`)."""
    unknown = sorted(set(splits.inputs) - set(embedded._fields))
    if unknown:   # a misspelt field would silently stay whole on every rank
        raise ValueError(f"SeqSplits name {unknown}, which {type(embedded).__name__} does not have "
                         f"(its fields: {list(embedded._fields)})")
    streams = [getattr(embedded, name) for name in splits.attention]
    rows = [x.shape[splits.inputs[name].dim] for name, x in zip(splits.attention, streams)]
    local = type(embedded)(*(split_input(seq, splits, name, value) for name, value in zip(embedded._fields, embedded)))
    return LocalInputs(local, sequence_meta(seq, rows, streams[0].device))


def gather_output(seq: SequenceLayout, splits: SeqSplits, out: torch.Tensor, rows: int) -> torch.Tensor:
    """`final_layer`'s output on this rank's rows -> every rank's `rows` real rows, in order."""
    return seq.gather(out, splits.output.dim, rows)


def embed_split(rt, model, *args, hole: SlotHole | None = None) -> LocalInputs:
    """`model.embed(*args)` split over the phase's SP ranks as `model.seq_splits` declares: a
    step piece of its own (compiled like the others), for every model with `embed`. `hole`:
    slots no query may see (`padded_rows`: each batch row's padding of its first stream)."""
    return with_hole(split_inputs(rt.seq, model.seq_splits, model.embed(*args)), hole)


def with_hole(local: LocalInputs, hole: SlotHole | None) -> LocalInputs:
    """`local` with its attention meta's `hole` set (None: as it is). A compiled step piece
    returns its inputs without one and the caller adds it: torch 2.11's dynamo fails to return
    a dataclass it rebuilt inside the graph (an AssertionError in its side-effect codegen)."""
    return local if hole is None else local._replace(meta=dataclasses.replace(local.meta, hole=hole))


def padded_rows(rows: list[torch.Tensor], multiple: int = 1) -> tuple[torch.Tensor, SlotHole | None]:
    """Batch rows of one stream of different lengths (each [1, L_b, ...]: a request's prompt,
    every row real) as one [B, L, ...], zero-padded at the tail to the longest rounded up to a
    multiple of `multiple` (a compiled run's text bucket: prompts of similar length then share
    every graph), and the hole that hides each row's padding, slots [L_b, L), from every query:
    for the stream the attention sees first (`SeqSplits.attention`), whose slots start at 0 on
    every plan (one row each and every SP layout: `sequence_meta`). Each row then attends as it
    would alone (diffusers masks a batch of prompts' padding the same way). No hole where no row
    is padded (a single request's call outside a bucket)."""
    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, got {multiple}")
    lengths = [x.shape[1] for x in rows]
    longest = -(-max(lengths) // multiple) * multiple
    if all(n == longest for n in lengths):
        return (rows[0] if len(rows) == 1 else torch.cat(rows)), None
    padded = torch.cat([torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, longest - x.shape[1])) for x in rows])
    return padded, SlotHole(torch.tensor(lengths, device=padded.device), longest)


def final_gathered(rt, model, h: torch.Tensor, temb: torch.Tensor, rows: int) -> torch.Tensor:
    """`model.final_layer(h, temb)` on this rank's rows, every rank's `rows` real rows gathered."""
    return gather_output(rt.seq, model.seq_splits, model.final_layer(h, temb), rows)


def sequence_meta(seq: SequenceLayout, rows: Sequence[int], device=None) -> AttentionMeta:
    """The meta of streams of `rows` real rows each, each split over `seq` alone and joined by
    the attention in this order (rank r holds chunk r of every stream, stream after stream).

    Real rows take the slots of the joint sequence (stream after stream), padding rows spare
    slots past all of them, and the real rows attend as one bidirectional block: no real row
    sees a padding row. One stream (or no SP) is one run of slots, given as `slot_runs` so
    that a core may attend mask-free pieces; the rank-major order of several streams is not
    one run, which `plan_segments` could only attend as one masked piece: left out.
    """
    total = sum(rows)
    if len(rows) == 1 or seq.size == 1:
        return AttentionMeta(slots=seq.pad_slots(torch.arange(total, device=device), total),
                             image_blocks=((0, total),), slot_runs=seq.pad_runs(((0, total),), total))
    chunks, start, spare = [], 0, total
    for n in rows:
        slots = seq.pad_slots(torch.arange(start, start + n, device=device), spare)
        chunks.append(slots.chunk(seq.size))
        start, spare = start + n, spare + slots.shape[0] - n
    slots = torch.cat([torch.cat(mine) for mine in zip(*chunks)])
    return AttentionMeta(slots=slots, image_blocks=((0, total),))
