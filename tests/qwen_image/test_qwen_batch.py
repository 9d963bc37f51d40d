"""Qwen-Image requests of one bucket as rows of one denoise batch (dtgen/denoise_loop.py), each
with its own seed, prompts (of different lengths: a call pads its rows' text to the longest
and hides each row's padding from the joint attention), true-CFG scale, step caches, progress
and record, against the same requests run alone. CPU, float32, the tiny default.

Batched latents equal the unbatched ones within 1e-5 of their scale (measured: 4e-7; without
the per-row mask the shorter prompts' rows are off by 8e-3). Through `single` here and every
2-rank plan of placements/qwen_image.py on gloo CPU ranks; a request that leaves at a step
boundary leaves the others as alone; and through the server's engine and HTTP route, two
concurrent /v1/images/generations requests of one bucket run as one batch.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import threading

import pytest
import torch

from dtgen.batching import per_member
from dtgen.launch import RankPool
from dtgen.serve.errors import Cancelled
from models.qwen_image.pipeline import T2IRequest
from models.qwen_image.spec import SPEC
from models.qwen_image.tiny import ensure_tiny_checkpoint
from placements.qwen_image import PLANS
from tests.support.batching import assert_rel_close, quiet

from .test_qwen_image_plans import _pipe

RTOL = 1e-5
BASE = dict(height=64, width=48, steps=3)
# Text rows (after the template): 127 / 105, 102 / 100, 147 / 116 (prompt / negative prompt).
REQUESTS = [T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", seed=1,
                       true_cfg_scale=4.0, **BASE),
            T2IRequest(prompt="a cat", negative_prompt=" ", seed=2, true_cfg_scale=2.5, **BASE),
            T2IRequest(prompt="waves crash on a rocky shore at dusk, seen from a cliff above",
                       negative_prompt="low quality, static", seed=3, true_cfg_scale=6.0, **BASE)]
# first-block on 4 steps: at step 2 the first request's measures (1.117, 1.125) are above the
# threshold and the others' (1.04-1.05) below, so the requests of one call disagree there.
# (MagCache and TaylorSeer batch through the same model-free code: tests/wan/test_wan_batch.py.)
CACHES = {"first-block": "first-block:threshold=1.08", "taylor": "taylor:interval=2"}
CACHED_STEPS = 4


def with_(req, **change):
    return dataclasses.replace(req, **change)


def assert_close(got: torch.Tensor, want: torch.Tensor, where: str = "") -> None:
    assert_rel_close(got, want, RTOL, where)


def decisions(report: dict):
    """Per call site (CFG branch): its full steps and each row's decision."""
    return [(s["full_steps"], s.get("full_rows")) for s in report.get("call_sites", [report])]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen-batch"))


@pytest.fixture(scope="module")
def pipe(ckpt):
    return _pipe(ckpt)


@pytest.fixture(scope="module")
def alone(pipe):
    return [pipe.generate(r, record=True) for r in REQUESTS]


def test_what_a_batch_shares_is_the_specs_bucket(pipe):
    key = pipe.batch_key
    assert pipe.buckets is SPEC.buckets and SPEC.batches and len({key(r) for r in REQUESTS}) == 1
    assert len({pipe.encode(r)[0].shape[1] for r in REQUESTS}) == 3   # three prompt lengths in one batch
    assert key(with_(REQUESTS[0], step_cache="taylor")) == key(with_(REQUESTS[1], step_cache={"method": "taylor"}))
    for change in (dict(steps=4), dict(height=48), dict(step_cache="taylor"), dict(true_cfg_scale=1.0)):
        assert key(with_(REQUESTS[0], **change)) != key(REQUESTS[0]), change


def test_batched_requests_equal_their_runs_alone(pipe, alone):
    together = pipe.generate_batch(REQUESTS, quiet(3), record=True)
    for k, (a, b) in enumerate(zip(alone, together)):
        assert_close(b.latents, a.latents, f"request {k}")
        for i, (x, y) in enumerate(zip(b.record["noise"], a.record["noise"], strict=True)):
            assert_close(x, y, f"request {k}, step {i}")
        assert b.image.shape == (64, 48, 3) and int((b.image.int() - a.image.int()).abs().max()) <= 1
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
    for k, (a, b) in enumerate(zip(alone_cached[name], together)):
        assert decisions(b.record["step_cache"]) == decisions(a.record["step_cache"]), (name, k)
        assert_close(b.latents, a.latents, f"{name}, request {k}")
    assert all(r["cached_steps"] for r in reports), reports
    if name == "first-block":
        thr = 1.08
        sites = [s for r in reports for s in r.get("call_sites", [r])]
        measures = [d for s in sites for step in s["first_block_diff"] for d in step if d is not None]
        assert min(abs(d - thr) / thr for d in measures) > 1e-3, measures
        assert len({tuple(s["full_rows"][2]) for s in sites}) > 1   # the members of a call disagree at step 2


