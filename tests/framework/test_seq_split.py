"""dtgen/seq_split.py: a model's declared split points applied for a phase's sequence layout,
on the docs' tiny DiT (models/tiny_dit: its `embed` and its `seq_splits`). The SP ranks are
simulated (each rank's `SequenceLayout` over no group): every rank's share, put together, is
the whole; test_tiny_dit runs the same declaration on gloo ranks under every SP kind, and the
models' plans' tests (test_wan_pipeline, test_qwen_image_plans) their own. CPU, well under a second."""
import pytest
import torch

from dtgen.seq_split import GatherRows, SeqSplits, SplitRows, sequence_meta, split_input, split_inputs
from dtgen.sequence import SequenceLayout
from models.tiny_dit.model import TinyDiT, TinyInputs

SPLITS = TinyDiT.seq_splits


def _embedded(S: int, per_token: bool) -> TinyInputs:
    """The tiny DiT's `embed` of S rows: tokens [2, S, 32], temb [2, 1 or S, 32], RoPE ([S, 8],
    [S, 8]) and the row count."""
    g = torch.Generator().manual_seed(S)
    with torch.random.fork_rng():
        torch.manual_seed(S)
        dit = TinyDiT()
    t = torch.rand(2, S, generator=g) if per_token else torch.rand(2, generator=g)
    with torch.no_grad():
        return dit.embed(torch.randn(2, S, 8, generator=g), t * 1000)


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
    assert all(s.inputs.rows == S for s in shares)   # a field not named in the splits: whole on every rank
    assert all(torch.equal(s.meta.slots, shares[0].meta.slots) for s in shares)   # the whole sequence's
    assert split_input(SequenceLayout(None, size, 0), SPLITS, "rows", e.rows) == S


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
    with pytest.raises(ValueError, match=r"\['token'\], which TinyInputs does not have"):
        split_inputs(SequenceLayout(None, 2, 0), typo, _embedded(4, False))
    assert set(SPLITS.inputs) <= set(TinyInputs._fields) and set(SPLITS.attention) <= set(SPLITS.inputs)
