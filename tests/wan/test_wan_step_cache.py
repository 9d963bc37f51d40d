"""Wan's step caches against diffusers 0.42's hooks (diffusers.hooks.first_block_cache,
taylorseer_cache, mag_cache) on the tiny Wan case: diffusers' WanPipeline with the hook on its
transformer(s) and dtgen's pipeline with the same config, same folder, same noise, must take
the same decision at every step for every CFG branch and give the same latents within the
Wan pipeline's bounds (atol 2e-5, rtol 1e-5: float32, the two only order sums differently).
CPU, float32. The plans are covered in tests/wan/test_wan_pipeline.py (every plan, cached runs).

What diffusers' hooks decide is read off its transformer, not its hooks: a forward hook on the
last block's FFN fires exactly when the last block's own forward runs (a full step for that
branch); WanPipeline calls its transformer for "cond", then "uncond", every step.
"""
import re

import pytest
import torch

from dtgen.requests import RequestError
from models.wan.pipeline import T2VRequest

from .test_wan_pipeline import REQUEST, _diffusers_pipeline, _pipe

diffusers = pytest.importorskip("diffusers")
from diffusers.hooks import (FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig,  # noqa: E402
                             apply_taylorseer_cache)

STEPS = 10
# diffusers' TaylorSeer default patterns ("^blocks.*attn", fullmatch) match no Wan module (its
# attention modules are blocks.N.attn1 / attn2): hooked on every block instead, the cached
# step's output is the last block's extrapolation, what dtgen's taylorseer computes.
EVERY_BLOCK = [r"blocks\.\d+"]
# A threshold between the two CFG rows' measures at step 1 (0.035600 and 0.035635 on this
# case), so the rows disagree there: dtgen runs its per-row partial path, diffusers one
# branch's blocks. The test checks every measure stays clear of it (relative 1e-4).
SPLIT_THRESHOLD = 0.03562
MAG_RATIOS = (1.0, 0.99, 0.985, 1.01, 0.995, 0.97)   # 6 ratios for 10 steps: both interpolate


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    from models.wan.tiny import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("wan-step-cache"))


@pytest.fixture(scope="module")
def ours(wan_checkpoint):
    return _pipe(wan_checkpoint)


@pytest.fixture(scope="module")
def theirs(wan_checkpoint):
    return _diffusers_pipeline(wan_checkpoint)


@pytest.fixture(scope="module")
def noise(ours):
    return torch.randn(ours.latent_shape(REQUEST), generator=torch.Generator().manual_seed(3))


def run_diffusers(pipe, config, req: T2VRequest, noise, guidance_2=None):
    """WanPipeline with `config` on each transformer (fresh hooks, removed after): the latents
    and, per transformer, per branch, which steps ran its last block."""
    dits = [d for d in (pipe.transformer, pipe.transformer_2) if d is not None]
    calls = {id(d): [] for d in dits}
    handles = []
    for d in dits:
        handles.append(d.register_forward_pre_hook(lambda m, a, log=calls[id(d)]: log.append(False)))
        handles.append(d.blocks[-1].ffn.register_forward_hook(
            lambda m, a, o, log=calls[id(d)]: log.__setitem__(-1, True)))
        if config is not None:
            d.enable_cache(config)
    try:
        with torch.no_grad():
            latents = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height,
                           width=req.width, num_frames=req.num_frames, num_inference_steps=req.steps,
                           guidance_scale=req.guidance_scale, guidance_scale_2=guidance_2, latents=noise.clone(),
                           output_type="latent").frames
    finally:
        for h in handles:
            h.remove()
        for d in dits:
            if config is not None:
                d.disable_cache()
    return latents, [calls[id(d)] for d in dits]


def our_rows(report: dict) -> list[list[list[bool]]]:
    """Per denoiser segment, per step, per row: ran in full."""
    segments = report.get("segments", [report])
    out = []
    for s in segments:
        rows = s.get("full_rows") or [[i in s["full_steps"]] * 2 for i in range(s["steps"])]
        out.append(rows)
    return out


def their_rows(calls: list[bool], branches: int) -> list[list[bool]]:
    return [calls[i:i + branches] for i in range(0, len(calls), branches)]


