"""Qwen2.5-VL's text path (the Qwen-Image text encoder) as plain modules, its tokenizer, and the
prompt encoding of diffusers' QwenImagePipeline.

The checkpoint's `text_encoder/` is a whole `Qwen2_5_VLForConditionalGeneration`; text-to-image
reads its language model only (`model.embed_tokens`, `model.layers.N`, `model.norm`) and skips
the vision tower (`visual.`) and the LM head. For text without images Qwen2.5-VL's multimodal
RoPE gives the three position axes the same index, which is the plain 1-D RoPE (rotate-half,
theta `rope_theta`) at positions 0..n-1; attention is causal with GQA; MLP SwiGLU; RMSNorms
in float32 (transformers' Qwen2RMSNorm). What the pipeline takes is the LAST hidden state,
after the final norm (transformers' `hidden_states[-1]`).

Prompt encoding (QwenImagePipeline._get_qwen_prompt_embeds): the prompt goes into a fixed
chat template, the first 34 tokens (the template's system part: a constant, counted with the
released tokenizer) are dropped from the hidden states, and at most `max_sequence_length`
rows are kept. Each prompt is encoded alone (the pipeline's batch of one): no padding row
exists, so the mask is all ones, and diffusers then passes no mask at all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.layers.config import read_json
from dtgen.layers.linear import Linear, empty_param
from dtgen.layers.norms import RMSNorm
from dtgen.layers.rope import apply_rope, rope_angles

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34           # prompt_template_encode_start_idx
TOKENIZER_MAX_LENGTH = 1024  # tokenizer_max_length (+ TEMPLATE_DROP: the truncation length)
IGNORED_CHECKPOINT_PREFIXES = ("visual.", "lm_head.")
# transformers' Qwen2Tokenizer pre-tokenization.
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class QwenTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "QwenTextConfig":
        """A Qwen2.5-VL config.json: the text fields at the top (transformers 4) or under
        `text_config` (transformers 5); rope_theta at the top or in `rope_parameters`."""
        d = read_json(path)
        text = {**d, **d.get("text_config", {})}
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act={text['hidden_act']!r} is not supported (silu)")
        try:
            theta = text.get("rope_theta", (text.get("rope_parameters") or {}).get("rope_theta", 1000000.0))
            return cls(text["vocab_size"], text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"],
                       text["num_attention_heads"], text["num_key_value_heads"], text.get("rms_norm_eps", 1e-6),
                       float(theta))
        except KeyError as e:
            raise ValueError(f"{path}: the text config has no {e.args[0]!r}") from None


class SelfAttention(nn.Module):
    def __init__(self, cfg: QwenTextConfig):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.q_proj = Linear(D, cfg.num_attention_heads * hd)
        self.k_proj = Linear(D, cfg.num_key_value_heads * hd)
        self.v_proj = Linear(D, cfg.num_key_value_heads * hd)
        self.o_proj = Linear(cfg.num_attention_heads * hd, D, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Local head counts read off the weights: a TP rank holds whole heads (and KV heads).
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)) for p in (self.q_proj, self.k_proj, self.v_proj))
        # Rotate-half in the activation dtype (the tables are cast to it), as transformers does.
        q = apply_rope(q, cos, sin, upcast=False).transpose(1, 2)
        k = apply_rope(k, cos, sin, upcast=False).transpose(1, 2)
        v = v.transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: QwenTextConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenTextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenTextEncoder(nn.Module):
    """The language model of Qwen2_5_VLForConditionalGeneration; parameters under `model.`
    as in its checkpoint."""

    def __init__(self, cfg: QwenTextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = empty_param(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rope(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] (float32) of positions 0..n-1, the angles twice (rotate-half)."""
        freqs = rope_angles(torch.arange(n, device=device)[:, None], (self.cfg.head_dim,), self.cfg.rope_theta)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, n] (no padding) -> the last hidden state [B, n, hidden], after the norm."""
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        cos, sin = (t.to(x.dtype) for t in self.rope(input_ids.shape[1], input_ids.device))   # as transformers
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)


def load_tokenizer(folder: str | Path):
    """The `tokenizer/` folder as a `tokenizers.Tokenizer`: its tokenizer.json, or (the released
    layout) vocab.json + merges.txt + tokenizer_config.json built as transformers' Qwen2Tokenizer
    builds them (NFC, the Qwen2 split, byte-level BPE, the added special tokens at their ids)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    missing = [f for f in ("vocab.json", "merges.txt", "tokenizer_config.json") if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{folder}: no tokenizer.json and no {missing} (a Qwen2 tokenizer folder)")
    tok = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=None,
                                  continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                  byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    added = json.loads((folder / "tokenizer_config.json").read_text()).get("added_tokens_decoder", {})
    for i, t in sorted(added.items(), key=lambda kv: int(kv[0])):
        tok.add_special_tokens([AddedToken(t["content"], special=True, normalized=False)])
        if tok.token_to_id(t["content"]) != int(i):
            raise ValueError(f"{folder}: added token {t['content']!r} should have id {i}, got "
                             f"{tok.token_to_id(t['content'])} (ids must follow the vocabulary)")
    return tok


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """[1, n]: the templated prompt's ids, truncated as the pipeline truncates."""
    ids = tokenizer.encode(PROMPT_TEMPLATE.format(prompt), add_special_tokens=False).ids
    return torch.tensor([ids[:TOKENIZER_MAX_LENGTH + TEMPLATE_DROP]])


@torch.no_grad()
def encode_prompt(encoder: QwenTextEncoder, tokenizer, prompt: str, device, dtype: torch.dtype,
                  max_sequence_length: int = 512) -> torch.Tensor:
    """prompt_embeds [1, L, hidden] (every row real: its mask is all ones)."""
    ids = prompt_ids(tokenizer, prompt).to(device)
    if ids.shape[1] <= TEMPLATE_DROP:
        raise ValueError(f"the templated prompt has {ids.shape[1]} tokens, no more than the {TEMPLATE_DROP} "
                         "the pipeline drops")
    hidden = encoder(ids)
    return hidden[:, TEMPLATE_DROP:][:, :max_sequence_length].to(dtype)
