"""The segmented attention (mask-free pieces from static slot runs) equals the masked one."""
import pytest
import torch

from dtgen.sequence import SequenceLayout, SlotHole
from dtgen.attention import (AttentionMeta, AttentionSegment, LayerKVCache, LocalAttention,
                                             plan_segments, slots_of_runs)


def test_plan_of_a_denoise_sequence():
    # text [0, 10), image [10, 30), <eoi> 30, two padding rows 31, 32; keys = the cache [0, 40)
    segs = plan_segments(((0, 33),), ((0, 40),), ((10, 30),))
    assert segs == (AttentionSegment(0, 10, 10, "causal"), AttentionSegment(10, 30, 30, "dense"),
                    AttentionSegment(30, 33, 40, "masked"))
    # a later step: <timestep> at 9, the image rows, padding at 31..; keys = the cache
    segs = plan_segments(((9, 30), (31, 33)), ((0, 40),), ((10, 30),))
    assert [s.kind for s in segs] == ["masked", "dense", "masked"]
    assert segs[1] == AttentionSegment(1, 21, 30, "dense")


def test_plan_with_a_hole_masks_the_rows_past_it():
    # bos + text [0, 5), bucket padding [5, 8) (the hole), head [8, 10), image [10, 30), <eoi> 30
    segs = plan_segments(((0, 31),), ((0, 40),), ((10, 30),), hole_end=8)
    assert segs == (AttentionSegment(0, 8, 8, "causal"), AttentionSegment(8, 10, 40, "masked"),
                    AttentionSegment(10, 30, 30, "dense-hole"), AttentionSegment(30, 31, 40, "masked"))


def test_plan_falls_back_to_one_mask_when_keys_are_not_one_run():
    assert plan_segments(((0, 4), (6, 8)), ((0, 4), (6, 8)), ()) == (AttentionSegment(0, 6, 6, "masked"),)


CASES = [
    # (query runs, image blocks, cache length or None)
    (((0, 23),), ((6, 19),), None),
    (((0, 23),), ((6, 19),), 26),
    (((5, 19), (23, 25)), ((6, 19),), 26),     # later denoise step with padding
    (((0, 23),), (), 26),                      # a prompt prefill
    (((3, 17),), ((4, 9), (11, 15)), None),    # two image blocks, text between them
    (((0, 12),), ((0, 12),), None),            # all image
]


HOLES = [None, (2, 5)]   # bucket padding at slots [2, 5) (start given as a tensor)


@pytest.mark.parametrize("runs,blocks,cache_len", CASES)
@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("hole", HOLES, ids=["no-hole", "hole"])
def test_segments_match_the_masked_attention(runs, blocks, cache_len, kv_heads, hole):
    g = torch.Generator().manual_seed(0)
    n, hq, d = sum(b - a for a, b in runs), 6, 16
    q = torch.randn(2, n, hq, d, generator=g)
    k = torch.randn(2, n, kv_heads, d, generator=g)
    v = torch.randn(2, n, kv_heads, d, generator=g)
    slots = slots_of_runs(runs)

    def cache():
        if cache_len is None:
            return None
        prefill = torch.randn(2, kv_heads, cache_len, d, generator=torch.Generator().manual_seed(1))
        return LayerKVCache(prefill.clone(), prefill.clone() * 0.5)

    ref_cache, seg_cache = cache(), cache()
    hole = None if hole is None else SlotHole(torch.tensor(hole[0]), hole[1])
    ref = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, hole=hole), ref_cache)
    out = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, slot_runs=runs, hole=hole), seg_cache)
    real = slots.new_ones(n, dtype=torch.bool) if hole is None else hole.visible(slots)
    torch.testing.assert_close(out[:, real], ref[:, real], rtol=1e-5, atol=1e-5)  # rows in the hole are padding
    if hole is not None:   # the hole must matter: rows past it would see those keys otherwise
        unholed = LocalAttention()(q, k, v, AttentionMeta(slots, blocks), cache())
        assert (unholed - ref)[:, slots >= 5].abs().max() > 1e-2
    if cache_len is not None:
        assert torch.equal(seg_cache.k, ref_cache.k) and torch.equal(seg_cache.v, ref_cache.v)


def test_runs_that_do_not_match_the_rows_are_refused():
    q = torch.randn(1, 5, 2, 8)
    meta = AttentionMeta(torch.arange(5), (), slot_runs=((0, 4),))
    with pytest.raises(ValueError, match="slot_runs"):
        LocalAttention()(q, q, q, meta, None)


def test_a_dense_kernel_core_without_slot_runs_runs_text_and_refuses_image_rows():
    """A core with a dense kernel (FP8 attention) fed at moving slots (a tensor, no runs: an
    AR decode step): text only has no dense piece, so the masked kernel is exact; with image
    rows they would miss the dense kernel, so that is refused."""
    def dense(q, k, v):
        raise AssertionError("a text-only step has no dense piece")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))
    text = AttentionMeta(torch.tensor([4, 5, 6]), ())
    cache = LayerKVCache(torch.randn(1, 2, 8, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g))
    want = LocalAttention()(q, k, v, text, LayerKVCache(cache.k.clone(), cache.v.clone()))
    torch.testing.assert_close(LocalAttention(dense)(q, k, v, text, cache), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs AttentionMeta.slot_runs"):
        LocalAttention(dense)(q, k, v, AttentionMeta(torch.arange(3), ((0, 3),)), None)


def test_pad_runs_follow_pad_slots():
    seq = SequenceLayout(size=4)
    for runs, spare in [(((0, 10),), 10), (((3, 10),), 12), (((0, 8),), 8)]:
        padded = seq.pad_runs(runs, spare)
        assert torch.equal(slots_of_runs(padded), seq.pad_slots(slots_of_runs(runs), spare))


@pytest.mark.gpu
@pytest.mark.parametrize("hole", [None, (250, 290)], ids=["no-hole", "hole"])
def test_flash_pieces_match_the_masked_kernel_on_cuda(hole):
    """bf16 on CUDA: the dense and causal pieces run flash attention (GQA without copying
    K/V); they must agree with the masked kernel at bf16 precision, with a cache. With a
    hole (bucket padding in the text), the image rows run the key-prefix op instead."""
    g = torch.Generator(device="cuda").manual_seed(0)
    text, image, pad = 301, 1024, 3
    n = text + image + 1 + pad
    runs, blocks = ((0, n),), ((text, text + image),)
    q = torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, n, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, n, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = slots_of_runs(runs, "cuda")

    def cache():
        return LayerKVCache(torch.zeros(1, 2, n + 8, 128, device="cuda", dtype=torch.bfloat16),
                            torch.zeros(1, 2, n + 8, 128, device="cuda", dtype=torch.bfloat16))

    hole = None if hole is None else SlotHole(torch.tensor(hole[0], device="cuda"), hole[1])
    ref = LocalAttention()(q.float(), k.float(), v.float(), AttentionMeta(slots, blocks, hole=hole), None)
    out = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, slot_runs=runs, hole=hole), cache())
    masked = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, hole=hole), cache())
    real = torch.ones(n, dtype=torch.bool, device="cuda") if hole is None else hole.visible(slots)
    torch.testing.assert_close(out.float()[:, real], ref[:, real], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(masked.float()[:, real], ref[:, real], rtol=2e-2, atol=2e-2)
