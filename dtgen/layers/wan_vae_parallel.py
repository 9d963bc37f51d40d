"""Wan VAE decode (and the image-to-video condition's encode) split along the video height or
width over a process group.

The generic pieces (and the driver, ``SplitDecoder``) live in ``dtgen/spatial.py``; this file
maps them onto ``WanVAE`` (``dtgen/layers/wan_vae.py``: Wan's and Qwen-Image's decoder), as
``models/hunyuan_image3/parallel_vae.py`` does for HunyuanImage-3. The process group is passed in:

- every convolution -> ``HaloConv``: the 3x3x3 causal convs and the upsamplers' 3x3 conv2d get
  one row/column from each neighbour (zeros at the outer edges); 1x1x1 convs and the 3x1x1
  ``time_conv`` need no halo and run as they are. Only SPACE is exchanged: time stays whole
  on every member, so each member keeps its own causal cache (``CausalCache``) of its own
  rows; the halo of the cached context frames is re-exchanged with the current chunk's
  (the window [cached frames, chunk] goes through the halo conv as one tensor), which costs
  k_t - 1 = 2 extra frames of halo per conv and needs no cache of halos;
- norms: none to distribute. Every Wan decoder norm is ``ChannelRMSNorm``, which normalizes
  each position's channel vector on its own (no statistics over space or time), so it runs
  unchanged on a member's rows; there is no GroupNorm in the Wan decoder;
- the mid-block ``AttentionBlock`` -> ``ParallelAttentionBlock``: attention is over the h*w
  positions of each frame, so with the frames as a batch ([B*T, C, h, w]) local queries
  attend over K and V all-gathered (``split_attention``: one gather for both, uneven splits
  padded) along the split dim;
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

The encode (``parallel_encode``, an image-to-video VAE's ``encoder``) splits the same way, by
latent rows: a member holds 8 pixel rows per latent row, so every level's rows and offsets stay
even. Its convs and mid-block attention are the decode's; its downsamplers
(``ParallelDownsample``) pad one zero row at the bottom / right edge and run a 3x3 stride-2
conv, so an output row reads its two input rows and the next one: each member takes the next
member's first row (zeros past the image's edge: the unsplit zero pad). The latents are
gathered on every member.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from dtgen.spatial import (POINTWISE_LEAVES, SPLIT_DIMS, SpatialSplit, SplitDecoder, SplitOutput, check_output,
                           check_pointwise_convs, gather_split, halo_pad, route_output, spatial_parallel,
                           split_attention)

from .norms import ChannelRMSNorm
from .wan_vae import AttentionBlock, Downsample, Upsample2x, WanEncoder, WanVAE, _from_frames, _per_frame


class ParallelAttentionBlock(nn.Module):
    """``AttentionBlock`` on a split input: per frame, local queries over the whole frame's
    keys and values."""

    def __init__(self, attn: AttentionBlock, split: SpatialSplit):
        super().__init__()
        check_pointwise_convs(attn, ("to_qkv", "proj"), split.dim)
        self.attn = attn
        self.split = split

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn
        y = _per_frame(x)  # [B*T, C, h_local, w]: the split dim is still -2 / -1
        q, k, v = a.to_qkv(a.norm(y)).chunk(3, dim=1)  # the norm is per position: local rows suffice
        return x + _from_frames(a.proj(split_attention(q, k, v, self.split)), x.shape[0])


class ParallelDownsample(nn.Module):
    """An encoder ``Downsample`` on this member's rows (see the module docstring); its time conv
    (3x1x1) reads no neighbour and runs as the original's."""

    def __init__(self, down: Downsample, split: SpatialSplit, exchange: str = "p2p"):
        super().__init__()
        self.down, self.split, self.exchange = down, split, exchange
        self.time_conv = down.time_conv

    def spatial(self, frames: Tensor) -> Tensor:
        conv = self.down.resample[1]
        x = halo_pad(frames, self.split, 0, 1, self.exchange)   # the next member's first row, or the zero pad
        # the unsplit dim's own zero pad (F.pad's order: width's left, right, then height's top, bottom)
        pad = [0, 1, 0, 0] if self.split.dim == -2 else [0, 0, 0, 1]
        return conv(torch.nn.functional.pad(x, pad))

    forward = Downsample.forward


