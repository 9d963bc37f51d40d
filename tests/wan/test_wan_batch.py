"""Wan requests of one bucket as rows of one denoise batch (dtgen/denoise_loop.py), each with
its own seed, prompts, guidance, sampler (UniPC's multistep history), step caches, progress
and record, against the same requests run alone. CPU, float32, the tiny default.

Batched latents equal the unbatched ones within 1e-5 of their scale (measured: 5e-7; batch
rows change the GEMM blocking, which moves the float32 rounding). Through `single` here, and
every 2- and 4-rank plan of placements/wan.py on gloo CPU ranks; a request that leaves at a
step boundary leaves the others equal to their runs alone; and through the server's engine
and HTTP routes, two video jobs of one bucket run their denoise steps as one batch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dtgen.batching import per_member
from dtgen.launch import RankPool
from dtgen.serve.errors import Cancelled
from models.wan.pipeline import T2VRequest
from models.wan.spec import SPEC
from placements.wan import PLANS
from tests.support.batching import assert_rel_close, quiet

from .test_wan_pipeline import _pipe

RTOL = 1e-5
BASE = dict(height=48, width=32, num_frames=9, steps=3)
# Prompts of different token counts (Wan pads every one to 512 rows), seeds and guidance.
REQUESTS = [T2VRequest(prompt="a red fox runs on the snow", negative_prompt="blurry", seed=1, guidance_scale=5.0,
                       **BASE),
            T2VRequest(prompt="a cat", negative_prompt="", seed=2, guidance_scale=3.0, **BASE),
            T2VRequest(prompt="waves crash on a rocky shore at dusk", negative_prompt="low quality, static", seed=3,
                       guidance_scale=7.5, **BASE)]
# first-block on 4 steps: at step 2 the first two requests' measures (0.0550, 0.0567) are above
# the threshold and the third's (0.0528) below, so the requests of one call disagree (the
# other blocks run on some members' rows only); step 1 reuses for all, step 3 runs all.
CACHES = {"first-block": "first-block:threshold=0.054", "taylor": "taylor:interval=2,low_freqs_order=2,"
          "high_freqs_order=1", "magcache": "magcache:calibrate=true",
          "taylorseer": "taylorseer:interval=2,disable_before=1,order=2,factors_dtype=float32"}
CACHED_STEPS = 4


def with_(req, **change):
    return dataclasses.replace(req, **change)


def assert_close(got: torch.Tensor, want: torch.Tensor, where: str = "") -> None:
    assert_rel_close(got, want, RTOL, where)


def decisions(report: dict):
    """What a step cache decided: per segment, its full steps and each row's decision."""
    return [(s["full_steps"], s.get("full_rows")) for s in report.get("segments", [report])]


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    from models.wan.tiny import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("wan-batch"))


@pytest.fixture(scope="module")
def pipe(wan_checkpoint):
    return _pipe(wan_checkpoint)


@pytest.fixture(scope="module")
def alone(pipe):
    return [pipe.generate(r, record=True) for r in REQUESTS]


def test_what_a_batch_shares_is_the_specs_bucket(pipe):
    key = pipe.batch_key
    assert pipe.buckets is SPEC.buckets and SPEC.batches
    assert len({key(r) for r in REQUESTS}) == 1   # seeds, prompts, guidance: per row
    cache = with_(REQUESTS[0], step_cache="first-block:threshold=0.05")
    assert key(cache) == key(with_(REQUESTS[1], step_cache={"method": "first-block", "threshold": 0.05}))
    for change in (dict(steps=4), dict(height=64), dict(num_frames=5), dict(shift=5.0), dict(sampler="euler"),
                   dict(step_cache="taylor"), dict(guidance_scale=1.0), dict(guidance_scale_2=1.0)):
        assert key(with_(REQUESTS[0], **change)) != key(REQUESTS[0]), change


