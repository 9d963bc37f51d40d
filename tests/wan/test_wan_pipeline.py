"""Wan text-to-video end to end: diffusers' WanPipeline on the same folder, every plan against one
process, and the one-line refusals. CPU, float32, the embedded tiny default."""
import json

import pytest
import torch

from dtgen.checkpoint import CheckpointError
from dtgen.launch import RankPool
from dtgen.plan import PlanError, resolve
from models.wan.model import WanAdapter, WanConfigs, load
from models.wan.pipeline import T2VRequest, WanT2VPipeline
from models.wan.tiny import ensure_tiny_checkpoint, write_random_checkpoint
from placements.wan import PLANS, get_plan

# 9 frames -> 3 latent frames; 48 x 32 px -> 6 x 4 latents -> 3 x 2 patches: 18 tokens a step,
# which no SP degree of 4 divides (the padding is exercised), 2 rows a rank at SP4 + padding.
REQUEST = T2VRequest(prompt="a red fox runs on the snow", negative_prompt="blurry, low quality", height=48,
                     width=32, num_frames=9, steps=3, guidance_scale=5.0, seed=11)


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="module")
def a14b_checkpoint(tmp_path_factory):
    """Wan2.2-A14B's layout: a high-noise and a low-noise DiT, boundary_ratio 0.875."""
    folder = tmp_path_factory.mktemp("wan-a14b") / "tiny-a14b"
    folder.mkdir()
    write_random_checkpoint(folder, seed=7, two_experts=True)
    return folder


def _pipe(ckpt, plan="single", rank=0, world=1):
    loaded = load(ckpt, get_plan(plan), rank, world)
    return WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0)


def _diffusers_pipeline(ckpt):
    """diffusers' own WanPipeline over the same folder (the VAE's encoder, which the folder does
    not carry, stays at its random init: text-to-video never runs it)."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    def from_folder(cls, name):   # from_pretrained would want `accelerate` for these classes
        model = cls.from_config(cls.load_config(ckpt / name))
        return model, model.load_state_dict(load_file(ckpt / name / "diffusion_pytorch_model.safetensors"),
                                            strict=False)
    vae, vae_keys = from_folder(diffusers.AutoencoderKLWan, "vae")
    assert all(k.startswith(("encoder.", "quant_conv.")) for k in vae_keys.missing_keys) and not vae_keys.unexpected_keys
    dits = []
    for name in ("transformer", "transformer_2"):
        if (ckpt / name).is_dir():
            dit, keys = from_folder(diffusers.WanTransformer3DModel, name)
            assert not keys.missing_keys and not keys.unexpected_keys
            dits.append(dit.eval())
    index = json.loads((ckpt / "model_index.json").read_text())
    return diffusers.WanPipeline(
        tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "tokenizer"),
        text_encoder=transformers.UMT5EncoderModel.from_pretrained(ckpt / "text_encoder"),
        transformer=dits[0], transformer_2=dits[1] if len(dits) > 1 else None, vae=vae.eval(),
        scheduler=diffusers.UniPCMultistepScheduler.from_pretrained(ckpt / "scheduler"),
        boundary_ratio=index.get("boundary_ratio"))


def test_matches_diffusers_wan_pipeline(wan_checkpoint):
    """The whole request (prompt encoding, 3 UniPC steps with CFG 5.0, VAE decode) against
    diffusers' WanPipeline loading the same diffusers-format folder, from the same noise."""
    pipe = _pipe(wan_checkpoint)
    ref = _diffusers_pipeline(wan_checkpoint)
    noise = torch.randn(pipe.latent_shape(REQUEST), generator=torch.Generator().manual_seed(3))
    ours = pipe.generate(REQUEST, latents=noise)
    kwargs = dict(prompt=REQUEST.prompt, negative_prompt=REQUEST.negative_prompt, height=REQUEST.height,
                  width=REQUEST.width, num_frames=REQUEST.num_frames, num_inference_steps=REQUEST.steps,
                  guidance_scale=REQUEST.guidance_scale, latents=noise.clone())
    with torch.no_grad():
        want_latents = ref(**kwargs, output_type="latent").frames
        want_video = ref(**kwargs, output_type="pt").frames[0]          # [F, 3, H, W] in [0, 1]
    torch.testing.assert_close(ours.latents, want_latents, atol=2e-5, rtol=1e-5)
    want = (want_video.permute(0, 2, 3, 1) * 255).round()
    assert ours.video.shape == want.shape == (9, 48, 32, 3)
    assert (ours.video.float() - want).abs().max() <= 1   # uint8 rounding of equal floats


