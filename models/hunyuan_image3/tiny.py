"""The embedded tiny default: a small random HunyuanImage-3 written as an official checkpoint.

The example runs on it when no `--checkpoint` is given. The weights are written once, as
sharded safetensors with `model.safetensors.index.json` and official key names, into a
cache folder, so the real loader path always runs. The shape admits every shipped plan
(8 KV heads: TP8 AR; 16 query heads: TP2 x SP4 Ulysses).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from dtgen.caches import cache_root, write_folder_once
from dtgen.plan import Rule

from .config import HunyuanImage3Config
from .loading import build_on_meta, param_specs

TINY_VERSION = 2  # 2: the image-editing modules (VAE encoder, vision tower, aligner)
_RATIO_BASE = 256


def tiny_config(layers: int = 2) -> dict:
    """Official config.json fields, tiny values; special ids sit above the byte range."""
    specials = {f"<img_ratio_{k}>": 448 + k for k in range(37)}
    specials.update({"<img_size_256>": 485, "<boi>": 486, "<eoi>": 487, "<img>": 488, "<cfg>": 489,
                     "<timestep>": 490, "<guidance>": 491, "<timestep_r>": 492, "<joint_img_sep>": 493,
                     "<|startoftext|>": 494, "<|endoftext|>": 495, "<pad>": 496,
                     # the Instruct template's (image editing)
                     "<think>": 497, "</think>": 498, "<recaption>": 499, "</recaption>": 500,
                     "<answer>": 501, "</answer>": 502})
    return {
        "architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
        "hidden_size": 256, "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8,
        "attention_head_dim": 16, "head_dim": 16, "vocab_size": 512, "num_experts": 8,
        "moe_topk": [2] * layers, "moe_intermediate_size": [64] * layers, "intermediate_size": 64,
        "num_shared_expert": [1] * layers, "use_mixed_mlp_moe": True, "moe_layer_num_skipped": 0,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "use_qk_norm": True, "rope_type": "2d",
        "rope_theta": 10000.0, "rope_scaling": {"type": "custom", "factor": 1.0}, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "patch_embed_hidden_dim": 64, "patch_size": 1, "img_proj_type": "unet",
        "image_base_size": _RATIO_BASE, "vae_downsample_factor": [16, 16], "vae_dtype": "float32",
        # The encoder needs the last width to be a multiple of 2 * latent_channels.
        "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [32, 32, 32, 32, 64],
                "layers_per_block": 2, "latent_channels": 32, "in_channels": 3, "out_channels": 3,
                "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
                "upsample_match_channel": True, "only_decoder": False, "scaling_factor": 0.562679178327931,
                "shift_factor": None},
        # Image editing: a small SigLIP2-style tower (the released one is so400m), its aligner
        # and the naflex processor's settings.
        "vit": {"model_type": "siglip2_vision_model", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_channels": 3, "patch_size": 16,
                "num_patches": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 64, "n_embed": 256, "depth": 2},
        "vit_processor": {"image_processor_type": "Siglip2ImageProcessorFast", "resample": 2,
                          "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                          "patch_size": 16, "max_num_patches": 64},
        "bos_token_id": 494, "eos_token_id": 495, "pad_token_id": 496, "image_token_id": 488,
        "im_start_id": 486, "im_end_id": 487, "cfg_distilled": False, "use_meanflow": False,
        "tiny_special_token_ids": specials,
    }


def _init(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Same recipe as the golden fixtures: every path contributes, nothing explodes."""
    if key.endswith("weight") and len(shape) == 1:  # RMSNorm / GroupNorm scales
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if key.endswith("bias"):
        return 0.02 * torch.randn(shape, generator=g)
    if len(shape) >= 3:  # convolutions
        std = min(0.05, 1 / math.sqrt(math.prod(shape[1:])))
        return std * torch.randn(shape, generator=g)
    return 0.05 * torch.randn(shape, generator=g)


def write_random_checkpoint(folder: Path, config: dict, seed: int = 1234, shards: int = 2) -> None:
    """Random bf16 weights under the official names, as `shards` safetensors files plus the index."""
    cfg = HunyuanImage3Config.from_dict(config)
    # With the image-editing modules when the config has them (their keys are official too).
    model = build_on_meta(cfg, image_editing=bool(config.get("vit")) and not config["vae"].get("only_decoder", True))
    specs = param_specs(model, {n: Rule.REPLICATE for n, _ in model.named_parameters()}, torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in specs.values():
        for key in spec.keys:
            tensors[key] = _init(key, spec.official_shape, g).to(torch.bfloat16)
    keys = sorted(tensors)
    per = -(-len(keys) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's checkpoint folder, written on first use (atomically: a temporary
    folder renamed into place, so an interrupted run leaves nothing half-written)."""
    root = Path(root) if root is not None else cache_root()
    return write_folder_once(root / f"tiny-hunyuan-image3-v{TINY_VERSION}", "model.safetensors.index.json",
                             lambda folder: write_random_checkpoint(folder, tiny_config()))
