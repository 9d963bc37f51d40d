"""dtgen/denoiser_calls.py on the docs' tiny DiT (models/tiny_dit) and two variants of it: the
pieces a step cache composes (embed, blocks lo..hi-1, head) give the whole prediction, the head
of a step that embeds nothing takes the time embedding alone, a carried stream travels from
block range to block range (and a range asked for out of order is refused), and `row_blocks`
runs some batch rows only where the DiT can select them. One process, CPU, float64."""
from types import SimpleNamespace

import pytest
import torch

from dtgen.denoiser_calls import denoiser_call, predict
from dtgen.sequence import SequenceLayout
from models.tiny_dit.model import TinyDiT

RT = SimpleNamespace(seq=SequenceLayout())   # a phase without sequence parallelism


class CarryingDiT(TinyDiT):
    """The tiny DiT whose blocks carry a second stream: each block adds the carried rows' mean
    to the tokens and the tokens' mean to the carried rows (so the order of the ranges matters)."""

    def block_input(self, inputs):
        return inputs.tokens, torch.ones_like(inputs.tokens[:, :1])

    def blocks_between(self, inputs, meta, h, carried, lo, hi):
        for block in self.blocks[lo:hi]:
            h = block(h + carried, inputs.temb, inputs.rope, meta)
            carried = carried + h.mean(1, keepdim=True)
        return h, carried


class SelectingDiT(TinyDiT):
    """The tiny DiT that can give the blocks' inputs of some batch rows (a per-row time embedding)."""

    def select_rows(self, inputs, index):
        return inputs._replace(temb=inputs.temb.index_select(0, index))


def _dit(cls=TinyDiT):
    torch.manual_seed(0)
    return cls().double().eval()


def _args():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 7, 8, generator=g, dtype=torch.float64), torch.tensor([900.0, 500.0, 20.0],
                                                                               dtype=torch.float64)


@torch.no_grad()
@pytest.mark.parametrize("cls", [TinyDiT, CarryingDiT], ids=["one-stream", "carried-stream"])
def test_the_pieces_compose_to_the_whole_prediction(cls):
    dit, (x, t) = _dit(cls), _args()
    call = denoiser_call(RT, dit, x, t)
    assert call.num_blocks == 2 and call.rows.length == 7 and call.rows.dim == 1
    h = call.blocks(call.blocks(call.embed(), 0, 1), 1, 2)
    whole = predict(RT, dit, x, t)
    assert whole.shape == x.shape
    torch.testing.assert_close(call.head(h), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(call.prediction(), whole, rtol=0, atol=1e-12)
    # a step that reuses the blocks' output embeds nothing: the head takes the time alone
    fresh = denoiser_call(RT, dit, x, t)
    torch.testing.assert_close(fresh.head(h), whole, rtol=0, atol=1e-12)


@torch.no_grad()
def test_a_carried_stream_refuses_block_ranges_out_of_order():
    call = denoiser_call(RT, _dit(CarryingDiT), *_args())
    h = call.embed()
    with pytest.raises(RuntimeError, match=r"blocks 1\.\.1 asked for after blocks ending at 0"):
        call.blocks(h, 1, 2)


@torch.no_grad()
def test_row_blocks_run_the_picked_rows_as_the_whole_call_would():
    assert denoiser_call(RT, _dit(), *_args()).row_blocks is None   # the tiny DiT selects no rows
    dit, (x, t) = _dit(SelectingDiT), _args()
    call = denoiser_call(RT, dit, x, t)
    h1 = call.blocks(call.embed(), 0, 1)
    every = call.blocks(h1, 1, 2)
    picked = call.row_blocks(h1[[0, 2]], 1, 2, [0, 2])
    torch.testing.assert_close(picked, every[[0, 2]], rtol=0, atol=1e-12)
