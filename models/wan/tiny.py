"""The embedded tiny default: a small random Wan text-to-video model written as a diffusers-format folder.

`python -m examples.wan_t2v` runs on it when no `--checkpoint` is given. It is written once into
the cache folder, in the layout of the published Wan 2.1 diffusers repos (`model_index.json`,
`transformer/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`), so the real loader path
always runs, and diffusers itself can load the same folder (the parity tests do). The shape
admits every shipped plan: 4 heads (Ulysses 4), 16 latent channels.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dtgen.tiny import ensure_tiny_folder, model_index, with_overrides, write_diffusers_folder
from dtgen.tiny import write_t5_tokenizer as write_tokenizer

TINY_VERSION = 1


def tiny_configs() -> dict[str, dict]:
    """Every component's config.json (diffusers / transformers field names), tiny values."""
    return {
        "text_encoder": {
            "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 128, "d_model": 32,
            "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 16, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu",
            "dense_act_fn": "gelu_new", "is_gated_act": True, "pad_token_id": 0, "eos_token_id": 1,
            "decoder_start_token_id": 0, "tie_word_embeddings": False},
        "transformer": {
            "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 4,
            "attention_head_dim": 16, "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32,
            "ffn_dim": 128, "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024},
        "vae": {
            "_class_name": "AutoencoderKLWan", "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 1, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0},
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


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's folder, written on first use."""
    return ensure_tiny_folder(f"tiny-wan-t2v-v{TINY_VERSION}", write_random_checkpoint, root)
