"""The VAE half of the image-editing (TI2I) condition against the official golden outputs.

Cases are discovered (``discover_ti2i_cases``: ../shared/golden-ti2i and every folder in
$DTGEN_GOLDEN_TI2I_DIRS), so a new case needs no code change. Per case: the reference image
goes through the bucket/resize/crop, the encoder gives the posterior and its seeded sample,
and the decoder (this case's widths) decodes ``vae_latent_in``. Weights come straight from
the case's shards (``vae.*``, upcast to float32).
"""
import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from models.hunyuan_image3.cond_image import (MAX_SIDE, MIN_SIDE, load_reference_image, resize_and_crop,
                                              vae_bucket, vae_pixels)
from models.hunyuan_image3.resolutions import resolution_table
from models.hunyuan_image3.tiny import tiny_config
from models.hunyuan_image3.vae import HunyuanVAE, VAEConfig
from tests.support.golden import GoldenCase, discover_ti2i_cases

ENCODE_KEYS = ("cond_vae_resized_uint8", "cond_vae_posterior_mean", "cond_vae_posterior_logvar",
               "cond_vae_sample_noise", "cond_vae_latent")


def _cases():
    cases = discover_ti2i_cases()
    if not cases:
        reason = "no TI2I golden case under ../shared/golden-ti2i or DTGEN_GOLDEN_TI2I_DIRS"
        return [pytest.param(None, id="no-golden", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(c, id=c.name) for c in cases]


def _config(case: Path) -> dict:
    return json.loads((case / "config.json").read_text())


def _vae_weights(case: Path) -> dict[str, torch.Tensor]:
    """Every ``vae.*`` tensor of the case's shards, prefix stripped, float32."""
    weight_map = json.loads((case / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {}
    for shard in sorted({f for k, f in weight_map.items() if k.startswith("vae.")}):
        with safe_open(case / shard, "pt") as f:
            for key in f.keys():
                if key.startswith("vae."):
                    weights[key.removeprefix("vae.")] = f.get_tensor(key).float()
    return weights


@lru_cache(maxsize=None)
def _golden(case: Path) -> GoldenCase:
    return GoldenCase(case)


@lru_cache(maxsize=None)
def _vae(case: Path) -> HunyuanVAE:
    with torch.device("meta"):
        vae = HunyuanVAE(VAEConfig.from_dict(_config(case)["vae"]), with_encoder=True)
    vae.load_state_dict(_vae_weights(case), strict=True, assign=True)
    return vae.eval()


def _sample_seed(g: GoldenCase) -> int:
    inputs = g.meta.get("conditioning", {}).get("inputs", {})
    seed = inputs.get("cond_vae_sample_seed", g.meta.get("seeds", {}).get("cond_vae_sample"))
    if seed is None:
        pytest.skip("golden.json names no condition-latent seed")
    return int(seed)


@lru_cache(maxsize=None)
@torch.no_grad()
def _encoded(case: Path):
    # One encode per case, shared by the tests that check its pieces (the encoder is the
    # slow part of this file on CPU).
    g = _golden(case)
    pixels = vae_pixels(_rgb_image(g.t["cond_vae_resized_uint8"]))
    return _vae(case).encode(pixels, torch.Generator("cpu").manual_seed(_sample_seed(g)))


def _check(g: GoldenCase, name: str, ours: torch.Tensor):
    result = g.check(name, ours, g.t[name])
    print(f"{name}: max abs deviation {result.max_abs:.3e}")
    assert result.ok, f"{name}: max abs {result.max_abs:.3e} outside the case's tolerance (rtol {g.rtol}, atol {g.atol})"


def _rgb_image(u8: torch.Tensor) -> Image.Image:
    """uint8 [H, W, 3] -> PIL RGB image."""
    return Image.frombytes("RGB", (u8.shape[1], u8.shape[0]), bytes(u8.contiguous().flatten().tolist()))


def _needs(g: GoldenCase, *names: str):
    if not g.has(*names):
        pytest.skip(f"case has no {', '.join(n for n in names if n not in g.t)}")


# --- reference image -> VAE pixels ---------------------------------------------------------

@pytest.mark.parametrize("case", _cases())
def test_resized_crop_matches_golden(case, tmp_path):
    """PNG on disk -> load -> bucket -> LANCZOS cover + centre crop: the golden uint8 crop, exactly."""
    g = _golden(case)
    _needs(g, "ref_image_uint8", "cond_vae_resized_uint8")
    ref = g.t["ref_image_uint8"]
    path = tmp_path / "reference.png"
    _rgb_image(ref).save(path)

    image = load_reference_image(path)
    assert image.size == (ref.shape[1], ref.shape[0])
    expected = g.t["cond_vae_resized_uint8"]
    bucket = vae_bucket(image.height, image.width, int(_config(case)["image_base_size"]))
    assert bucket == tuple(expected.shape[:2])
    crop = resize_and_crop(image, bucket)
    ours = torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8).view(crop.height, crop.width, 3)
    assert torch.equal(ours, expected), f"{int((ours != expected).sum())} bytes differ"


@pytest.mark.parametrize("case", _cases())
def test_vae_pixels_rule(case):
    """(u8/255 - 0.5)/0.5 in float32, CHW: the pixels the official VAE saw."""
    g = _golden(case)
    _needs(g, "cond_vae_resized_uint8")
    u8 = g.t["cond_vae_resized_uint8"]
    pixels = vae_pixels(_rgb_image(u8))
    assert pixels.dtype == torch.float32 and pixels.shape == (1, 3, *u8.shape[:2])
    assert torch.equal(pixels[0], (u8.permute(2, 0, 1).float() / 255 - 0.5) / 0.5)
    assert pixels.min() >= -1 and pixels.max() <= 1


def test_bucket_is_the_nearest_ratio():
    table = resolution_table(256)
    for h, w in table:  # every bucket is its own nearest
        assert vae_bucket(h, w, 256) == (h, w)
    assert vae_bucket(64, 64, 256) == (256, 256)
    assert vae_bucket(100, 1000, 256) == (128, 512)  # beyond the table: the widest bucket
    assert vae_bucket(1000, 100, 256) == (512, 128)
    with pytest.raises(ValueError, match="positive"):
        vae_bucket(0, 10, 256)


@pytest.mark.parametrize("size", [(64, 64), (100, 60), (60, 100), (37, 200), (333, 17)])
def test_resize_and_crop_gives_the_bucket(size):
    image = Image.new("RGB", size, (10, 20, 30))
    bucket = vae_bucket(size[1], size[0], 256)
    out = resize_and_crop(image, bucket)
    assert (out.height, out.width) == bucket


# --- encoder --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _cases())
def test_posterior_matches_golden(case):
    g = _golden(case)
    _needs(g, *ENCODE_KEYS)
    encoded = _encoded(case)
    _check(g, "cond_vae_posterior_mean", encoded.mean)
    _check(g, "cond_vae_posterior_logvar", encoded.logvar)


@pytest.mark.parametrize("case", _cases())
def test_row_chunked_encode_matches_golden_and_the_whole_encode(case, monkeypatch):
    """encode(row_chunks=N) (--vae-chunks on an edit: the encoder's ResnetBlocks a slab of
    rows at a time, the TI2I condition's memory peak) meets the same golden tolerance and
    equals the whole encode to float32 summation order, for uneven slabs."""
    import models.hunyuan_image3.vae as vae_module
    g = _golden(case)
    _needs(g, *ENCODE_KEYS)
    pixels = vae_pixels(_rgb_image(g.t["cond_vae_resized_uint8"]))
    vae = _vae(case)
    slabbed = []
    monkeypatch.setattr(vae_module, "norm_silu_conv_rows", lambda *a, **k: slabbed.append(1) or
                        vae_module.norm_silu_conv_rows_with(a[0], a[1], a[1].statistics(a[0]), *a[2:], **k))
    with torch.no_grad():   # as the pipeline runs (the slabs write the residual in place)
        chunked = vae.encode(pixels, torch.Generator("cpu").manual_seed(_sample_seed(g)), row_chunks=3)
    assert len(slabbed) == 2 * (sum(len(level.block) for level in vae.encoder.down) + 2)   # every block slabbed
    whole = _encoded(case)
    _check(g, "cond_vae_posterior_mean", chunked.mean)
    _check(g, "cond_vae_latent", chunked.latent)
    # float32 summation order: the slabs' convolutions and group norms sum in another order.
    # Measured: 1.48e-5 at most on an AMD EPYC CPU (oneDNN's kernels there), under 1e-5
    # elsewhere; the mean reaches 8.6, so 3e-5 is 3.5e-6 of its scale, a few float32 ulps.
    torch.testing.assert_close(chunked.mean, whole.mean, rtol=1e-5, atol=3e-5)
    torch.testing.assert_close(chunked.logvar, whole.logvar, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("case", _cases())
def test_sample_noise_and_latent_match_golden(case):
    g = _golden(case)
    _needs(g, *ENCODE_KEYS)
    encoded = _encoded(case)
    # The draw itself is exact: same generator, same shape, drawn on the CPU.
    assert torch.equal(encoded.noise, g.t["cond_vae_sample_noise"])
    _check(g, "cond_vae_sample_noise", encoded.noise)
    _check(g, "cond_vae_latent", encoded.latent)
    # The latent is the SAMPLE (mean + std * eps) scaled, not the mean.
    scale = _vae(case).cfg.scaling_factor
    assert torch.equal(encoded.latent, (encoded.mean + torch.exp(0.5 * encoded.logvar) * encoded.noise) * scale)
    assert (encoded.latent - encoded.mean * scale).abs().max() > 1e-2


@pytest.mark.parametrize("case", _cases())
def test_encoder_layout_matches_checkpoint(case):
    """state_dict keys = the checkpoint's vae.* keys; the DCAE downsamplers have the widths the
    temporal rule implies (levels that also halve time convolve to C_out/8, others C_out/4)."""
    weight_map = json.loads((case / "model.safetensors.index.json").read_text())["weight_map"]
    vae = _vae(case)
    assert set(vae.state_dict()) == {k.removeprefix("vae.") for k in weight_map if k.startswith("vae.")}
    cfg = vae.cfg
    n_spatial = cfg.ffactor_spatial.bit_length() - 1
    n_temporal = cfg.ffactor_temporal.bit_length() - 1
    for i, level in enumerate(vae.encoder.down):
        if i >= n_spatial:
            assert level.downsample is None
            continue
        temporal = i >= n_spatial - n_temporal
        out = cfg.block_out_channels[i + 1]
        assert level.downsample.rt == (2 if temporal else 1)
        assert level.downsample.conv.weight.shape[0] == out // (8 if temporal else 4)


def test_encode_rejects_bad_pixels():
    """Needs no golden data: the tiny default's VAE (with its encoder), random weights."""
    vae = HunyuanVAE(VAEConfig.from_dict(tiny_config()["vae"]), with_encoder=True)
    f = vae.cfg.ffactor_spatial
    for shape, what in [((3, 2 * f, 2 * f), "got shape"), ((1, 4, 2 * f, 2 * f), "got shape"),
                        ((1, 3, 2 * f + 1, 2 * f), "multiples of ffactor_spatial")]:
        with pytest.raises(ValueError, match=what) as err:
            vae.encode(torch.zeros(shape))
        assert "\n" not in str(err.value)


# --- decoder with this case's widths --------------------------------------------------------

@pytest.mark.parametrize("case", _cases())
@torch.no_grad()
def test_decoder_matches_golden(case):
    g = _golden(case)
    _needs(g, "vae_latent_in", "vae_decoded")
    _check(g, "vae_decoded", _vae(case).decode(g.t["vae_latent_in"]))


# --- text-to-image configs stay decoder-only --------------------------------------------------

def test_t2i_config_builds_decoder_only():
    """Needs no golden data: the tiny default's VAE section as a text-to-image checkpoint
    ships it (`only_decoder: true`, the released T2I config's value)."""
    cfg = VAEConfig.from_dict({**tiny_config()["vae"], "only_decoder": True})
    with torch.device("meta"):
        vae = HunyuanVAE(cfg)
    assert vae.encoder is None and list(dict(vae.named_children())) == ["decoder"]
    assert all(k.startswith("decoder.") for k in vae.state_dict())
    with pytest.raises(ValueError, match="no encoder.*only_decoder=true") as err:
        vae.encode(torch.zeros(1, 3, 16, 16))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="only_decoder=true: this checkpoint has no VAE encoder"):
        HunyuanVAE(cfg, with_encoder=True)


def test_only_decoder_defaults_to_true():
    cfg = VAEConfig.from_dict({"block_out_channels": [32, 64], "layers_per_block": 1, "latent_channels": 32,
                               "out_channels": 3, "ffactor_spatial": 2, "ffactor_temporal": 1,
                               "scaling_factor": 1.0})
    assert cfg.only_decoder and cfg.in_channels == 3 and cfg.downsample_match_channel


# --- load_reference_image -------------------------------------------------------------------

def _save(tmp_path: Path, name: str, image: Image.Image, **kwargs) -> Path:
    path = tmp_path / name
    image.save(path, **kwargs)
    return path


def _one_line_error(path: Path, *fragments: str) -> str:
    with pytest.raises(ValueError) as err:
        load_reference_image(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


def test_load_rejects_missing_and_non_files(tmp_path):
    _one_line_error(tmp_path / "absent.png", "no such file")
    _one_line_error(tmp_path, "not a file")


def test_load_rejects_unreadable_files(tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"this is not an image\n" * 10)
    _one_line_error(garbage, "not a readable image")
    good = _save(tmp_path, "good.png", Image.effect_noise((64, 64), 40).convert("RGB"))
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:200])
    _one_line_error(truncated, "not a readable image")


def test_load_rejects_sizes_outside_the_limits(tmp_path):
    _one_line_error(_save(tmp_path, "small.png", Image.new("RGB", (MIN_SIDE - 1, 64))),
                    "too small", f"MIN_SIDE={MIN_SIDE}")
    _one_line_error(_save(tmp_path, "large.png", Image.new("L", (MAX_SIDE + 1, MIN_SIDE))),
                    "too large", f"MAX_SIDE={MAX_SIDE}")


@pytest.mark.parametrize("mode, suffix", [("I;16", ".png"), ("I", ".tiff"), ("F", ".tiff"), ("CMYK", ".jpg")])
def test_load_rejects_modes_without_a_faithful_rgb(tmp_path, mode, suffix):
    path = _save(tmp_path, f"image{suffix}", Image.new(mode, (32, 32)))
    with Image.open(path) as check:
        stored = check.mode
    _one_line_error(path, f"mode {stored!r} is not supported")


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA"])
def test_load_converts_plain_modes_to_rgb(tmp_path, mode):
    source = Image.effect_noise((40, 24), 60).convert(mode)
    path = _save(tmp_path, "image.png", source)
    image = load_reference_image(path)
    assert image.mode == "RGB" and image.size == (40, 24)
    # Alpha is dropped, not composited: the official loader's convert("RGB").
    assert image.tobytes() == source.convert("RGB").tobytes()


def test_load_applies_exif_orientation(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: stored 40x24, shown 24x40
    path = _save(tmp_path, "rotated.jpg", Image.new("RGB", (40, 24), (200, 10, 10)), exif=exif)
    assert load_reference_image(path).size == (24, 40)


@pytest.mark.parametrize("case", _cases())
def test_magnitude_scaled_tolerance_still_catches_a_small_error(case):
    """The encoder outputs' atol follows their magnitude (tests/support/golden.py says why);
    an error of 3e-4 of each value, far below what a wrong padding or eps gives, still fails."""
    g = _golden(case)
    _needs(g, *ENCODE_KEYS)
    for name in ("cond_vae_posterior_mean", "cond_vae_posterior_logvar", "cond_vae_latent"):
        gold = g.t[name]
        assert g.check(name, gold.clone(), gold).ok
        assert not g.check(name, gold * (1 + 3e-4) + 3e-4, gold).ok, name
