"""The segmented attention (mask-free pieces from static slot runs) equals the masked one."""
import pytest
import torch

from dtgen.sequence import SequenceLayout
from models.hunyuan_image3.attention import (AttentionMeta, AttentionSegment, LayerKVCache, LocalAttention,
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


@pytest.mark.parametrize("runs,blocks,cache_len", CASES)
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_segments_match_the_masked_attention(runs, blocks, cache_len, kv_heads):
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
    ref = LocalAttention()(q, k, v, AttentionMeta(slots, blocks), ref_cache)
    out = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, slot_runs=runs), seg_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if cache_len is not None:
        assert torch.equal(seg_cache.k, ref_cache.k) and torch.equal(seg_cache.v, ref_cache.v)


def test_runs_that_do_not_match_the_rows_are_refused():
    q = torch.randn(1, 5, 2, 8)
    meta = AttentionMeta(torch.arange(5), (), slot_runs=((0, 4),))
    with pytest.raises(ValueError, match="slot_runs"):
        LocalAttention()(q, q, q, meta, None)


def test_pad_runs_follow_pad_slots():
    seq = SequenceLayout(size=4)
    for runs, spare in [(((0, 10),), 10), (((3, 10),), 12), (((0, 8),), 8)]:
        padded = seq.pad_runs(runs, spare)
        assert torch.equal(slots_of_runs(padded), seq.pad_slots(slots_of_runs(runs), spare))


@pytest.mark.gpu
def test_flash_pieces_match_the_masked_kernel_on_cuda():
    """bf16 on CUDA: the dense and causal pieces run flash attention (GQA without copying
    K/V); they must agree with the masked kernel at bf16 precision, with a cache."""
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

    ref = LocalAttention()(q.float(), k.float(), v.float(), AttentionMeta(slots, blocks), None)
    out = LocalAttention()(q, k, v, AttentionMeta(slots, blocks, slot_runs=runs), cache())
    masked = LocalAttention()(q, k, v, AttentionMeta(slots, blocks), cache())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(masked.float(), ref, rtol=2e-2, atol=2e-2)
