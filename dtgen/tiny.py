"""The tiny default checkpoints that models write (and benchmarks, at larger shapes): random
weights, written as a diffusers-format folder, and the tokenizer fixtures those folders hold.

A model's tiny.py keeps its tiny configs (its `model_index.json` follows from them:
`model_index`) and the module tree that names every parameter; `write_diffusers_folder` writes
the folder from them (the real loader reads it,
and diffusers / transformers load the same folder), `ensure_tiny_folder` writes it once into the
cache folder.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

from .caches import cache_root, write_folder_once

# A component's weights file, by the library its model_index.json entry names.
WEIGHTS_FILE = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
# The marker of a complete folder (written with the rest; `write_folder_once` renames the folder into place).
MODEL_INDEX_FILE = "model_index.json"


# Tiny configs of the framework's own blocks (transformers / diffusers field names), for the tiny
# defaults of the models that use them.
TINY_UMT5 = {   # dtgen/layers/t5.py: 4 heads (the text encoder's TP up to 4 ranks)
    "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 128, "d_model": 32,
    "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new", "is_gated_act": True, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0, "tie_word_embeddings": False}


def tiny_wan_vae(class_name: str) -> dict:
    """The Wan 2.1 VAE (dtgen/layers/wan_vae.py) at a tiny width, 16 latent channels, under the
    diffusers class a model's folder names (AutoencoderKLWan, AutoencoderKLQwenImage)."""
    return {"_class_name": class_name, "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
            "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}


def random_weight(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every path contributes, nothing explodes (the Hunyuan tiny default's recipe; at the tiny
    shapes every scale is the 0.05 cap, at the published ones 1 / sqrt(fan-in))."""
    randn = torch.randn(shape, generator=g, device=g.device)
    if key.endswith("weight") and len(shape) == 1:   # norm scales
        return 1 + 0.1 * randn
    if key.endswith("bias"):
        return 0.02 * randn
    return min(0.05, 1 / math.sqrt(math.prod(shape[1:]))) * randn   # linears, convolutions, modulation tables


def component_tensors(model: nn.Module, g: torch.Generator, dtype: torch.dtype,
                      scales: dict[str, float] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """`random_weight` for every parameter of `model` (a tree whose top-level modules are a
    diffusers folder's components), on the CPU in `dtype`, grouped by component under the
    component's own keys. `scales`: factors for the parameters whose full names begin with a key."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        component, _, key = name.partition(".")
        value = random_weight(key, tuple(p.shape), g)
        for prefix, factor in (scales or {}).items():
            if name.startswith(prefix):
                value = value * factor
        tensors.setdefault(component, {})[key] = value.to("cpu", dtype).contiguous()
    return tensors


def with_overrides(configs: dict[str, dict], overrides: dict[str, dict] | None) -> dict[str, dict]:
    """`configs` with, per component, the values of `overrides` replacing its own (a benchmark
    at the published shapes); an unknown component is a KeyError naming it."""
    for component, values in (overrides or {}).items():
        configs[component].update(values)
    return configs


def model_index(pipeline: str, configs: dict[str, dict], tokenizer: str, **extra) -> dict:
    """A diffusers folder's model_index.json: the pipeline class, the tokenizer's transformers
    class, and per component of `configs` its [library, class], read off its config (a
    transformers model's `architectures`, a diffusers class's `_class_name`); `extra` on top."""
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1", "tokenizer": ["transformers", tokenizer]}
    for component, config in configs.items():
        index[component] = (["transformers", config["architectures"][0]] if "architectures" in config
                            else ["diffusers", config["_class_name"]])
    return {**index, **extra}


def write_diffusers_folder(folder: Path, model_index: dict, configs: dict[str, dict],
                           module_tree: Callable[[Path], nn.Module], write_tokenizer: Callable[[Path], None],
                           seed: int = 1234, dtype: torch.dtype = torch.float32, device: str = "cpu",
                           scales: dict[str, float] | None = None, files: dict[str, dict] | None = None) -> None:
    """A diffusers-format folder of random weights: `model_index.json`, per component of
    `configs` its config.json (the scheduler's: scheduler_config.json), the tokenizer
    (`write_tokenizer(folder / "tokenizer")`), and per component with parameters its weights
    under the file name of the library its model_index entry names. `module_tree(folder)`
    builds the model from the written configs (on the meta device: only names and shapes);
    its parameters are drawn by `component_tensors` in their order, from one generator seeded
    with `seed` on `device` (a GPU's draws differ from the CPU's), stored in `dtype`. `files`:
    other JSON files by their path in the folder (an image processor's preprocessor_config.json)."""
    for component, config in configs.items():
        (folder / component).mkdir(parents=True, exist_ok=True)
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        (folder / component / name).write_text(json.dumps(config, indent=1))
    for path, content in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(json.dumps(content))
    write_tokenizer(folder / "tokenizer")
    (folder / MODEL_INDEX_FILE).write_text(json.dumps(model_index, indent=1))
    with torch.device("meta"):
        model = module_tree(folder)
    tensors = component_tensors(model, torch.Generator(device).manual_seed(seed), dtype, scales)
    for component, weights in tensors.items():
        file = WEIGHTS_FILE[model_index[component][0]]
        save_file(weights, str(folder / component / file), metadata={"format": "pt"})


def ensure_tiny_folder(name: str, write: Callable[[Path], None], root: Path | None = None) -> Path:
    """The folder `root / name` (root: the cache folder), written by `write(folder)` on first use
    (atomically: a temporary folder renamed into place, so an interrupted run leaves nothing
    half-written)."""
    root = Path(root) if root is not None else cache_root()
    return write_folder_once(root / name, MODEL_INDEX_FILE, write)


# ---- tokenizer fixtures ---------------------------------------------------------------
# Words a tiny T5 vocabulary keeps whole (the example prompts' and the tests'); other text falls
# back to single characters.
T5_WORDS = ("a", "an", "the", "cat", "dog", "fox", "bird", "runs", "walks", "flies", "jumps", "on", "in", "over",
            "grass", "snow", "sky", "water", "red", "blue", "big", "small", "slowly", "quickly", "lighthouse",
            "sea", "at", "night", "day", "blurry", "low", "quality")


def write_t5_tokenizer(folder: Path, words: tuple[str, ...] = T5_WORDS) -> None:
    """A T5-shaped tokenizer.json (Unigram, Metaspace, "$A </s>"): pad 0, eos 1, unk 2; `words`
    whole, the lower-case letters, digits, "," and "." one piece each (UMT5's layout, at a
    vocabulary of 4 + len(words) + 38)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
             + [("\u2581" + w, -1.0 - 0.01 * i) for i, w in enumerate(words)]
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


QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_MERGES = ("t h", "th e", "Ġ t", "Ġ a", "Ġt h", "Ġth e", "i n", "o n", "Ġ o", "Ġ s", "e r", "a n", "r e", "Ġ c",
                "Ġ d", "a t", "e s", "o r", "Ġ f", "Ġa n", "Ġan d")


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable stand-ins of the byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_qwen2_tokenizer(folder: Path, merges: tuple[str, ...] = QWEN2_MERGES,
                          special_tokens: tuple[str, ...] = QWEN2_SPECIAL_TOKENS) -> None:
    """A Qwen2Tokenizer folder (vocab.json + merges.txt + tokenizer_config.json, byte-level BPE):
    the byte alphabet (ids 0-255), one token per merge, then `special_tokens`; pad is the first
    of them, eos the last."""
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    for m in merges:
        vocab["".join(m.split())] = len(vocab)
    added = {str(len(vocab) + i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                   "rstrip": False, "single_word": False} for i, t in enumerate(special_tokens)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
         "eos_token": special_tokens[-1], "pad_token": special_tokens[0], "unk_token": None,
         "model_max_length": 131072, "errors": "replace", "clean_up_tokenization_spaces": False}, indent=1))
