"""The UMT5 text encoder (google/umt5-xxl: Wan 2.1 / 2.2's) as plain modules, plus its tokenizer.

Same math as transformers' `UMT5EncoderModel` (its `last_hidden_state`), same parameter names,
so the diffusers checkpoint's `text_encoder/` tensors load by name. No module here knows
about process groups: the number of local heads is read off `q.weight` (rows // d_kv), the
local FFN width off `wi_0.weight`, the relative-bias columns off the bias table, so the same
code runs the full model and any tensor-parallel rank's shard of it.

Architecture (encoder only, pre-norm T5 blocks, no biases anywhere):
  h = shared[input_ids]
  per block:  h = h + o(attn(q, k, v, bias_l))   with q, k, v, o on rms_norm(h)
              h = h + wo(gelu_tanh(wi_0(n)) * wi_1(n)),  n = rms_norm(h)
  out = rms_norm_final(h)
- T5 layer norm: RMS without mean subtraction, the variance and the normalisation in float32,
  cast to the weight's dtype before the scale.
- Attention has NO 1/sqrt(d_kv) scaling (folded into the weights at training time).
- UMT5 (unlike T5/mT5, where only block 0 holds a table) has a relative-position bias table in
  EVERY block: `relative_attention_bias.weight` [num_buckets, heads]. Buckets are the
  bidirectional T5 buckets (half for each sign, half of those exact, the rest logarithmic up to
  max_distance); computed once per forward and shared by all blocks.
- Padding: keys where attention_mask == 0 get finfo.min added to their scores (as transformers'
  SDPA path does: `where(mask, bias, min)`). Padded *query* rows are computed like any other.
- Gated-GELU FFN with the tanh approximation ("gelu_new"), here `F.gelu(approximate="tanh")`,
  the same function evaluated in one kernel.
- Left out: transformers' fp16 inf-clamp after each sub-layer (Wan runs UMT5-XXL in bf16; T5
  activations can overflow fp16, so run this in bf16 or fp32), dropout (inference only), the
  decoder, caches, output_attentions / hidden_states.

Public API: `UMT5Config` (`from_dict`, `from_json`), `UMT5Encoder(cfg)(input_ids, attention_mask)`
-> last_hidden_state, `UMT5Encoder.checkpoint_keys(present)`, `load_tokenizer(folder)` ->
`T5PromptTokenizer` (ids + mask padded to 512 from `tokenizer.json` with the HF `tokenizers`
package), `clean_prompt`, `relative_position_buckets`, `encode_prompt_embeds` (the prompt
embedding as diffusers' Wan pipelines make it: trimmed to each prompt and zero-padded).

Checkpoint keys (`UMT5EncoderModel` state dict):
  shared.weight, encoder.embed_tokens.weight (the SAME tensor: tied),
  encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}.weight,
  encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight,
  encoder.block.{i}.layer.0.layer_norm.weight,
  encoder.block.{i}.layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight,
  encoder.block.{i}.layer.1.layer_norm.weight, encoder.final_layer_norm.weight.
`encoder.embed_tokens` here IS the `shared` module, so `state_dict()` lists both keys (as
transformers does) while `named_parameters()` has only `shared.weight`: one tensor to load. A
checkpoint may hold either key or both (safetensors saves a tied tensor once);
`checkpoint_keys` says which one to read (`shared.weight` first).

Tensor-parallel rules (dtgen.plan.Rule; "column" = dim 0, "row" = last dim):

  parameter                                            rule       note
  shared.weight                                        REPLICATE  [vocab, d_model] lookup table
  encoder.block.*.layer.0.layer_norm.weight            REPLICATE
  encoder.block.*.layer.0.SelfAttention.q.weight       COLUMN     whole heads (d_kv rows each)
  encoder.block.*.layer.0.SelfAttention.k.weight       COLUMN     same heads as q
  encoder.block.*.layer.0.SelfAttention.v.weight       COLUMN     same heads as q
  encoder.block.*.layer.0.SelfAttention.relative_attention_bias.weight
                                                       ROW        [num_buckets, heads] split on
                                                                  dim 1 (its last dim) into the
                                                                  same head blocks as q
  encoder.block.*.layer.0.SelfAttention.o.weight       ROW        output is a partial sum
  encoder.block.*.layer.1.layer_norm.weight            REPLICATE
  encoder.block.*.layer.1.DenseReluDense.wi_0.weight   COLUMN
  encoder.block.*.layer.1.DenseReluDense.wi_1.weight   COLUMN     same rows as wi_0
  encoder.block.*.layer.1.DenseReluDense.wo.weight     ROW        output is a partial sum
  encoder.final_layer_norm.weight                      REPLICATE

  Partial-sum outputs (all-reduce by forward hook), nothing between them and the residual add:
    encoder.block.*.layer.0.SelfAttention.o
    encoder.block.*.layer.1.DenseReluDense.wo
  (Their parents `...SelfAttention` and `...DenseReluDense` return exactly those outputs, so
  hooking the parents is equivalent.) The bias table's ROW split is only a slicing rule: the
  embedding's output is per-head, not a partial sum, so it gets no hook.
  Split units (ParamSpec.unit): q/k/v rows and o columns in whole heads (d_kv), the bias table
  in single columns (one head each), wi_0/wi_1 rows and wo columns in 1. So the finest split
  (TP degree x micros) must divide num_heads (64 for XXL) and d_ff (10240). Rank r's heads must
  be the same contiguous block in q, k, v, o and the bias table: plain block splits do that.
  The embedding is replicated (2.1 GB in bf16 for the 256384 x 4096 table): splitting it would
  need a masked lookup plus an all-reduce, which this module does not do.
"""
from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.requests import RequestError

