"""Batched AR decode on the tiny model (float32, CPU): `run_ar_batch` / `decode_batch` against
separate `run_ar` runs, the one-request decode through the batched path (torch references,
and the Triton kernels under TRITON_INTERPRET=1) against the masked-SDPA step, and a TP2 plan
on two gloo ranks against one process.

Tolerances. Tokens: equal. Logits: 1e-4 absolute (float32 logits of O(1-10); the paths regroup
sums: masked SDPA over the whole cache against a softmax over each request's own keys, a
3-row MoE GEMM against 1-row ones; a wrong key, slot or position moves a logit by O(0.1)).
"""
import pytest
import torch

from dtgen.launch import RankPool
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import RequestRun, T2IRequest
from placements.hunyuan_image3 import get_plan

REQUESTS = [T2IRequest(prompt="a fox", max_new_tokens=5, seed=1, ignore_stop=True),
            T2IRequest(prompt="a lighthouse on a cliff at dusk, oil painting", max_new_tokens=3, seed=2),
            T2IRequest(prompt="red", max_new_tokens=6, seed=3, temperature=0.0, ignore_stop=True)]
LOGIT_TOL = 1e-4


def _pipe(ckpt, plan="single", rank=0, world=1, **kw):
    loaded = load(ckpt, get_plan(plan), rank, world)
    return HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0, **kw)


def _alone(pipe, req):
    run = RequestRun.fresh(pipe.device)
    tokens, ratio = pipe.run_ar(req, run)
    return tokens, ratio, run.record["ar_logits"]


def _assert_same(got_tokens, got_ratio, got_logits, tokens, ratio, logits):
    assert got_tokens == tokens and got_ratio == ratio
    assert len(got_logits) == len(logits)
    for a, b in zip(got_logits, logits):
        assert float((a - b).abs().max()) < LOGIT_TOL


@pytest.fixture(scope="module")
def alone(tiny_checkpoint):
    pipe = _pipe(tiny_checkpoint)
    return [_alone(pipe, r) for r in REQUESTS]


def test_batch_equals_separate_runs(tiny_checkpoint, alone):
    pipe = _pipe(tiny_checkpoint)
    results = pipe.run_ar_batch(REQUESTS)
    assert [len(r.tokens) for r in results] == [len(a[0]) for a in alone]
    for got, (tokens, ratio, logits) in zip(results, alone):
        _assert_same(got.tokens, got.ratio_index, got.logits, tokens, ratio, logits)
    assert any(len(a[0]) != len(alone[0][0]) for a in alone)     # the requests really decode different counts


def test_one_request_through_the_batched_path(tiny_checkpoint, alone):
    """The AR loop's own decode step on the batched path (a batch of one), torch references."""
    pipe = _pipe(tiny_checkpoint, decode_impl="reference")
    _assert_same(*_alone(pipe, REQUESTS[2]), *alone[2])


def test_kernels_under_the_interpreter(tiny_checkpoint):
    """One decode step of two requests at different lengths through the fused prologue and the
    split-KV kernel (interpreted: every program runs in Python, so one step) against the same
    step on the torch references, from the same prefilled cache: logits, tokens and the K/V
    written."""
    from dtgen.sampling import Sampling

    ref = _pipe(tiny_checkpoint, decode_impl="reference")
    rt = ref.controller.activate("ar")
    cache = ref._cache(rt, 2, 256)
    for b, n in enumerate((5, 19)):   # two prompts of their own lengths, each in its own row
        ref._feed(ref._prefill_fn, rt, [1 + (7 * i) % 200 for i in range(n)], 0, cache.rows(b, b + 1), 256,
                  Sampling(0.0, 0, 1.0).step_args(ref.cfg.vocab_size, ref.device), None, static_slots=True)
    kernel = _pipe(tiny_checkpoint, decode_impl="triton")
    copy = kernel._cache(kernel.controller.activate("ar"), 2, 256)
    for a, b in zip(copy.layers, cache.layers):
        a.k.copy_(b.k)
        a.v.copy_(b.v)
    ids, positions = torch.tensor([[3], [11]]), torch.tensor([5, 19])
    greedy = Sampling(0.0, 0, 1.0).step_args(ref.cfg.vocab_size, ref.device)
    expected = ref.decode_batch(rt, ids, positions, cache, (None, None), (greedy, greedy))
    got = kernel.decode_batch(rt, ids, positions, copy, (None, None), (greedy, greedy))
    assert float((got[0] - expected[0]).abs().max()) < LOGIT_TOL and torch.equal(got[1], expected[1])
    # Layer 0 from equal inputs: V a copy, K within 4 ulp (float32); deeper layers' inputs
    # carry the attention's float32 regrouping (1e-6 relative).
    assert torch.equal(copy.layers[0].v, cache.layers[0].v)
    for a, b in zip(copy.layers, cache.layers):
        torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.v, b.v, rtol=1e-5, atol=1e-5)


def test_bad_input(tiny_checkpoint):
    with pytest.raises(ValueError, match="decode_impl"):
        _pipe(tiny_checkpoint, decode_impl="flash")
    pipe = _pipe(tiny_checkpoint)
    with pytest.raises(ValueError, match="no requests"):
        pipe.run_ar_batch([])
    with pytest.raises(ValueError, match="request 1 is an image edit"):
        pipe.run_ar_batch([REQUESTS[0], T2IRequest(reference=torch.zeros(16, 16, 3, dtype=torch.uint8))])


def _tp2_job(ctx, ckpt):
    pipe = _pipe(ckpt, "tp2", ctx.rank, ctx.world_size)
    results = pipe.run_ar_batch(REQUESTS)
    return [(r.tokens, r.ratio_index, r.logits) for r in results] if ctx.rank == 0 else None


def test_tp2_plan_on_two_ranks(tiny_checkpoint, alone):
    """The kv heads are sharded: each rank's kernels see 4 local KV heads of 8."""
    with RankPool(2, timeout_s=240) as pool:
        got = pool.run(_tp2_job, tiny_checkpoint)[0]
    for (tokens, ratio, logits), expected in zip(got, alone):
        _assert_same(tokens, ratio, logits, *expected)