def test_a_request_that_leaves_at_step_2_leaves_the_others_as_alone(pipe, alone_cached):
    def cancel_at_2(phase, done, total):
        if (phase, done) == ("denoise", 2):
            raise Cancelled("cancelled by DELETE")

    quiet_one = lambda *a: None  # noqa: E731
    reqs = [with_(r, steps=CACHED_STEPS, step_cache=CACHES["first-block"]) for r in REQUESTS]
    # the longest prompt leaves: the others' calls pad to a shorter text from step 3 on
    out = pipe.generate_batch(reqs, per_member([quiet_one, quiet_one, cancel_at_2]), decode=False)
    assert isinstance(out[2], Cancelled), out[2]
    for k in (0, 1):
        want = alone_cached["first-block"][k]
        assert decisions(out[k].record["step_cache"]) == decisions(want.record["step_cache"])
        assert_close(out[k].latents, want.latents, f"request {k}")


def test_requests_without_cfg_batch_their_conditional_rows(pipe):
    reqs = [with_(r, true_cfg_scale=1.0) for r in REQUESTS]
    alone = [pipe.generate(r, decode=False) for r in reqs]
    together = pipe.generate_batch(reqs, quiet(3), decode=False)
    for k, (a, b) in enumerate(zip(alone, together)):
        assert_close(b.latents, a.latents, f"request {k}")
    with pytest.raises(ValueError, match=r"^guided: the requests of one batch must share it"):
        pipe.generate_batch([REQUESTS[0], reqs[1]], quiet(2), decode=False)


# ---- every 2-rank plan, gloo CPU ranks ------------------------------------------------------
def job_batched_through_plans(ctx, ckpt, plans):
    """Per plan: three requests alone and batched (4 steps, a first-block cache: its measures
    sum over the SP ranks, its rows split over the CFG ranks); the largest latent difference
    relative to the scale, and whether the decisions agree."""
    out = {}
    for plan in plans:
        pipe = _pipe(ckpt, plan, ctx.rank, ctx.world_size)
        reqs = [with_(r, steps=CACHED_STEPS, step_cache=CACHES["first-block"]) for r in REQUESTS]
        alone = [pipe.generate(r, decode=False) for r in reqs]
        together = pipe.generate_batch(reqs, quiet(3), decode=False)
        out[plan] = ([float((a.latents - b.latents).abs().max() / a.latents.abs().max())
                      for a, b in zip(alone, together)],
                     [a.record.get("step_cache") is None or decisions(a.record["step_cache"]) ==
                      decisions(b.record["step_cache"]) for a, b in zip(alone, together)])
    return out


def test_batched_equals_alone_through_every_plan(ckpt):
    plans = [name for name, plan in PLANS.items() if plan.world_size in (2, 4)]
    assert plans == ["tp2", "ulysses2", "cfg2"], plans
    with RankPool(2, timeout_s=600) as pool:
        results = pool.run(job_batched_through_plans, ckpt, plans)
    for rank, per_plan in enumerate(results):
        assert sorted(per_plan) == sorted(plans)
        for plan, (diffs, same) in per_plan.items():
            assert max(diffs) <= RTOL and all(same), (plan, rank, diffs, same)


