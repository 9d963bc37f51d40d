"""dtgen/seq_split.py: a model's declared split points applied for a phase's sequence layout.
The SP ranks are simulated (each rank's `SequenceLayout` over no group): every rank's share,
put together, is the whole; the plans' tests (test_wan_pipeline, test_qwen_image_plans) run
the same declarations on gloo ranks against one process. CPU, well under a second."""
from typing import NamedTuple

import pytest
import torch

from dtgen.seq_split import GatherRows, SeqSplits, SplitRows, sequence_meta, split_input, split_inputs
from dtgen.sequence import SequenceLayout
from models.qwen_image.transformer import QwenImageTransformer, QwenInputs
from models.wan.transformer import WanInputs, WanTransformer


class Embedded(NamedTuple):
    tokens: torch.Tensor          # [B, S, D]
    temb: torch.Tensor            # [B, 1 or S, D]
    rope: tuple[torch.Tensor, torch.Tensor]   # [S, d] each
    text: torch.Tensor            # [B, L, D]: whole on every rank
    grid: tuple[int, int]


SPLITS = SeqSplits(inputs={"tokens": SplitRows(1), "temb": SplitRows(1, only_per_row=True), "rope": SplitRows(0)},
                   attention=("tokens",), output=GatherRows(1))


def _embedded(S: int, per_token: bool) -> Embedded:
    g = torch.Generator().manual_seed(S)
    return Embedded(torch.randn(2, S, 3, generator=g), torch.randn(2, S if per_token else 1, 3, generator=g),
                    (torch.randn(S, 4, generator=g), torch.randn(S, 4, generator=g)), torch.randn(2, 5, 3, generator=g),
                    (S, 1))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("per_token", [False, True])
def test_every_ranks_share_put_together_is_the_whole(size, per_token):
    S = 7   # no SP degree > 1 here divides it: every split pads
    e = _embedded(S, per_token)
    shares = [split_inputs(SequenceLayout(None, size, r), SPLITS, e) for r in range(size)]
    pad = -(-S // size) * size - S
    for name, dim in (("tokens", 1), ("rope", 0)):
        for k in range(2 if name == "rope" else 1):
            got = torch.cat([s.inputs.rope[k] if name == "rope" else s.inputs.tokens for s in shares], dim)
            whole = e.rope[k] if name == "rope" else e.tokens
            assert torch.equal(got.narrow(dim, 0, S), whole) and got.shape[dim] == S + pad
            assert not got.narrow(dim, S, pad).any()   # zero tail padding
    temb = [s.inputs.temb for s in shares]
    if per_token:   # per-token timesteps travel with their rows
        assert torch.equal(torch.cat(temb, 1)[:, :S], e.temb)
    else:           # one for every row: whole on every rank
        assert all(t is e.temb for t in temb)
    assert all(s.inputs.text is e.text and s.inputs.grid == e.grid for s in shares)
    assert all(torch.equal(s.meta.slots, shares[0].meta.slots) for s in shares)   # the whole sequence's
    assert split_input(SequenceLayout(None, size, 0), SPLITS, "text", e.text) is e.text


def test_one_stream_meta_is_one_block_with_padding_past_it():
    meta = sequence_meta(SequenceLayout(None, 4, 0), [18])
    assert meta.slots.tolist() == list(range(20)) and meta.image_blocks == ((0, 18),)
    assert meta.slot_runs == ((0, 20),)
    one = sequence_meta(SequenceLayout(), [18])
    assert one.slots.tolist() == list(range(18)) and one.slot_runs == ((0, 18),)


def test_joint_streams_meta_follows_each_ranks_chunks():
    """Text (5 rows) then image (3 rows), each split alone over 2 ranks: rank 0 holds text 0-2
    and image 0-1, rank 1 text 3-4 + a padding row and image 2 + a padding row; real rows
    keep their joint slots (text 0..4, image 5..7), padding rows take 8 and 9."""
    meta = sequence_meta(SequenceLayout(None, 2, 1), [5, 3])
    assert meta.slots.tolist() == [0, 1, 2, 5, 6, 3, 4, 8, 7, 9]
    assert meta.image_blocks == ((0, 8),) and meta.slot_runs is None
    one = sequence_meta(SequenceLayout(), [5, 3])
    assert one.slots.tolist() == list(range(8)) and one.slot_runs == ((0, 8),)


def test_a_declaration_names_fields_the_model_has():
    with pytest.raises(ValueError, match="not split"):
        SeqSplits(inputs={"tokens": SplitRows(1)}, attention=("img",), output=GatherRows(1))
    typo = SeqSplits(inputs={"token": SplitRows(1), "tokens": SplitRows(1)}, attention=("tokens",),
                     output=GatherRows(1))
    with pytest.raises(ValueError, match=r"\['token'\], which Embedded does not have"):
        split_inputs(SequenceLayout(None, 2, 0), typo, _embedded(4, False))
    for model, inputs in ((WanTransformer, WanInputs), (QwenImageTransformer, QwenInputs)):
        assert set(model.seq_splits.inputs) <= set(inputs._fields), model
