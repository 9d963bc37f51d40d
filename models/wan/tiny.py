"""The embedded tiny default: a small random Wan text-to-video model written as a diffusers-format folder.

`python -m examples.wan_t2v` runs on it when no `--checkpoint` is given. It is written once into
the cache folder, in the layout of the published Wan 2.1 diffusers repos (`model_index.json`,
`transformer/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`), so the real loader path
always runs, and diffusers itself can load the same folder (the parity tests do). The shape
admits every shipped plan: 4 heads (Ulysses 4), 16 latent channels.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dtgen.caches import cache_root, write_folder_once
from dtgen.tiny import component_tensors

TINY_VERSION = 1
_WORDS = ("a", "an", "the", "cat", "dog", "fox", "bird", "runs", "walks", "flies", "jumps", "on", "in", "over",
          "grass", "snow", "sky", "water", "red", "blue", "big", "small", "slowly", "quickly", "lighthouse",
          "sea", "at", "night", "day", "blurry", "low", "quality")


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


MODEL_INDEX = {
    "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}


def write_tokenizer(folder: Path) -> None:
    """A T5-shaped tokenizer.json (Unigram, Metaspace, "$A </s>"): pad 0, eos 1, unk 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
             + [("\u2581" + w, -1.0 - 0.01 * i) for i, w in enumerate(_WORDS)]
             + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789,."])
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
         "extra_ids": 0, "additional_special_tokens": [], "model_max_length": 512}))


def write_random_checkpoint(folder: Path, seed: int = 1234, two_experts: bool = False, overrides: dict | None = None,
                            dtype: torch.dtype = torch.float32, device: str = "cpu",
                            scales: dict[str, float] | None = None) -> None:
    """Random weights under the diffusers / transformers names, one folder per component.
    `two_experts`: Wan2.2-A14B's layout, a low-noise `transformer_2` beside the high-noise
    `transformer`, switched at boundary_ratio 0.875 (the A14B T2V value). `overrides`: per
    component, config values that replace the tiny ones (a benchmark at the published DiT
    shapes); `dtype`: of the stored weights; `device`: where they are drawn (a GPU draws a
    billion in a blink; the draws differ from the CPU's); `scales`: factors for the parameters
    whose names ("transformer.blocks.0.ffn...") begin with a key."""
    from dtgen.layers.t5 import UMT5Config
    from dtgen.layers.wan_vae import WanVAEConfig

    from .config import WanTransformerConfig
    from .model import WanConfigs, WanT2V   # the module tree gives every name and shape

    configs = tiny_configs()
    for component, values in (overrides or {}).items():
        configs[component].update(values)
    dit = WanTransformerConfig.from_dict(configs["transformer"])
    cfgs = WanConfigs(UMT5Config.from_dict(configs["text_encoder"]), dit, WanVAEConfig.from_dict(configs["vae"]),
                      dit if two_experts else None, 0.875 if two_experts else None)
    with torch.device("meta"):
        model = WanT2V(cfgs)
    g = torch.Generator(device).manual_seed(seed)
    files = {"transformer": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
             "text_encoder": "model.safetensors"}
    if two_experts:
        files["transformer_2"] = files["transformer"]
        configs["transformer_2"] = configs["transformer"]
    tensors = component_tensors(model, g, dtype, scales)
    for component, file in files.items():
        (folder / component).mkdir(parents=True)
        save_file(tensors[component], str(folder / component / file), metadata={"format": "pt"})
    for component in (*files, "scheduler"):
        (folder / component).mkdir(parents=True, exist_ok=True)
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        (folder / component / name).write_text(json.dumps(configs[component], indent=1))
    write_tokenizer(folder / "tokenizer")
    index = dict(MODEL_INDEX)
    if two_experts:
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's folder, written on first use (atomically: a temporary folder renamed
    into place, so an interrupted run leaves nothing half-written)."""
    root = Path(root) if root is not None else cache_root()
    return write_folder_once(root / f"tiny-wan-t2v-v{TINY_VERSION}", "model_index.json", lambda folder: write_random_checkpoint(folder))
