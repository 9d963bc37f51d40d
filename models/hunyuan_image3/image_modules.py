"""Image-side modules: timestep embedders, `patch_embed` (UNetDown) and `final_layer` (UNetUp).

Module and parameter names follow the checkpoint (`mlp.0`, `in_layers.2`, `emb_layers.1`,
`out_layers.3`, `skip_connection`, `model.1.2`, ...), so loading is a plain name match.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.layers.embeddings import timestep_sinusoid   # [B] raw timesteps (0..1000) -> [B, dim], [cos, sin]


class TimestepEmbedder(nn.Module):
    """sinusoid(256) -> Linear -> GELU (exact) -> Linear."""

    def __init__(self, hidden: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freq = timestep_sinusoid(t, self.frequency_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(freq)


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in float32 and cast back (32 groups, eps 1e-5)."""

    def __init__(self, channels: int):
        super().__init__(32, channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class ResBlock(nn.Module):
    """Timestep-conditioned residual block (scale first, then shift)."""

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int):
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(in_channels), nn.SiLU(),
                                       nn.Conv2d(in_channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(GroupNorm32(out_channels), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip_connection = (nn.Identity() if in_channels == out_channels
                                else nn.Conv2d(in_channels, out_channels, 1))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb).to(h.dtype)[..., None, None].chunk(2, dim=1)
        norm, rest = self.out_layers[0], self.out_layers[1:]
        h = norm(h) * (1 + scale) + shift
        return self.skip_connection(x) + rest(h)


class PatchEmbed(nn.Module):
    """`patch_embed` (UNetDown, patch size 1): latents [B, C, h, w] -> tokens [B, h*w, H]."""

    def __init__(self, latent_channels: int, mid_channels: int, hidden: int):
        super().__init__()
        self.model = nn.Sequential(nn.Conv2d(latent_channels, mid_channels, 3, padding=1),
                                   ResBlock(mid_channels, hidden, hidden))

    def forward(self, latents: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.model[0](latents.to(self.model[0].weight.dtype))
        h = self.model[1](h, emb)
        return h.flatten(2).transpose(1, 2)  # row-major over the latent grid


class FinalLayer(nn.Module):
    """`final_layer` (UNetUp): tokens [B, h*w, H] -> prediction [B, C, h, w]."""

    def __init__(self, hidden: int, mid_channels: int, latent_channels: int):
        super().__init__()
        self.model = nn.Sequential(
            ResBlock(hidden, mid_channels, hidden),
            nn.Sequential(GroupNorm32(mid_channels), nn.SiLU(), nn.Conv2d(mid_channels, latent_channels, 3, padding=1)),
        )

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # contiguous: the native GroupNorm kernel that compiled graphs call needs it
        x = tokens.transpose(1, 2).reshape(tokens.shape[0], -1, height, width).contiguous()
        x = self.model[0](x, emb)
        return self.model[1](x)
