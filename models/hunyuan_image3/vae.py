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

Channels-last path (`HunyuanVAE.set_channels_last`, the pipeline's choice for a bf16 / fp16 VAE on CUDA): the
activation is kept channels_last_3d ([B, C, T, H, W] stored as B, T, H, W, C) from the first convolution to
the last. Why: on an H200, bf16 2-D convs over channels_last frames run a 4-frame conv faster than F.conv3d on
NCDHW (bench/results/h200-2026-12-03/lm-head-fp8/vae_conv_probe.json), and on NCDHW cuDNN spends a sizeable
share of a request's convolution time in nchwToNhwc/nhwcToNchw layout conversions (its tensor-core kernels
want channels last). In that layout every frame is a channels_last 2-D image and the frames of one sample are
consecutive, so the 5-D map IS a batch of channels_last frames (a view): each 3x3x3 conv runs as 2-D convs,
one per time tap over the frames it meets (3T - 2 frame-taps; `VAEConv3d._forward_cl`), 1x1x1 convs as one
GEMM over positions, GroupNorm's statistics and its normalization read the strided map in place
(`VAEGroupNorm`), residuals are added in place, and the upsampler's depth-to-space (the downsampler's
space-to-depth) writes its channels_last output directly, its shortcut added in the same pass. The image and
the encoder's moments come back contiguous. Same values as the NCDHW path up to summation order
(tests/hunyuan_image3/test_vae_channels_last.py).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dtgen.layers.conv import conv3d

_GROUPS = 32
_NORM_EPS = 1e-6
# DiagonalGaussianDistribution clamps the log-variance to this range before exp().
_LOGVAR_RANGE = (-30.0, 20.0)
_CL = torch.channels_last_3d


def _cl_empty(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=_CL)


def _is_cl(module: nn.Module) -> bool:
    """Whether a conv runs the channels-last path (a split decode's HaloConv never does)."""
    return getattr(module, "channels_last", False)


