"""kernels/fp8_attention.py (INT8 QK, FP8 or FP16 PV) and Wan's `--attention-dtype fp8`.

CPU: the Triton kernel under TRITON_INTERPRET=1 (conftest sets it) at tiny odd lengths (not
multiples of the 16-row interpreter tiles), head_dim 64 and 128, against its torch
reference and against float64 attention; opcheck; the one-line refusals; the Wan tiny
pipeline with the option (head_dim 64) against its SDPA run. GPU (marker `gpu`): the kernel
at a Wan 1.3B shape against SDPA in bf16.

Tolerances, from measurement (random N(0, 1) q, v; k with an offset of 3 that the
smoothing must remove): the kernel against the reference: they round P against different
row maxima (running vs final), 1-2% relative L2 at these lengths, bound 0.04 (FP16 PV:
1e-4, bound 2e-3). Against exact attention: FP8 PV 3.0-3.5%, bound 0.06; FP16 PV 1.0-1.2%,
bound 0.025 (random data is the hard case: each output is an average of unrelated rows, so
the per-element rounding does not average out relative to it).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_attention import fp8_attention, fp8_attention_reference
from tests.support.triton import needs_triton

pytestmark = needs_triton


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _qkv(B, H, Sq, Sk, D, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, s, D, generator=g) for s in (Sq, Sk, Sk))
    return q.to(device, dtype), (k + 3.0).to(device, dtype), v.to(device, dtype)


@pytest.mark.parametrize("B,H,Sq,Sk,D", [(1, 2, 37, 29, 64), (2, 1, 19, 45, 128), (1, 1, 5, 3, 64), (1, 2, 21, 33, 16),
                                       (1, 1, 17, 19, 96)])
@pytest.mark.parametrize("pv,vs_ref,vs_exact", [("fp8", 0.04, 0.06), ("fp16", 2e-3, 0.025)])
def test_kernel_matches_reference_and_stays_near_exact(B, H, Sq, Sk, D, pv, vs_ref, vs_exact):
    q, k, v = _qkv(B, H, Sq, Sk, D)
    out = fp8_attention(q, k, v, impl="triton", pv=pv)
    assert out.shape == q.shape and out.dtype == q.dtype
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel(out, fp8_attention_reference(q, k, v, pv)) < vs_ref
    assert rel(out, exact) < vs_exact
    assert rel(fp8_attention_reference(q, k, v, pv), exact) < vs_exact
    # "auto" on the CPU is the reference
    torch.testing.assert_close(fp8_attention(q, k, v, pv=pv), fp8_attention_reference(q, k, v, pv))


@pytest.mark.parametrize("tiles", [dict(), dict(tma=True), dict(magic=False), dict(block_m=8, block_n=8), dict(block_m=8, tma=True),
                                   dict(magic=False, block_n=8)],
                         ids=["pointers", "tma", "i2f", "tiles8", "tiles8-16-tma", "i2f-n8"])
def test_gqa_and_every_kernel_variant_match_the_reference(tiles):
    """GQA (4 query heads over 2 KV heads: each reads its group's K/V) with each of the
    kernel's variants: TMA descriptors or pointers, the logits' bit trick or I2F, tiles
    smaller than the scale blocks. The variants compute the same thing; the bounds as above."""
    from kernels.fp8_attention import AttentionTiles, _fp8_attention_triton, quantize_qkv
    q, _, _ = _qkv(2, 4, 37, 45, 64, seed=1)
    _, k, v = _qkv(2, 2, 37, 45, 64, seed=2)
    out = _fp8_attention_triton(*quantize_qkv(q, k, v), 37, 45, 4, torch.float32, AttentionTiles(
        **{"num_warps": 4, "num_stages": 1, "tma": False, **tiles})).transpose(1, 2)
    expanded = (k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    exact = F.scaled_dot_product_attention(q.double(), *(t.double() for t in expanded))
    ref = fp8_attention_reference(q, k, v)
    assert rel(out, ref) < 0.04 and rel(out, exact) < 0.06
    # the reference's GQA: its rounding is per KV head, the same as with K/V expanded
    assert rel(ref, exact) < 0.06


def test_long_key_sequences_get_their_own_tiles_on_the_gpu():
    """From LONG_KEYS keys on the GPU runs LONG_KEY_TILES (three programs an SM); shorter
    sequences, and the interpreter, the default tiles."""
    from kernels.fp8_attention import DEFAULT_TILES, LONG_KEY_TILES, LONG_KEYS, default_tiles
    assert default_tiles(LONG_KEYS, gpu=True) == LONG_KEY_TILES == default_tiles(32760, gpu=True)
    assert default_tiles(LONG_KEYS - 1, gpu=True) == DEFAULT_TILES == default_tiles(32760, gpu=False)
    assert LONG_KEY_TILES.maxnreg == 168 and LONG_KEY_TILES.num_stages == 2


def test_opcheck_and_refusals():
    q, k, v = _qkv(1, 2, 7, 9, 64)
    from kernels.fp8_attention import AttentionTiles, _fp8_attention_triton, quantize_qkv
    # (not test_schema: its mode compares e4m3 tensors with CPU ops e4m3 does not have)
    torch.library.opcheck(torch.ops.dtgen.fp8_attention_quantized.default,
                          (*quantize_qkv(q, k, v, "fp8"), 7, 9, 2, torch.float32),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match=r"head_dim up to 128, not 192"):
        fp8_attention(*_qkv(1, 1, 4, 4, 192))
    with pytest.raises(ValueError, match=r"query heads \(2\) a multiple of the KV heads \(3\)"):
        fp8_attention(q, *_qkv(1, 3, 7, 9, 64)[1:])
    with pytest.raises(ValueError, match=r"tiles 16 x 12 must divide the scale blocks 16 x 16"):
        _fp8_attention_triton(*quantize_qkv(q, k, v), 7, 9, 2, torch.float32, AttentionTiles(block_n=12))
    with pytest.raises(ValueError, match="pv must be one of"):
        fp8_attention(q, k, v, pv="bf16")
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_attention(q, k, v, impl="cudnn")


def _wan_folder(root, head_dim):
    from models.wan.tiny import write_random_checkpoint
    folder = root / f"wan-hd{head_dim}"
    folder.mkdir()
    write_random_checkpoint(folder, overrides={"transformer": {"attention_head_dim": head_dim,
                                                               "num_attention_heads": 2, "ffn_dim": 256}})
    return folder


def test_wan_fp8_options_stay_near_the_model_dtype_run(tmp_path):
    """Tiny Wan (head_dim 64), 3 UniPC steps with CFG: each option against the float32 run.
    Measured: dense 0.32%, attention 0.03%, both 0.33% relative L2 of the final
    latents (which are mostly the noise; the velocities move more). Bounds 1% / 0.2% / 1%."""
    from models.wan.model import load
    from models.wan.pipeline import T2VRequest, WanT2VPipeline
    from placements.wan import get_plan
    folder = _wan_folder(tmp_path, 64)
    req = T2VRequest(prompt="a red fox", negative_prompt="", height=48, width=64, num_frames=9, steps=3,
                     guidance_scale=5.0, seed=0)
    latents = {}
    for dense, attention in (("model", "model"), ("fp8", "model"), ("model", "fp8"), ("fp8", "fp8")):
        loaded = load(folder, get_plan("single"), dense_dtype=dense, attention_dtype=attention)
        pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
        noise = torch.randn(pipe.latent_shape(req), generator=torch.Generator().manual_seed(3))
        latents[dense, attention] = pipe.generate(req, latents=noise, decode=False).latents
    base = latents["model", "model"]
    bounds = {("fp8", "model"): 0.01, ("model", "fp8"): 2e-3, ("fp8", "fp8"): 0.01}
    for key, bound in bounds.items():
        err = rel(latents[key], base)
        assert 0 < err < bound, f"{key}: relative L2 {err:.2e} (bound {bound})"


def test_wan_fp8_attention_refusals_in_one_line(tmp_path):
    from models.wan.model import load
    from models.wan.tiny import ensure_tiny_checkpoint
    from placements.wan import get_plan
    tiny = ensure_tiny_checkpoint(tmp_path)   # head_dim 16: runs padded to 64
    with pytest.raises(ValueError, match=r"--attention-dtype fp8: the FP8 attention kernel handles head_dim "
                                         r"up to 128; this model has 256"):
        load(_wan_folder(tmp_path, 256), get_plan("single"), attention_dtype="fp8")
    with pytest.raises(ValueError, match=r"--attention-dtype fp8 runs under the attention kinds .* uses \['ring'\]"):
        load(tiny, get_plan("ring2"), rank=0, world_size=2, attention_dtype="fp8")
    with pytest.raises(ValueError, match="attention_dtype must be one of"):
        load(tiny, get_plan("single"), attention_dtype="int4")


@pytest.mark.gpu
@pytest.mark.parametrize("pv,bound", [("fp8", 0.06), ("fp16", 0.025)])
def test_gpu_kernel_at_a_wan_shape_against_sdpa(pv, bound):
    """Wan 1.3B's self-attention at 480p x 81 frames cut to 4 heads (32760 rows, head_dim
    128: the long-key tiles), bf16, an odd length, and HunyuanImage-3's denoise cut to 8 query heads over 2 KV
    heads (GQA; 4098 image rows over a 5606-key prefix); against SDPA in float32 of the same
    bf16 inputs (K/V expanded for GQA)."""
    for B, Hq, Hkv, Sq, Sk in ((1, 4, 4, 32760, 32760), (1, 4, 4, 1000, 1000), (2, 8, 2, 4098, 5606)):
        q = _qkv(B, Hq, Sq, Sk, 128, device="cuda", dtype=torch.bfloat16)[0]
        _, k, v = _qkv(B, Hkv, Sq, Sk, 128, seed=1, device="cuda", dtype=torch.bfloat16)
        out = fp8_attention(q, k, v, pv=pv)
        g = Hq // Hkv
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                              v.float().repeat_interleave(g, 1))
        assert out.dtype == torch.bfloat16 and rel(out, want) < bound, (Sq, Sk, rel(out, want))
        if Sk <= 1000:   # the reference holds [S, S] float32 logits
            assert rel(out, fp8_attention_reference(q, k, v, pv)) < 0.04


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [dict(tma=False), dict(magic=False), dict(block_n=64, num_warps=4),
                                   dict(block_m=64, num_warps=4, tma=False), dict(block_m=64, block_n=64, maxnreg=128),
                                   dict(block_m=64, num_warps=4, num_stages=2, maxnreg=168)],
                         ids=["pointers", "i2f", "n64", "m64", "m64-n64-maxnreg", "long-key-tiles"])
def test_gpu_kernel_variants_match_the_default(tiles):
    """Each variant of the kernel compiles on the GPU stack (triton 3.6) and computes what the
    default tiles do (bound 0.03: 64-key steps round P against other running maxima).""" 
    from kernels.fp8_attention import AttentionTiles, _fp8_attention_triton, quantize_qkv
    q, k, v = _qkv(1, 4, 3000, 3000, 128, device="cuda", dtype=torch.bfloat16)
    operands = quantize_qkv(q, k, v)
    base = _fp8_attention_triton(*operands, 3000, 3000, 4, torch.bfloat16)
    other = _fp8_attention_triton(*operands, 3000, 3000, 4, torch.bfloat16, AttentionTiles(**tiles))
    assert rel(other, base) < 0.03


@pytest.mark.gpu
def test_gpu_wan_compiled_fp8_options_match_eager(tmp_path):
    """The tiny Wan (head_dim 64) in bf16 on one GPU with both FP8 options, each block compiled
    as a region: the custom ops trace (one node each) and the video matches the eager run's
    (bf16 fusions round differently: bound 2e-2 relative L2 of the latents), which stays near
    the bf16 SDPA run (bound 2e-2)."""
    from dtgen.compile import CompileOptions
    from models.wan.model import load
    from models.wan.pipeline import T2VRequest, WanT2VPipeline
    from placements.wan import get_plan
    folder = _wan_folder(tmp_path, 64)
    req = T2VRequest(prompt="a red fox", negative_prompt="", height=48, width=64, num_frames=9, steps=3,
                     guidance_scale=5.0, seed=0)
    out = {}
    for name, fp8, compiled in (("bf16", "model", False), ("eager", "fp8", False), ("compiled", "fp8", True)):
        loaded = load(folder, get_plan("single"), dtype=torch.bfloat16, device="cuda", dense_dtype=fp8,
                      attention_dtype=fp8)
        pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, torch.device("cuda"),
                              compile_options=CompileOptions(enabled=compiled, regions=compiled))
        noise = torch.randn(pipe.latent_shape(req), generator=torch.Generator().manual_seed(3))
        out[name] = pipe.generate(req, latents=noise, decode=False).latents.float().cpu()
    assert rel(out["compiled"], out["eager"]) < 2e-2
    assert rel(out["eager"], out["bf16"]) < 2e-2
