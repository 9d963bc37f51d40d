"""Qwen-Image's modules and its whole request against diffusers 0.42 / transformers 5 on the tiny
random case in the diffusers layout, in one process. CPU, float32."""
import pytest
import torch

from models.qwen_image.model import QwenImageAdapter, QwenImageConfigs, load
from dtgen.layers.flow_match import DynamicShiftSampler
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest, pack
from models.qwen_image.text_encoder import PROMPT_TEMPLATE, encode_prompt, prompt_ids
from models.qwen_image.tiny import ensure_tiny_checkpoint
from placements.qwen_image import get_plan

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

# 64 x 48 px -> 8 x 6 latents -> 4 x 3 patches: 12 image tokens; the prompts' text rows are
# 21 and 9 (after the template's 34), so the two CFG branches have different lengths.
REQUEST = T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", height=64, width=48,
                     steps=3, true_cfg_scale=4.0, seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def pipe(ckpt):
    loaded = load(ckpt, get_plan("single"))
    return QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")


@pytest.fixture(scope="module")
def reference(ckpt):
    """diffusers' QwenImagePipeline over the same folder (from_config + load_state_dict: from_pretrained
    would want `accelerate`; the VAE encoder and the text encoder's vision tower, absent from the
    folder, stay at their random init: text-to-image never runs them)."""
    from safetensors.torch import load_file

    def from_folder(cls, name, strict=True):
        model = cls.from_config(cls.load_config(ckpt / name))
        keys = model.load_state_dict(load_file(ckpt / name / "diffusion_pytorch_model.safetensors"), strict=strict)
        return model.eval(), keys
    transformer, _ = from_folder(diffusers.QwenImageTransformer2DModel, "transformer")
    vae, keys = from_folder(diffusers.AutoencoderKLQwenImage, "vae", strict=False)
    assert all(k.startswith(("encoder.", "quant_conv.")) for k in keys.missing_keys) and not keys.unexpected_keys
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt / "text_encoder").eval()
    return diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(ckpt / "scheduler"), vae=vae,
        text_encoder=text_encoder, tokenizer=transformers.Qwen2Tokenizer.from_pretrained(ckpt / "tokenizer"),
        transformer=transformer)


