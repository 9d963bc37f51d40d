"""Wan DiT configuration, read from a diffusers `transformer/config.json` (WanTransformer3DModel).

Only the text-to-video variant is supported (Wan 2.1 T2V, Wan 2.2 T2V A14B and TI2V-5B used
for text-to-video). Image-conditioned variants (an image embedder, added K/V projections in the
cross-attention) are refused by key, as is any key this module does not know: a silent
default could change the architecture.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtgen.layers.config import JsonConfig, config_values

# Keys whose only supported value is "unset": they switch on the I2V / FLF2V image branch.
_MUST_BE_NONE = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


@dataclass(frozen=True)
class WanTransformerConfig(JsonConfig):
    """Field names and defaults are diffusers' `WanTransformer3DModel.__init__` arguments."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    # Not a config.json key: diffusers hard-codes it (WanRotaryPosEmbed's theta).
    rope_theta: float = 10000.0
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanTransformerConfig":
        for key in _MUST_BE_NONE:
            if d.get(key) is not None:
                raise ValueError(f"Wan transformer config: '{key}'={d[key]!r} (image conditioning) is not supported")
        qk_norm = d.get("qk_norm", "rms_norm_across_heads")
        if qk_norm != "rms_norm_across_heads":
            raise ValueError(f"Wan transformer config: 'qk_norm'={qk_norm!r} is not supported "
                             "(only 'rms_norm_across_heads')")
        kw = config_values(cls, d, "Wan transformer config", exclude={"raw", "rope_theta"}, also_known=_MUST_BE_NONE)
        if "patch_size" in kw:
            kw["patch_size"] = tuple(int(p) for p in kw["patch_size"])
            if len(kw["patch_size"]) != 3:
                raise ValueError(f"Wan transformer config: 'patch_size'={d['patch_size']!r} must have 3 entries")
        if kw.get("out_channels") is None:
            # diffusers: `out_channels = out_channels or in_channels`
            kw["out_channels"] = kw.get("in_channels", cls.in_channels)
        if kw.get("attention_head_dim", cls.attention_head_dim) % 2:
            raise ValueError("Wan transformer config: 'attention_head_dim' must be even (RoPE pairs)")
        return cls(**kw, raw=dict(d))
