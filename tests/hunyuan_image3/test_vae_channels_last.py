"""The VAE's channels-last path (`HunyuanVAE.set_channels_last`: the activation kept
channels_last_3d, 3x3x3 convs as per-time-tap 2-D convs over channels_last frames, GroupNorm
on the strided map, depth-to-space / space-to-depth written channels-last) computes what the
NCDHW path computes: float32 to summation order, bf16 within bf16 rounding; decode and encode,
with and without row chunks, non-square latents, a batch of two. Tiny shapes on the CPU."""
from __future__ import annotations

import pytest
import torch

from models.hunyuan_image3 import vae as vae_module
from models.hunyuan_image3.vae import HunyuanVAE, VAEConfig

# The official structure (x16 space, x4 time: decoder levels of 1, 2 and 4 frames; encoder
# levels of 4, 2 and 1), 32 channels. Widths differ per level so that the upsamplers and
# downsamplers change channels (repeats / group sizes other than 1).
CFG = {"block_out_channels": [32, 64, 64, 128, 128], "layers_per_block": 1, "latent_channels": 32,
       "out_channels": 3, "ffactor_spatial": 16, "ffactor_temporal": 4, "scaling_factor": 0.5,
       "shift_factor": 0.1, "upsample_match_channel": True, "only_decoder": False}


def _vae(dtype=torch.float32, cfg=CFG) -> HunyuanVAE:
    torch.manual_seed(0)
    vae = HunyuanVAE(VAEConfig.from_dict(cfg), with_encoder=True).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():   # norm affine away from identity, so it counts
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    return vae.to(dtype)


@pytest.fixture(scope="module")
def vae32():
    return _vae()


def _close(actual, expected, dtype, what):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
    else:   # bf16: relative to the map's scale (both paths round every op to bf16)
        err = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < 2e-2, f"{what}: relative L2 {err}"


@torch.no_grad()
@pytest.mark.parametrize("latent_hw", [(3, 5), (2, 2)])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_decode_matches_ncdhw_float32(vae32, latent_hw, chunks):
    latents = torch.randn(1, 32, *latent_hw, generator=torch.Generator().manual_seed(1))
    vae32.set_channels_last(False)
    frames, image = vae32.decode_all_frames(latents), vae32.decode(latents)
    vae32.set_channels_last(True)
    try:
        assert vae32.channels_last == {"decoder": True, "encoder": True}
        cl_image = vae32.decode(latents, row_chunks=chunks)
        z = vae32._to_decoder_space(latents)
        cl_frames = vae32.decoder(z, row_chunks=chunks)
    finally:
        vae32.set_channels_last(False)
    assert cl_frames.is_contiguous(memory_format=torch.channels_last_3d)
    assert cl_image.shape == image.shape and cl_image.is_contiguous()   # callers get the usual layout
    _close(cl_frames, frames, torch.float32, "frames")
    _close(cl_image, image, torch.float32, "image")


@torch.no_grad()
@pytest.mark.parametrize("chunks", [1, 3])
def test_encode_matches_ncdhw_float32(vae32, chunks):
    pixels = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(2)) * 2 - 1
    vae32.set_channels_last(False)
    ref = vae32.encode(pixels, torch.Generator().manual_seed(3))
    vae32.set_channels_last(True)
    try:
        got = vae32.encode(pixels, torch.Generator().manual_seed(3), row_chunks=chunks)
    finally:
        vae32.set_channels_last(False)
    for name in ("mean", "logvar", "latent"):
        assert getattr(got, name).is_contiguous()
        _close(getattr(got, name), getattr(ref, name), torch.float32, name)
    assert torch.equal(got.noise, ref.noise)


@torch.no_grad()
def test_batch_of_two_and_cached_weights(vae32):
    """Two samples (per-sample norms and time taps), and weights kept as 2-D channels_last
    kernels (`cache_weights`): the same values; the cache is remade when the weight changes."""
    latents = torch.randn(2, 32, 2, 3, generator=torch.Generator().manual_seed(4))
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(5)) * 2 - 1
    vae32.set_channels_last(False)
    image, moments = vae32.decode(latents), vae32.encode(pixels, torch.Generator().manual_seed(0)).mean
    vae32.set_channels_last(True, cache_weights=True)
    try:
        conv = vae32.decoder.up[-1].block[0].conv1
        assert "_cl_taps_cache" in conv.__dict__
        _close(vae32.decode(latents, row_chunks=2), image, torch.float32, "image")
        _close(vae32.encode(pixels, torch.Generator().manual_seed(0)).mean, moments, torch.float32, "mean")
        taps = conv.cl_taps()
        assert all(t.is_contiguous(memory_format=torch.channels_last) for t in taps)
        assert conv.cl_taps()[0] is taps[0]   # kept
        conv.weight.mul_(1.0)                 # a new version: remade
        assert conv.cl_taps()[0] is not taps[0]
    finally:
        vae32.set_channels_last(False)
    assert "_cl_taps_cache" not in conv.__dict__


