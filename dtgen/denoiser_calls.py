"""One DiT evaluation cut at the split points the DiT declares, built once for every DiT.

A step cache (dtgen/step_cache.py) runs a denoiser in pieces (`DenoiserCall`: embed, blocks
lo..hi-1, head). The pieces are the same for every DiT once the DiT says where it cuts, as
diffusers' models declare their split points to its hooks; the DiT is a plain module and
declares them as methods over `args`, its `embed` arguments (latents, timestep, text, ...):

    seq_splits                      where `embed`'s rows split and the final layer's gather
                                    under sequence parallelism (dtgen/seq_split.py)
    embed(*args) -> inputs          the blocks' inputs (a NamedTuple), with a field `temb`:
                                    what the final layer is conditioned on
    embed_time(*args) -> temb       `inputs.temb` alone, for a step that runs no block
    block_input(inputs) -> (h, carried)
                                    the rows entering block 0 (what a cache keeps and
                                    extrapolates), and the stream the blocks carry beside
                                    them (Qwen-Image's text rows; None: none)
    blocks_between(inputs, meta, h, carried, lo, hi) -> (h, carried)
                                    blocks lo..hi-1 on this rank's rows
    num_blocks                      how many blocks there are
    stream_rows(*args) -> int       the real rows of `h` (the head gathers them)
    final_layer(h, temb)            the output layer, row by row
    output(out, *args) (optional)   the gathered rows in the prediction's layout (Wan's
                                    unpatchify); without it the rows are the prediction
    select_rows(inputs, index) (optional)
                                    the inputs of some batch rows only, for blocks that
                                    carry no stream: a first-block step whose rows disagree
                                    then runs the other blocks on the rows that need them
    run_block                       how a block is called (an attribute: regions mode puts
                                    the compiled region there)

`DenoiserCalls` runs these as the pieces of `CompiledSteps`: the whole prediction as one
step (what a step without a cache runs), and embed, the time embedding alone, blocks and
head as steps of their own (--compile: one graph each; --compile-regions: eager around the
DiT's compiled `run_block`). The SP split and gather are the framework's (`embed_split`,
`final_gathered`); the DiT shards nothing.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from .compiled_steps import CompiledSteps
from .seq_split import LocalInputs, embed_split, final_gathered, split_input, with_hole
from .sequence import SlotHole
from .step_cache import DenoiserCall, RowLayout


def head(rt, dit, h: torch.Tensor, temb: torch.Tensor, *args) -> torch.Tensor:
    """The final layer on this rank's rows, every rank's real rows gathered, in the DiT's output layout."""
    out = final_gathered(rt, dit, h, temb, dit.stream_rows(*args))
    return dit.output(out, *args) if hasattr(dit, "output") else out


def time_alone(rt, dit, *args) -> torch.Tensor:
    """`embed`'s temb alone, this rank's rows of it (a step that runs no block)."""
    return split_input(rt.seq, dit.seq_splits, "temb", dit.embed_time(*args))


def blocks(rt, dit, local: LocalInputs, h: torch.Tensor, carried, lo: int, hi: int | None):
    """Blocks lo..hi-1 on this rank's rows: (h, the carried stream)."""
    return dit.blocks_between(local.inputs, local.meta, h, carried, lo, hi)


def predict(rt, dit, *args, hole: SlotHole | None = None) -> torch.Tensor:
    """The whole evaluation's prediction, the rows spread over the phase's SP ranks."""
    local = embed_split(rt, dit, *args, hole=hole)
    h, _ = blocks(rt, dit, local, *dit.block_input(local.inputs), 0, None)
    return head(rt, dit, h, local.inputs.temb, *args)


class DenoiserCalls:
    """The `DenoiserCall`s of DiTs that declare their split points (see the module docstring),
    their pieces run as `steps` asks (None: eager). `dits`: the DiTs whose `run_block` becomes
    the compiled region in regions mode (one compiled function for every DiT sharing it)."""

    # Entered around blocks run on some rows of the call only (`row_blocks`): what keeps per-row
    # state in step with them (the resident LoRA adapters' row map, `ResidentLoras.picked_rows`).
    picked_rows: Callable = staticmethod(lambda picked: nullcontext())   # nothing keeps per-row state

    def __init__(self, steps: CompiledSteps | None = None, dits: list = ()):
        step: Callable[[Callable], Callable] = steps.step if steps is not None else (lambda fn: fn)
        self._predict, self._embed, self._time, self._blocks, self._head = map(
            step, (predict, embed_split, time_alone, blocks, head))
        if steps is not None and steps.regions:
            compiled: dict[Callable, Callable] = {}
            for dit in dits:
                # a DiT a former pipeline set up holds a compiled region: compile its plain function
                plain = getattr(dit.run_block, "__wrapped__", dit.run_block)
                if plain not in compiled:
                    compiled[plain] = steps.region(plain)
                dit.run_block = compiled[plain]

    def __call__(self, rt, dit, *args, hole: SlotHole | None = None) -> DenoiserCall:
        """One evaluation of `dit` on `args` (its `embed` arguments) on the phase `rt`. `hole`:
        slots no query may see (each batch row's text padding, `padded_rows`)."""
        made: dict = {}

        def embed() -> torch.Tensor:
            # The hole is set outside the compiled piece: torch 2.11's dynamo fails to return a
            # dataclass it rebuilt inside the graph (`with_hole`).
            made["local"] = with_hole(self._embed(rt, dit, *args), hole)
            h, carried = dit.block_input(made["local"].inputs)
            made["carried"] = (0, carried)
            return h

        def run_blocks(h: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            at, carried = made["carried"]
            if carried is not None and at != lo:   # the carried stream is the one after block lo - 1
                raise RuntimeError(f"blocks {lo}..{hi - 1} asked for after blocks ending at {at}")
            h, carried = self._blocks(rt, dit, made["local"], h, carried, lo, hi)
            made["carried"] = (hi, carried)
            return h

        def row_blocks(h: torch.Tensor, lo: int, hi: int, picked: list[int]) -> torch.Tensor:
            local = made["local"]
            some = local._replace(inputs=dit.select_rows(local.inputs, torch.tensor(picked, device=h.device)))
            with self.picked_rows(picked):
                return self._blocks(rt, dit, some, h, None, lo, hi)[0]

        def run_head(h: torch.Tensor) -> torch.Tensor:
            temb = made["local"].inputs.temb if "local" in made else self._time(rt, dit, *args)
            return self._head(rt, dit, h, temb, *args)

        return DenoiserCall(head=run_head, embed=embed, blocks=run_blocks, num_blocks=dit.num_blocks,
                            rows=RowLayout(rt.seq, 1, dit.stream_rows(*args)),
                            row_blocks=row_blocks if hasattr(dit, "select_rows") else None,
                            predict=lambda: self._predict(rt, dit, *args, hole=hole))


def denoiser_call(rt, dit, *args, hole: SlotHole | None = None) -> DenoiserCall:
    """`DenoiserCalls`' call with every piece eager (no compiled steps)."""
    return DenoiserCalls()(rt, dit, *args, hole=hole)
