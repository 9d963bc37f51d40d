"""DiT step batching: requests of one denoise shape share their denoise steps as
rows of one batch, each with its own seed, guidance, prompt length (so its own RoPE
positions and padding hole), step cache, progress and cancel.

Batched outputs are compared with the same requests run one at a time, in float32 on the
CPU: latents within 1e-4 (batch rows change the GEMM and SDPA blocking, which moves the
float32 rounding: 5e-6 to 1e-5 was seen on latents of magnitude ~4.6; a row given another
request's positions or hole is off by ~0.9), uint8 images within one level. Through `single`
here and every 2- and 4-rank plan the server runs on gloo CPU ranks. A request cancelled at a step,
or failing at a step boundary, leaves and the others stay equal to their unbatched runs.
The VAE decode (3-10 s an image on this CPU, a function of the latents alone) is replaced by
a cheap stand-in of the latents (so each result's image still shows whose latents it got),
and the real one decodes one request's batched and unbatched latents to compare images.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dtgen.batching import per_member
from dtgen.launch import RankPool
from dtgen.serve.errors import Cancelled
from dtgen.step_cache import parse_step_cache
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.denoise import denoise_key
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline, to_uint8
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import PLANS, get_plan

BUCKET = 16          # denoise text rows per bucket: the prompts below (6, 10, 13 rows) share one
LATENT_ATOL = 1e-4
PROMPTS = [("a fox", 1, 5.0), ("a cat sat", 2, 3.0), ("a fox in the", 3, 7.5)]


def _requests(steps: int = 3, step_cache=None, cfg_mode: str = "serial") -> list[T2IRequest]:
    return [T2IRequest(prompt=p, seed=s, guidance=g, steps=steps, image_size="256x256", step_cache=step_cache,
                       cfg_mode=cfg_mode) for p, s, g in PROMPTS]


def _pipe(ckpt, plan: str = "single", rank: int = 0, world: int = 1) -> HunyuanT2IPipeline:
    loaded = load(ckpt, get_plan(plan), rank, world)
    return HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0,
                              prompt_bucket=BUCKET)


def _no_images(pipe: HunyuanT2IPipeline) -> HunyuanT2IPipeline:
    """The VAE decode replaced by a stand-in: [h, w, 3] in [0, 1] from the latents' first channels."""
    pipe.decode_image = lambda latents: latents[0, :3].permute(1, 2, 0).sigmoid().cpu()
    return pipe


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint):
    return _no_images(_pipe(tiny_checkpoint))


@pytest.fixture(scope="module")
def alone(pipe):
    """The three requests one at a time (no step cache)."""
    return [pipe.generate(r) for r in _requests()]


def test_requests_of_one_bucket_share_a_shape_but_not_their_positions(pipe):
    seqs = []
    for r in _requests():
        ids = pipe.tok.encode(r.prompt)
        from models.hunyuan_image3.diffusion_sequence import build_diffusion_sequence
        seqs.append(build_diffusion_sequence(ids, pipe.special, pipe.cfg.image_base_size, 16, 16, 16, bucket=BUCKET))
    assert len({denoise_key(r, s) for r, s in zip(_requests(), seqs)}) == 1
    assert len({s.pad for s in seqs}) == 3, "three text lengths: three holes and position shifts"


def test_batched_requests_equal_their_unbatched_runs(pipe, alone):
    together = pipe.generate_batch(_requests(), per_member([lambda *a: None] * 3))
    for a, b in zip(alone, together):
        assert b.record["denoise_batch"] == [3]
        assert _max_diff(a.latents, b.latents) < LATENT_ATOL
        assert _max_diff(a.image, b.image) < LATENT_ATOL   # each result got its own request's latents
    # the seeds and guidance are each request's own: the three images differ
    assert _max_diff(together[0].latents, together[1].latents) > 0.1
    # The uint8 image of the request with the longest text (its hole and positions differ
    # most from row 0's), through the real VAE decode.
    decode = lambda latents: to_uint8(HunyuanT2IPipeline.decode_image(pipe, latents)).int()  # noqa: E731
    ia, ib = decode(alone[2].latents), decode(together[2].latents)
    assert int((ia - ib).abs().max()) <= 1 and float((ia == ib).float().mean()) > 0.999