@pytest.mark.parametrize("guidance_2", [3.0, 1.0], ids=["guided", "unguided-low-noise"])
def test_a14b_two_experts_match_diffusers(a14b_checkpoint, guidance_2):
    """Wan2.2-A14B: both DiTs resident; t >= 875 runs the high-noise one with guidance 5, the
    rest the low-noise one with guidance_scale_2 (1.0: its conditional row alone, as
    WanPipeline skips CFG there). 4 steps at shift 3: timesteps 999, 900 (high), 750, 500 (low)."""
    pipe = _pipe(a14b_checkpoint)
    assert pipe.model.transformer_2 is not None
    req = T2VRequest(**{**REQUEST.__dict__, "steps": 4, "guidance_scale_2": guidance_2})
    noise = torch.randn(pipe.latent_shape(req), generator=torch.Generator().manual_seed(4))
    ours = pipe.generate(req, latents=noise, decode=False)
    ref = _diffusers_pipeline(a14b_checkpoint)
    with torch.no_grad():
        want = ref(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
                   num_frames=req.num_frames, num_inference_steps=req.steps, guidance_scale=req.guidance_scale,
                   guidance_scale_2=guidance_2, latents=noise.clone(), output_type="latent").frames
    torch.testing.assert_close(ours.latents, want, atol=2e-5, rtol=1e-5)
    # The experts differ: with the high-noise DiT throughout, the result is not the same.
    pipe.model.transformer_2, low = None, pipe.model.transformer_2
    one_expert = pipe.generate(req, latents=noise, decode=False)
    pipe.model.transformer_2 = low
    assert float((one_expert.latents - ours.latents).abs().max()) > 1e-3


# Cached runs on every plan (dtgen/step_cache.py): first-block everywhere (its decisions are
# data: block 0's residual means are summed over the SP ranks, each CFG rank decides its own
# branch and the report gathers both; at step 2 the two rows' measures, 0.0537044 and
# 0.0537236, straddle the threshold, so the rows disagree there), and one more method per plan in turn:
# the official Taylor cache with unequal band orders (the FFT split spans every rank's rows),
# MagCache's calibration (ratio means over every rank's rows), TaylorSeer (a schedule).
CACHED_STEPS = 4
FIRST_BLOCK = "first-block:threshold=0.053714"
OTHER_CACHES = ("taylor:interval=2,order=2,low_freqs_order=2,high_freqs_order=1", "magcache:calibrate=true",
                "taylorseer:interval=2,disable_before=1,order=2,factors_dtype=float32")


def cached_requests(plan: str) -> list[T2VRequest]:
    other = OTHER_CACHES[list(PLANS).index(plan) % len(OTHER_CACHES)]
    return [T2VRequest(**{**REQUEST.__dict__, "steps": CACHED_STEPS, "step_cache": spec})
            for spec in (FIRST_BLOCK, other)]


def job_plan(ctx, ckpt, plan):
    pipe = _pipe(ckpt, plan, ctx.rank, ctx.world_size)
    result = pipe.generate(REQUEST, decode=False, record=True)
    for _ in range(2):   # switching back and forth moves nothing and changes nothing
        pipe.controller.activate("denoise")
        pipe.controller.activate("encode")
    again = pipe.generate(REQUEST, decode=False)
    cached = [pipe.generate(req, decode=False) for req in cached_requests(plan)]
    return {"latents": result.latents, "noise": result.record["noise"],
            "repeat_equal": torch.equal(result.latents, again.latents),
            "copied": pipe.controller.last_switch.weights_copied,
            "cached": [(r.latents, r.record["step_cache"]) for r in cached]}


def _reference(ckpt):
    return _pipe(ckpt).generate(REQUEST, decode=False, record=True)