def test_batched_requests_equal_their_runs_alone(pipe, alone):
    together = pipe.generate_batch(REQUESTS, quiet(3), record=True)
    for k, (a, b) in enumerate(zip(alone, together)):
        assert_close(b.latents, a.latents, f"request {k}")
        for i, (x, y) in enumerate(zip(b.record["noise"], a.record["noise"], strict=True)):
            assert_close(x, y, f"request {k}, step {i}")
        assert b.video.shape == (9, 48, 32, 3) and int((b.video.int() - a.video.int()).abs().max()) <= 1
        assert len(b.timings_ms["denoise_step"]) == 3 and b.timings_ms["total"] > 0
    # each request kept its own seed, prompts and guidance: the three differ
    assert float((together[0].latents - together[1].latents).abs().max()) > 0.1


@pytest.fixture(scope="module")
def alone_cached(pipe):
    return {name: [pipe.generate(with_(r, steps=CACHED_STEPS, step_cache=spec), decode=False) for r in REQUESTS]
            for name, spec in CACHES.items()}


@pytest.mark.parametrize("name", list(CACHES))
def test_batched_step_caches_decide_per_request_as_alone(pipe, alone_cached, name):
    reqs = [with_(r, steps=CACHED_STEPS, step_cache=CACHES[name]) for r in REQUESTS]
    together = pipe.generate_batch(reqs, quiet(3), decode=False)
    reports = [a.record["step_cache"] for a in alone_cached[name]]
    assert all(0 < len(r["cached_steps"]) for r in reports) or name == "magcache", reports
    for k, (a, b) in enumerate(zip(alone_cached[name], together)):
        assert decisions(b.record["step_cache"]) == decisions(a.record["step_cache"]), (name, k)
        assert_close(b.latents, a.latents, f"{name}, request {k}")
        if name == "magcache":   # each request's own ratios, per CFG row
            for x, y in zip(b.record["step_cache"]["mag_ratios_rows"], a.record["step_cache"]["mag_ratios_rows"]):
                assert x == pytest.approx(y, rel=1e-5)
    if name == "first-block":
        thr = 0.054
        measures = [d for r in reports for step in r["first_block_diff"] for d in step if d is not None]
        assert min(abs(d - thr) / thr for d in measures) > 1e-3, measures
        at_step_2 = [r["full_rows"][2] for r in reports]
        assert len({tuple(rows) for rows in at_step_2}) > 1, at_step_2   # the members of a call disagree


def test_a_request_that_leaves_at_step_2_leaves_the_others_as_alone(pipe, alone_cached):
    """Request 1's progress raises at denoise step 2 (a cancel): it leaves with that error; the
    others finish, their first-block caches going on as alone (step 2 reuses for some rows)."""
    seen = []

    def cancel_at_2(phase, done, total):
        seen.append((phase, done))
        if (phase, done) == ("denoise", 2):
            raise Cancelled("cancelled by DELETE")

    quiet_one = lambda *a: None  # noqa: E731
    reqs = [with_(r, steps=CACHED_STEPS, step_cache=CACHES["first-block"]) for r in REQUESTS]
    out = pipe.generate_batch(reqs, per_member([quiet_one, cancel_at_2, quiet_one]), decode=False)
    assert isinstance(out[1], Cancelled) and seen == [("denoise", 1), ("denoise", 2)], (out[1], seen)
    for k in (0, 2):
        want = alone_cached["first-block"][k]
        assert decisions(out[k].record["step_cache"]) == decisions(want.record["step_cache"])
        assert_close(out[k].latents, want.latents, f"request {k}")


def test_requests_without_guidance_batch_their_conditional_rows(pipe):
    reqs = [with_(r, guidance_scale=1.0) for r in REQUESTS[:2]]
    alone = [pipe.generate(r, decode=False) for r in reqs]
    together = pipe.generate_batch(reqs, quiet(2), decode=False)
    for k, (a, b) in enumerate(zip(alone, together)):
        assert_close(b.latents, a.latents, f"request {k}")
    with pytest.raises(ValueError, match=r"^guided: the requests of one batch must share it"):
        pipe.generate_batch([REQUESTS[0], reqs[1]], quiet(2), decode=False)


