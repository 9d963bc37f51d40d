"""HunyuanImage-3 VAE decode split along the image height or width over a process group.

The generic pieces live in ``dtgen/spatial.py``; this file only maps them onto
``HunyuanVAE``:

- every ``VAEConv3d`` (3x3x3 with padding 1, or 1x1x1) -> ``HaloConv``: one row/column
  from each neighbour, zeros at the outer edges;
- every GroupNorm -> ``DistGroupNorm``: whole-image statistics, one small all-gather each;
- the mid-block ``AttnBlock`` -> ``ParallelAttnBlock``: local queries; K and V computed
  locally, concatenated and all-gathered once along the split dim (uneven splits: padded
  gather), so every query attends over every (t, h, w) position;
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

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dtgen.spatial import (DistGroupNorm, SpatialSplit, check_halo_conv, gather_split, gather_split_to,
                           spatial_parallel)

from .vae import AttnBlock, HunyuanVAE

DIMS = {"height": -2, "width": -1}
# conv_in (3x3x3, padding 1) needs one latent row from each neighbour: the most any member
# must hold at latent resolution; later layers only see more rows (x2 per upsampler).
_MIN_LATENT_ROWS = 1

Output = Union[str, int]


def _tokens(y: Tensor) -> Tensor:  # [B, C, T, H, W] -> [B, 1, T*H*W, C], as AttnBlock
    return y.flatten(2).transpose(1, 2).unsqueeze(1)


class ParallelAttnBlock(nn.Module):
    """``AttnBlock`` on a split input: local queries over all keys and values."""

    def __init__(self, attn: AttnBlock, split: SpatialSplit):
        super().__init__()
        for name in ("q", "k", "v", "proj_out"):
            if check_halo_conv(getattr(attn, name), split.dim):
                raise ValueError(f"AttnBlock.{name} is not a 1x1 convolution")
        self.attn = attn
        self.norm = DistGroupNorm(attn.norm, split)
        self.split = split

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        a = self.attn
        n = self.norm(x)
        kv = gather_split(torch.cat([a.k(n), a.v(n)], dim=1), self.split)  # one gather for K and V
        k, v = kv.chunk(2, dim=1)
        o = F.scaled_dot_product_attention(_tokens(a.q(n)), _tokens(k), _tokens(v))
        o = o.squeeze(1).transpose(1, 2).reshape(b, c, t, h, w)
        return x + a.proj_out(o)


class ParallelVAE:
    """Decodes with ``vae``'s own parameters, split along ``dim`` over ``group``.

    ``group``: any process group (None: the default group); it need not match any
    transformer axis. ``exchange``: halo exchange, "p2p" (batch_isend_irecv) or "allgather"
    (functional collective).
    """

    def __init__(self, vae: HunyuanVAE, group=None, dim: str = "height", exchange: str = "p2p"):
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {sorted(DIMS)}, got {dim!r}")
        if exchange not in ("p2p", "allgather"):
            raise ValueError(f"exchange must be 'p2p' or 'allgather', got {exchange!r}")
        self.vae = vae
        self.group = group
        self.dim = dim
        self.exchange = exchange

    def split_for(self, latents: Tensor) -> SpatialSplit:
        """The latent split for these latents; ValueError naming the extent and the group size
        when some member would get no row."""
        if latents.dim() != 4:
            raise ValueError(f"expected latents [B, C, h, w], got shape {tuple(latents.shape)}")
        return SpatialSplit.build(self.group, DIMS[self.dim], latents.shape[DIMS[self.dim]],
                                  min_size=_MIN_LATENT_ROWS, what=f"latent {self.dim}")

    def twin(self, split: SpatialSplit) -> HunyuanVAE:
        """The split-aware twin of the VAE (same parameter tensors)."""
        return spatial_parallel(self.vae, split, {AttnBlock: ParallelAttnBlock}, exchange=self.exchange)

    def image_rows(self, latents: Tensor) -> tuple[int, int]:
        """(offset, size) of this member's rows (or columns) of the decoded image, for
        ``output="local"``."""
        split = self.split_for(latents)
        f = self.vae.cfg.ffactor_spatial
        return split.offset() * f, split.sizes[split.rank] * f

    def decode_all_frames(self, latents: Tensor, output: Output = "all") -> Optional[Tensor]:
        """``HunyuanVAE.decode_all_frames``, split; see ``decode`` for ``output``."""
        split = self._check_output(self.split_for(latents), output)
        return self._output(self.twin(split).decode_all_frames(split.local(latents)), split, output)

    def decode(self, latents: Tensor, output: Output = "all") -> Optional[Tensor]:
        """``HunyuanVAE.decode`` of the full ``latents`` (the same on every member), split.

        ``output``: "all" (full image on every member), "local" (this member's rows, see
        ``image_rows``) or a group rank (full image there, None on the others).
        """
        split = self._check_output(self.split_for(latents), output)
        return self._output(self.twin(split).decode(split.local(latents)), split, output)

    @staticmethod
    def _check_output(split: SpatialSplit, output: Output) -> SpatialSplit:
        # Checked before decoding, on every member alike.
        if output in ("all", "local"):
            return split
        if isinstance(output, int) and not isinstance(output, bool) and 0 <= output < split.size:
            return split
        raise ValueError(f"output must be 'all', 'local' or a rank of the group of {split.size}, got {output!r}")

    @staticmethod
    def _output(local: Tensor, split: SpatialSplit, output: Output) -> Optional[Tensor]:
        if output == "all":
            return gather_split(local, split)
        if output == "local":
            return local
        return gather_split_to(local, split, output)


def parallel_decode(vae: HunyuanVAE, latents: Tensor, group=None, dim: str = "height",
                    output: Output = "all", exchange: str = "p2p") -> Optional[Tensor]:
    """``vae.decode(latents)`` split along ``dim`` ("height" or "width") over ``group``."""
    return ParallelVAE(vae, group, dim, exchange).decode(latents, output)
