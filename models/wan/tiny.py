"""The embedded tiny defaults: small random Wan models written as diffusers-format folders.

`python -m examples.wan_t2v` runs on the text-to-video one when no `--checkpoint` is given, and
on the image-to-video one (Wan2.1-I2V's layout) when it is given `--image`. Each is written once
into the cache folder, in the layout of the published diffusers repos (`model_index.json`,
`transformer/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`; image to video also
`image_encoder/` and `image_processor/`, or Wan2.2-I2V-A14B's two experts without them), so the
real loader path always runs, and diffusers itself can load the same folder (the parity tests
do). The shape admits every shipped plan: 4 heads (Ulysses 4), 16 latent channels.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dtgen.tiny import TINY_UMT5, ensure_tiny_folder, model_index, tiny_wan_vae, with_overrides, write_diffusers_folder
from dtgen.tiny import write_t5_tokenizer as write_tokenizer

TINY_VERSION = 1
TINY_I2V_VERSION = 1
# Wan2.2-I2V-A14B's switch (model_index.json's boundary_ratio); its T2V sibling's is 0.875.
I2V_A14B_BOUNDARY = 0.9
# Wan2.1-I2V's image processor (image_processor/preprocessor_config.json), the crop at the tiny tower's size.
TINY_IMAGE_PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 28},
    "resample": 3, "do_center_crop": True, "crop_size": {"height": 28, "width": 28}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def tiny_configs() -> dict[str, dict]:
    """Every component's config.json (diffusers / transformers field names), tiny values."""
    return {
        "text_encoder": dict(TINY_UMT5),
        "transformer": {
            "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 4,
            "attention_head_dim": 16, "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32,
            "ffn_dim": 128, "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024},
        "vae": tiny_wan_vae("AutoencoderKLWan"),
        "scheduler": {
            "_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction", "use_flow_sigmas": True,
            "num_train_timesteps": 1000, "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2",
            "predict_x0": True, "lower_order_final": True, "final_sigmas_type": "zero",
            "timestep_spacing": "linspace"},
    }


def write_random_checkpoint(folder: Path, seed: int = 1234, two_experts: bool = False, overrides: dict | None = None,
                            dtype: torch.dtype = torch.float32, device: str = "cpu",
                            scales: dict[str, float] | None = None) -> None:
    """Random weights under the diffusers / transformers names, one folder per component
    (dtgen.tiny.write_diffusers_folder). `two_experts`: Wan2.2-A14B's layout, a low-noise
    `transformer_2` beside the high-noise `transformer`, switched at boundary_ratio 0.875 (the
    A14B T2V value). `overrides`: per component, config values that replace the tiny ones (a
    benchmark at the published DiT shapes; the experts share theirs); `dtype`: of the stored
    weights; `device`: where they are drawn (a GPU draws a billion in a blink; the draws differ
    from the CPU's); `scales`: factors for the parameters whose names ("transformer.blocks.0.ffn...")
    begin with a key."""
    from .model import WanConfigs, WanT2V   # the module tree gives every name and shape

    configs = tiny_configs()
    if two_experts:
        configs["transformer_2"] = configs["transformer"]
    index = model_index("WanPipeline", configs, "T5TokenizerFast", **({"boundary_ratio": 0.875} if two_experts else {}))
    write_diffusers_folder(folder, index, with_overrides(configs, overrides),
                           lambda written: WanT2V(WanConfigs.from_folder(written)), write_tokenizer,
                           seed, dtype, device, scales)


def i2v_configs(two_experts: bool = False) -> dict[str, dict]:
    """The image-to-video components' configs: the DiT takes 16 noise + 4 mask + 16 condition
    channels; Wan2.1-I2V (one DiT) also a CLIP vision tower whose features its cross-attention
    reads (image_dim, added_kv_proj_dim); Wan2.2-I2V-A14B (two experts) has no image encoder."""
    configs = tiny_configs()
    dit = configs["transformer"]
    dit["in_channels"] = 36
    if two_experts:
        configs["transformer_2"] = dict(dit)
    else:
        dit.update(image_dim=32, added_kv_proj_dim=dit["num_attention_heads"] * dit["attention_head_dim"])
        configs["image_encoder"] = {
            "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "num_channels": 3,
            "image_size": 28, "patch_size": 7, "hidden_act": "gelu", "layer_norm_eps": 1e-5}
    return configs


def write_random_i2v_checkpoint(folder: Path, seed: int = 1234, two_experts: bool = False,
                                overrides: dict | None = None, dtype: torch.dtype = torch.float32,
                                device: str = "cpu", scales: dict[str, float] | None = None) -> None:
    """`write_random_checkpoint`'s image-to-video sibling, WanImageToVideoPipeline's layout:
    Wan2.1-I2V (`image_encoder/`, `image_processor/`, one DiT), or with `two_experts`
    Wan2.2-I2V-A14B (`transformer_2/`, boundary_ratio 0.9, the image components listed as null)."""
    from .model import WanConfigs, WanT2V

    configs = i2v_configs(two_experts)
    extra = ({"boundary_ratio": I2V_A14B_BOUNDARY, "image_encoder": [None, None], "image_processor": [None, None]}
             if two_experts else {"image_processor": ["transformers", "CLIPImageProcessor"]})
    index = model_index("WanImageToVideoPipeline", configs, "T5TokenizerFast", expand_timesteps=False, **extra)
    files = {} if two_experts else {"image_processor/preprocessor_config.json": TINY_IMAGE_PROCESSOR}
    write_diffusers_folder(folder, index, with_overrides(configs, overrides),
                           lambda written: WanT2V(WanConfigs.from_folder(written)), write_tokenizer,
                           seed, dtype, device, scales, files)


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's folder, written on first use."""
    return ensure_tiny_folder(f"tiny-wan-t2v-v{TINY_VERSION}", write_random_checkpoint, root)


def ensure_tiny_i2v_checkpoint(root: Path | None = None) -> Path:
    """The tiny image-to-video default's folder (Wan2.1-I2V's layout), written on first use."""
    return ensure_tiny_folder(f"tiny-wan-i2v-v{TINY_I2V_VERSION}", write_random_i2v_checkpoint, root)
