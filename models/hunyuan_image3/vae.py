"""HunyuanImage-3.0 VAE (the official ``AutoencoderKLConv3D``) as plain modules.

The decoder always exists. The encoder exists only when the config says
``only_decoder: false``: text-to-image never encodes and its checkpoints store just
``vae.decoder.*``, while image editing (TI2I) encodes the reference image and its
checkpoints also store ``vae.encoder.*``. Module and parameter names mirror the checkpoint,
so ``HunyuanVAE.state_dict()`` keys are the checkpoint keys without the ``vae.`` prefix.

Shapes: the decoder is a 3-D (video) decoder. A latent image [B, C, h, w] is given a time
axis T=1; the first log2(ffactor_temporal) upsamplers also double time, so the decoder
returns ffactor_temporal frames [B, 3, T_out, f*h, f*w] (f = ffactor_spatial) and the
image is the LAST frame. The encoder is the mirror image: an image is repeated into
ffactor_temporal identical frames, the last log2(ffactor_temporal) spatial downsamplers
also halve time, and one latent frame comes out.

Every convolution is a ``VAEConv3d`` (symmetric zero padding) called as a module on a
[B, C, T, H, W] tensor, so a spatially split decode can swap each one for a
halo-exchanging version without touching the blocks that call it. (The GroupNorm
statistics and the mid-block attention span the whole image, so a split decode must
handle those too; the upsamplers' depth-to-space is per position and splits freely.)
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_GROUPS = 32
_NORM_EPS = 1e-6
# DiagonalGaussianDistribution clamps the log-variance to this range before exp().
_LOGVAR_RANGE = (-30.0, 20.0)


@dataclass(frozen=True)
class VAEConfig:
    """The model-relevant part of the official ``vae`` sub-config (same field names).

    ``block_out_channels`` is listed in ENCODER order, as in the official config; the
    decoder walks it reversed.

    ``only_decoder`` defaults to True although the official class defaults to False: a
    config that does not say otherwise is taken as a text-to-image one, whose checkpoint
    holds no encoder weights (and whose VAE widths the encoder may not even accept).
    """

    block_out_channels: tuple[int, ...]
    layers_per_block: int
    latent_channels: int
    out_channels: int
    ffactor_spatial: int
    ffactor_temporal: int
    scaling_factor: float
    shift_factor: Optional[float] = None
    upsample_match_channel: bool = True
    in_channels: int = 3
    only_decoder: bool = True
    downsample_match_channel: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "VAEConfig":
        """Read the official ``vae`` dict; unknown fields (encoder settings, tiling sizes,
        ``_class_name``, ...) are ignored, a missing required field raises ValueError."""
        kwargs = {}
        for f in fields(cls):
            if f.name in d:
                kwargs[f.name] = d[f.name]
            elif f.default is MISSING:
                raise ValueError(f"VAE config is missing required field {f.name!r}")
        kwargs["block_out_channels"] = tuple(int(c) for c in kwargs["block_out_channels"])
        return cls(**kwargs)

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        return tuple(reversed(self.block_out_channels))


def _log2_exact(n: int, name: str) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two, got {n}")
    return n.bit_length() - 1


def _check_group_widths(channels: tuple[int, ...]) -> None:
    for c in channels:
        if c % _GROUPS:
            raise ValueError(f"block_out_channels entries must be multiples of {_GROUPS}, got {c}")


class VAEConv3d(nn.Conv3d):
    """3-D convolution with symmetric zero padding, the only convolution type in the VAE.

    The official subclass splits the time axis into chunks (with a one-frame overlap) once
    an input exceeds 2 GiB, purely to bound memory; the result is the same convolution,
    so it is not reproduced here.

    Few frames run as 2-D convolutions computing the same sums without the taps that only
    meet the zero time padding (the decoder starts from ONE frame; its first levels have 1
    and 2): a 3x3x3 conv on T=1 is the 3x3 conv of the middle time tap (a third of the
    FLOPs); on T=2 frames folded into channels ([C, T] -> C*T, no copy) meet a [2 Cout, 2 C]
    kernel of the four taps that touch a frame (4 of 6 frame-taps); 1x1x1 convs are 1x1 2-D
    convs. Exact up to float summation order (cuDNN picks other algorithms).
    `FOLD_MAX_FRAMES` (0: never) says up to how many frames the 3x3x3 conv is folded; more
    frames would need T^2 > 3T frame-taps.
    """

    FOLD_MAX_FRAMES = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size, padding=kernel_size // 2)

    def forward(self, x: Tensor, pad_rows: bool = True) -> Tensor:
        """`pad_rows=False`: no zero padding along H (a slab of rows that carries its halo)."""
        k, t = self.kernel_size[0], x.shape[2]
        if k == 1:
            b, c, _, h, w = x.shape
            y = F.conv2d(x.reshape(b, c, t * h, w), self.weight.view(self.out_channels, c, 1, 1), self.bias)
            return y.view(b, self.out_channels, t, h, w)
        ph = k // 2 if pad_rows else 0
        if k != 3 or t > self.FOLD_MAX_FRAMES:
            return F.conv3d(x, self.weight, self.bias, padding=(k // 2, ph, k // 2))
        b, c, _, h, w = x.shape
        if t == 1:
            return F.conv2d(x[:, :, 0], self.weight[:, :, 1], self.bias, padding=(ph, 1)).unsqueeze(2)
        # T frames: input channel (c, s), output channel (o, r), tap s - r + 1 when it exists.
        taps = torch.arange(t, device=x.device)
        tap = taps[None, :] - taps[:, None] + 1                      # [r, s]
        inside = ((tap >= 0) & (tap <= 2)).to(self.weight.dtype)
        kernel = self.weight[:, :, tap.clamp(0, 2)] * inside[None, None, :, :, None, None]  # [o, c, r, s, 3, 3]
        kernel = kernel.permute(0, 2, 1, 3, 4, 5).reshape(self.out_channels * t, c * t, 3, 3)
        bias = self.bias.repeat_interleave(t) if self.bias is not None else None
        y = F.conv2d(x.reshape(b, c * t, h, w), kernel, bias, padding=(ph, 1))
        return y.view(b, self.out_channels, t, y.shape[-2], w)


class VAEGroupNorm(nn.GroupNorm):
    """nn.GroupNorm, computed faster on the decoder's big maps: PyTorch's CUDA kernel reduces
    each (sample, group) row in one thread block, 32 blocks for a whole 1024x1024 map (158 ms
    of a 555 ms decode on an H200); `torch.var_mean` spreads each row over many blocks.
    Normalization is one eval-mode batch-norm pass, as PyTorch's own kernels compute it
    (fp32 statistics and affine, output in x's dtype): the same values up to summation order."""

    # Statistics of bf16 / fp16 maps are taken in fp32, this many groups at a time (a
    # transient fp32 copy of 1/GROUP_CHUNKS of the map, not all of it).
    GROUP_CHUNKS = 4

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return super().forward(x)   # batch_norm takes no gradient through its statistics
        return self.normalize(x, self.statistics(x))

    def statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per (sample, group) mean and biased variance of the whole map, fp32, [B, G] each."""
        b, g = x.shape[0], self.num_groups
        xg = x.reshape(b, g, -1)
        if x.dtype == torch.float32:
            var, mean = torch.var_mean(xg, dim=-1, correction=0)
        else:
            parts = [torch.var_mean(part.float(), dim=-1, correction=0)
                     for part in xg.chunk(min(self.GROUP_CHUNKS, g), dim=1)]
            var, mean = torch.cat([v for v, _ in parts], 1), torch.cat([m for _, m in parts], 1)
        return mean, var

    def normalize(self, x: Tensor, stats: tuple[Tensor, Tensor]) -> Tensor:
        """x (the whole map, or any part of it: rows, frames) normalized with `stats`."""
        b, c = x.shape[:2]
        rep = c // self.num_groups
        mean, var = stats
        y = F.batch_norm(x.reshape(1, b * c, -1), mean.repeat_interleave(rep, 1).reshape(-1),
                         var.repeat_interleave(rep, 1).reshape(-1),
                         self.weight.float().repeat(b) if self.weight is not None else None,
                         self.bias.float().repeat(b) if self.bias is not None else None,
                         training=False, momentum=0.0, eps=self.eps)
        return y.view(x.shape)


def _row_slabs(rows: int, chunks: int) -> list[tuple[int, int]]:
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def norm_silu_conv_rows(x: Tensor, norm: VAEGroupNorm, conv: VAEConv3d, chunks: int,
                        out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    return norm_silu_conv_rows_with(x, norm, norm.statistics(x), conv, chunks, out, accumulate)


def norm_silu_conv_rows_with(x: Tensor, norm: VAEGroupNorm, stats: tuple[Tensor, Tensor], conv: VAEConv3d,
                             chunks: int, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """conv(silu(norm(x))) computed over `chunks` slabs of rows (H): the norm's statistics of
    the whole map first, then per slab its rows plus a one-row halo normalized, SiLU'd and
    convolved (zero rows at the map's edges, as the conv's own padding), so the normalized
    map never exists whole. The result goes into `out` (allocated when None), or is added to
    it (`accumulate`: a residual). Exact: every output row sums the same products.
    `stats`: the norm's statistics of the whole map (x may be part of its frames)."""
    h = x.shape[-2]
    p = conv.kernel_size[1] // 2
    for a, b in _row_slabs(h, chunks):
        lo, hi = max(a - p, 0), min(b + p, h)
        y = F.silu(norm.normalize(x[..., lo:hi, :], stats), inplace=True)
        if a - lo < p or hi - b < p:   # the map's top or bottom edge: the conv's zero padding
            y = F.pad(y, (0, 0, p - (a - lo), p - (hi - b)))
        y = conv(y, pad_rows=False)
        if out is None:
            out = torch.empty(*y.shape[:3], h, y.shape[-1], dtype=y.dtype, device=y.device)
        if accumulate:
            out[..., a:b, :].add_(y)
        else:
            out[..., a:b, :].copy_(y)
    return out


def _chunkable(*modules) -> bool:
    """Row chunks need the plain modules (a split decode swaps in halo and distributed ones)
    and no autograd (the residual goes into the input in place)."""
    return not torch.is_grad_enabled() and all(isinstance(m, (VAEGroupNorm, VAEConv3d)) for m in modules)


def _group_norm(channels: int) -> nn.GroupNorm:
    return VAEGroupNorm(_GROUPS, channels, eps=_NORM_EPS, affine=True)


class ResnetBlock(nn.Module):
    """norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> conv2, plus the (projected) input."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = _group_norm(in_channels)
        self.conv1 = VAEConv3d(in_channels, out_channels, 3)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = VAEConv3d(out_channels, out_channels, 3)
        # The checkpoint only has a shortcut projection where the width changes.
        self.nin_shortcut = VAEConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        """`row_chunks` > 1: each norm -> SiLU -> conv runs over that many slabs of rows
        (`norm_silu_conv_rows`) and conv2 adds into the input in place (no shortcut
        projection): two whole maps live at once instead of three. Exact."""
        if row_chunks > 1 and self.nin_shortcut is None and _chunkable(self.norm1, self.conv1, self.norm2, self.conv2):
            h = norm_silu_conv_rows(x, self.norm1, self.conv1, row_chunks)
            return norm_silu_conv_rows(h, self.norm2, self.conv2, row_chunks, out=x, accumulate=True)
        # One name per intermediate, reassigned, and SiLU and the residual in place: at most
        # the input, a conv's input and its output live at once (the decoder's last level
        # holds 2 GB maps in fp32).
        h = F.silu(self.norm1(x), inplace=True)
        h = self.conv1(h)
        h = F.silu(self.norm2(h), inplace=True)
        h = self.conv2(h)
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return h.add_(x)


class AttnBlock(nn.Module):
    """Single-head self-attention over every (t, h, w) position, scale 1/sqrt(C)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = VAEConv3d(channels, channels, 1)
        self.k = VAEConv3d(channels, channels, 1)
        self.v = VAEConv3d(channels, channels, 1)
        self.proj_out = VAEConv3d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        n = self.norm(x)

        def tokens(y: Tensor) -> Tensor:  # [B, C, T, H, W] -> [B, 1, T*H*W, C]
            return y.flatten(2).transpose(1, 2).unsqueeze(1)

        a = F.scaled_dot_product_attention(tokens(self.q(n)), tokens(self.k(n)), tokens(self.v(n)))
        a = a.squeeze(1).transpose(1, 2).reshape(b, c, t, h, w)
        return x + self.proj_out(a)


def _depth_to_space(x: Tensor, rt: int) -> Tensor:
    """[B, (rt*2*2*C), T, H, W] -> [B, C, T*rt, H*2, W*2].

    The channel index splits as (rt, rh, rw, c) with c fastest; channel (i, j, k, c) at
    input position (t, h, w) lands at output position (t*rt + i, h*2 + j, w*2 + k).
    """
    b, ch, t, h, w = x.shape
    c = ch // (rt * 4)
    x = x.reshape(b, rt, 2, 2, c, t, h, w)
    x = x.permute(0, 4, 5, 1, 6, 2, 7, 3)  # b, c, t, rt, h, rh, w, rw
    return x.reshape(b, c, t * rt, h * 2, w * 2)


class Upsample(nn.Module):
    """DCAE-style upsampler: conv to C_out*rt*2*2 channels, depth-to-space, plus the same
    depth-to-space of the input repeated channel-wise (a parameter-free shortcut)."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        if (factor * out_channels) % in_channels:
            raise ValueError(
                f"upsampler {in_channels}->{out_channels} (x{factor}): "
                f"{factor * out_channels} is not a multiple of {in_channels}"
            )
        self.repeats = factor * out_channels // in_channels
        self.conv = VAEConv3d(in_channels, out_channels * factor, 3)

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        # repeat_interleave (each channel `repeats` times in a row), NOT tile: after the
        # (rt, rh, rw, c) split, output channel c at sub-position s reads input channel
        # (s*C_out + c) // repeats.
        if row_chunks > 1 and _chunkable(self.conv):
            # The conv and its depth-to-space a slab of rows at a time, into the output: the
            # conv's whole output never exists beside it.
            rows = x.shape[-2]
            y = None
            for a, b in _row_slabs(rows, row_chunks):
                lo, hi = max(a - 1, 0), min(b + 1, rows)
                part = F.pad(x[..., lo:hi, :], (0, 0, 1 - (a - lo), 1 - (hi - b)))
                part = _depth_to_space(self.conv(part, pad_rows=False), self.rt)
                if y is None:
                    y = torch.empty(*part.shape[:3], 2 * rows, part.shape[-1], dtype=part.dtype, device=part.device)
                y[..., 2 * a:2 * b, :].copy_(part)
                del part
        else:
            y = _depth_to_space(self.conv(x), self.rt).contiguous()  # a fresh tensor: added to in place
        b, c_out, tt, hh, ww = y.shape
        c_in, t, h, w = x.shape[1:]
        r = self.repeats
        if c_out % r:
            return y.add_(_depth_to_space(x.repeat_interleave(r, dim=1), self.rt))
        # When C_out is a multiple of `repeats`, input channel (s*C_out + c) // r is
        # s*(C_out/r) + c // r: the shortcut is a broadcast view of x, added in place
        # without materializing the repeated input or its depth-to-space.
        q = c_out // r
        shortcut = x.reshape(b, self.rt, 2, 2, q, 1, t, h, w).expand(b, self.rt, 2, 2, q, r, t, h, w)
        shortcut = shortcut.permute(0, 4, 5, 6, 1, 7, 2, 8, 3)   # b, q, r, t, rt, h, rh, w, rw
        y.view(b, q, r, t, self.rt, h, 2, w, 2).add_(shortcut)
        return y


class UpLevel(nn.Module):
    """One decoder level: ``layers_per_block + 1`` ResnetBlocks, then an optional upsampler
    (the attribute exists only on levels that upsample, as in the checkpoint)."""

    def __init__(self, blocks: list[ResnetBlock], upsample: Optional[Upsample]):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.upsample = upsample

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        for blk in self.block:
            x = blk(x, row_chunks) if row_chunks > 1 else blk(x)
        if self.upsample is not None:
            x = self.upsample(x, row_chunks) if row_chunks > 1 else self.upsample(x)
        return x


def _space_to_depth(x: Tensor, rt: int) -> Tensor:
    """[B, C, T*rt, H*2, W*2] -> [B, (rt*2*2*C), T, H, W], the inverse of ``_depth_to_space``.

    Input position (t*rt + i, h*2 + j, w*2 + k) of channel c lands in channel (i, j, k, c),
    c fastest, at output position (t, h, w).
    """
    b, c, tt, hh, ww = x.shape
    t, h, w = tt // rt, hh // 2, ww // 2
    x = x.reshape(b, c, t, rt, h, 2, w, 2)
    x = x.permute(0, 3, 5, 7, 1, 2, 4, 6)  # b, rt, rh, rw, c, t, h, w
    return x.reshape(b, rt * 4 * c, t, h, w)


class Downsample(nn.Module):
    """DCAE-style downsampler: conv to C_out/(rt*2*2) channels, space-to-depth, plus the same
    space-to-depth of the input averaged over groups of consecutive channels (a
    parameter-free shortcut)."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        if out_channels % factor or (factor * in_channels) % out_channels:
            raise ValueError(
                f"downsampler {in_channels}->{out_channels} (x{factor}): {out_channels} must be a multiple "
                f"of {factor} and divide {factor * in_channels}"
            )
        self.group_size = factor * in_channels // out_channels
        self.conv = VAEConv3d(in_channels, out_channels // factor, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = _space_to_depth(self.conv(x), self.rt)
        shortcut = _space_to_depth(x, self.rt)
        b, _, t, hh, ww = shortcut.shape
        # Consecutive channels after the (rt, rh, rw, c) merge, as the official view(...).mean(2).
        shortcut = shortcut.view(b, h.shape[1], self.group_size, t, hh, ww).mean(dim=2)
        return h + shortcut


class DownLevel(nn.Module):
    """One encoder level: ``layers_per_block`` ResnetBlocks, then an optional downsampler
    (the attribute exists only on levels that downsample, as in the checkpoint)."""

    def __init__(self, blocks: list[ResnetBlock], downsample: Optional[Downsample]):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.downsample = downsample

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        for blk in self.block:
            x = blk(x, row_chunks) if row_chunks > 1 else blk(x)
        if self.downsample is not None:
            x = self.downsample(x)
        return x


class MidBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        if row_chunks > 1:
            return self.block_2(self.attn_1(self.block_1(x, row_chunks)), row_chunks)
        return self.block_2(self.attn_1(self.block_1(x)))


class VAEDecoder(nn.Module):
    """The official ``Decoder``: z [B, latent_channels, T, h, w] -> [B, out_channels, T', H, W]."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans = cfg.decoder_channels
        n_spatial = _log2_exact(cfg.ffactor_spatial, "ffactor_spatial")
        n_temporal = _log2_exact(cfg.ffactor_temporal, "ffactor_temporal")
        _check_group_widths(chans)
        if chans[0] % cfg.latent_channels:
            raise ValueError(
                f"decoder width {chans[0]} must be a multiple of latent_channels {cfg.latent_channels}"
            )
        # conv_in's shortcut repeats every latent channel this many times (repeat_interleave).
        self.in_repeats = chans[0] // cfg.latent_channels

        self.conv_in = VAEConv3d(cfg.latent_channels, chans[0], 3)
        self.mid = MidBlock(chans[0])

        levels = []
        block_in = chans[0]
        for i, block_out in enumerate(chans):
            blocks = []
            for _ in range(cfg.layers_per_block + 1):
                blocks.append(ResnetBlock(block_in, block_out))
                block_in = block_out
            upsample = None
            # Upsampling levels come first; a level that doubles time also doubles space.
            if i < n_spatial or i < n_temporal:
                if i == len(chans) - 1:
                    raise ValueError(
                        f"ffactor_spatial={cfg.ffactor_spatial}/ffactor_temporal={cfg.ffactor_temporal} "
                        f"need more than {len(chans)} levels"
                    )
                up_out = chans[i + 1] if cfg.upsample_match_channel else block_in
                upsample = Upsample(block_in, up_out, temporal=i < n_temporal)
                block_in = up_out
            levels.append(UpLevel(blocks, upsample))
        self.up = nn.ModuleList(levels)

        self.norm_out = _group_norm(block_in)
        self.conv_out = VAEConv3d(block_in, cfg.out_channels, 3)

    def forward(self, z: Tensor, last_frame: bool = False, row_chunks: int = 1) -> Tensor:
        """`last_frame`: return only the last output frame ([B, C, 1, H, W]; the image), whose
        conv_out reads the last two frames alone (zero time padding after them).
        `row_chunks` > 1: the big maps' convolutions run over that many slabs of rows, so that
        fewer whole maps live at once (exact; see ResnetBlock.forward)."""
        h = self.conv_in(z) + z.repeat_interleave(self.in_repeats, dim=1)
        if row_chunks > 1:
            h = self.mid(h, row_chunks)
            for level in self.up:
                h = level(h, row_chunks)
            if _chunkable(self.norm_out, self.conv_out):
                stats = self.norm_out.statistics(h)
                if last_frame and h.shape[2] > 1:   # conv_out's last frame reads the last two
                    h = h[:, :, -2:]
                # the norm's statistics are the whole map's; rows and frames are normalized per slab
                out = norm_silu_conv_rows_with(h, self.norm_out, stats, self.conv_out, row_chunks)
                return out[:, :, -1:] if last_frame else out
        else:
            h = self.mid(h)
            for level in self.up:
                h = level(h)
        h = F.silu(self.norm_out(h), inplace=True)
        if last_frame and h.shape[2] > 1:
            return self.conv_out(h[:, :, -2:])[:, :, -1:]
        return self.conv_out(h)


class VAEEncoder(nn.Module):
    """The official ``Encoder``: x [B, in_channels, T, H, W] -> moments [B, 2*latent_channels,
    T/ffactor_temporal, H/f, W/f] (f = ffactor_spatial; mean first, then log-variance)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans = cfg.block_out_channels
        n_spatial = _log2_exact(cfg.ffactor_spatial, "ffactor_spatial")
        n_temporal = _log2_exact(cfg.ffactor_temporal, "ffactor_temporal")
        _check_group_widths(chans)
        if n_temporal > n_spatial:
            raise ValueError(f"the encoder halves time only where it halves space: ffactor_temporal="
                             f"{cfg.ffactor_temporal} must not exceed ffactor_spatial={cfg.ffactor_spatial}")

        self.conv_in = VAEConv3d(cfg.in_channels, chans[0], 3)
        levels = []
        block_in = chans[0]
        for i, block_out in enumerate(chans):
            blocks = []
            for _ in range(cfg.layers_per_block):
                blocks.append(ResnetBlock(block_in, block_out))
                block_in = block_out
            downsample = None
            # Downsampling levels come first; the LAST log2(ffactor_temporal) of them also halve
            # time (official: i >= log2(ffactor_spatial // ffactor_temporal)).
            if i < n_spatial:
                if i == len(chans) - 1:
                    raise ValueError(
                        f"ffactor_spatial={cfg.ffactor_spatial} needs more than {len(chans)} levels"
                    )
                down_out = chans[i + 1] if cfg.downsample_match_channel else block_in
                downsample = Downsample(block_in, down_out, temporal=i >= n_spatial - n_temporal)
                block_in = down_out
            levels.append(DownLevel(blocks, downsample))
        self.down = nn.ModuleList(levels)
        self.mid = MidBlock(block_in)

        moments = 2 * cfg.latent_channels
        if block_in % moments:
            raise ValueError(f"encoder width {block_in} (block_out_channels[-1]) must be a multiple of "
                             f"2*latent_channels = {moments}")
        # The end shortcut averages this many consecutive channels into each moment channel.
        self.out_group_size = block_in // moments
        self.norm_out = _group_norm(block_in)
        self.conv_out = VAEConv3d(block_in, moments, 3)

    def forward(self, x: Tensor, row_chunks: int = 1) -> Tensor:
        """`row_chunks` > 1: the ResnetBlocks' norm -> SiLU -> conv run over that many slabs of
        rows, as the decoder's (exact; ResnetBlock.forward): the first level's 4-frame maps are
        what an edit's condition encode peaks on."""
        h = self.conv_in(x)
        for level in self.down:
            h = level(h, row_chunks)
        h = self.mid(h, row_chunks)
        b, c, t, hh, ww = h.shape
        shortcut = h.view(b, c // self.out_group_size, self.out_group_size, t, hh, ww).mean(dim=2)
        return self.conv_out(F.silu(self.norm_out(h))) + shortcut


class EncodedImage(NamedTuple):
    """``HunyuanVAE.encode`` output, every tensor [B, latent_channels, h, w]."""

    mean: Tensor    # posterior mean, encoder space
    logvar: Tensor  # posterior log-variance, clamped
    noise: Tensor   # the standard-normal draw of the sample
    latent: Tensor  # (mean + exp(logvar/2) * noise - shift) * scaling: diffusion space


def _posterior_noise(shape: tuple[int, ...], generator: Optional[torch.Generator],
                     device: torch.device, dtype: torch.dtype) -> Tensor:
    """diffusers ``randn_tensor(shape, generator, device, dtype)``, single-generator case: a CPU
    generator draws on the CPU (in ``dtype``) and the draw is moved, so a seed gives the same
    noise whatever device the VAE is on."""
    if generator is None or generator.device.type == device.type:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if generator.device.type != "cpu":
        raise ValueError(f"a {generator.device.type} generator cannot draw the posterior noise for a VAE on "
                         f"{device.type}; use a CPU generator")
    return torch.randn(shape, generator=generator, device="cpu", dtype=dtype).to(device)


class HunyuanVAE(nn.Module):
    """The VAE, held by the top-level model as ``vae`` (names ``vae.decoder.*`` and, unless
    ``only_decoder``, ``vae.encoder.*``)."""

    def __init__(self, cfg: VAEConfig, with_encoder: bool = False):
        """`with_encoder`: also build the encoder (image editing encodes the reference image;
        text-to-image never encodes, so its model holds no encoder even when the checkpoint
        has one)."""
        super().__init__()
        self.cfg = cfg
        if with_encoder and cfg.only_decoder:
            raise ValueError("the VAE config says only_decoder=true: this checkpoint has no VAE encoder, which "
                             "image editing needs")
        # A plain None attribute, not a child: a decoder-only VAE has no encoder state_dict keys.
        self.encoder = VAEEncoder(cfg) if with_encoder else None
        self.decoder = VAEDecoder(cfg)

    def encode(self, pixels: Tensor, generator: Optional[torch.Generator] = None,
               row_chunks: int = 1) -> EncodedImage:
        """Images [B, in_channels, H, W] in [-1, 1] (H, W multiples of ffactor_spatial) -> a
        SAMPLE of the posterior in diffusion space, as the official ``vae_encode``.

        The image is repeated into ffactor_temporal identical frames (one latent frame comes
        out); the noise is drawn like diffusers ``randn_tensor`` (``generator`` None: the
        default generator of the VAE's device). Then shift_factor is subtracted (when set and
        non-zero) and the result multiplied by scaling_factor (when set and non-zero): the
        inverse of ``_to_decoder_space``. `row_chunks`: the encoder's (VAEEncoder.forward).
        """
        if self.encoder is None:
            raise ValueError("this VAE has no encoder (built without it, or vae config only_decoder=true); "
                             "encoding an image needs it built (image editing) from vae.encoder.* weights")
        f, c = self.cfg.ffactor_spatial, self.cfg.in_channels
        if pixels.dim() != 4 or pixels.shape[1] != c or pixels.shape[2] % f or pixels.shape[3] % f:
            raise ValueError(f"expected pixels [B, {c}, H, W] with H and W multiples of ffactor_spatial={f}, "
                             f"got shape {tuple(pixels.shape)}")
        weight = self.encoder.conv_in.weight
        frames = pixels.to(weight.device, weight.dtype).unsqueeze(2)
        frames = frames.expand(-1, -1, self.cfg.ffactor_temporal, -1, -1)
        mean, logvar = self.encoder(frames, row_chunks).chunk(2, dim=1)
        logvar = logvar.clamp(*_LOGVAR_RANGE)
        # Drawn with the [B, C, 1, h, w] shape and the moments' dtype, as the official
        # DiagonalGaussianDistribution.sample hands them to randn_tensor.
        noise = _posterior_noise(tuple(mean.shape), generator, mean.device, mean.dtype)
        latent = mean + torch.exp(0.5 * logvar) * noise
        if self.cfg.shift_factor:
            latent = latent - self.cfg.shift_factor
        if self.cfg.scaling_factor:
            latent = latent * self.cfg.scaling_factor
        return EncodedImage(*(t.squeeze(2) for t in (mean, logvar, noise, latent)))

    def _to_decoder_space(self, latents: Tensor) -> Tensor:
        """Diffusion-space [B, C, h, w] -> decoder input [B, C, 1, h, w] in the weights' dtype.

        Same order and truthiness tests as the official pipeline: divide by
        scaling_factor, then add shift_factor when it is set and non-zero; the scaling is
        done in the latents' own precision before casting.
        """
        if latents.dim() != 4:
            raise ValueError(f"expected latents [B, C, h, w], got shape {tuple(latents.shape)}")
        z = latents
        if self.cfg.scaling_factor:
            z = z / self.cfg.scaling_factor
        if self.cfg.shift_factor:
            z = z + self.cfg.shift_factor
        return z.to(self.decoder.conv_in.weight.dtype).unsqueeze(2)

    def decode_all_frames(self, latents: Tensor) -> Tensor:
        """[B, C, h, w] -> every decoded frame, [B, out_channels, ffactor_temporal, f*h, f*w]
        with f = ffactor_spatial."""
        return self.decoder(self._to_decoder_space(latents))

    def decode(self, latents: Tensor, row_chunks: int = 1) -> Tensor:
        """[B, C, h, w] -> raw image [B, out_channels, f*h, f*w] (f = ffactor_spatial): the LAST
        decoded frame, unclamped (the pipeline maps it to [0, 1] with (x/2 + 0.5).clamp)."""
        return self.decoder(self._to_decoder_space(latents), last_frame=True, row_chunks=row_chunks)[:, :, -1]