from .config import JsonConfig, config_values
from .linear import empty_param
from .norms import RMSNorm

EMBEDDING_KEYS = ("shared.weight", "encoder.embed_tokens.weight")


# ---- configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class UMT5Config(JsonConfig):
    """Field names are transformers' `UMT5Config` keys; defaults are google/umt5-xxl's."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    pad_token_id: int = 0
    eos_token_id: int = 1
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # Everything that would change the math is checked; one line naming the key.
        if self.feed_forward_proj != "gated-gelu":
            raise ValueError(f"text_encoder config: feed_forward_proj={self.feed_forward_proj!r} is not "
                             "supported (only 'gated-gelu')")
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                     "relative_attention_max_distance"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"text_encoder config: {name}={v!r} must be a positive integer")
        nb = self.relative_attention_num_buckets
        # Bidirectional buckets: half per sign, half of those exact; the log part needs >= 1 exact
        # bucket and max_distance beyond it (else log(max_distance / max_exact) <= 0).
        if not isinstance(nb, int) or nb < 4 or nb % 2:
            raise ValueError(f"text_encoder config: relative_attention_num_buckets={nb!r} must be an even "
                             "integer >= 4")
        if self.relative_attention_max_distance <= nb // 4:
            raise ValueError(f"text_encoder config: relative_attention_max_distance="
                             f"{self.relative_attention_max_distance} must exceed num_buckets // 4 = {nb // 4}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UMT5Config":
        """From a `text_encoder/config.json` dict; keys this encoder does not use are kept in `raw`."""
        model_type = d.get("model_type", "umt5")
        if model_type != "umt5":
            # t5 / mt5 hold a relative-bias table in block 0 only: a different parameter layout.
            raise ValueError(f"text_encoder config: model_type={model_type!r} is not supported (only 'umt5')")
        if d.get("is_decoder", False):
            raise ValueError("text_encoder config: is_decoder=True is not supported (encoder only)")
        kwargs = config_values(cls, d, "text_encoder config", exclude={"raw"}, refuse_unknown=False, skip_none=True)
        return cls(**kwargs, raw=dict(d))


# ---- modules -----------------------------------------------------------------------------------

def _linear(n_in: int, n_out: int) -> nn.Linear:
    # A real nn.Linear (the TP output hooks attach to it), without the init pass over the weight.
    lin = nn.Linear(n_in, n_out, bias=False, device="meta")
    lin.weight = empty_param(n_out, n_in)
    return lin


def _embedding(rows: int, dim: int) -> nn.Embedding:
    emb = nn.Embedding(rows, dim, device="meta")
    emb.weight = empty_param(rows, dim)
    return emb


def t5_layer_norm(dim: int, eps: float) -> RMSNorm:
    """T5's layer norm: w * x / sqrt(mean(x^2) + eps), no mean, no bias; float32 inside, rounded
    to w's dtype."""
    return RMSNorm(dim, eps, rounding="weight")