def test_batched_taylor_caches_decide_per_request_and_equal_their_unbatched_runs(tiny_checkpoint):
    """Taylor cache (a full step every 2), CFG branches as rows of one call: every request
    keeps its own cache (its own derivatives); the schedule is the same for all."""
    pipe = _no_images(_pipe(tiny_checkpoint))
    reqs = _requests(steps=4, step_cache=parse_step_cache("taylor:interval=2"), cfg_mode="batch")
    alone = [pipe.generate(r) for r in reqs]
    together = pipe.generate_batch(reqs, per_member([lambda *a: None] * 3))
    for a, b in zip(alone, together):
        assert b.record["step_cache"] == a.record["step_cache"] and b.record["step_cache"][0]["cached_steps"]
        assert _max_diff(a.latents, b.latents) < LATENT_ATOL


def test_a_cancelled_request_leaves_and_the_others_stay_equal(tiny_checkpoint, alone):
    pipe = _no_images(_pipe(tiny_checkpoint))
    seen = []

    def cancel_at_2(phase, done, total):
        seen.append((phase, done))
        if phase == "denoise" and done == 2:
            raise Cancelled("cancelled by DELETE")

    quiet = lambda *a: None  # noqa: E731
    out = pipe.generate_batch(_requests(), per_member([quiet, cancel_at_2, quiet]))
    assert isinstance(out[1], Cancelled) and seen[-1] == ("denoise", 2), seen
    for k in (0, 2):
        assert out[k].record["denoise_batch"] == [3] and _max_diff(alone[k].latents, out[k].latents) < LATENT_ATOL


def _serve(pipe: HunyuanT2IPipeline, reqs: list[T2IRequest], deadlines_s: list, on_step=None, on_decode=None):
    """The requests as jobs of the server's engine in this process (one rank): the job board,
    the per-request flag at every step boundary, the state and HTTP status each job ends
    with. `on_step(phase, done, total)` runs in the adapter's step hook (on every member's
    boundary); `on_decode(board, jobs)` inside each VAE decode. Returns the jobs and the
    latents each decode got, in order."""
    from dtgen.serve.engine import Engine, RankLink
    from dtgen.serve.jobs import JobBoard
    from models.hunyuan_image3.serving import HunyuanServeAdapter

    class Adapter(HunyuanServeAdapter):
        def on_step(self, phase, done, total):
            super().on_step(phase, done, total)
            if on_step is not None:
                on_step(phase, done, total)

    adapter = Adapter(pipe, 0, reqs[0], warmup=False)
    board = JobBoard(8)
    jobs = [board.submit(r, d, batch_key=adapter.batch_key(r)) for r, d in zip(reqs, deadlines_s)]
    decoded, stand_in = [], pipe.decode_image

    def decode(latents):
        if on_decode is not None:
            on_decode(board, jobs)
        decoded.append(latents)
        return stand_in(latents)

    pipe.decode_image = decode
    engine = Engine(RankLink(0, 1, None), adapter, board, ping_s=0.05, max_batch=len(reqs))
    engine.start()   # the jobs wait already: they run as one batch
    try:
        assert all(job.finished.wait(120) for job in jobs), [job.as_dict() for job in jobs]
    finally:
        engine.stop()
    return jobs, decoded


def test_a_deadline_passing_mid_denoise_ends_that_request_alone_with_504(tiny_checkpoint, alone, monkeypatch):
    """Through the server's engine: request 1's deadline (10 s) passes at denoise step 2 (the
    job board's clock jumps a minute there); it leaves the batch cancelled with 504 on its
    own, the others (their deadline an hour) finish with their unbatched runs' latents."""
    import time
    from types import SimpleNamespace

    import dtgen.serve.jobs as jobs_module
    skew = [0.0]
    monkeypatch.setattr(jobs_module, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + skew[0]))

    def clock(phase, done, total):
        if phase == "denoise" and done == 2:
            skew[0] = 60.0

    pipe = _no_images(_pipe(tiny_checkpoint))
    jobs, decoded = _serve(pipe, _requests(), [3600, 10, 3600], on_step=clock)
    late = jobs[1]
    assert (late.state, late.http_status, late.error) == ("cancelled", 504, "deadline passed"), late.as_dict()
    assert (late.phase, late.done, late.batch_size) == ("denoise", 2, 3), late.as_dict()
    assert [j.state for j in jobs] == ["succeeded", "cancelled", "succeeded"], [j.as_dict() for j in jobs]
    assert len(decoded) == 2   # request 1 was never decoded
    for k, latents in zip((0, 2), decoded):
        assert jobs[k].result["denoise_batch"] == 3
        assert _max_diff(alone[k].latents, latents) < LATENT_ATOL
        assert int((to_uint8(alone[k].image).int() - jobs[k].result["pixels"].int()).abs().max()) <= 1


