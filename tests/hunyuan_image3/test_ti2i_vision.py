"""The ViT half of the TI2I condition (SigLIP2 tower, aligner, naflex processor).

Golden checks run on every TI2I case found by `discover_ti2i_cases()` (../shared/golden-ti2i
and $DTGEN_GOLDEN_TI2I_DIRS) whose `golden.safetensors` holds the ViT tensors; the weights
come straight from the case's checkpoint shards (`vision_model.*`, `vision_aligner.*`,
bf16 upcast to float32, which is exact). The other tests need no case.
"""
import json
from pathlib import Path

import pytest
import torch

from dtgen.checkpoint import CheckpointReader
from models.hunyuan_image3.vision import (AlignerConfig, VisionAligner, VisionConfig, VisionProcessorConfig,
                                          VisionTransformer, target_size_for_max_patches, vit_inputs)
from tests.support.golden import GoldenCase, case_has_tensors, discover_ti2i_cases

PROCESSOR_KEYS = ("cond_vit_pixel_values", "cond_vit_pixel_attention_mask", "cond_vit_spatial_shapes")
TOWER_KEYS = ("cond_vit_embeddings", "cond_vit_last_hidden_state", "cond_vit_aligned")

# The tiny case's dicts, for the tests that need no golden case.
TINY_VIT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_channels": 3, "patch_size": 16, "num_patches": 9, "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-06}
TINY_ALIGNER = {"projector_type": "mlp_gelu", "input_dim": 64, "n_embed": 256, "depth": 2}
TINY_PROCESSOR = {"resample": 2, "rescale_factor": 0.00392156862745098, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "patch_size": 16, "max_num_patches": 20}