def _unchanged(module: nn.Module, split: SpatialSplit) -> nn.Module:
    return module


class ParallelWanVAE(SplitDecoder):
    """Decodes with ``vae``'s own parameters, split along ``dim`` over ``group`` (arguments:
    see ``SplitDecoder``)."""

    latent_layout = ("B", "C", "T", "h", "w")
    # The encoder (an image-to-video VAE's) stays as it is: the decode twin never runs it.
    overrides = {AttentionBlock: ParallelAttentionBlock, WanEncoder: _unchanged}
    # Leaves that act on each spatial position alone (see the module docstring).
    pointwise = (*POINTWISE_LEAVES, ChannelRMSNorm, Upsample2x)

    def video_rows(self, latents: Tensor) -> tuple[int, int]:
        """(offset, size) of this member's rows (or columns) of the decoded video, for
        ``output="local"``."""
        return self.local_rows(latents, self.vae.cfg.spatial_factor)

    def decode(self, latents: Tensor, output: SplitOutput = "all", chunk_frames: int = 1) -> Optional[Tensor]:
        """``WanVAE.decode`` of the full normalized ``latents`` (the same on every member), split.

        ``output``: "all" (full video on every member), "local" (this member's rows, see
        ``video_rows``) or a group rank (full video there, None on the others).
        """
        split = self.split_for(latents)
        check_output(output, split)
        return route_output(self.twin(split).decode(split.local(latents), chunk_frames), split, output)


def parallel_decode(vae: WanVAE, latents: Tensor, group=None, dim: str = "height", output: SplitOutput = "all",
                    exchange: str = "p2p", chunk_frames: int = 1) -> Optional[Tensor]:
    """``vae.decode(latents)`` split along ``dim`` ("height" or "width") over ``group``."""
    return ParallelWanVAE(vae, group, dim, exchange).decode(latents, output, chunk_frames)


def parallel_encode(vae: WanVAE, video: Tensor, group=None, dim: Optional[str] = None,
                    exchange: str = "p2p") -> Tensor:
    """``vae.encode(video)`` (normalized latents, on every member of ``group``) split along ``dim``
    ("height" or "width"; default: the longer side) by latent rows."""
    factor = vae.cfg.spatial_factor
    if video.shape[-2] % factor or video.shape[-1] % factor:
        raise ValueError(f"video of {video.shape[-2]}x{video.shape[-1]} px: both sides must be multiples of {factor}")
    dim = dim or ("height" if video.shape[-2] >= video.shape[-1] else "width")
    d = SPLIT_DIMS[dim]
    split = SpatialSplit.build(group, d, video.shape[d] // factor, what=f"latent {dim}")
    local = video.narrow(d, split.offset() * factor, split.sizes[split.rank] * factor)
    overrides = {AttentionBlock: ParallelAttentionBlock,
                 Downsample: lambda down, s: ParallelDownsample(down, s, exchange)}
    twin = spatial_parallel(vae, split, overrides, exchange=exchange, pointwise=ParallelWanVAE.pointwise)
    return gather_split(twin.encode(local), split)


def decode_uint8(vae: WanVAE, latents: Tensor, group=None, is_main: bool = True) -> Optional[Tensor]:
    """The decoded video as uint8 [B, T, H, W, 3] on the CPU (pixels in [-1, 1] scaled to 0..255):
    split along the longer side over `group` when one is given (the pixels on its rank 0), else
    decoded whole on the main rank; None on every other rank."""
    if group is not None:
        dim = "height" if latents.shape[-2] >= latents.shape[-1] else "width"
        video = parallel_decode(vae, latents, group, dim=dim, output=0)
    else:
        video = vae.decode(latents) if is_main else None
    if video is None:
        return None
    return ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
