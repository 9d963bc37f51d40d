"""The CLIP vision tower and its preprocessing (dtgen/layers/clip_vision.py) against transformers'
CLIPVisionModel (hidden_states[-2], what WanImageToVideoPipeline reads) and CLIPImageProcessorPil
(its image processor without torchvision), CPU float32, tiny config."""
import numpy as np
import pytest
import torch
from PIL import Image

from dtgen.layers.clip_vision import CLIPImagePreprocessor, CLIPVisionConfig, CLIPVisionTower

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=3, image_size=28,
            patch_size=7, hidden_act="gelu", layer_norm_eps=1e-5)


def _image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
@torch.no_grad()
def test_penultimate_hidden_state_matches_transformers(act):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**{**TINY, "hidden_act": act})).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = CLIPVisionTower(CLIPVisionConfig.from_dict(ref.config.to_dict())).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not missing and all(k.endswith("position_ids") for k in unexpected)
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    want = ref(pixel_values=x, output_hidden_states=True).hidden_states[-2]
    torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [(40, 30), (30, 52), (28, 28), (97, 61)])
def test_preprocessing_matches_clip_image_processor_pil(size):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    config = {"crop_size": 28, "size": 28, "do_center_crop": True, "do_normalize": True, "do_resize": True,
              "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
              "resample": 3}
    image = _image(*size)
    want = CLIPImageProcessorPil(**config)(images=image, return_tensors="pt")["pixel_values"]
    got = CLIPImagePreprocessor.from_dict(config)(image)
    assert got.shape == want.shape == (1, 3, 28, 28)
    assert (got - want).abs().max().item() < 1e-6


def test_config_refusals_name_the_key():
    for d, key in (({"do_center_crop": False}, "do_center_crop"), ({"size": {"height": 3, "width": 3}}, "size")):
        with pytest.raises(ValueError, match=key):
            CLIPImagePreprocessor.from_dict(d)
    with pytest.raises(ValueError, match="hidden_act"):
        CLIPVisionConfig.from_dict({**TINY, "hidden_act": "relu"})