CASES = {
    "first-block": (f"first-block:threshold={SPLIT_THRESHOLD}", FirstBlockCacheConfig(threshold=SPLIT_THRESHOLD)),
    "taylorseer-float32": ("taylorseer:interval=3,disable_before=2,order=2,factors_dtype=float32",
                           TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, max_order=2,
                                                 taylor_factors_dtype=torch.float32, cache_identifiers=EVERY_BLOCK)),
    # diffusers' defaults (interval 5, from step 3, order 1, bfloat16 factors)
    "taylorseer-defaults": ("taylorseer", TaylorSeerCacheConfig(cache_identifiers=EVERY_BLOCK)),
    "magcache": ("magcache:threshold=0.03,max_skip_steps=2,retention_ratio=0.2,mag_ratios="
                 + "/".join(map(str, MAG_RATIOS)),
                 MagCacheConfig(threshold=0.03, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=STEPS,
                                mag_ratios=list(MAG_RATIOS))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_decisions_and_latents_as_diffusers(ours, theirs, noise, name):
    spec, config = CASES[name]
    req = T2VRequest(**{**REQUEST.__dict__, "steps": STEPS, "step_cache": spec})
    got = ours.generate(req, latents=noise, decode=False)
    want, (calls,) = run_diffusers(theirs, config, req, noise)
    report = got.record["step_cache"]
    (rows,) = our_rows(report)
    assert rows == their_rows(calls, 2), name
    assert 0 < len(report["cached_steps"]) < STEPS, report   # the case caches, and not everything
    if name == "first-block":
        thr = SPLIT_THRESHOLD
        assert any(r[0] != r[1] for r in rows), "the rows should disagree at some step"
        measures = [d for step in report["first_block_diff"] for d in step if d is not None]
        assert min(abs(d - thr) / thr for d in measures) > 1e-4, report["first_block_diff"]
    if name == "taylorseer-defaults":
        # bfloat16 factors: a float32 value that differs by ~1e-6 between the two may round to
        # the neighbouring bfloat16 (2^-8 = 3.9e-3 relative). How many factors flip depends on
        # the CPU's float32 kernels: measured 9e-5 of the latents' scale on CI's CPU and 6.7e-4
        # on another 2-core machine (both torch 2.13). The bound stays below half a bfloat16
        # step, far under what a wrong interval, order or start step moves (whole steps).
        scale = float(want.abs().max())
        assert float((got.latents - want).abs().max()) <= 1.5e-3 * scale
    else:
        torch.testing.assert_close(got.latents, want, atol=2e-5, rtol=1e-5)


def test_magcache_calibration_measures_diffusers_ratios(ours, theirs, noise):
    """calibrate=true: every step in full; the ratios per CFG row equal those diffusers' hook
    measures per branch ("cond", "uncond")."""
    measured = []
    req = T2VRequest(**{**REQUEST.__dict__, "steps": STEPS, "step_cache": "magcache:calibrate=true"})
    got = ours.generate(req, latents=noise, decode=False)
    from diffusers.hooks.mag_cache import MagCacheBlockHook
    original = MagCacheBlockHook._perform_calibration_step

    def spy(self, state, residual):
        original(self, state, residual)
        measured.append(state.calibration_ratios[-1])
    MagCacheBlockHook._perform_calibration_step = spy
    try:
        want, (calls,) = run_diffusers(theirs, MagCacheConfig(calibrate=True, num_inference_steps=STEPS), req, noise)
    finally:
        MagCacheBlockHook._perform_calibration_step = original
    report = got.record["step_cache"]
    assert all(calls) and report["full_steps"] == list(range(STEPS))
    torch.testing.assert_close(got.latents, want, atol=2e-5, rtol=1e-5)
    theirs_rows = their_rows(measured, 2)
    assert len(report["mag_ratios_rows"]) == len(theirs_rows) == STEPS
    for a, b in zip(report["mag_ratios_rows"], theirs_rows):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert report["mag_ratios"] == [r[0] for r in report["mag_ratios_rows"]]


def test_taylorseer_default_patterns_hook_nothing_on_wan(theirs):
    """Why the cases above hook every block: diffusers' default TaylorSeer patterns leave Wan
    without a single hook (so the "cached" run is the uncached one), `blocks\\.\\d+` hooks
    exactly the blocks."""
    names = [n for n, _ in theirs.transformer.named_modules()]
    default = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn",
               "^temporal_transformer_blocks.*attn")
    assert not [n for n in names if any(re.fullmatch(p, n) for p in default)]
    assert [n for n in names if re.fullmatch(EVERY_BLOCK[0], n)] == ["blocks.0", "blocks.1"]
    from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS
    assert tuple(_TRANSFORMER_BLOCK_IDENTIFIERS) == default   # what this test assumes of 0.42


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    from models.wan.tiny import write_random_checkpoint
    folder = tmp_path_factory.mktemp("wan-a14b-cache") / "tiny-a14b"
    folder.mkdir()
    write_random_checkpoint(folder, seed=7, two_experts=True)
    return _pipe(folder), _diffusers_pipeline(folder)


