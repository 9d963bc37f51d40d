"""Qwen-Image's VAE (diffusers' `AutoencoderKLQwenImage`): the Wan 2.1 VAE, decoded by `dtgen/layers/wan_vae.py`.

diffusers' AutoencoderKLQwenImage is a copy of AutoencoderKLWan (Wan 2.1: z_dim 16, 8x space,
4x time, causal 3-D convolutions, RMS norms, per-frame mid-block attention), with the weights
fine-tuned for images. The decoder's modules, keys and math are the same, so `WanVAE` decodes
it and `dtgen/layers/wan_vae_parallel.py` splits it. Where they differ:
- the config: `input_channels` (the image channels, encoder input AND decoder output) where
  Wan has `in_channels` / `out_channels`; none of Wan 2.2's fields (`decoder_base_dim`,
  `is_residual`, `patch_size`, the scale factors);
- the causal cache slice `x[:, :, -min(CACHE_T, T)]` where Wan has `x[:, :, -CACHE_T:]`: the
  same frames (a slice past the start clips), so nothing to follow;
- an image is one latent frame: the pipeline decodes [B, z, 1, h, w] and keeps frame 0.
"""
from __future__ import annotations

from dtgen.layers.config import config_values
from dtgen.layers.wan_vae import IGNORED_CHECKPOINT_PREFIXES, WanVAE, WanVAEConfig

__all__ = ["IGNORED_CHECKPOINT_PREFIXES", "QwenImageVAE", "vae_config"]
# WanVAEConfig's fields that AutoencoderKLQwenImage does not have.
_WAN_ONLY = ("in_channels", "out_channels", "decoder_base_dim", "is_residual", "patch_size", "scale_factor_temporal",
             "scale_factor_spatial")
QwenImageVAE = WanVAE


def vae_config(d: dict) -> WanVAEConfig:
    """An AutoencoderKLQwenImage `vae/config.json` dict as the WanVAEConfig of the same decoder."""
    kw = config_values(WanVAEConfig, d, "Qwen-Image VAE config", exclude=_WAN_ONLY, also_known=("input_channels",))
    channels = d.get("input_channels", 3)
    return WanVAEConfig.from_dict({**kw, "in_channels": channels, "out_channels": channels,
                                   "scale_factor_temporal": None, "scale_factor_spatial": None})
