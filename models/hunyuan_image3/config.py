"""HunyuanImage-3.0 configuration, read from the official `config.json` field names."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vae import VAEConfig

# rope_scaling types whose math is plain (unscaled) RoPE. The released checkpoint says
# {"type": "custom", "factor": 1.0}; anything else would change the frequencies.
_PLAIN_ROPE_SCALING = {None, "custom", "default"}
_SUPPORTED_ROPE_TYPES = {"2d"}


class ConfigError(ValueError):
    """A config.json that this implementation cannot run faithfully."""


def _per_layer(value: Any, num_layers: int, name: str) -> list[int]:
    """The official config stores some MoE fields as per-layer lists (or one scalar)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ConfigError(f"config field '{name}' has {len(value)} entries, expected one per layer ({num_layers})")
        return [int(v) for v in value]
    return [int(value)] * num_layers


@dataclass
class HunyuanImage3Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    moe_topk: list[int]
    moe_intermediate_size: list[int]
    num_shared_expert: list[int]
    use_mixed_mlp_moe: bool
    norm_topk_prob: bool
    routed_scaling_factor: float
    use_qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    patch_embed_hidden_dim: int
    patch_size: int
    image_base_size: int
    vae_downsample_factor: tuple[int, int]
    vae: VAEConfig
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    # Ids of the special tokens by name (`<boi>`, `<cfg>`, `<img_ratio_3>`, ...), when the
    # config carries them (the tiny fixtures do). A real checkpoint takes them from its
    # tokenizer instead.
    special_token_ids: dict[str, int] = field(default_factory=dict)
    # The Instruct-Distil checkpoint's sampler: `cfg_distilled` embeds the guidance scale as a
    # `<guidance>` token (guidance_emb) instead of running an unconditional row; `use_meanflow`
    # adds a `<timestep_r>` token (timestep_r_emb) holding the step's end time.
    cfg_distilled: bool = False
    use_meanflow: bool = False
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def shared_intermediate_size(self, layer: int) -> int:
        # The official code sizes the shared MLP as moe_intermediate_size * num_shared_expert,
        # not intermediate_size.
        return self.moe_intermediate_size[layer] * self.num_shared_expert[layer]

    @classmethod
    def from_dict(cls, d: dict) -> "HunyuanImage3Config":
        def need(name: str):
            if name not in d or d[name] is None:
                raise ConfigError(f"config.json is missing required field '{name}'")
            return d[name]

        rope_type = d.get("rope_type", "2d")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope_type {rope_type!r}: HunyuanImage-3 uses '2d' (1-D positions for text, "
                f"2-D for image tokens); supported: {sorted(_SUPPORTED_ROPE_TYPES)}")
        scaling = d.get("rope_scaling") or {}
        scaling_type = scaling.get("type", scaling.get("rope_type"))
        if scaling_type not in _PLAIN_ROPE_SCALING or float(scaling.get("factor", 1.0)) != 1.0:
            raise ConfigError(
                f"unsupported rope_scaling {scaling!r}: only unscaled RoPE (type 'custom'/'default', factor 1.0) "
                f"is implemented")
        if int(d.get("moe_layer_num_skipped", 0) or 0) != 0:
            raise ConfigError("moe_layer_num_skipped > 0 (dense leading layers) is not supported; "
                              "the released model has every layer MoE")
        if d.get("use_mla") or d.get("use_cla"):
            raise ConfigError("use_mla / use_cla attention variants are not supported")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias are not supported (the released model has no biases)")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {d.get('hidden_act')!r}; only 'silu' is implemented")
        if int(d.get("patch_size", 1)) != 1 or d.get("img_proj_type", "unet") != "unet":
            raise ConfigError("only patch_size 1 with img_proj_type 'unet' is implemented (the released setting)")
        if d.get("tie_word_embeddings"):
            raise ConfigError("tie_word_embeddings=true is not supported (the released lm_head is separate)")

        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("attention_head_dim") or d.get("head_dim") or int(need("hidden_size")) // heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise ConfigError(f"head_dim {head_dim} must be even for rotary embeddings")
        vae_dict = d.get("vae")
        if not isinstance(vae_dict, dict):
            raise ConfigError("config.json is missing the 'vae' sub-config")
        down = d.get("vae_downsample_factor", [16, 16])
        specials = dict(d.get("tiny_special_token_ids") or d.get("special_token_ids") or {})
        return cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            num_experts=int(need("num_experts")),
            moe_topk=_per_layer(need("moe_topk"), layers, "moe_topk"),
            moe_intermediate_size=_per_layer(need("moe_intermediate_size"), layers, "moe_intermediate_size"),
            num_shared_expert=_per_layer(d.get("num_shared_expert", 1), layers, "num_shared_expert"),
            use_mixed_mlp_moe=bool(d.get("use_mixed_mlp_moe", True)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0) or 1.0),
            use_qk_norm=bool(d.get("use_qk_norm", True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            max_position_embeddings=int(need("max_position_embeddings")),
            patch_embed_hidden_dim=int(need("patch_embed_hidden_dim")),
            patch_size=int(d.get("patch_size", 1)),
            image_base_size=int(d.get("image_base_size", 1024)),
            vae_downsample_factor=(int(down[0]), int(down[1])),
            vae=VAEConfig.from_dict(vae_dict),
            bos_token_id=int(need("bos_token_id")),
            eos_token_id=int(need("eos_token_id")),
            pad_token_id=int(d.get("pad_token_id", -1)),
            image_token_id=int(need("image_token_id")),
            special_token_ids={str(k): int(v) for k, v in specials.items()},
            cfg_distilled=bool(d.get("cfg_distilled", False)),
            use_meanflow=bool(d.get("use_meanflow", False)),
            raw=dict(d),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "HunyuanImage3Config":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)
