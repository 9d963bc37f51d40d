"""The embedded tiny default: a small random Qwen-Image written as a diffusers-format folder.

`python -m examples.qwen_t2i` runs on it when no `--checkpoint` is given. The layout is the
released Qwen/Qwen-Image repo's (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`
(a Qwen2.5-VL config, the language model's weights), `tokenizer/` (vocab.json + merges.txt +
tokenizer_config.json, byte-level BPE), `scheduler/`), so the real loader path runs, and
diffusers / transformers load the same folder (the parity tests do). The shapes admit every
shipped plan: 4 heads (TP2, Ulysses 2), 2 KV heads in the text encoder (TP2).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dtgen.caches import cache_root, write_folder_once
from dtgen.tiny import component_tensors

TINY_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ("t h", "th e", "Ġ t", "Ġ a", "Ġt h", "Ġth e", "i n", "o n", "Ġ o", "Ġ s", "e r", "a n", "r e", "Ġ c",
           "Ġ d", "a t", "e s", "o r", "Ġ f", "Ġa n", "Ġan d")
VOCAB_SIZE = 320     # the byte alphabet, the merges, the special tokens, and spare rows


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
        "vae": {
            "_class_name": "AutoencoderKLQwenImage", "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 1, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0},
        # Qwen/Qwen-Image's scheduler_config.json values.
        "scheduler": {
            "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
            "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
            "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
            "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
            "use_karras_sigmas": False},
    }


MODEL_INDEX = {
    "_class_name": "QwenImagePipeline", "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable stand-ins of the byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(folder: Path) -> None:
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    for m in _MERGES:
        vocab["".join(m.split())] = len(vocab)
    added = {str(len(vocab) + i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                   "rstrip": False, "single_word": False} for i, t in enumerate(SPECIAL_TOKENS)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(_MERGES) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
         "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 131072,
         "errors": "replace", "clean_up_tokenization_spaces": False}, indent=1))


def write_random_checkpoint(folder: Path, seed: int = 1234, overrides: dict | None = None,
                            dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """Random weights under the diffusers / transformers names, one folder per component.
    `overrides`: per component, config values replacing the tiny ones (the benchmark's shapes)."""
    from .model import QwenImageConfigs, QwenImageT2I   # the module tree gives every name and shape

    configs = tiny_configs()
    for component, values in (overrides or {}).items():
        configs[component].update(values)
    files = {"transformer": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
             "text_encoder": "model.safetensors"}
    for component in (*files, "scheduler"):
        (folder / component).mkdir(parents=True, exist_ok=True)
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        (folder / component / name).write_text(json.dumps(configs[component], indent=1))
    write_tokenizer(folder / "tokenizer")
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=1))
    with torch.device("meta"):
        model = QwenImageT2I(QwenImageConfigs.from_folder(folder))
    g = torch.Generator(device).manual_seed(seed)
    tensors = component_tensors(model, g, dtype)
    for component, file in files.items():
        save_file(tensors[component], str(folder / component / file), metadata={"format": "pt"})


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The tiny default's folder, written once (atomically: a temporary folder renamed into place)."""
    root = Path(root) if root is not None else cache_root()
    return write_folder_once(root / f"tiny-qwen-image-v{TINY_VERSION}", "model_index.json", write_random_checkpoint)
