"""2 x 2 latent packing: the VAE's latents as the token rows an MMDiT reads, and back (diffusers'
`_pack_latents` / `_unpack_latents` of QwenImagePipeline, the same layout as FluxPipeline's).
Each row holds one 2 x 2 patch of every channel, channels first: [C, 2, 2] flattened."""
from __future__ import annotations

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] -> [B, (H/2)(W/2), C*4] (QwenImagePipeline._pack_latents)."""
    B, C, _, H, W = latents.shape
    return latents.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, H * W // 4, C * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h*w, C*4] on the (h, w) patch grid -> [B, C, 1, 2h, 2w] (QwenImagePipeline._unpack_latents)."""
    B, _, C4 = latents.shape
    return latents.view(B, h, w, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C4 // 4, 1, 2 * h, 2 * w)
