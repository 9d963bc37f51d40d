"""HunyuanImage-3 VAE decode split along the image height or width over a process group.

The generic pieces (and the driver, ``SplitDecoder``) live in ``dtgen/spatial.py``; this
file only maps them onto ``HunyuanVAE``:

- every ``VAEConv3d`` (3x3x3 with padding 1, or 1x1x1) -> ``HaloConv``: one row/column
  from each neighbour, zeros at the outer edges;
- every GroupNorm -> ``DistGroupNorm``: whole-image statistics, one small all-gather each;
- the mid-block ``AttnBlock`` -> ``ParallelAttnBlock``: local queries; K and V computed
  locally, concatenated and all-gathered once along the split dim (``split_attention``,
  uneven splits: padded gather), so every query attends over every (t, h, w) position;
- the upsamplers' depth-to-space and the repeated-input shortcuts are per position: they run
  unchanged and double every member's rows alike.

No weight is copied or moved: the split decoder is a twin whose containers are shallow
clones of the originals and whose leaves wrap the original modules, built per call (it
depends on the latent size); the original ``HunyuanVAE`` is never modified, so nothing needs
restoring, on success or on error.

Usage (every member of ``group`` calls it with the same full latents)::

    image = parallel_decode(vae, latents, group, dim="height")            # full image everywhere
    part = parallel_decode(vae, latents, group, dim="width", output="local")
    image_or_none = parallel_decode(vae, latents, group, output=0)        # only group rank 0

Uneven extents are allowed (``torch.tensor_split`` sizes: the first ``h % P`` members hold
one latent row more); each member needs at least one latent row.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from dtgen.spatial import (DistGroupNorm, SpatialSplit, SplitDecoder, SplitOutput, check_output,
                           check_pointwise_convs, route_output, split_attention)

from .vae import AttnBlock, HunyuanVAE


class ParallelAttnBlock(nn.Module):
    """``AttnBlock`` on a split input: local queries over all keys and values. Attention runs
    over the whole [B, C, T, H, W] map, so ``split_attention`` takes the block's maps as
    they are."""

    def __init__(self, attn: AttnBlock, split: SpatialSplit):
        super().__init__()
        check_pointwise_convs(attn, ("q", "k", "v", "proj_out"), split.dim)
        self.attn = attn
        self.norm = DistGroupNorm(attn.norm, split)
        self.split = split

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn
        n = self.norm(x)
        return x + a.proj_out(split_attention(a.q(n), a.k(n), a.v(n), self.split))


class ParallelVAE(SplitDecoder):
    """Decodes with ``vae``'s own parameters, split along ``dim`` over ``group`` (arguments:
    see ``SplitDecoder``); ``group`` need not match any transformer axis."""

    latent_layout = ("B", "C", "h", "w")
    overrides = {AttnBlock: ParallelAttnBlock}

    def image_rows(self, latents: Tensor) -> tuple[int, int]:
        """(offset, size) of this member's rows (or columns) of the decoded image, for
        ``output="local"``."""
        return self.local_rows(latents, self.vae.cfg.ffactor_spatial)

    def decode_all_frames(self, latents: Tensor, output: SplitOutput = "all") -> Optional[Tensor]:
        """``HunyuanVAE.decode_all_frames``, split; see ``decode`` for ``output``."""
        split = self.split_for(latents)
        check_output(output, split)
        return route_output(self.twin(split).decode_all_frames(split.local(latents)), split, output)

    def decode(self, latents: Tensor, output: SplitOutput = "all") -> Optional[Tensor]:
        """``HunyuanVAE.decode`` of the full ``latents`` (the same on every member), split.

        ``output``: "all" (full image on every member), "local" (this member's rows, see
        ``image_rows``) or a group rank (full image there, None on the others).
        """
        split = self.split_for(latents)
        check_output(output, split)
        return route_output(self.twin(split).decode(split.local(latents)), split, output)


def parallel_decode(vae: HunyuanVAE, latents: Tensor, group=None, dim: str = "height",
                    output: SplitOutput = "all", exchange: str = "p2p") -> Optional[Tensor]:
    """``vae.decode(latents)`` split along ``dim`` ("height" or "width") over ``group``."""
    return ParallelVAE(vae, group, dim, exchange).decode(latents, output)