def relative_position_buckets(length: int, num_buckets: int, max_distance: int,
                              device: torch.device | None = None) -> torch.Tensor:
    """[length, length] int64 bucket of (key position - query position), bidirectional.

    Same float ops in the same order as transformers, so boundary positions land in the same
    bucket: half of the buckets for each sign; of those, half exact distances, the rest
    log-spaced up to max_distance (and everything beyond in the last bucket).
    """
    pos = torch.arange(length, dtype=torch.long, device=device)
    rel = pos[None, :] - pos[:, None]
    half = num_buckets // 2
    bucket = (rel > 0).to(torch.long) * half
    rel = rel.abs()
    max_exact = half // 2
    # clamp(min=1) only keeps log(0) out of the branch that where() discards anyway.
    large = max_exact + (torch.log(rel.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = large.clamp(max=half - 1)
    return bucket + torch.where(rel < max_exact, rel, large)


class UMT5Attention(nn.Module):
    """Self-attention with a per-layer relative-position bias and no score scaling."""

    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.d_kv = cfg.d_kv
        inner = cfg.num_heads * cfg.d_kv
        self.q = _linear(cfg.d_model, inner)
        self.k = _linear(cfg.d_model, inner)
        self.v = _linear(cfg.d_model, inner)
        self.o = _linear(inner, cfg.d_model)
        self.relative_attention_bias = _embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_keep: torch.Tensor | None) -> torch.Tensor:
        B, S, _ = x.shape
        D = self.d_kv
        # Local heads: whatever this rank's q/k/v rows hold (-1), never a world size.
        q = self.q(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k(x).view(B, S, -1, D).transpose(1, 2)
        v = self.v(x).view(B, S, -1, D).transpose(1, 2)
        # [S, S, heads_local] -> [1, heads_local, S, S]; the table's columns are this rank's heads.
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0).to(q.dtype)
        if key_keep is not None:
            # Padded keys: the dtype's min instead of the bias (transformers' SDPA path does the same).
            bias = torch.where(key_keep, bias, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        # o's output goes straight to the residual add: under TP it is the partial sum that the
        # framework all-reduces with a forward hook on this very module.
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


class UMT5GatedFFN(nn.Module):
    """wo(gelu_tanh(wi_0 x) * wi_1 x)."""

    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.wi_0 = _linear(cfg.d_model, cfg.d_ff)
        self.wi_1 = _linear(cfg.d_model, cfg.d_ff)
        self.wo = _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        # transformers may keep `wo` in float32 (its _keep_in_fp32_modules, used for fp16): feed it
        # its own dtype, as transformers does. A no-op when all weights share one dtype.
        return self.wo(h.to(self.wo.weight.dtype))


class UMT5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.SelfAttention = UMT5Attention(cfg)
        self.layer_norm = t5_layer_norm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h, buckets, key_keep):
        return h + self.SelfAttention(self.layer_norm(h), buckets, key_keep)


class UMT5LayerFF(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.DenseReluDense = UMT5GatedFFN(cfg)  # transformers' name, kept for the checkpoint keys
        self.layer_norm = t5_layer_norm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h):
        return h + self.DenseReluDense(self.layer_norm(h))


class UMT5Block(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        # `layer.0` / `layer.1`: the checkpoint's nesting.
        self.layer = nn.ModuleList([UMT5LayerSelfAttention(cfg), UMT5LayerFF(cfg)])

    def forward(self, h, buckets, key_keep):
        return self.layer[1](self.layer[0](h, buckets, key_keep))


class UMT5Stack(nn.Module):
    def __init__(self, cfg: UMT5Config, embed_tokens: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embed_tokens  # the same module as the encoder's `shared` (tied)
        self.block = nn.ModuleList([UMT5Block(cfg) for _ in range(cfg.num_layers)])
        self.final_layer_norm = t5_layer_norm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        S = input_ids.shape[1]
        # One bucket map for all blocks (each block has its own table to look them up in).
        buckets = relative_position_buckets(S, self.cfg.relative_attention_num_buckets,
                                            self.cfg.relative_attention_max_distance, input_ids.device)
        key_keep = None if attention_mask is None else (attention_mask != 0)[:, None, None, :]
        for block in self.block:
            h = block(h, buckets, key_keep)
        return self.final_layer_norm(h)


class UMT5Encoder(nn.Module):
    """`UMT5EncoderModel` without the wrapper: forward(input_ids, attention_mask) returns
    last_hidden_state [B, S, d_model]."""

    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.cfg = cfg
        # `shared` is registered first, so named_parameters() reports the tied table under
        # `shared.weight` (and only there).
        self.shared = _embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = UMT5Stack(cfg, self.shared)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)

    def checkpoint_keys(self, present: Iterable[str]) -> dict[str, str]:
        """Parameter name -> the checkpoint key to read it from, given the keys a checkpoint has.

        The only non-identity: `shared.weight` comes from `shared.weight` if present, else from
        `encoder.embed_tokens.weight` (the same tied tensor). When both are present the second is
        simply not read. Raises if neither is there.
        """
        present = set(present)
        out = {}
        for name, _ in self.named_parameters():
            if name == "shared.weight":
                found = [k for k in EMBEDDING_KEYS if k in present]
                if not found:
                    raise KeyError(f"text_encoder checkpoint has none of {EMBEDDING_KEYS}")
                out[name] = found[0]
            else:
                out[name] = name
        return out


def encode_prompt_embeds(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         max_len: int = 512, dtype: torch.dtype | None = None) -> torch.Tensor:
    """diffusers `WanPipeline._get_t5_prompt_embeds` after tokenization: [B, max_len, d_model].

    The encoder runs on the padded ids WITH the mask; then each row keeps its first
    seq_len = mask.sum() positions and the rest is set to exactly zero (the pipeline trims to
    seq_len and re-pads with zeros to max_sequence_length). Rows shorter than max_len (input
    not padded to it) are zero-padded; no data-dependent shapes, so it compiles.
    `dtype`: cast the result (the pipeline casts to the text encoder's dtype before trimming).
    """
    B, L = input_ids.shape
    if L > max_len:
        raise ValueError(f"input_ids has {L} positions, more than max_len={max_len}")
    h = encoder(input_ids, attention_mask)
    if dtype is not None:
        h = h.to(dtype)
    seq_lens = (attention_mask > 0).sum(dim=1)
    keep = torch.arange(L, device=h.device)[None, :] < seq_lens[:, None]
    # where(), not a multiply: garbage (even inf/nan) in padded rows must become exact zeros.
    h = torch.where(keep[..., None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    if L < max_len:
        h = F.pad(h, (0, 0, 0, max_len - L))
    return h


# ---- tokenizer ---------------------------------------------------------------------------------

def clean_prompt(text: str) -> str:
    """diffusers' `prompt_clean` without ftfy (not a dtgen dependency): html-unescape twice,
    strip, collapse whitespace runs to one space. Identical to diffusers when ftfy is absent."""
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class T5PromptTokenizer:
    """The `tokenizers` tokenizer of a T5 `tokenizer.json`, called as the Wan pipeline calls its
    transformers tokenizer: padding="max_length", truncation=True, add_special_tokens=True.

    __call__(prompts) -> (input_ids, attention_mask), both int64 [B, max_length]: the pieces,
    truncated to max_length - 1, then EOS (appended by hand, so a tokenizer.json with or without
    its post-processor gives the same ids), then pad ids with mask 0 (right padding).
    """

    def __init__(self, tokenizer, pad_id: int, eos_id: int, max_length: int = 512, clean: bool = True):
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_length = max_length
        self.clean = clean

    def __call__(self, prompts: str | list[str], max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = max_length or self.max_length
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if self.clean:
            prompts = [clean_prompt(p) for p in prompts]
        encs = self.tokenizer.encode_batch(prompts, add_special_tokens=False)
        ids = torch.full((len(prompts), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        for i, enc in enumerate(encs):
            row = list(enc.ids[: n - 1]) + [self.eos_id]  # truncation keeps room for EOS, as T5's does
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return ids, mask

    def token_count(self, text: str) -> int:
        """The rows `text` takes as the pipeline tokenizes it: cleaned, and an end-of-text token after it."""
        return len(self.tokenizer.encode(clean_prompt(text) if self.clean else text, add_special_tokens=False).ids) + 1


def check_prompt_tokens(tokenizer: T5PromptTokenizer, request, most: int, model: str,
                        fields: tuple[str, ...] = ("prompt", "negative_prompt")) -> None:
    """`RequestError` naming the first of the request's `fields` longer than the text encoder
    reads (`most` tokens, `model`'s): the model would cut it there (diffusers' pipelines do so
    silently), and a user would never learn that the end of the prompt was not seen."""
    for name in fields:
        count = tokenizer.token_count(getattr(request, name))
        if count > most:
            raise RequestError(name, f"is {count} tokens; {model}'s text encoder reads at most {most}: "
                                     "shorten it (it is not cut short silently)")


def _special(folder: Path, name: str, default: str) -> str:
    """A special token's text from tokenizer_config.json / special_tokens_map.json, if given."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        p = folder / fname
        if p.is_file():
            v = json.loads(p.read_text()).get(name)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                return v
    return default


def load_tokenizer(folder: str | Path, max_length: int = 512, clean: bool = True) -> T5PromptTokenizer:
    """The Wan `tokenizer/` folder (its `tokenizer.json`) as a `T5PromptTokenizer`."""
    from tokenizers import Tokenizer  # runtime dependency of dtgen; imported here to keep import light

    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (dtgen reads only the `tokenizers` format, "
                                "not spiece.model)")
    tok = Tokenizer.from_file(str(path))
    # Padding / truncation are done by hand in __call__; a setting saved in the file must not interfere.
    tok.no_padding()
    tok.no_truncation()
    ids = {}
    for name, default in (("pad_token", "<pad>"), ("eos_token", "</s>")):
        text = _special(folder, name, default)
        ids[name] = tok.token_to_id(text)
        if ids[name] is None:
            raise ValueError(f"{path}: {name} {text!r} is not in the vocabulary")
    return T5PromptTokenizer(tok, ids["pad_token"], ids["eos_token"], max_length, clean)