# ---- the server: two concurrent image requests of one bucket, one batch -------------------------
def test_two_image_requests_run_their_denoise_steps_as_one_batch(pipe, alone):
    """Two concurrent POST /v1/images/generations to a server with max_batch 2 (its engine held
    until both wait): both jobs report batch_size 2, their answers denoise_batch 2, and each
    decodes its own request's latents (those of its run alone) into its answer's image."""
    import numpy as np
    from PIL import Image

    from models.qwen_image.serving import QwenServeAdapter
    from tests.support.engine import serving
    from tests.support.serve import call

    adapter = QwenServeAdapter(pipe, 0, with_(REQUESTS[0], prompt="x"), warmup=False)
    bodies = [{"prompt": r.prompt, "negative_prompt": r.negative_prompt, "seed": r.seed,
               "true_cfg_scale": r.true_cfg_scale} for r in REQUESTS[:2]]
    assert [adapter.parse(b) for b in bodies] == REQUESTS[:2]
    answers, decoded, decode = {}, [], pipe.decode_latents
    pipe.decode_latents = lambda req, latents: decoded.append(latents) or decode(req, latents)   # in batch order
    try:
        with serving(adapter, max_batch=2) as (base, board):
            def post(body):
                answers[body["seed"]] = call(base, "POST", "/v1/images/generations", body)

            threads = [threading.Thread(target=post, args=(body,)) for body in bodies]
            for t in threads:
                t.start()
            board.wait_queued(2)
            jobs = board.queued()   # in the order they came
            board.release()
            for t in threads:
                t.join(120)
            assert [job.as_dict()["batch_size"] for job in jobs] == [2, 2], [job.as_dict() for job in jobs]
    finally:
        del pipe.decode_latents
    by_seed = {r.seed: a for r, a in zip(REQUESTS, alone)}
    for job, latents in zip(jobs, decoded, strict=True):
        want = by_seed[job.request.seed]
        assert_close(latents, want.latents, f"seed {job.request.seed}")
        status, answer, _ = answers[job.request.seed]
        assert status == 200 and answer["dtgen"]["denoise_batch"] == 2 and answer["dtgen"]["seed"] == job.request.seed
        png = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
        image = torch.from_numpy(np.asarray(png.convert("RGB")).copy())
        assert int((image.int() - want.image.int()).abs().max()) <= 1


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_compiled_adapter_warms_up_every_batch_size(ckpt, max_batch):
    """A compiled pipeline (dynamo's eager backend: tracing without code generation) behind the
    server's adapter, warmed up for --max-batch 2: the first batch of two requests (prompts of
    other lengths than the warm-up's, within its 64-row text bucket; each its own seed and CFG
    scale) compiles no graph. Warmed up for --max-batch 1 (the batch of one alone), the same batch
    compiles in the request: what the batch warm-up is for."""
    from dtgen.compile import CompileOptions, unique_graphs
    from models.qwen_image.model import load
    from models.qwen_image.pipeline import QwenImagePipeline
    from models.qwen_image.serving import QwenServeAdapter
    from placements.qwen_image import get_plan

    torch._dynamo.reset()   # no graph of another test's compiled pipeline answers for this one's
    loaded = load(ckpt, get_plan("single"))
    pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu",
                             compile_options=CompileOptions(enabled=True, backend="eager"))
    adapter = QwenServeAdapter(pipe, 0, T2IRequest("a red fox", height=48, width=64, steps=2),
                               warmup_batch=max_batch)
    adapter.warm_up(lambda *a: None)
    warm = unique_graphs()
    prompts = {5: "a small red fox in the snow", 6: "a fox"}
    lengths = {len(pipe.encode(T2IRequest(p, height=48, width=64))[0][0]) for p in (*prompts.values(), "a red fox")}
    assert len(lengths) == 3, lengths   # three prompt lengths: the bucket, not one length, shares the graphs
    jobs = [adapter.parse({"prompt": prompts[s], "seed": s, "true_cfg_scale": 2.0 + s}) for s in (5, 6)]
    assert all(not isinstance(r, BaseException) for r in pipe.generate_batch(jobs, quiet(2), decode=False))
    new_graphs = unique_graphs() - warm
    assert (new_graphs == 0) if max_batch == 2 else (new_graphs > 0), new_graphs


@pytest.mark.gpu
def test_compiled_batch_on_gpu_matches_alone(ckpt):
    """One GPU, bf16, the step's pieces compiled: three requests of three prompt lengths batched
    (each row's padding hidden by the per-row hole inside the compiled graphs), without a cache
    and with the Taylor cache, give their compiled runs alone's latents to bf16 rounding and the
    same decisions, with no graph break."""
    import torch._dynamo

    from dtgen.compile import CompileOptions, graph_breaks
    from models.qwen_image.model import load
    from models.qwen_image.pipeline import QwenImagePipeline
    from placements.qwen_image import get_plan
    torch._dynamo.reset()
    loaded = load(ckpt, get_plan("single"), dtype=torch.bfloat16, device="cuda")
    pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                             compile_options=CompileOptions(enabled=True))
    for spec in (None, CACHES["taylor"]):
        reqs = [with_(r, steps=CACHED_STEPS, step_cache=spec) for r in REQUESTS]
        alone = [pipe.generate(r, decode=False) for r in reqs]
        together = pipe.generate_batch(reqs, quiet(3), decode=False)
        for k, (a, b) in enumerate(zip(alone, together)):
            scale = float(a.latents.abs().max())
            assert float((a.latents - b.latents).abs().max()) <= 0.05 * scale, (spec, k)
            assert a.record.get("step_cache") == b.record.get("step_cache"), (spec, k)
    assert graph_breaks() == {}
