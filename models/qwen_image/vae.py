"""Qwen-Image's VAE (diffusers' `AutoencoderKLQwenImage`): the Wan 2.1 VAE, decoded by
`dtgen/layers/wan_vae.py` (`WanVAEConfig.from_qwen_image` reads its config) and split by
`dtgen/layers/wan_vae_parallel.py`. The pipeline decodes an image as one latent frame
([B, z, 1, h, w]) and keeps frame 0.
"""
from __future__ import annotations

from dtgen.layers.wan_vae import IGNORED_CHECKPOINT_PREFIXES, WanVAE, WanVAEConfig

__all__ = ["IGNORED_CHECKPOINT_PREFIXES", "QwenImageVAE", "vae_config"]
QwenImageVAE = WanVAE
vae_config = WanVAEConfig.from_qwen_image