def test_a_job_cancelled_during_its_vae_decode_ends_succeeded(tiny_checkpoint, alone):
    """A cancel (or a deadline) takes effect at the next step boundary; the VAE decode has
    none (only the decoding ranks run it, so the ranks agree on nothing there): a DELETE
    that comes during the decode lets it finish, and the job answers its image. docs/serving.md
    says so; a change that stops the decode must change both."""
    def delete(board, jobs):
        board.cancel(jobs[0], "cancelled by DELETE")

    pipe = _no_images(_pipe(tiny_checkpoint))
    (job,), (latents,) = _serve(pipe, _requests()[:1], [None], on_decode=delete)
    assert job.cancel_reason == "cancelled by DELETE"   # the DELETE came, during the decode
    assert job.state == "succeeded" and job.http_status == 200 and job.error is None, job.as_dict()
    assert _max_diff(alone[0].latents, latents) < LATENT_ATOL
    assert torch.equal(job.result["pixels"], to_uint8(alone[0].image))   # the decoded (stand-in) image


def test_a_request_failing_at_a_step_fails_alone(tiny_checkpoint, alone):
    pipe = _no_images(_pipe(tiny_checkpoint))

    def fail_first(phase, done, total):
        if phase == "denoise" and done == 1:
            raise RuntimeError("injected: request 0 fails after denoise step 1")

    quiet = lambda *a: None  # noqa: E731
    out = pipe.generate_batch(_requests(), per_member([fail_first, quiet, quiet]))
    assert isinstance(out[0], RuntimeError) and "request 0 fails" in str(out[0])
    for k in (1, 2):
        assert _max_diff(alone[k].latents, out[k].latents) < LATENT_ATOL


def test_batched_ar_decodes_together_and_a_request_cancelled_mid_ar_leaves(pipe):
    """Three text-to-image requests decode their AR tokens together (`run_ar_batch`): one
    boundary per decode step for those with the same max_new_tokens; each equals its run
    alone (tokens, latents). Request 1, cancelled at its AR step 2, leaves; the others go on."""
    reqs = [replace(r, max_new_tokens=n, ignore_stop=True) for r, n in zip(_requests(steps=2), (4, 6, 4))]
    alone = [pipe.generate(r) for r in reqs]
    calls = []

    def hook(phase, done, total, members):
        calls.append((phase, done, total, tuple(members)))
        return {1: Cancelled("cancelled by DELETE")} if (phase, done) == ("ar", 2) and 1 in members else {}

    together = pipe.generate_batch(reqs, per_member([lambda *a: None] * 3))
    for a, b in zip(alone, together):
        assert len(b.tokens) == len(a.tokens) > 0 and b.tokens == a.tokens
        assert _max_diff(a.latents, b.latents) < LATENT_ATOL
    out = pipe.generate_batch(reqs, hook)
    assert isinstance(out[1], Cancelled), out[1]
    ar = [c for c in calls if c[0] == "ar"]
    assert ar[:3] == [("ar", 0, 4, (0, 2)), ("ar", 0, 6, (1,)), ("ar", 1, 4, (0, 2))], ar
    assert ("ar", 3, 6, (1,)) not in ar and ("ar", 4, 4, (0, 2)) in ar, ar
    for k in (0, 2):
        assert out[k].tokens == alone[k].tokens
        assert _max_diff(alone[k].latents, out[k].latents) < LATENT_ATOL