def test_a_bad_request_fails_alone_before_any_work(pipe, alone):
    bad = with_(REQUESTS[1], num_frames=8)
    out = pipe.generate_batch([REQUESTS[0], bad], quiet(2), decode=False)
    assert isinstance(out[1], ValueError) and str(out[1]).startswith("num_frames: 8 does not map"), out[1]
    assert_close(out[0].latents, alone[0].latents, "request 0")


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    from models.wan.tiny import write_random_checkpoint
    folder = tmp_path_factory.mktemp("wan-a14b-batch") / "tiny-a14b"
    folder.mkdir()
    write_random_checkpoint(folder, seed=7, two_experts=True)
    return _pipe(folder)


@pytest.mark.parametrize("guidance_2, spec", [((3.0, 4.0), CACHES["taylorseer"]),
                                               ((1.0, 1.0), "first-block:threshold=0.05")],
                         ids=["guided", "unguided-low-noise"])
def test_a14b_experts_switch_inside_the_shared_loop(a14b, guidance_2, spec):
    """Wan2.2-A14B, 4 steps: 2 on the high-noise expert, 2 on the low-noise one (unguided:
    its conditional rows alone); each request keeps a step cache per expert."""
    reqs = [with_(r, steps=4, guidance_scale_2=g, step_cache=spec) for r, g in zip(REQUESTS, guidance_2)]
    alone = [a14b.generate(r, decode=False) for r in reqs]
    together = a14b.generate_batch(reqs, quiet(2), decode=False)
    for k, (a, b) in enumerate(zip(alone, together)):
        report = b.record["step_cache"]
        assert [s["denoiser"] for s in report["segments"]] == ["transformer", "transformer_2"]
        assert decisions(report) == decisions(a.record["step_cache"]), k
        assert_close(b.latents, a.latents, f"request {k}")
        measures = [d for s in a.record["step_cache"]["segments"] for step in s.get("first_block_diff", [])
                    for d in step if d is not None]
        assert all(abs(d - 0.05) / 0.05 > 1e-3 for d in measures), measures   # decisions clear of the threshold


# ---- every 2- and 4-rank plan, gloo CPU ranks ------------------------------------------------
PLAN_CACHES = (None, CACHES["first-block"])


def job_batched_through_plans(ctx, ckpt, plans):
    """Per plan: two requests alone and batched (4 steps; a first-block cache on every CFG plan,
    where each rank decides its branch's rows and the report gathers both, and on every other
    plan, where the measures sum over the SP ranks); the largest latent difference relative to
    the latents' scale, and whether the decisions agree."""
    out = {}
    for i, plan in enumerate(plans):
        pipe = _pipe(ckpt, plan, ctx.rank, ctx.world_size)
        cache = PLAN_CACHES[1] if "cfg" in plan or i % 2 else None
        reqs = [with_(r, steps=CACHED_STEPS, step_cache=cache) for r in REQUESTS[:2]]
        alone = [pipe.generate(r, decode=False) for r in reqs]
        together = pipe.generate_batch(reqs, quiet(2), decode=False)
        out[plan] = ([float((a.latents - b.latents).abs().max() / a.latents.abs().max())
                      for a, b in zip(alone, together)],
                     [a.record.get("step_cache") is None or decisions(a.record["step_cache"]) ==
                      decisions(b.record["step_cache"]) for a, b in zip(alone, together)])
    return out


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_batched_equals_alone_through_every_plan(wan_checkpoint, world):
    plans = [name for name, plan in PLANS.items() if plan.world_size == world]
    assert len(plans) >= 5, plans
    with RankPool(world, timeout_s=600) as pool:
        results = pool.run(job_batched_through_plans, wan_checkpoint, plans)
    for rank, per_plan in enumerate(results):
        assert sorted(per_plan) == sorted(plans)
        for plan, (diffs, same) in per_plan.items():
            assert max(diffs) <= RTOL and all(same), (plan, rank, diffs, same)


