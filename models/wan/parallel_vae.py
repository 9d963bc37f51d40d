"""Wan VAE decode split along the video height or width over a process group.

The generic pieces live in ``dtgen/spatial.py``; this file maps them onto ``WanVAE``
(``models/wan/vae.py``), following ``models/hunyuan_image3/parallel_vae.py``:

- every convolution -> ``HaloConv``: the 3x3x3 causal convs and the upsamplers' 3x3 conv2d get
  one row/column from each neighbour (zeros at the outer edges); 1x1x1 convs and the 3x1x1
  ``time_conv`` need no halo and run as they are. Only SPACE is exchanged: time stays whole
  on every member, so each member keeps its own causal cache (``CausalCache``) of its own
  rows; the halo of the cached context frames is re-exchanged with the current chunk's
  (the window [cached frames, chunk] goes through the halo conv as one tensor), which costs
  k_t - 1 = 2 extra frames of halo per conv and needs no cache of halos;
- norms: none to distribute. Every Wan decoder norm is ``RMSNorm``, which normalizes each
  position's channel vector on its own (no statistics over space or time), so it runs
  unchanged on a member's rows; there is no GroupNorm in the Wan decoder;
- the mid-block ``AttentionBlock`` -> ``ParallelAttentionBlock``: attention is over the h*w
  positions of each frame, so local queries attend over K and V all-gathered (one gather for
  both, uneven splits padded) along the split dim;
- the upsamplers' nearest x2 is per position (``Upsample2x``: every member's rows double),
  time doubling and the per-frame reshapes do not touch the split dims.

No weight is copied or moved: the split decoder is a twin built per call (it depends on the
latent size) whose containers are shallow clones of the originals and whose leaves wrap the
original modules; the original ``WanVAE`` is never modified.

Usage (every member of ``group`` calls it with the same full latents)::

    video = parallel_decode(vae, latents, group, dim="height")             # full video everywhere
    part = parallel_decode(vae, latents, group, dim="width", output="local")
    video_or_none = parallel_decode(vae, latents, group, output=0)         # only group rank 0

Uneven extents are allowed (``torch.tensor_split`` sizes: the first ``h % P`` members hold one
latent row more); each member needs at least one latent row (the 3x3 halo of ``conv_in``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch.nn.functional as F
from torch import Tensor, nn

from dtgen.spatial import POINTWISE_LEAVES, SpatialSplit, check_halo_conv, gather_split, gather_split_to, \
    spatial_parallel

from .vae import AttentionBlock, RMSNorm, Upsample2x, WanVAE, _from_frames, _per_frame, _tokens

DIMS = {"height": -2, "width": -1}
# conv_in (3x3 in space) needs one latent row from each neighbour: the most any member must
# hold at latent resolution; later layers only see more rows (x2 per upsampler).
_MIN_LATENT_ROWS = 1
# Leaves that act on each spatial position alone (see the module docstring).
_POINTWISE = (*POINTWISE_LEAVES, RMSNorm, Upsample2x)

Output = Union[str, int]


class ParallelAttentionBlock(nn.Module):
    """``AttentionBlock`` on a split input: per frame, local queries over the whole frame's
    keys and values."""

    def __init__(self, attn: AttentionBlock, split: SpatialSplit):
        super().__init__()
        for name in ("to_qkv", "proj"):
            if check_halo_conv(getattr(attn, name), split.dim):
                raise ValueError(f"AttentionBlock.{name} is not a 1x1 convolution")
        self.attn = attn
        self.split = split

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn
        b, c = x.shape[:2]
        y = _per_frame(x)  # [B*T, C, h_local, w]: the split dim is still -2 / -1
        qkv = a.to_qkv(a.norm(y))  # the norm is per position: local rows suffice
        # One gather for K and V (the channel thirds after Q), along the split dim.
        kv = gather_split(qkv[:, c:].contiguous(), self.split)
        k, v = _tokens(kv).chunk(2, dim=-1)
        o = F.scaled_dot_product_attention(_tokens(qkv[:, :c]), k, v)
        o = o.squeeze(1).transpose(1, 2).reshape(y.shape)
        return x + _from_frames(a.proj(o), b)


class ParallelWanVAE:
    """Decodes with ``vae``'s own parameters, split along ``dim`` over ``group``.

    ``group``: any process group (None: the default group). ``exchange``: halo exchange,
    "p2p" (batch_isend_irecv) or "allgather" (functional collective).
    """

    def __init__(self, vae: WanVAE, group=None, dim: str = "height", exchange: str = "p2p"):
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
        if latents.dim() != 5:
            raise ValueError(f"expected latents [B, C, T, h, w], got shape {tuple(latents.shape)}")
        return SpatialSplit.build(self.group, DIMS[self.dim], latents.shape[DIMS[self.dim]],
                                  min_size=_MIN_LATENT_ROWS, what=f"latent {self.dim}")

    def twin(self, split: SpatialSplit) -> WanVAE:
        """The split-aware twin of the VAE (same parameter tensors)."""
        return spatial_parallel(self.vae, split, {AttentionBlock: ParallelAttentionBlock},
                                exchange=self.exchange, pointwise=_POINTWISE)

    def video_rows(self, latents: Tensor) -> tuple[int, int]:
        """(offset, size) of this member's rows (or columns) of the decoded video, for
        ``output="local"``."""
        split = self.split_for(latents)
        f = self.vae.cfg.spatial_factor
        return split.offset() * f, split.sizes[split.rank] * f

    def decode(self, latents: Tensor, output: Output = "all", chunk_frames: int = 1) -> Optional[Tensor]:
        """``WanVAE.decode`` of the full normalized ``latents`` (the same on every member), split.

        ``output``: "all" (full video on every member), "local" (this member's rows, see
        ``video_rows``) or a group rank (full video there, None on the others).
        """
        split = self._check_output(self.split_for(latents), output)
        local = self.twin(split).decode(split.local(latents), chunk_frames)
        if output == "all":
            return gather_split(local, split)
        if output == "local":
            return local
        return gather_split_to(local, split, output)

    @staticmethod
    def _check_output(split: SpatialSplit, output: Output) -> SpatialSplit:
        # Checked before decoding, on every member alike.
        if output in ("all", "local"):
            return split
        if isinstance(output, int) and not isinstance(output, bool) and 0 <= output < split.size:
            return split
        raise ValueError(f"output must be 'all', 'local' or a rank of the group of {split.size}, got {output!r}")


def parallel_decode(vae: WanVAE, latents: Tensor, group=None, dim: str = "height", output: Output = "all",
                    exchange: str = "p2p", chunk_frames: int = 1) -> Optional[Tensor]:
    """``vae.decode(latents)`` split along ``dim`` ("height" or "width") over ``group``."""
    return ParallelWanVAE(vae, group, dim, exchange).decode(latents, output, chunk_frames)