PLANS_2 = [n for n, p in PLANS.items() if p.world_size == 2]
PLANS_4 = [n for n, p in PLANS.items() if p.world_size == 4]


def _decisions(report: dict):
    return report["full_steps"], report.get("full_rows")


@pytest.mark.parametrize("world, plans", [(2, PLANS_2), (4, PLANS_4)], ids=["2-ranks", "4-ranks"])
def test_every_plan_matches_one_process(wan_checkpoint, world, plans):
    """Every shipped plan (Ulysses, pipelined Ulysses, ring, Attention2D, CFG, and their 4-rank
    combinations; the text encoder replicated or TP) gives the single process's latents and
    every step's guided prediction, on every rank; and with a step cache, the single
    process's decisions (every step, every CFG row) and latents."""
    want = _reference(wan_checkpoint)
    single = _pipe(wan_checkpoint)
    want_cached = {}
    for plan in plans:
        for req in cached_requests(plan):
            if req.step_cache not in want_cached:
                want_cached[req.step_cache] = single.generate(req, decode=False)
    first_block = want_cached[FIRST_BLOCK].record["step_cache"]
    assert any(len(set(rows)) > 1 for rows in first_block["full_rows"]), first_block   # the rows disagree
    thr = first_block["config"]["threshold"]
    assert min(abs(d - thr) / thr for step in first_block["first_block_diff"] for d in step if d is not None) > 1e-4
    with RankPool(world, timeout_s=240) as pool:
        for plan in plans:
            for rank, got in enumerate(pool.run(job_plan, wan_checkpoint, plan)):
                where = f"plan {plan}, rank {rank}"
                assert got["repeat_equal"] and got["copied"] == 0, where
                for a, b in zip(got["noise"], want.record["noise"], strict=True):
                    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=where)
                torch.testing.assert_close(got["latents"], want.latents, atol=2e-5, rtol=1e-5, msg=where)
                for req, (latents, report) in zip(cached_requests(plan), got["cached"], strict=True):
                    ref = want_cached[req.step_cache]
                    assert _decisions(report) == _decisions(ref.record["step_cache"]), f"{where}, {req.step_cache}"
                    torch.testing.assert_close(latents, ref.latents, atol=2e-5, rtol=1e-5,
                                               msg=f"{where}, {req.step_cache}")
                    if "mag_ratios_rows" in report:   # float32 means over regrouped rows
                        for a, b in zip(report["mag_ratios_rows"], ref.record["step_cache"]["mag_ratios_rows"]):
                            assert a == pytest.approx(b, rel=1e-5), where


def test_plans_resolve_and_cover_every_denoise_kind():
    kinds = {p.phases["denoise"].attention for p in PLANS.values()}
    assert {"ulysses", "ulysses-pipelined", "ring", "attn2d", "ulysses-ring", "ulysses-attn2d"} <= kinds
    for plan in PLANS.values():
        resolve(plan, plan.world_size)


