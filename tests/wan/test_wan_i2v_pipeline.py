"""Wan image-to-video end to end against diffusers' WanImageToVideoPipeline on the same tiny
folders (Wan2.1-I2V: CLIP features + condition channels; Wan2.2-I2V-A14B: two experts, the
condition alone), CPU float32: the image features, the condition (mask and latents), every step
of a 3-step CFG run from saved noise, the decoded video; a batch against each request alone; and
the one-line refusals."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from dtgen.reference_images import ReferenceImage
from dtgen.reference_images import aspect_size as reference_size
from dtgen.requests import RequestError
from models.wan.model import load
from models.wan.pipeline import T2VRequest, WanT2VPipeline, vae_pixels
from models.wan.tiny import write_random_checkpoint, write_random_i2v_checkpoint
from placements.wan import get_plan

# 9 frames -> 3 latent frames; 48 x 32 px -> 6 x 4 latents -> 3 x 2 patches (as the T2V tests).
BASE = dict(prompt="a red fox runs on the snow", negative_prompt="blurry, low quality", height=48, width=32,
            num_frames=9, steps=3, guidance_scale=5.0, seed=11)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny convolutions on a busy 2-core machine: one intra-op thread is several times faster
    than two (as tests/wan/test_wan_vae.py measures); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _image(w: int = 40, h: int = 56, seed: int = 0) -> Image.Image:
    """A smooth random image (a noise image would make the Lanczos resize's ringing the test)."""
    g = np.random.default_rng(seed)
    small = g.integers(0, 256, (4, 3, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)


def _request(**change) -> T2VRequest:
    return T2VRequest(**{**BASE, "image": ReferenceImage.from_pil(_image(), "ref.png"), **change})


@pytest.fixture(scope="module")
def i2v_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan-i2v") / "tiny-i2v"
    folder.mkdir()
    write_random_i2v_checkpoint(folder, seed=5)
    return folder


@pytest.fixture(scope="module")
def a14b_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan-i2v-a14b") / "tiny-i2v-a14b"
    folder.mkdir()
    write_random_i2v_checkpoint(folder, seed=6, two_experts=True)
    return folder


def _pipe(ckpt, plan="single", rank=0, world=1, vae_group=None):
    loaded = load(ckpt, get_plan(plan), rank, world)
    return WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0,
                          vae_group=vae_group)


def _diffusers_pipeline(ckpt):
    """diffusers' WanImageToVideoPipeline over the same folder (CLIPImageProcessorPil: no torchvision
    here). Its prompt cleaning calls ftfy even where ftfy is not installed (WanPipeline's checks
    first): without ftfy it gets WanPipeline's cleaning, what dtgen's matches."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.basic_clean = pipeline_wan.basic_clean
    from safetensors.torch import load_file
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    def from_folder(cls, name):   # from_pretrained would want `accelerate` for these classes
        model = cls.from_config(cls.load_config(ckpt / name))
        model.load_state_dict(load_file(ckpt / name / "diffusion_pytorch_model.safetensors"), strict=True)
        return model.eval()
    index = json.loads((ckpt / "model_index.json").read_text())
    clip = (ckpt / "image_encoder").is_dir()
    return diffusers.WanImageToVideoPipeline(
        tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "tokenizer"),
        text_encoder=transformers.UMT5EncoderModel.from_pretrained(ckpt / "text_encoder"),
        vae=from_folder(diffusers.AutoencoderKLWan, "vae"),
        scheduler=diffusers.UniPCMultistepScheduler.from_pretrained(ckpt / "scheduler"),
        image_processor=CLIPImageProcessorPil(**json.loads((ckpt / "image_processor" / "preprocessor_config.json")
                                                           .read_text())) if clip else None,
        image_encoder=transformers.CLIPVisionModel.from_pretrained(ckpt / "image_encoder").eval() if clip else None,
        transformer=from_folder(diffusers.WanTransformer3DModel, "transformer"),
        transformer_2=from_folder(diffusers.WanTransformer3DModel, "transformer_2")
        if (ckpt / "transformer_2").is_dir() else None,
        boundary_ratio=index.get("boundary_ratio"), expand_timesteps=False)


def _recording(pipe):
    """The pipeline with each step's latents kept (the sampler's outputs, in order)."""
    steps, make = [], pipe.sampler

    def sampler(req):
        s = make(req)
        step = s.step
        s.step = lambda noise, latents: steps.append(step(noise, latents)) or steps[-1]
        return s
    pipe.sampler = sampler
    return steps


def _run_both(ckpt, req, guidance_2=None):
    pipe, ref = _pipe(ckpt), _diffusers_pipeline(ckpt)
    noise = torch.randn(pipe.latent_shape(req), generator=torch.Generator().manual_seed(3))
    ours_steps = _recording(pipe)
    ours = pipe.generate(req, latents=noise)
    want_steps = []

    def keep(_, i, t, tensors):
        want_steps.append(tensors["latents"].clone())
        return {}
    with torch.no_grad():
        video = ref(image=req.image.pil(), prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height,
                    width=req.width, num_frames=req.num_frames, num_inference_steps=req.steps,
                    guidance_scale=req.guidance_scale, guidance_scale_2=guidance_2, latents=noise.clone(),
                    output_type="pt", callback_on_step_end=keep).frames[0]
    return pipe, ref, ours, ours_steps, want_steps, video


@torch.no_grad()
def test_image_features_and_condition_match_diffusers(i2v_checkpoint):
    pipe, ref = _pipe(i2v_checkpoint), _diffusers_pipeline(i2v_checkpoint)
    req = _request()
    image = req.image.pil()
    torch.testing.assert_close(pipe.image_features(req), ref.encode_image(image, torch.device("cpu")),
                               atol=1e-5, rtol=1e-5)
    pixels = ref.video_processor.preprocess(image, height=req.height, width=req.width).float()
    assert torch.equal(vae_pixels(image, req.height, req.width), pixels)
    noise = torch.randn(pipe.latent_shape(req))
    _, want = ref.prepare_latents(pixels, 1, 16, req.height, req.width, req.num_frames, torch.float32,
                                  torch.device("cpu"), None, noise)
    got = pipe.condition(req)
    assert got.shape == want.shape == (1, 20, 3, 6, 4)
    assert torch.equal(got[:, :4], want[:, :4])   # the frame mask: 1 on the first latent frame's 4 frames
    assert got[:, :4, 0].eq(1).all() and got[:, :4, 1:].eq(0).all()
    torch.testing.assert_close(got[:, 4:], want[:, 4:], atol=1e-5, rtol=1e-5)


def _check_steps(ours, ours_steps, want_steps, video, frames, height, width):
    """Each step's latents, the last step's as the result, and the decoded video."""
    assert len(ours_steps) == len(want_steps)
    for i, (a, b) in enumerate(zip(ours_steps, want_steps)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda m: f"step {i}: {m}")
    torch.testing.assert_close(ours.latents, want_steps[-1], atol=2e-5, rtol=1e-5)
    want = (video.permute(0, 2, 3, 1) * 255).round()
    assert ours.video.shape == want.shape == (frames, height, width, 3)
    assert (ours.video.float() - want).abs().max() <= 1   # uint8 rounding of equal floats


def test_wan21_i2v_matches_diffusers_step_by_step(i2v_checkpoint):
    """3 UniPC steps with CFG 5.0 from the same noise: diffusers runs the two branches as two
    calls, dtgen as two rows of one call (the same rows of every matrix product)."""
    req = _request()
    _, _, ours, ours_steps, want_steps, video = _run_both(i2v_checkpoint, req)
    _check_steps(ours, ours_steps, want_steps, video, 9, 48, 32)


@pytest.mark.parametrize("guidance_2", [3.0, 1.0], ids=["guided", "unguided-low-noise"])
def test_wan22_i2v_a14b_matches_diffusers(a14b_checkpoint, guidance_2):
    """Two experts switched at boundary_ratio 0.9 (4 steps at shift 3: 999, 900 high-noise; 750,
    500 low-noise), no image encoder: the condition channels alone."""
    req = _request(steps=4, guidance_scale_2=guidance_2)
    pipe, _, ours, ours_steps, want_steps, video = _run_both(a14b_checkpoint, req, guidance_2)
    assert pipe.model.image_encoder is None and pipe.model.transformer_2 is not None
    _check_steps(ours, ours_steps, want_steps, video, 9, 48, 32)


def test_a_batch_gives_each_request_its_own_run(i2v_checkpoint):
    """Two requests with different images, prompts and seeds as one batch (the server's path):
    each gets the latents it gets alone."""
    from dtgen.batching import per_member
    pipe = _pipe(i2v_checkpoint)
    reqs = [_request(), _request(seed=5, prompt="a dog", image=ReferenceImage.from_pil(_image(64, 32, 1), "b.png"))]
    assert pipe.batch_key(reqs[0]) == pipe.batch_key(reqs[1])
    alone = [pipe.generate(r, decode=False) for r in reqs]
    together = pipe.generate_batch(reqs, per_member([lambda *a: None] * 2), decode=False)
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.latents, a.latents, atol=2e-5, rtol=1e-5)
    assert float((alone[0].latents - alone[1].latents).abs().max()) > 1e-2


def test_the_reference_sizes_the_video_by_its_aspect_ratio():
    tall = ReferenceImage.from_pil(_image(40, 80), "tall.png")
    assert reference_size(tall, 480 * 832, 16) == (880, 432)   # about 480 x 832 px at 2:1, multiples of 16
    assert reference_size(tall, 48 * 64, 16) == (64, 32)


def test_bad_input_is_refused_in_one_line(i2v_checkpoint, tmp_path):
    pipe = _pipe(i2v_checkpoint)
    with pytest.raises(RequestError, match="^image: is required: this checkpoint makes video from an image") as e:
        pipe.check(T2VRequest(**BASE))
    assert e.value.field == "image"
    with pytest.raises(RequestError, match="4k \\+ 1"):
        pipe.check(_request(num_frames=8))
    t2v = tmp_path / "t2v"
    t2v.mkdir()
    write_random_checkpoint(t2v)
    with pytest.raises(RequestError, match="makes video from text") as e:
        _pipe(t2v).check(_request())
    assert e.value.field == "image"
    for name, make, message in (("absent.png", None, "no such file"), ("bad.png", b"not an image", "not a readable"),
                                ("small.png", Image.new("RGB", (8, 40)), "too small")):
        path = tmp_path / name
        if isinstance(make, bytes):
            path.write_bytes(make)
        elif make is not None:
            make.save(path)
        with pytest.raises(RequestError, match=message) as e:
            T2VRequest(**{**BASE, "image": str(path)})
        assert e.value.field == "image" and "\n" not in str(e.value)


# ---- every Wan plan against one process ---------------------------------------------------------
CACHED = "first-block:threshold=0.05"


def job_plan(ctx, ckpt, plan):
    import torch.distributed as dist
    torch.set_num_threads(1)
    # the condition's VAE encode split over every rank, as the command does (--vae-parallel)
    pipe = _pipe(ckpt, plan, ctx.rank, ctx.world_size, vae_group=dist.group.WORLD)
    result = pipe.generate(_request(), decode=False, record=True)
    cached = pipe.generate(_request(steps=4, step_cache=CACHED), decode=False)
    return {"latents": result.latents, "noise": result.record["noise"], "cached": cached.latents,
            "decisions": cached.record["step_cache"]["full_steps"]}


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_every_plan_matches_one_process(i2v_checkpoint, world):
    """Wan2.1-I2V on every shipped plan of `world` ranks (Ulysses, pipelined Ulysses, ring,
    Attention2D, CFG and their 4-rank combinations; the text encoder replicated or TP; the
    condition's VAE encode split over the ranks): every step's guided prediction and the latents of one
    process, and with a first-block cache its decisions and latents."""
    from dtgen.launch import RankPool
    from placements.wan import PLANS
    single = _pipe(i2v_checkpoint)
    want = single.generate(_request(), decode=False, record=True)
    want_cached = single.generate(_request(steps=4, step_cache=CACHED), decode=False)
    assert 0 < len(want_cached.record["step_cache"]["full_steps"]) < 4   # some steps reused, some not
    plans = [n for n, p in PLANS.items() if p.world_size == world]
    with RankPool(world, timeout_s=240) as pool:
        for plan in plans:
            for rank, got in enumerate(pool.run(job_plan, i2v_checkpoint, plan)):
                where = f"plan {plan}, rank {rank}"
                for a, b in zip(got["noise"], want.record["noise"], strict=True):
                    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=where)
                torch.testing.assert_close(got["latents"], want.latents, atol=2e-5, rtol=1e-5, msg=where)
                assert got["decisions"] == want_cached.record["step_cache"]["full_steps"], where
                torch.testing.assert_close(got["cached"], want_cached.latents, atol=2e-5, rtol=1e-5, msg=where)


@pytest.mark.gpu
@pytest.mark.parametrize("regions", [False, True], ids=["whole-step", "regions"])
def test_compiled_bf16_on_gpu_matches_eager(i2v_checkpoint, regions):
    """One GPU: the tiny Wan2.1-I2V in bf16 (the image encoder and VAE float32) with the denoise
    step compiled gives the eager run's latents to bf16 rounding, with no graph break, and a
    second request of the same shape (another image) compiles nothing."""
    import torch._dynamo

    from dtgen.compile import CompileOptions, graph_breaks, unique_graphs
    torch._dynamo.reset()
    loaded = load(i2v_checkpoint, get_plan("single"), dtype=torch.bfloat16, device="cuda")
    eager = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda").generate(_request())
    compiled = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                              compile_options=CompileOptions(enabled=True, regions=regions))
    first = compiled.generate(_request())
    graphs = unique_graphs()
    compiled.generate(_request(image=ReferenceImage.from_pil(_image(64, 32, 1), "other.png")))
    assert graph_breaks() == {} and graphs >= 1 and unique_graphs() == graphs
    scale = float(eager.latents.abs().max())
    assert float((first.latents - eager.latents).abs().max()) <= 0.05 * scale
    assert first.video.shape == eager.video.shape == (9, 48, 32, 3)


def test_two_image_to_video_jobs_run_their_denoise_steps_as_one_batch(i2v_checkpoint):
    """POST /v1/videos with two different `input_reference` files to a server with max_batch 2
    (its engine held until both wait): both run as one batch (denoise_batch 2), and each job's
    latents are those of its request alone."""
    pytest.importorskip("fastapi")
    import io

    from models.wan.serving import WanServeAdapter
    from tests.support.engine import serving
    from tests.support.serve import call
    from tests.wan.test_serve_i2v import multipart

    pipe = _pipe(i2v_checkpoint)
    adapter = WanServeAdapter(pipe, 0, T2VRequest(**{**BASE, "prompt": "x"}), fps=8, warmup=False)
    pngs = []
    for image in (_image(), _image(40, 56, 1)):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    forms = [({"prompt": p, "seed": str(s), "size": "32x48"}, {"input_reference": (f"{k}.png", png)})
             for k, (p, s, png) in enumerate(zip(("a fox", "a dog"), (1, 2), pngs))]
    parsed = [adapter.parse(f, True, {k: [v] for k, v in files.items()}).request for f, files in forms]
    alone = [pipe.generate(req, decode=False).latents for req in parsed]
    decoded, decode = [], pipe.decode_latents
    pipe.decode_latents = lambda req, latents: decoded.append(latents) or decode(req, latents)
    try:
        with serving(adapter, max_batch=2) as (base, board):
            ids = []
            for fields, files in forms:
                body, kind = multipart(fields, files)
                status, video, _ = call(base, "POST", "/v1/videos", body, content_type=kind)
                assert status == 202, video
                ids.append(video["id"])
            board.release()
            for job in (board.get(i) for i in ids):
                assert job.finished.wait(120), job.as_dict()
            for i in ids:
                _, video, _ = call(base, "GET", f"/v1/videos/{i}")
                assert video["status"] == "completed" and video["dtgen"]["denoise_batch"] == 2, video
    finally:
        del pipe.decode_latents
    assert len(decoded) == 2
    for got, want in zip(decoded, alone):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert float((alone[0] - alone[1]).abs().max()) > 1e-2
