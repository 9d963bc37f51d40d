"""The embedded tiny default: a small random Qwen-Image written as a diffusers-format folder.

`python -m examples.qwen_t2i` runs on it when no `--checkpoint` is given. The layout is the
released Qwen/Qwen-Image repo's (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`
(a Qwen2.5-VL config, the language model's weights), `tokenizer/` (vocab.json + merges.txt +
tokenizer_config.json, byte-level BPE), `scheduler/`), so the real loader path runs, and
diffusers / transformers load the same folder (the parity tests do). The shapes admit every
shipped plan: 4 heads (TP2, Ulysses 2), 2 KV heads in the text encoder (TP2).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dtgen.tiny import (ensure_tiny_folder, model_index, tiny_wan_vae, with_overrides, write_diffusers_folder,
                        write_qwen2_tokenizer)

TINY_VERSION = 1
VOCAB_SIZE = 320     # the tokenizer's byte alphabet, merges and special tokens, and spare rows


def tiny_configs() -> dict[str, dict]:
    return {
        "text_encoder": {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "tie_word_embeddings": False,
            "text_config": {"model_type": "qwen2_5_vl_text", "vocab_size": VOCAB_SIZE, "hidden_size": 32,
                            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                            "max_position_embeddings": 2048, "bos_token_id": 256, "eos_token_id": 258,
                            "rope_parameters": {"rope_type": "default", "type": "mrope", "rope_theta": 1000000.0,
                                                "mrope_section": [1, 1, 2]}},
            "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": 1, "hidden_size": 16,
                              "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                              "fullatt_block_indexes": [0], "window_size": 16, "patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2}},
        "transformer": {
            "_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64, "out_channels": 16,
            "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4, "joint_attention_dim": 32,
            "guidance_embeds": False, "axes_dims_rope": [4, 6, 6]},
        "vae": tiny_wan_vae("AutoencoderKLQwenImage"),
        # Qwen/Qwen-Image's scheduler_config.json values.
        "scheduler": {
            "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
            "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
            "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
            "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
            "use_karras_sigmas": False},
    }


def write_random_checkpoint(folder: Path, seed: int = 1234, overrides: dict | None = None,
                            dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """Random weights under the diffusers / transformers names, one folder per component
    (dtgen.tiny.write_diffusers_folder). `overrides`: per component, config values replacing the
    tiny ones (the benchmark's shapes)."""
    from .model import QwenImageConfigs, QwenImageT2I   # the module tree gives every name and shape

    configs = tiny_configs()
    write_diffusers_folder(folder, model_index("QwenImagePipeline", configs, "Qwen2Tokenizer"),
                           with_overrides(configs, overrides),
                           lambda written: QwenImageT2I(QwenImageConfigs.from_folder(written)), write_qwen2_tokenizer,
                           seed, dtype, device)


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's folder, written on first use."""
    return ensure_tiny_folder(f"tiny-qwen-image-v{TINY_VERSION}", write_random_checkpoint, root)