def test_bad_input_is_refused_in_one_line(wan_checkpoint, tmp_path):
    pipe = _pipe(wan_checkpoint)
    cases = {"num_frames: 80 does not map to whole latent frames (it must be 4k + 1); nearest valid: 77 or 81":
             dict(num_frames=80),
             "height: 50 must be a multiple of 16 (VAE x patch size); nearest valid: 48 or 64": dict(height=50)}
    for message, change in cases.items():
        with pytest.raises(ValueError) as e:
            pipe.generate(T2VRequest(**{**REQUEST.__dict__, **change}))
        assert str(e.value) == message
    # 4 heads cannot split over Ulysses 8 (the plan check names the numbers).
    from dtgen.plan import PhasePlan, Plan
    from placements.wan import PARAM_RULES, TP_OUTPUTS
    wide = Plan("u8", (("sp", 8),), {"encode": PhasePlan(replicate=("sp",)),
                                     "denoise": PhasePlan(sp=("sp",), attention="ulysses"),
                                     "decode": PhasePlan(replicate=("sp",))}, PARAM_RULES, TP_OUTPUTS)
    with pytest.raises(PlanError, match="4 query heads per TP rank are not divisible by the SP size 8"):
        load(wan_checkpoint, wide, 0, 8)
    # A diffusers folder without its VAE folder.
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(wan_checkpoint, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(CheckpointError, match=r"missing the component folder\(s\) \['vae'\]"):
        load(broken, get_plan("single"))


def test_the_adapter_is_all_the_model_gives_the_build(wan_checkpoint):
    """The build is the framework's: the adapter names the attention modules (the DiT's self-
    attention, 4 heads each) and keeps the float32 parameters diffusers keeps."""
    cfgs = WanConfigs.from_folder(wan_checkpoint)
    adapter = WanAdapter(cfgs)
    with torch.device("meta"):
        model = adapter.build_on_meta()
    heads = adapter.attention_heads(model)
    assert sorted(heads) == [f"transformer.blocks.{i}.attn1" for i in range(2)] and set(heads.values()) == {(4, 4)}
    assert adapter.param_dtype("transformer.blocks.0.scale_shift_table", torch.bfloat16) == torch.float32
    assert adapter.param_dtype("transformer.blocks.0.attn1.to_q.weight", torch.bfloat16) == torch.bfloat16
    assert adapter.param_dtype("vae.decoder.conv_in.weight", torch.bfloat16) == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("regions", [False, True], ids=["whole-step", "regions"])
def test_compiled_bf16_on_gpu_matches_eager(wan_checkpoint, regions):
    """One GPU, the GPU stack's torch and triton: the tiny pipeline in bf16 with the denoise
    step compiled by inductor (one graph per step, or one region shared by the blocks) gives
    the eager run's latents to bf16 rounding, with no graph break, and a second request of the
    same shape compiles nothing."""
    import torch._dynamo
    from dtgen.compile import CompileOptions, graph_breaks, unique_graphs
    torch._dynamo.reset()
    loaded = load(wan_checkpoint, get_plan("single"), dtype=torch.bfloat16, device="cuda")
    eager = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda").generate(REQUEST)
    compiled = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                              compile_options=CompileOptions(enabled=True, regions=regions))
    first = compiled.generate(REQUEST)
    graphs = unique_graphs()
    again = compiled.generate(REQUEST)
    assert graph_breaks() == {} and graphs >= 1 and unique_graphs() == graphs
    scale = float(eager.latents.abs().max())
    assert float((first.latents - eager.latents).abs().max()) <= 0.05 * scale
    assert torch.equal(first.latents, again.latents)
    assert first.video.shape == eager.video.shape == (9, 48, 32, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("regions", [False, True], ids=["whole-step", "regions"])
def test_cached_compiled_bf16_on_gpu_matches_eager(wan_checkpoint, regions):
    """One GPU: cached requests in bf16 with the step's pieces compiled (--compile: embed, the
    block ranges and the head each one graph; --compile-regions: one block region shared by
    all) take the eager run's decisions and give its latents to bf16 rounding (the bound of
    the uncached compiled test), with no graph break; a second request compiles nothing."""
    import torch._dynamo

    from dtgen.compile import CompileOptions, graph_breaks, unique_graphs
    torch._dynamo.reset()
    loaded = load(wan_checkpoint, get_plan("single"), dtype=torch.bfloat16, device="cuda")
    eager = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda")
    requests = [T2VRequest(**{**REQUEST.__dict__, "steps": 6, "step_cache": spec})
                for spec in ("first-block:threshold=0.05", "taylorseer:interval=2,disable_before=1,order=2")]
    want = [eager.generate(req, decode=False) for req in requests]
    compiled = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                              compile_options=CompileOptions(enabled=True, regions=regions))
    first = [compiled.generate(req, decode=False) for req in requests]
    graphs = unique_graphs()
    again = [compiled.generate(req, decode=False) for req in requests]
    assert graph_breaks() == {} and unique_graphs() == graphs
    for w, f, a in zip(want, first, again):
        assert f.record["step_cache"]["full_steps"] == w.record["step_cache"]["full_steps"]
        assert f.record["step_cache"].get("full_rows") == w.record["step_cache"].get("full_rows")
        assert float((f.latents - w.latents).abs().max()) <= 0.05 * float(w.latents.abs().max())
        assert torch.equal(f.latents, a.latents)
        assert f.timings_ms["denoise_cached_step"] is not None