def _add_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out[...] = a + b in one pass (out a strided view); under torch.compile as a copy_ of the
    sum, which inductor fuses (it refuses out= views)."""
    if torch.compiler.is_compiling():
        out.copy_(a + b)
    else:
        torch.add(a, b, out=out)


def _positions(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B, T, H, W, C]: for a channels_last_3d map, its memory as a
    contiguous view (channels fastest)."""
    return x.permute(0, 2, 3, 4, 1)


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
    # Set per instance by HunyuanVAE.set_channels_last: the input is channels_last_3d and so
    # is the output (`_forward_cl`); `cache_cl_weights` keeps the 2-D channels_last kernels.
    channels_last = False
    cache_cl_weights = False

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size, padding=kernel_size // 2)

    def forward(self, x: Tensor, pad_rows: bool = True) -> Tensor:
        """`pad_rows=False`: no zero padding along H (a slab of rows that carries its halo)."""
        if self.channels_last:
            return self._forward_cl(x, pad_rows)
        k, t = self.kernel_size[0], x.shape[2]
        if k == 1:
            b, c, _, h, w = x.shape
            y = F.conv2d(x.reshape(b, c, t * h, w), self.weight.view(self.out_channels, c, 1, 1), self.bias)
            return y.view(b, self.out_channels, t, h, w)
        ph = k // 2 if pad_rows else 0
        if k != 3 or t > self.FOLD_MAX_FRAMES:
            return conv3d(x, self.weight, self.bias, (k // 2, ph, k // 2))
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

    def cl_taps(self) -> tuple[Tensor, Tensor, Tensor]:
        """The 3x3x3 kernel's three time taps as channels_last 2-D kernels [O, C, 3, 3] (one
        copy of the weight, [kT, O, kH, kW, C] in memory). Kept when `cache_cl_weights` (and
        remade only if the weight tensor is replaced, e.g. a phase binding another view), else
        made per call: the decoder's 3x3x3 weights are 1.7 GB in bf16, so the choice is a copy
        per decode (its time: bench/results/h200-2026-12-03-keep-ar/fusions/bench_vae_suite.json) or a second
        resident copy of 1.7 GB."""
        w = self.weight
        compiling = torch.compiler.is_compiling()
        if self.cache_cl_weights and not compiling:
            key = (w.data_ptr(), w._version, w.dtype, w.device)
            cached = self.__dict__.get("_cl_taps_cache")
            if cached is not None and cached[0] == key:
                return cached[1]
        m = w.permute(2, 0, 3, 4, 1).contiguous()
        taps = tuple(m[i].permute(0, 3, 1, 2) for i in range(3))
        if self.cache_cl_weights and not compiling:
            self.__dict__["_cl_taps_cache"] = (key, taps)
        return taps

    def _forward_cl(self, x: Tensor, pad_rows: bool) -> Tensor:
        """The channels-last path (module docstring): x [B, C, T, H, W] channels_last_3d, read
        as B*T channels_last frames (a view). 3x3x3: the middle tap over every frame, then the
        first (second) tap's conv of frames 0..T-2 (1..T-1) added into frames 1..T-1 (0..T-2):
        the 3T - 2 frame-taps that meet a frame, none on the zero time padding (`taps2d_cl_resident`
        in bench/results/h200-2026-12-03/lm-head-fp8/vae_conv_probe.json). 1x1x1: one GEMM over
        positions. Output channels_last_3d."""
        b, c, t, h, w = x.shape
        k = self.kernel_size[0]
        if k == 1:
            y = F.linear(_positions(x), self.weight.view(self.out_channels, c), self.bias)
            return y.permute(0, 4, 1, 2, 3)
        if k != 3:   # not in the VAE
            return F.conv3d(x, self.weight.contiguous(memory_format=_CL), self.bias,
                            padding=(k // 2, k // 2 if pad_rows else 0, k // 2))
        pad = (1 if pad_rows else 0, 1)
        frames = x.transpose(1, 2).flatten(0, 1)            # [B*T, C, H, W], channels_last
        if t == 1 and not (self.cache_cl_weights and not torch.compiler.is_compiling()):
            middle = self.weight[:, :, 1].contiguous(memory_format=torch.channels_last)
            return F.conv2d(frames, middle, self.bias, padding=pad).unsqueeze(2)
        before, middle, after = self.cl_taps()
        y = F.conv2d(frames, middle, self.bias, padding=pad)
        for i in range(b if t > 1 else 0):   # per sample: its frames are consecutive
            fx, fy = frames[i * t:(i + 1) * t], y[i * t:(i + 1) * t]
            fy[1:] += F.conv2d(fx[:-1], before, None, padding=pad)
            fy[:-1] += F.conv2d(fx[1:], after, None, padding=pad)
        return y.unflatten(0, (b, t)).transpose(1, 2)


class VAEGroupNorm(nn.GroupNorm):
    """nn.GroupNorm, computed faster on the decoder's big maps: PyTorch's CUDA kernel reduces
    each (sample, group) row in one thread block, 32 blocks for a whole 1024x1024 map (a large
    share of a decode's time on an H200); `torch.var_mean` spreads each row over many blocks.
    Normalization is one eval-mode batch-norm pass, as PyTorch's own kernels compute it
    (fp32 statistics and affine, output in x's dtype): the same values up to summation order."""

    # Statistics of bf16 / fp16 maps are taken in fp32, this many groups at a time (a
    # transient fp32 copy of 1/GROUP_CHUNKS of the map, not all of it).
    GROUP_CHUNKS = 4
    # Set by HunyuanVAE.set_channels_last: x is channels_last_3d; the statistics read it in
    # place and the normalized map comes out channels_last_3d (no layout copy).
    channels_last = False

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return super().forward(x)   # batch_norm takes no gradient through its statistics
        return self.normalize(x, self.statistics(x))

    def statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per (sample, group) mean and biased variance of the whole map, fp32, [B, G] each."""
        b, g = x.shape[0], self.num_groups
        if self.channels_last:
            # channels fastest: [B, T*H*W, G, C/G], a view of a channels_last_3d map; each
            # group reduced over its positions and its channels
            xg, dims = _positions(x).reshape(b, -1, g, x.shape[1] // g), (1, 3)
            split = 2
        else:
            xg, dims, split = x.reshape(b, g, -1), -1, 1
        if x.dtype == torch.float32:
            var, mean = torch.var_mean(xg, dim=dims, correction=0)
        else:
            parts = [torch.var_mean(part.float(), dim=dims, correction=0)
                     for part in xg.chunk(min(self.GROUP_CHUNKS, g), dim=split)]
            var, mean = torch.cat([v for v, _ in parts], 1), torch.cat([m for _, m in parts], 1)
        return mean, var

    def normalize(self, x: Tensor, stats: tuple[Tensor, Tensor]) -> Tensor:
        """x (the whole map, or any part of it: rows, frames) normalized with `stats`."""
        b, c = x.shape[:2]
        rep = c // self.num_groups
        mean, var = stats
        if self.channels_last:
            return self._normalize_cl(x, mean.repeat_interleave(rep, 1), var.repeat_interleave(rep, 1))
        y = F.batch_norm(x.reshape(1, b * c, -1), mean.repeat_interleave(rep, 1).reshape(-1),
                         var.repeat_interleave(rep, 1).reshape(-1),
                         self.weight.float().repeat(b) if self.weight is not None else None,
                         self.bias.float().repeat(b) if self.bias is not None else None,
                         training=False, momentum=0.0, eps=self.eps)
        return y.view(x.shape)

    def _normalize_cl(self, x: Tensor, mean: Tensor, var: Tensor) -> Tensor:
        """Per-sample eval-mode batch norm on the [1, C, T, H, W] channels_last_3d map itself
        (its elementwise kernel follows the input's strides; out channels_last_3d, any rows or
        frames of a map: a fresh tensor). Several samples: one pass each into the output."""
        w = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None

        def one(i: int) -> Tensor:
            return F.batch_norm(x[i:i + 1], mean[i], var[i], w, bias, training=False, momentum=0.0, eps=self.eps)
        if x.shape[0] == 1:
            return one(0)
        out = _cl_empty(x.shape, x)
        for i in range(x.shape[0]):
            out[i:i + 1].copy_(one(i))
        return out


def _cl_rows_conv(conv: "VAEConv3d", slab: Tensor, a: int, b: int, lo: int, hi: int) -> Tensor:
    """Channels-last: the conv's output rows [a, b) of a map, from the slab of
    its input rows [lo, hi) (the halo included). A slab on the map's top or bottom edge takes
    the conv's own zero padding on both sides and the rows it computes past the slab are cut
    (at most two rows: no padded copy of the slab, as F.pad would make); inner slabs none."""
    p = conv.kernel_size[1] // 2
    if a - lo < p or hi - b < p:
        return conv(slab)[..., a - lo:b - lo, :]
    return conv(slab, pad_rows=False)[..., a - lo - p:b - lo - p, :]


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
    cl = _is_cl(conv)
    for a, b in _row_slabs(h, chunks):
        lo, hi = max(a - p, 0), min(b + p, h)
        y = F.silu(norm.normalize(x[..., lo:hi, :], stats), inplace=True)
        if cl:
            y = _cl_rows_conv(conv, y, a, b, lo, hi)
        else:
            if a - lo < p or hi - b < p:   # the map's top or bottom edge: the conv's zero padding
                y = F.pad(y, (0, 0, p - (a - lo), p - (hi - b)))
            y = conv(y, pad_rows=False)
        if out is None:
            out = (_cl_empty((*y.shape[:3], h, y.shape[-1]), y) if cl else
                   torch.empty(*y.shape[:3], h, y.shape[-1], dtype=y.dtype, device=y.device))
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
        if _is_cl(self.q):   # tokens are the positions of the channels_last map: views
            def tokens_cl(y: Tensor) -> Tensor:
                return _positions(y).reshape(b, 1, t * h * w, c)
            a = F.scaled_dot_product_attention(tokens_cl(self.q(n)), tokens_cl(self.k(n)), tokens_cl(self.v(n)))
            return x + self.proj_out(a.reshape(b, t, h, w, c).permute(0, 4, 1, 2, 3))

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
        if _is_cl(self.conv):
            return self._forward_cl(x, row_chunks)
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

    def _forward_cl(self, x: Tensor, row_chunks: int) -> Tensor:
        """Channels-last: the output [B, C_out, T*rt, 2H, 2W] is channels_last_3d, i.e. memory
        [B, T, rt, H, 2, W, 2, C_out], and the conv's output at (t, h, w) holds channels
        (rt, rh, rw, c): depth-to-space is a permutation of the conv output's memory view, and
        one add writes conv + shortcut straight into the output (no depth-to-space copy and
        no second pass for the shortcut). With `row_chunks`, a slab of rows at a time (the
        conv's whole output never exists)."""
        b, c_in, t, h, w = x.shape
        rt, r = self.rt, self.repeats
        c_out = self.conv.out_channels // (rt * 4)
        out = _cl_empty((b, c_out, t * rt, 2 * h, 2 * w), x)
        out_m = _positions(out).view(b, t, rt, h, 2, w, 2, c_out)
        # Input channel s*(C_out/r) + c // r at sub-position s: a broadcast view, as forward's
        # (C_out/r = C_in/(rt*4) is whole: C_in is a multiple of 32).
        q = c_out // r
        shortcut = _positions(x).unflatten(-1, (rt, 2, 2, q, 1)).permute(0, 1, 4, 2, 5, 3, 6, 7, 8)
        out_m = out_m.unflatten(-1, (q, r))
        slabs = _row_slabs(h, row_chunks) if row_chunks > 1 and _chunkable(self.conv) else [(0, h)]
        for a, bb in slabs:
            lo, hi = max(a - 1, 0), min(bb + 1, h)
            y = self.conv(x) if len(slabs) == 1 else _cl_rows_conv(self.conv, x[..., lo:hi, :], a, bb, lo, hi)
            y = _positions(y).unflatten(-1, (rt, 2, 2, q, r)).permute(0, 1, 4, 2, 5, 3, 6, 7, 8)
            _add_into(y, shortcut[:, :, :, a:bb], out_m[:, :, :, a:bb])
            del y
        return out


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
        if _is_cl(self.conv):
            return self._forward_cl(x)
        h = _space_to_depth(self.conv(x), self.rt)
        shortcut = _space_to_depth(x, self.rt)
        b, _, t, hh, ww = shortcut.shape
        # Consecutive channels after the (rt, rh, rw, c) merge, as the official view(...).mean(2).
        shortcut = shortcut.view(b, h.shape[1], self.group_size, t, hh, ww).mean(dim=2)
        return h + shortcut

    def _forward_cl(self, x: Tensor) -> Tensor:
        """Channels-last: the output [B, rt*4*o, T/rt, H/2, W/2] is channels_last_3d, memory
        [B, T/rt, H/2, W/2, rt, 2, 2, o]: space-to-depth is a permutation of the conv output's
        memory view [B, T/rt, rt, H/2, 2, W/2, 2, o], and one add writes conv + shortcut into
        the output. The shortcut's groups of consecutive channels lie within one input
        channel block (C_in / group size = o, whole): its mean is taken on the input's view,
        no space-to-depth copy of the input."""
        y = self.conv(x)
        b, o, tt, hh, ww = y.shape
        rt, gs, c_in = self.rt, self.group_size, x.shape[1]
        t, h, w = tt // rt, hh // 2, ww // 2
        out = _cl_empty((b, rt * 4 * o, t, h, w), y)
        out_m = _positions(out).view(b, t, h, w, rt, 2, 2, o)
        y_m = _positions(y).reshape(b, t, rt, h, 2, w, 2, o).permute(0, 1, 3, 5, 2, 4, 6, 7)
        x_m = _positions(x).reshape(b, t, rt, h, 2, w, 2, c_in).permute(0, 1, 3, 5, 2, 4, 6, 7)
        shortcut = x_m.unflatten(-1, (o, gs)).mean(dim=-1)
        _add_into(y_m, shortcut, out_m)
        return out


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
        if _is_cl(self.conv_in):
            z = z.contiguous(memory_format=_CL)
            h = self.conv_in(z)
            # the shortcut: channel c reads latent channel c // in_repeats, added in place
            h.unflatten(1, (z.shape[1], self.in_repeats)).add_(z.unsqueeze(2))
        else:
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
        cl = _is_cl(self.conv_in)
        h = self.conv_in(x.contiguous(memory_format=_CL) if cl else x)
        for level in self.down:
            h = level(h, row_chunks)
        h = self.mid(h, row_chunks)
        b, c, t, hh, ww = h.shape
        shortcut = h.view(b, c // self.out_group_size, self.out_group_size, t, hh, ww).mean(dim=2)
        out = self.conv_out(F.silu(self.norm_out(h))) + shortcut
        return out.contiguous() if cl else out   # the moments (latent-sized) in the usual layout


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

    def set_channels_last(self, enabled: bool = True, cache_weights: bool = False,
                          decoder: bool = True, encoder: bool = True) -> "HunyuanVAE":
        """Run the decoder (`decoder`) and the encoder (`encoder`) on the channels-last path
        (module docstring), or back on the NCDHW one (`enabled=False`; the float32 golden
        path). Worth it in bf16 / fp16 on CUDA, where cuDNN's tensor-core convolutions want
        channels last; on the CPU it computes the same values (tests).

        `cache_weights`: each 3x3x3 conv keeps its weight as three channels_last 2-D kernels
        (made now, once; remade only if the weight tensor is replaced), a second resident
        copy of the VAE's conv weights (1.7 GB for the released decoder in bf16, 0.8 GB for the
        encoder); else the kernels are made per conv call (its cost: `python -m bench vae decode`'s
        bf16_cl_eager against bf16_cl_cached_eager,
        bench/results/h200-2026-12-03-keep-ar/fusions/bench_vae_suite.json). Not for a split decode
        (parallel_vae swaps the convs for halo ones; leave `decoder` False there)."""
        parts = [m for m, on in ((self.decoder, decoder), (self.encoder, encoder)) if on and m is not None]
        for part in parts:
            for m in part.modules():
                if isinstance(m, (VAEConv3d, VAEGroupNorm)):
                    m.channels_last = enabled
                if isinstance(m, VAEConv3d):
                    m.cache_cl_weights = enabled and cache_weights
                    m.__dict__.pop("_cl_taps_cache", None)
                    if m.cache_cl_weights and m.kernel_size[0] == 3:
                        m.cl_taps()
        return self

    @property
    def channels_last(self) -> dict[str, bool]:
        """Which parts run the channels-last path."""
        return {name: bool(part is not None and _is_cl(part.conv_in))
                for name, part in (("decoder", self.decoder), ("encoder", self.encoder))}

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
        image = self.decoder(self._to_decoder_space(latents), last_frame=True, row_chunks=row_chunks)[:, :, -1]
        # channels-last: the image [B, 3, H, W] is a strided view of the last frame; callers
        # get the usual layout (3 channels: a small copy)
        return image.contiguous() if _is_cl(self.decoder.conv_in) else image