# ---- the server: two video jobs of one bucket, one batch ----------------------------------------
def test_two_video_jobs_run_their_denoise_steps_as_one_batch(pipe):
    """POST /v1/videos twice to a server with max_batch 2 (its engine held until both wait):
    both jobs report batch_size 2 and denoise_batch 2, and each decodes its own request's
    latents, those of its run alone."""
    from models.wan.serving import WanServeAdapter
    from tests.support.engine import serving
    from tests.support.serve import call

    av = pytest.importorskip("av")
    adapter = WanServeAdapter(pipe, 0, with_(REQUESTS[0], prompt="x"), fps=8, warmup=False)
    bodies = [{"prompt": r.prompt, "negative_prompt": r.negative_prompt, "seed": r.seed,
               "guidance_scale": r.guidance_scale} for r in REQUESTS[:2]]
    alone = [pipe.generate(adapter.parse(body).request, decode=False).latents for body in bodies]
    decoded, decode = [], pipe.decode_latents
    pipe.decode_latents = lambda req, latents: decoded.append(latents) or decode(req, latents)   # each job's latents
    try:
        with serving(adapter, max_batch=2) as (base, board):
            ids = []
            for body in bodies:
                status, video, _ = call(base, "POST", "/v1/videos", body)
                assert status == 202 and video["status"] == "queued", video
                ids.append(video["id"])
            board.release()
            for job in (board.get(i) for i in ids):
                assert job.finished.wait(120), job.as_dict()
            for i in ids:
                status, job, _ = call(base, "GET", f"/v1/jobs/{i}")
                assert status == 200 and job["status"] == "succeeded" and job["batch_size"] == 2, job
                _, video, _ = call(base, "GET", f"/v1/videos/{i}")
                assert video["status"] == "completed" and video["dtgen"]["denoise_batch"] == 2, video
            import io
            import urllib.request
            raw = urllib.request.urlopen(f"{base}/v1/videos/{ids[1]}/content", timeout=30).read()
            with av.open(io.BytesIO(raw)) as container:
                assert len([f for f in container.decode(video=0)]) == 9
    finally:
        del pipe.decode_latents
    assert len(decoded) == 2
    for k, (got, want) in enumerate(zip(decoded, alone)):
        assert_close(got, want, f"job {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("regions", [False, True], ids=["whole-step", "regions"])
def test_compiled_batch_on_gpu_matches_alone(wan_checkpoint, regions):
    """One GPU, bf16, the step's pieces compiled (one graph each, or one block region): two
    requests batched, without a cache and with TaylorSeer (its cached steps run the head alone),
    give their compiled runs alone's latents to bf16 rounding (the bound of the compiled-vs-
    eager test) and the same decisions, with no graph break."""
    import torch._dynamo

    from dtgen.compile import CompileOptions, graph_breaks
    from models.wan.model import load
    from models.wan.pipeline import WanT2VPipeline
    from placements.wan import get_plan
    torch._dynamo.reset()
    loaded = load(wan_checkpoint, get_plan("single"), dtype=torch.bfloat16, device="cuda")
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                          compile_options=CompileOptions(enabled=True, regions=regions))
    for spec in (None, CACHES["taylorseer"]):
        reqs = [with_(r, steps=CACHED_STEPS, step_cache=spec) for r in REQUESTS[:2]]
        alone = [pipe.generate(r, decode=False) for r in reqs]
        together = pipe.generate_batch(reqs, quiet(2), decode=False)
        for k, (a, b) in enumerate(zip(alone, together)):
            scale = float(a.latents.abs().max())
            assert float((a.latents - b.latents).abs().max()) <= 0.05 * scale, (spec, k)
            assert a.record.get("step_cache") == b.record.get("step_cache"), (spec, k)
        assert float((together[0].latents - together[1].latents).abs().max()) > 0.1
    assert graph_breaks() == {}