@torch.no_grad()
def test_bf16_matches_ncdhw_bf16():
    vae = _vae(torch.bfloat16)
    latents = torch.randn(1, 32, 3, 2, generator=torch.Generator().manual_seed(6))
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(7)) * 2 - 1
    image, mean = vae.decode(latents, row_chunks=2), vae.encode(pixels, torch.Generator().manual_seed(0)).mean
    ref32 = _vae().decode(latents)
    vae.set_channels_last(True)
    for chunks in (1, 2):
        got = vae.decode(latents, row_chunks=chunks)
        assert got.dtype == torch.bfloat16
        _close(got, image, torch.bfloat16, f"image, chunks {chunks}")
        _close(got, ref32, torch.bfloat16, f"image vs fp32, chunks {chunks}")
        _close(vae.encode(pixels, torch.Generator().manual_seed(0), row_chunks=chunks).mean, mean, torch.bfloat16,
               f"mean, chunks {chunks}")


@torch.no_grad()
def test_row_chunks_are_slabbed_on_the_channels_last_path(vae32, monkeypatch):
    """row_chunks really slabs the channels-last ResnetBlocks (no silent fallback) and the
    upsamplers' slabs write the channels_last output directly."""
    calls = []
    real = vae_module._cl_rows_conv
    monkeypatch.setattr(vae_module, "_cl_rows_conv", lambda *a: calls.append(a[0]) or real(*a))
    vae32.set_channels_last(True)
    try:
        vae32.decode(torch.randn(1, 32, 3, 2), row_chunks=2)
    finally:
        vae32.set_channels_last(False)
    ups = {id(level.upsample.conv) for level in vae32.decoder.up if level.upsample is not None}
    assert ups <= {id(c) for c in calls} and len(calls) > 2 * len(ups)


def test_pipeline_layout_choice(vae32):
    """The pipeline's vae_layout: "auto" is channels-last only for a bf16 / fp16 VAE on CUDA
    (float32 keeps the golden-exact NCDHW path); explicit choices are kept."""
    from models.hunyuan_image3.pipeline import _resolve_vae_layout
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _resolve_vae_layout("auto", vae32, cpu) == "ncdhw"
    assert _resolve_vae_layout("auto", vae32, cuda) == "ncdhw"
    assert _resolve_vae_layout("channels-last", vae32, cpu) == "channels-last"
    assert _resolve_vae_layout("auto", None, cuda) == "ncdhw"
    with torch.device("meta"):
        bf16 = HunyuanVAE(VAEConfig.from_dict(CFG)).to(torch.bfloat16)
    assert _resolve_vae_layout("auto", bf16, cuda) == "channels-last"
    assert _resolve_vae_layout("auto", bf16, cpu) == "ncdhw"
    assert _resolve_vae_layout("ncdhw", bf16, cuda) == "ncdhw"
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    with pytest.raises(ValueError, match="applies to a decode on one rank"):   # never silently NCDHW
        HunyuanT2IPipeline(None, None, None, "cpu", vae_group=object(), vae_layout="channels-last")


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_channels_last_matches_ncdhw_on_cuda():
    """On the GPU (cuDNN's kernels, not the CPU's): the channels-last decode and encode equal
    the NCDHW ones, float32 with TF32 off to float32 summation order, bf16 within bf16
    rounding; with and without row chunks, a 16x24 latent (256x384 image)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    latents = torch.randn(1, 32, 16, 24, generator=torch.Generator().manual_seed(8)).cuda()
    pixels = (torch.rand(1, 3, 256, 384, generator=torch.Generator().manual_seed(9)) * 2 - 1).cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            vae = _vae(dtype).cuda()
            image = vae.decode(latents)
            mean = vae.encode(pixels.to(dtype), torch.Generator().manual_seed(0)).mean
            vae.set_channels_last(True)
            for chunks in (1, 4):
                _close(vae.decode(latents, row_chunks=chunks), image, dtype, f"{dtype} image, chunks {chunks}")
                _close(vae.encode(pixels.to(dtype), torch.Generator().manual_seed(0), row_chunks=chunks).mean,
                       mean, dtype, f"{dtype} mean, chunks {chunks}")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