def _vit_cases():
    cases = [c for c in discover_ti2i_cases() if case_has_tensors(c, ("ref_image_uint8",) + PROCESSOR_KEYS + TOWER_KEYS)]
    if not cases:
        reason = "no TI2I golden case with ViT tensors (../shared/golden-ti2i or DTGEN_GOLDEN_TI2I_DIRS)"
        return [pytest.param(None, id="no-golden", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(c, id=c.name) for c in cases]


def _load_prefix(module: torch.nn.Module, reader: CheckpointReader, prefix: str) -> None:
    weights = {k.removeprefix(prefix): reader.read(k).float() for k in reader.keys() if k.startswith(prefix)}
    module.load_state_dict(weights, strict=True)


_LOADED: dict[Path, tuple] = {}


def _load_case(folder: Path):
    """(GoldenCase, official config dict, tower, aligner) with the case's weights, cached per folder."""
    if folder not in _LOADED:
        config = json.loads((folder / "config.json").read_text())
        reader = CheckpointReader(folder)
        tower = VisionTransformer(VisionConfig.from_dict(config["vit"])).eval()
        aligner = VisionAligner(AlignerConfig.from_dict(config["vit_aligner"])).eval()
        _load_prefix(tower, reader, "vision_model.")
        _load_prefix(aligner, reader, "vision_aligner.")
        _LOADED[folder] = (GoldenCase(folder), config, tower, aligner)
    return _LOADED[folder]


@pytest.mark.parametrize("folder", _vit_cases())
def test_processor_matches_golden_exactly(folder):
    case, config, _, _ = _load_case(folder)
    ours = VisionProcessorConfig.from_dict(config["vit_processor"])(case.t["ref_image_uint8"])
    for name, tensor in zip(PROCESSOR_KEYS, ours):
        check = case.exact(name, tensor, case.t[name])
        assert check.ok and tensor.dtype == case.t[name].dtype, f"{name}: {check.detail or tensor.dtype}"


@pytest.mark.parametrize("folder", _vit_cases())
@torch.no_grad()
def test_tower_and_aligner_match_golden(folder):
    case, _, tower, aligner = _load_case(folder)
    t = case.t
    inputs = (t["cond_vit_pixel_values"], t["cond_vit_pixel_attention_mask"], t["cond_vit_spatial_shapes"])
    hidden = tower(*inputs)
    ours = {"cond_vit_embeddings": tower.embeddings(inputs[0], inputs[2]),
            "cond_vit_last_hidden_state": hidden,
            "cond_vit_aligned": aligner(hidden)}
    failed = [f"{c.name} max abs {c.max_abs:.2e}" for c in (case.check(n, ours[n], t[n]) for n in TOWER_KEYS)
              if not c.ok]
    assert not failed, f"outside rtol {case.rtol} / atol {case.atol}: {failed}"


# The bisection's result worked by hand for p = 16, at most 20 patches: 37x90 fits 3x6 = 18
# patches up to scale 96/90 (one more column makes 3x7 = 21); 300x20 fits 15x1 up to scale
# 0.8 (past it the width needs 2 columns and the height 16 rows).
ODD_SHAPES = [((37, 90), (48, 96)), ((300, 20), (240, 16))]


@pytest.mark.parametrize("size,expected_target", ODD_SHAPES, ids=["37x90", "300x20"])
def test_processor_odd_shapes(size, expected_target):
    proc = VisionProcessorConfig.from_dict(TINY_PROCESSOR)
    p, limit = proc.patch_size, proc.max_num_patches
    assert target_size_for_max_patches(*size, p, limit) == expected_target

    # One constant colour per channel: the bilinear resize keeps it, so every real row must be
    # exactly (u8 - 127.5) / 127.5 per channel, channel fastest.
    colour = torch.tensor([10, 128, 250], dtype=torch.uint8)
    pixels, mask, shapes = proc(colour.expand(*size, 3).contiguous())
    rows, cols = shapes[0].tolist()
    real = rows * cols
    assert (rows * p, cols * p) == expected_target and 1 <= real <= limit
    assert pixels.shape == (1, limit, 3 * p * p) and pixels.dtype == torch.float32
    assert mask.dtype == torch.int64 and shapes.dtype == torch.int64
    assert mask[0].tolist() == [1] * real + [0] * (limit - real)
    expected_row = ((colour.float() - 127.5) / 127.5).repeat(p * p)
    assert torch.equal(pixels[0, :real], expected_row.expand(real, -1))
    assert not pixels[0, real:].any()

    # A random image: real rows hold (u8 - 127.5) / 127.5 values of some uint8 image.
    noise = torch.randint(0, 256, (*size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pixels, mask2, shapes2 = vit_inputs(noise, p, limit)
    assert torch.equal(mask2, mask) and torch.equal(shapes2, shapes)
    levels = pixels[0, :real] * 127.5 + 127.5
    assert torch.equal(levels, levels.round()) and levels.min() >= 0 and levels.max() <= 255
    assert not pixels[0, real:].any()


@torch.no_grad()
def test_padding_keys_are_masked_and_images_batch_independently():
    torch.manual_seed(0)
    tower = VisionTransformer(VisionConfig.from_dict(TINY_VIT)).eval()
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (*size, 3), dtype=torch.uint8, generator=gen) for size, _ in ODD_SHAPES]
    inputs = [vit_inputs(image, 16, 20) for image in images]
    alone = [tower(*x) for x in inputs]
    batched = tower(*(torch.cat(parts) for parts in zip(*inputs)))
    for i, out in enumerate(alone):
        assert torch.allclose(batched[i], out[0], rtol=1e-5, atol=1e-6)

    # Padding rows are computed (they are tokens downstream) but no real row may see them.
    pixels, mask, shapes = inputs[0]
    real = int(mask.sum())
    noisy = pixels.clone()
    noisy[0, real:] = torch.randn(noisy.shape[1] - real, noisy.shape[2], generator=gen)
    out = tower(noisy, mask, shapes)
    assert torch.allclose(out[0, :real], alone[0][0, :real], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all() and not torch.allclose(out[0, real:], alone[0][0, real:])


@pytest.mark.parametrize("build,bad,field", [
    (VisionConfig, {**TINY_VIT, "hidden_act": "relu"}, "hidden_act"),
    (VisionConfig, {k: v for k, v in TINY_VIT.items() if k != "num_patches"}, "num_patches"),
    (VisionConfig, {**TINY_VIT, "num_patches": 10}, "num_patches"),
    (AlignerConfig, {**TINY_ALIGNER, "projector_type": "linear"}, "projector_type"),
    (AlignerConfig, {**TINY_ALIGNER, "depth": 3}, "depth"),
    (VisionProcessorConfig, {**TINY_PROCESSOR, "resample": 3}, "resample"),
    (VisionProcessorConfig, {k: v for k, v in TINY_PROCESSOR.items() if k != "max_num_patches"}, "max_num_patches"),
], ids=["vit-hidden_act", "vit-missing", "vit-nonsquare-table", "aligner-type", "aligner-depth",
        "processor-resample", "processor-missing"])
def test_bad_config_is_one_line_naming_the_field(build, bad, field):
    with pytest.raises(ValueError) as err:
        build.from_dict(bad)
    message = str(err.value)
    assert field in message and "\n" not in message, message


def test_bad_image_is_one_line():
    with pytest.raises(ValueError, match=r"uint8 \[H, W, C\].*float32 \[8, 8, 3\]"):
        vit_inputs(torch.zeros(8, 8, 3), 16, 20)