@pytest.mark.parametrize("name, spec, config, guidance_2", [
    ("first-block", "first-block:threshold=0.05", FirstBlockCacheConfig(threshold=0.05), 3.0),
    ("taylorseer", "taylorseer:interval=2,disable_before=1,factors_dtype=float32",
     TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32,
                           cache_identifiers=EVERY_BLOCK), 1.0),
])
def test_a14b_each_expert_keeps_its_own_cache(a14b, name, spec, config, guidance_2):
    """Wan2.2-A14B: 8 steps, 3 on the high-noise expert (t >= 875), 5 on the low-noise one.
    A cache per expert, counting that expert's steps from 0, is what diffusers does with the
    hook on each transformer: the same decisions, the same latents; the first step after the
    switch runs in full. With guidance_scale_2 = 1.0 dtgen runs the low-noise expert on the
    conditional row alone; WanPipeline still runs both branches there (its CFG switch reads
    guidance_scale) and combines them with weight 1: its conditional branch is the one to match."""
    ours, theirs = a14b
    req = T2VRequest(**{**REQUEST.__dict__, "steps": 8, "guidance_scale_2": guidance_2, "step_cache": spec})
    noise = torch.randn(ours.latent_shape(req), generator=torch.Generator().manual_seed(4))
    got = ours.generate(req, latents=noise, decode=False)
    want, (high, low) = run_diffusers(theirs, config, req, noise, guidance_2=guidance_2)
    report = got.record["step_cache"]
    assert [s["first_step"] for s in report["segments"]] == [0, 3]
    assert [s["denoiser"] for s in report["segments"]] == ["transformer", "transformer_2"]
    ours_high, ours_low = our_rows(report)
    assert ours_high == their_rows(high, 2), name
    if guidance_2 > 1:
        assert ours_low == their_rows(low, 2), name
    else:
        assert [r[:1] for r in ours_low] == [r[:1] for r in their_rows(low, 2)], name
    assert 3 in report["full_steps"] and report["cached_steps"], report
    torch.testing.assert_close(got.latents, want, atol=2e-5, rtol=1e-5)


def test_a_cache_changes_only_the_run_that_asked(ours, noise):
    """A request without a cache after a cached one is bitwise the one before it (no state
    survives a request); a cached request repeated is bitwise the same."""
    plain = T2VRequest(**{**REQUEST.__dict__, "steps": 6})
    cached = T2VRequest(**{**plain.__dict__, "step_cache": "first-block:threshold=0.05"})
    before = ours.generate(plain, latents=noise, decode=False)
    first = ours.generate(cached, latents=noise, decode=False)
    after = ours.generate(plain, latents=noise, decode=False)
    again = ours.generate(cached, latents=noise, decode=False)
    assert torch.equal(before.latents, after.latents) and "step_cache" not in after.record
    assert torch.equal(first.latents, again.latents) and first.record["step_cache"]["cached_steps"]
    assert not torch.equal(first.latents, before.latents)


def test_bad_cache_settings_are_refused_in_one_line(ours):
    # the request's own check (`T2VRequest.check`): the field, then the knob
    cases = {"first-block:threshold=-1": "step_cache: threshold: must be >= 0, got -1",
             "taylorseer:order=9": "step_cache: order: must be >= 0 and <= 4, got 9",
             "magcache": "step_cache: mag_ratios: are required",
             "nope": "step_cache: method: unknown method 'nope'"}
    for spec, message in cases.items():
        with pytest.raises(RequestError) as e:
            ours.generate(T2VRequest(**{**REQUEST.__dict__, "step_cache": spec}), decode=False)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)

