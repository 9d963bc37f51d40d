"""The docs' tiny DiT: plain modules, where its rows split under sequence parallelism and
where an evaluation may be cut (its split points), the adapter `dtgen.build` reads and its loader."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dtgen.attention import LocalAttention
from dtgen.build import ModelAdapter, build
from dtgen.checkpoint import CheckpointReader
from dtgen.denoiser_calls import denoiser_call
from dtgen.layers.embeddings import timestep_sinusoid
from dtgen.layers.rope import apply_rope, rope_angles
from dtgen.seq_split import GatherRows, SeqSplits, SplitRows


class Block(nn.Module):
    """Plain modules: no process group anywhere; the head count is read off the weights."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.core = LocalAttention()       # a phase swaps in Ulysses, ring, Attention2D, ...

    def forward(self, x, temb, rope, meta):
        B, S, _ = x.shape
        q, k, v = self.qkv(x + temb).view(B, S, 3, -1, self.head_dim).unbind(2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return x + self.out(self.core(q, k, v, meta, None).reshape(B, S, -1))


class TinyInputs(NamedTuple):   # what `embed` gives the blocks
    tokens: torch.Tensor        # [B, S, dim]
    temb: torch.Tensor          # [B, 1, dim]; [B, S, dim] with a timestep per token
    rope: tuple[torch.Tensor, torch.Tensor]   # cos, sin [S, head_dim]
    rows: int                   # S


class TinyDiT(nn.Module):
    # Under sequence parallelism every rank runs the blocks on its chunk of the token rows
    # (their RoPE rows and per-token time rows with them); the last layer's rows are gathered.
    seq_splits = SeqSplits(inputs={"tokens": SplitRows(1), "temb": SplitRows(1, only_per_row=True),
                                   "rope": SplitRows(0)}, attention=("tokens",), output=GatherRows(1))

    def __init__(self, channels=8, dim=32, heads=4, layers=2):
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(channels, dim), nn.Linear(dim, channels)
        self.blocks = nn.ModuleList(Block(dim, dim // heads) for _ in range(layers))
        # Its one condition, learned (a class-conditional DiT of one class): CFG's conditional
        # rows add it to the time rows, the null condition's rows do not.
        self.label = nn.Parameter(torch.randn(dim))

    def embed(self, x, t, cond=None):      # x [B, S, channels]; t [B] or [B, S]; cond [B]: 1 conditional row
        positions = torch.arange(x.shape[1], device=x.device)[:, None]
        angles = rope_angles(positions, [self.blocks[0].head_dim], 10000.0).repeat(1, 2)
        return TinyInputs(self.proj_in(x), self.embed_time(x, t, cond), (angles.cos(), angles.sin()), x.shape[1])

    # Its split points (dtgen/denoiser_calls.py), each over embed's arguments: a step cache keeps
    # and reuses what the blocks make of `block_input`; a step that reuses it embeds the time alone.
    def embed_time(self, x, t, cond=None):
        temb = timestep_sinusoid(t if t.dim() == 2 else t[:, None], self.proj_in.out_features)
        return temb if cond is None else temb + cond[:, None, None] * self.label

    def block_input(self, inputs):         # the rows entering block 0; no second stream beside them
        return inputs.tokens, None

    def blocks_between(self, inputs, meta, h, carried, lo, hi):
        for block in self.blocks[lo:hi]:
            h = block(h, inputs.temb, inputs.rope, meta)
        return h, None

    @property
    def num_blocks(self):
        return len(self.blocks)

    def stream_rows(self, x, *_):          # the real rows the last layer's output gathers
        return x.shape[1]

    def final_layer(self, h, temb):
        return self.proj_out(h + temb)


def velocity(rt, dit: TinyDiT, x, t, cond=None):
    """The whole evaluation's prediction on the phase `rt` (what a step without a step cache runs)."""
    return denoiser_call(rt, dit, x, t, cond).prediction()


class TinyAdapter(ModelAdapter):
    def build_on_meta(self):
        return TinyDiT()

    def attention_heads(self, model):
        return {f"blocks.{i}": (b.qkv.out_features // 3 // b.head_dim,) * 2 for i, b in enumerate(model.blocks)}


def load(checkpoint, plan, rank=0, world_size=1, dtype=torch.float32, device="cpu"):
    """The spec's loader: this rank's share of the model (checkpoint None: random weights)."""
    reader = None if checkpoint is None else CheckpointReader(checkpoint)
    try:
        return build(TinyAdapter(), plan, reader, rank, world_size, dtype, device)
    finally:
        if reader is not None:
            reader.close()