# ---- every 2- and 4-rank plan, gloo CPU ranks ------------------------------------------------
FOUR_RANK_PLANS = sorted(name for name, plan in PLANS.items() if plan.world_size == 4)
# The plans a 2-rank server runs (docs/serving.md's `--world-size 2 --plan tp2`): TP2 in both phases,
# AR TP2 -> denoise SP2, AR TP2 -> denoise CFG2.
TWO_RANK_PLANS = sorted(name for name, plan in PLANS.items() if plan.world_size == 2)


def job_batched_through_plans(ctx, ckpt, plans):
    """Per plan: the three requests alone and batched, with the Taylor cache (3 steps: the
    whole-sequence step, a cached one, a KV-cached full one), CFG branches as separate calls
    on every other plan and as rows of one call on the rest; the largest latent difference
    per request, on this rank."""
    out = {}
    for i, plan in enumerate(plans):
        pipe = _no_images(_pipe(ckpt, plan, ctx.rank, ctx.world_size))
        reqs = _requests(steps=3, step_cache=parse_step_cache("taylor:interval=2"),
                         cfg_mode=("serial", "batch")[i % 2])
        alone = [pipe.generate(r) for r in reqs]
        together = pipe.generate_batch(reqs, per_member([lambda *a: None] * len(reqs)))
        assert all(b.record["denoise_batch"] == [3] for b in together)
        out[plan] = [_max_diff(a.latents, b.latents) for a, b in zip(alone, together)]
    return out


def test_batched_requests_equal_their_unbatched_runs_through_every_four_rank_plan(tiny_checkpoint):
    assert len(FOUR_RANK_PLANS) >= 8, FOUR_RANK_PLANS
    with RankPool(4, timeout_s=600) as pool:
        results = pool.run(job_batched_through_plans, tiny_checkpoint, FOUR_RANK_PLANS)
    for rank, per_plan in enumerate(results):
        for plan, diffs in per_plan.items():
            assert max(diffs) < LATENT_ATOL, (plan, rank, diffs)


def test_batched_requests_equal_their_unbatched_runs_through_every_two_rank_plan(tiny_checkpoint):
    assert TWO_RANK_PLANS == ["hybrid2", "hybrid2-cfg", "tp2"], TWO_RANK_PLANS
    with RankPool(2, timeout_s=600) as pool:
        results = pool.run(job_batched_through_plans, tiny_checkpoint, TWO_RANK_PLANS)
    for rank, per_plan in enumerate(results):
        assert sorted(per_plan) == TWO_RANK_PLANS, (rank, per_plan)
        for plan, diffs in per_plan.items():
            assert len(diffs) == 3 and max(diffs) < LATENT_ATOL, (plan, rank, diffs)


def test_masks_and_kernels_take_one_hole_per_batch_row():
    """A per-row hole gives each row its own mask ([B, Sq, Sk]) and key-prefix count ([B]):
    the same as each row alone (attention_lse's reference, the key-prefix reference)."""
    from dtgen.attention import structured_mask
    from dtgen.sequence import SlotHole
    from kernels.attention_key_prefix import attention_key_prefix
    from kernels.attention_lse import attention_lse
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D = 3, 4, 2, 12, 8
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    slots, starts = torch.arange(S), torch.tensor([2, 5, 7])
    mask = structured_mask(slots, slots, ((8, 12),), SlotHole(starts, 8))
    assert mask.shape == (B, S, S)
    out, lse = attention_lse(q, k, v, mask)
    valid = torch.tensor([4, 9, 11])
    prefix = attention_key_prefix(q, k, v, valid)
    for b in range(B):
        row_mask = structured_mask(slots, slots, ((8, 12),), SlotHole(starts[b], 8))
        assert torch.equal(mask[b], row_mask)
        o, l = attention_lse(q[b:b + 1], k[b:b + 1], v[b:b + 1], row_mask)
        torch.testing.assert_close(out[b:b + 1], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[b:b + 1], l, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(prefix[b:b + 1], attention_key_prefix(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                                         valid[b]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"valid must be one int32/int64 element or one per batch row \[3\]"):
        attention_key_prefix(q, k, v, torch.tensor([4, 9]))