@torch.no_grad()
@pytest.mark.parametrize("grid, text_rows", [((4, 3), 9), ((5, 7), 4)], ids=["4x3", "5x7-odd"])
def test_transformer_matches_diffusers(pipe, reference, grid, text_rows):
    """The MMDiT forward (both streams, joint attention, the centred RoPE on even and odd grids)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, grid[0] * grid[1], 64, generator=g)
    text = torch.randn(2, text_rows, 32, generator=g)
    t = torch.tensor([0.9, 0.31])
    want = reference.transformer(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, *grid)]] * 2,
                                 return_dict=False)[0]
    got = pipe.model.transformer(x, t, text, *grid)
    assert got.shape == want.shape == (2, grid[0] * grid[1], 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)   # measured: < 1e-6


@torch.no_grad()
def test_compiled_block_region_has_no_complex_op_and_matches_eager(pipe):
    """The block region as a runtime compiles it: no complex tensor in its ATen graph (inductor
    has no code for complex ops and would run each as a kernel of its own; the eager RoPE's
    complex multiply becomes the real form under compile), the same result as eager."""
    import models.qwen_image.transformer as qt
    from torch._functorch.aot_autograd import aot_module_simplified
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm

    transformer = pipe.model.transformer
    g = torch.Generator().manual_seed(3)
    x, text, t = torch.randn(1, 12, 64, generator=g), torch.randn(1, 9, 32, generator=g), torch.tensor([0.6])
    eager = transformer(x, t, text, 4, 3)
    torch._dynamo.reset()
    transformer.run_block = torch.compile(
        qt.run_block, fullgraph=True, backend=lambda gm, inputs: aot_module_simplified(gm, inputs, fw_compiler=record))
    try:
        compiled = transformer(x, t, text, 4, 3)
    finally:
        transformer.run_block = qt.run_block
        torch._dynamo.reset()
    complex_nodes = [n for gm in graphs for n in gm.graph.nodes
                     if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()]
    assert graphs and not complex_nodes, complex_nodes
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_text_embeddings_match_diffusers(pipe, reference):
    """Tokens (the released tokenizer layout through `tokenizers`) equal transformers' Qwen2Tokenizer;
    prompt_embeds (the template's first 34 rows dropped) equal diffusers', whose mask is all ones."""
    for prompt in (REQUEST.prompt, REQUEST.negative_prompt, "Ünïcode, digits 1234 and\nnew lines"):
        want_ids = reference.tokenizer([PROMPT_TEMPLATE.format(prompt)], return_tensors="pt").input_ids
        assert torch.equal(prompt_ids(pipe.tokenizer, prompt), want_ids)
        want, mask = reference._get_qwen_prompt_embeds([prompt], device="cpu", dtype=torch.float32)
        got = encode_prompt(pipe.model.text_encoder, pipe.tokenizer, prompt, "cpu", torch.float32)
        assert got.shape == want.shape and bool(mask.all())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)   # measured: 0 (same ops)


@torch.no_grad()
def test_vae_decode_matches_diffusers(pipe, reference):
    z = torch.randn(1, 16, 1, 8, 6, generator=torch.Generator().manual_seed(2))
    want = reference.vae.decode(z, return_dict=False)[0]
    got = pipe.model.vae.decode_unnormalized(z)
    assert got.shape == want.shape == (1, 3, 1, 64, 48)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sampler_matches_diffusers_scheduler(pipe, reference):
    """The checkpoint's scheduler as QwenImagePipeline sets it up (sigmas linspace(1, 1/steps), mu
    from the token count through calculate_shift, shift_terminal 0.02): mu, sigmas and timesteps
    bit for bit, and the first sigma exactly 1.0. tests/framework/test_samplers.py covers more
    sizes, step counts and the step itself."""
    import numpy as np
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
    c = reference.scheduler.config
    for steps, tokens in ((3, 12), (2, 256), (20, 1024), (50, 4096), (28, 6032)):
        ours = DynamicShiftSampler(steps, tokens, pipe.model.cfgs.scheduler)
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        retrieve_timesteps(reference.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert ours.mu == mu
        assert torch.equal(ours.sigmas, reference.scheduler.sigmas), steps
        assert torch.equal(ours.timesteps, reference.scheduler.timesteps), steps
        assert float(ours.sigmas[0]) == 1.0


def test_three_step_cfg_run_matches_diffusers(pipe, reference):
    """The whole request (both prompts encoded, 3 steps of true CFG 4.0 with the norm rescale,
    the dynamic-shift Euler steps, the VAE decode) against QwenImagePipeline from the same noise."""
    noise = pack(torch.randn(1, 16, 1, 8, 6, generator=torch.Generator().manual_seed(3)))
    ours = pipe.generate(REQUEST, latents=noise)
    kwargs = dict(prompt=REQUEST.prompt, negative_prompt=REQUEST.negative_prompt, height=REQUEST.height,
                  width=REQUEST.width, num_inference_steps=REQUEST.steps, true_cfg_scale=REQUEST.true_cfg_scale,
                  latents=noise.clone())
    with torch.no_grad():
        want_latents = reference(**kwargs, output_type="latent").images
        want_image = reference(**kwargs, output_type="pt").images[0]          # [3, H, W] in [0, 1]
    torch.testing.assert_close(ours.latents, want_latents, atol=2e-5, rtol=1e-5)
    want = (want_image.permute(1, 2, 0) * 255).round()
    assert ours.image.shape == want.shape == (64, 48, 3)
    assert (ours.image.float() - want).abs().max() <= 1   # uint8 rounding of equal floats
    # CFG matters here: without it the result moves.
    alone = pipe.generate(T2IRequest(**{**REQUEST.__dict__, "true_cfg_scale": 1.0}), latents=noise, decode=False)
    assert float((alone.latents - ours.latents).abs().max()) > 1e-3


def test_bad_input_is_refused_in_one_line(pipe, ckpt):
    with pytest.raises(ValueError, match=r"^height: 70 must be a multiple of 16 \(VAE x patch size\); "
                                         r"nearest valid: 64 or 80$"):
        pipe.generate(T2IRequest(**{**REQUEST.__dict__, "height": 70}))
    with pytest.raises(ValueError, match=r"latents of shape \(1, 5, 64\) do not fit the request; expected \(1, 12, 64\)"):
        pipe.generate(REQUEST, latents=torch.zeros(1, 5, 64))
    cfgs = QwenImageConfigs.from_folder(ckpt)
    adapter = QwenImageAdapter(cfgs)
    with torch.device("meta"):
        model = adapter.build_on_meta()
    assert sorted(adapter.attention_heads(model)) == [f"transformer.transformer_blocks.{i}.attn" for i in range(2)]
    assert adapter.param_dtype("vae.decoder.conv_in.weight", torch.bfloat16) == torch.float32
