"""The Wan 2.1 VAE decoder (diffusers ``AutoencoderKLWan``, z_dim 16) as plain modules.

Wan 2.1 and Wan 2.2 A14B share this VAE, and Qwen-Image's (``AutoencoderKLQwenImage``) is the
same architecture (``WanVAEConfig.from_qwen_image`` reads its config into this one's): 16 latent
channels, 8x spatial and 4x temporal compression. The decode path is always built; the encode
path (``WanEncoder``, ``quant_conv``: image-to-video encodes its reference frame) only when asked
(``WanVAE(cfg, encoder=True)``); without it the checkpoint's encoder weights are listed in
``IGNORED_CHECKPOINT_PREFIXES`` for the loader to skip.
Module and parameter names mirror the diffusers ``vae/`` state dict, so
``WanVAE.state_dict()`` keys are exactly its ``post_quant_conv.*`` and ``decoder.*`` keys.

Layout (C = decoder_base_dim, default 96; mult = dim_mult, default (1, 2, 4, 4))::

    post_quant_conv       1x1x1, z -> z
    decoder.conv_in       3x3x3 causal, z -> 4C
    decoder.mid_block     resnets.0, attentions.0 (per-frame spatial self-attention), resnets.1
    decoder.up_blocks.i   num_res_blocks + 1 resnets, then (not on the last level)
                          upsamplers.0: [time_conv: causal 3x1x1, C_i -> 2 C_i, the two halves
                          become two frames (Wan 2.1: levels 0 and 1)] -> nearest x2 in H, W
                          -> 3x3 conv2d per frame to C_i / 2 (hence the next level's input is
                          half the listed width)
    decoder.norm_out      RMS norm, SiLU
    decoder.conv_out      3x3x3 causal, -> 3

Time is causal everywhere: a 3-frame temporal kernel sees the current and the two previous
frames, zeros before the first frame. Norms are RMS norms over the channels of ONE position
(no statistics over space or time); the only layer that mixes positions across space is the
mid-block attention (over the h*w positions of each frame, separately per frame); nothing
but the causal convolutions mixes frames.

Frame counts: the video's FIRST frame is never doubled in time (its upsamplers skip the
time_conv), every later frame is doubled at each temporal upsampler, so T latent frames give
1 + 4 (T - 1) video frames.

Decoding runs chunk by chunk over the latent frames (one latent frame per chunk by default,
as diffusers does), carrying a ``CausalCache`` from chunk to chunk: for every causal conv the
last ``k_t - 1`` frames of its input, which the next chunk prepends instead of zeros. The
result is the same as running every causal conv over the whole sequence at once (the
``chunk_frames`` argument does exactly that when it covers all frames, and the tests check
both against diffusers), but the activations held at any time are one chunk's plus the
small caches, instead of the whole video's at every layer (at 480p x 81 frames the
full-resolution activations alone are ~6 GB per tensor in bf16).

Every convolution is an ``nn.Conv3d``/``nn.Conv2d`` called as a module with symmetric zero
padding in space and no padding in time (the causal time context is prepended by the caller
through the cache), so a spatially split decode can swap each one for a halo-exchanging
version (``dtgen/layers/wan_vae_parallel.py``) without touching the blocks that call it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import JsonConfig, config_values
from .norms import ChannelRMSNorm

# Checkpoint keys of the encoder side: text-to-video never encodes, so its loader skips them.
IGNORED_CHECKPOINT_PREFIXES = ("encoder.", "quant_conv.")

# diffusers' AutoencoderKLWan defaults (the Wan 2.1 VAE): a config.json that omits a field
# gets these, as diffusers would give it.
_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


# WanVAEConfig's fields that AutoencoderKLQwenImage does not have.
_WAN_ONLY = ("in_channels", "out_channels", "decoder_base_dim", "is_residual", "patch_size", "scale_factor_temporal",
             "scale_factor_spatial")


@dataclass(frozen=True)
class WanVAEConfig(JsonConfig):
    """The diffusers ``vae/config.json`` of ``AutoencoderKLWan`` (same field names and defaults).

    ``temperal_downsample`` (sic, the diffusers spelling) is in ENCODER order; the decoder
    upsamples in time where it is true, walking it reversed. Encoder-only fields
    (``base_dim`` when ``decoder_base_dim`` is set, ``in_channels``, ``attn_scales``,
    ``dropout``) are accepted and unused: the decoder has no attention outside the mid block
    whatever ``attn_scales`` says, and dropout is a training-time op.
    """

    base_dim: int = 96
    decoder_base_dim: Optional[int] = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = _LATENTS_MEAN
    latents_std: tuple[float, ...] = _LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: Optional[int] = None
    scale_factor_temporal: Optional[int] = 4
    scale_factor_spatial: Optional[int] = 8

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanVAEConfig":
        """Read a diffusers ``vae/config.json`` dict. Keys starting with ``_`` are metadata;
        any other unknown key raises ValueError (a silent default could change the
        architecture), as does the Wan 2.2 TI2V-5B VAE (``is_residual`` / ``patch_size``)."""
        cfg = cls(**config_values(cls, d, "Wan VAE config", tuples=("dim_mult", "latents_mean", "latents_std",
                                                                      "attn_scales", "temperal_downsample")))
        cfg.validate()
        return cfg

    @classmethod
    def from_qwen_image(cls, d: dict[str, Any]) -> "WanVAEConfig":
        """An ``AutoencoderKLQwenImage`` ``vae/config.json`` dict as the config of the same decoder.
        diffusers' AutoencoderKLQwenImage is a copy of AutoencoderKLWan (the Wan 2.1 VAE) with
        the weights fine-tuned for images: the decoder's modules, keys and math are the same.
        The config differs: ``input_channels`` (the image channels, encoder input and decoder
        output) where Wan has ``in_channels`` / ``out_channels``, and none of Wan 2.2's fields.
        (Its causal cache slice ``x[:, :, -min(CACHE_T, T)]`` keeps the same frames as Wan's
        ``x[:, :, -CACHE_T:]``; an image is one latent frame.)"""
        kw = config_values(cls, d, "Qwen-Image VAE config", exclude=_WAN_ONLY, also_known=("input_channels",))
        channels = d.get("input_channels", 3)
        return cls.from_dict({**kw, "in_channels": channels, "out_channels": channels,
                              "scale_factor_temporal": None, "scale_factor_spatial": None})

    def validate(self) -> None:
        if self.is_residual or self.patch_size not in (None, 1):
            raise ValueError("Wan VAE config: the Wan 2.2 VAE (is_residual / patch_size, z_dim 48, used by "
                             "TI2V-5B) is not supported; only the Wan 2.1 VAE (Wan 2.1, Wan 2.2 A14B)")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"Wan VAE config: temperal_downsample needs {len(self.dim_mult) - 1} entries "
                             f"(one per upsampling level), got {len(self.temperal_downsample)}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"Wan VAE config: latents_mean / latents_std need z_dim={self.z_dim} entries")
        if self.scale_factor_spatial not in (None, self.spatial_factor) or \
                self.scale_factor_temporal not in (None, self.temporal_factor):
            raise ValueError(f"Wan VAE config: scale factors {self.scale_factor_spatial}/"
                             f"{self.scale_factor_temporal} disagree with the architecture "
                             f"({self.spatial_factor}/{self.temporal_factor})")

    @property
    def decoder_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        """Block widths: the mid block's, then each up level's output width."""
        return tuple(self.decoder_dim * m for m in (self.dim_mult[-1], *reversed(self.dim_mult)))

    @property
    def temporal_upsample(self) -> tuple[bool, ...]:
        """Per up level (decoder order): does its upsampler double time."""
        return tuple(reversed(self.temperal_downsample))

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(bool(t) for t in self.temporal_upsample)

    def num_frames(self, latent_frames: int) -> int:
        """Video frames decoded from ``latent_frames`` (the first latent frame gives one)."""
        return 1 + self.temporal_factor * (latent_frames - 1)


def unnormalize_latents(latents: Tensor, latents_mean, latents_std) -> Tensor:
    """WanPipeline's step before ``vae.decode``: normalized latents [B, z, T, h, w] -> the VAE's
    own latent space, ``latents / (1 / std) + mean``.

    Written as the pipeline computes it, so results agree to the bit: the reciprocal
    ``1 / std`` is taken in fp32 and cast to the latents' dtype, then divided by (not
    multiplied with std), all in the latents' dtype.
    """
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(latents_mean).view(shape).to(latents.device, latents.dtype)
    inv_std = (1.0 / torch.tensor(latents_std)).view(shape).to(latents.device, latents.dtype)
    return latents / inv_std + mean


# ---------------------------------------------------------------------------------------------
# Causal time context


class CausalCache:
    """State carried between the chunks of one video's decode.

    ``tails``: for every causal conv (keyed by the module object that is called), the last
    ``k_t - 1`` frames of its previous input, the time context the next chunk prepends (the
    video's first chunk gets zeros, the causal conv's zero padding). ``started``: whether the
    video's first frame has been decoded (the temporal upsamplers pass that frame through
    undoubled). One cache per video decode; never share one between videos.
    """

    def __init__(self):
        self.tails: dict[nn.Module, Tensor] = {}
        self.started = False

    def window(self, conv: nn.Module, x: Tensor) -> Tensor:
        """``x`` [B, C, t, H, W] with the previous ``k_t - 1`` input frames of ``conv`` in front,
        ready for ``conv`` (which pads nothing in time); remembers this call's last frames.

        ``k_t`` is read from ``conv.weight`` so wrapped convs (a halo-exchanging twin exposes
        the same weight) work unchanged.
        """
        context = conv.weight.shape[2] - 1
        if context == 0:
            return x
        tail = self.tails.get(conv)
        if tail is None:
            tail = x.new_zeros((*x.shape[:2], context, *x.shape[3:]))
        win = torch.cat([tail, x], dim=2)
        # clone(): a slice would keep the whole window alive until the next chunk.
        self.tails[conv] = win[:, :, -context:].clone()
        return win


class CausalConv3d(nn.Conv3d):
    """3-D conv with symmetric zero padding in space and NONE in time: the caller prepends the
    ``k_t - 1`` frames of causal context (``CausalCache.window``), so the module itself is a
    plain conv that a halo-exchanging wrapper can replace.

    diffusers pads ``2 * padding_t`` frames before the input (and its cache holds at most 2
    frames); with the kernels used here (k_t = 1 or 3, padding_t = (k_t - 1) / 2) that is the
    ``k_t - 1`` frames this module expects.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size):
        k = (kernel_size,) * 3 if isinstance(kernel_size, int) else tuple(kernel_size)
        super().__init__(in_channels, out_channels, k, padding=(0, k[1] // 2, k[2] // 2))


def _per_frame(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] (frames as a batch, for the 2-D layers)."""
    b, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(b * t, c, h, w)


def _from_frames(y: Tensor, b: int) -> Tensor:
    """[B*T, C, H, W] -> [B, C, T, H, W]."""
    bt, c, h, w = y.shape
    return y.view(b, bt // b, c, h, w).transpose(1, 2)


def _tokens(y: Tensor) -> Tensor:
    """[N, C, H, W] -> [N, 1, H*W, C]: one head, positions as tokens."""
    return y.flatten(2).transpose(1, 2).unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# Layers


class Upsample2x(nn.Module):
    """Nearest x2 in H and W on [N, C, H, W]: every pixel becomes a 2x2 block (diffusers'
    'nearest-exact' at scale 2 picks the same source pixels; copying is exact in any dtype).
    Per position: a split input upsamples to the split output, every member's rows doubled."""

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest")


class ResidualBlock(nn.Module):
    """norm1 -> SiLU -> causal conv1 -> norm2 -> SiLU -> causal conv2, plus the input (through a
    1x1x1 projection where the width changes; the checkpoint has none otherwise)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = ChannelRMSNorm(in_channels, 3)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3)
        self.norm2 = ChannelRMSNorm(out_channels, 3)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3)
        self.conv_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = self.conv1(cache.window(self.conv1, F.silu(self.norm1(x))))
        h = self.conv2(cache.window(self.conv2, F.silu(self.norm2(h))))
        return h + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each frame (frames independent),
    scale 1/sqrt(C); q, k, v from one 1x1 conv (channel thirds in that order)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = ChannelRMSNorm(channels, 2)
        self.to_qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c = x.shape[:2]
        y = _per_frame(x)
        q, k, v = _tokens(self.to_qkv(self.norm(y))).chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)
        o = o.squeeze(1).transpose(1, 2).reshape(y.shape)
        return x + _from_frames(self.proj(o), b)


class MidBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(channels, channels), ResidualBlock(channels, channels)])
        self.attentions = nn.ModuleList([AttentionBlock(channels)])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class Resample(nn.Module):
    """An upsampler: [time_conv doubles time] -> nearest x2 in space -> 3x3 conv per frame,
    ``channels`` -> ``channels // 2``."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(channels, channels // 2, 3, padding=1))
        # Causal 3x1x1 to twice the width: channel half j is output frame 2i + j of input frame i.
        self.time_conv = CausalConv3d(channels, 2 * channels, (3, 1, 1)) if temporal else None

    def _double_time(self, x: Tensor, cache: CausalCache) -> Tensor:
        head = None
        if not cache.started:
            # The video's first frame is not doubled and never enters time_conv: diffusers runs
            # the first chunk without it and starts time_conv's causal context (zeros) at the
            # second frame.
            head, x = x[:, :, :1], x[:, :, 1:]
        if x.shape[2]:
            y = self.time_conv(cache.window(self.time_conv, x))
            b, c2, t, h, w = y.shape
            x = y.view(b, 2, c2 // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c2 // 2, 2 * t, h, w)
        return x if head is None else torch.cat([head, x], dim=2)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        if self.time_conv is not None:
            x = self._double_time(x, cache)
        return _from_frames(self.resample(_per_frame(x)), x.shape[0])


class UpBlock(nn.Module):
    """One decoder level: ``num_res_blocks + 1`` residual blocks, then an optional upsampler
    (``upsamplers`` exists only on upsampling levels, as in the checkpoint)."""

    def __init__(self, in_channels: int, out_channels: int, num_resnets: int, upsample: Optional[str]):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResidualBlock(in_channels if i == 0 else out_channels, out_channels) for i in range(num_resnets)])
        self.upsamplers = None
        if upsample is not None:
            self.upsamplers = nn.ModuleList([Resample(out_channels, temporal=upsample == "3d")])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        for blk in self.resnets:
            x = blk(x, cache)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache)
        return x


class Downsample(nn.Module):
    """An encoder downsampler: zero-pad one row and column at the bottom / right, 3x3 stride-2
    conv per frame; with ``temporal``, then a 3x1x1 stride-2 time conv over the previous chunk's
    last frame and this chunk's (the video's first chunk, its first frame alone, passes through
    undownsampled in time, as in diffusers)."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(channels, channels, 3, stride=2))
        self.time_conv = nn.Conv3d(channels, channels, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def spatial(self, frames: Tensor) -> Tensor:
        """[N, C, H, W] frames -> [N, C, H / 2, W / 2] (a split encode swaps this step alone)."""
        return self.resample(frames)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = _from_frames(self.spatial(_per_frame(x)), x.shape[0])
        if self.time_conv is None:
            return x
        previous = cache.tails.get(self.time_conv)
        cache.tails[self.time_conv] = x[:, :, -1:].clone()
        return x if previous is None else self.time_conv(torch.cat([previous, x], dim=2))


class WanEncoder(nn.Module):
    """diffusers ``WanEncoder3d`` (Wan 2.1): one chunk of video frames [B, 3, t, H, W] -> its
    latent frames [B, 2 z, t', H / 8, W / 8] (mean and log-variance), continuing the video held
    in ``cache``. Its blocks are one flat list, as the checkpoint's ``down_blocks.N`` keys are:
    per level ``num_res_blocks`` residual blocks, then a downsampler but on the last level."""

    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        if cfg.attn_scales:
            raise ValueError(f"Wan VAE config: attn_scales={list(cfg.attn_scales)}: the encoder builds no "
                             "attention outside its mid block (every Wan 2.1 VAE has none)")
        widths = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(cfg.in_channels, widths[0], 3)
        blocks: list[nn.Module] = []
        for level, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(cin, cout))
                cin = cout
            if level != len(cfg.dim_mult) - 1:
                blocks.append(Downsample(cout, cfg.temperal_downsample[level]))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(widths[-1])
        self.norm_out = ChannelRMSNorm(widths[-1], 3)
        self.conv_out = CausalConv3d(widths[-1], 2 * cfg.z_dim, 3)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.conv_in(cache.window(self.conv_in, x))
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(cache.window(self.conv_out, F.silu(self.norm_out(x))))


def normalize_latents(z: Tensor, latents_mean, latents_std) -> Tensor:
    """WanImageToVideoPipeline's step after ``vae.encode``: VAE-space latents -> normalized,
    ``(z - mean) * (1 / std)``, the reciprocal taken in fp32 and cast to z's dtype, as it does."""
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(latents_mean).view(shape).to(z.device, z.dtype)
    inv_std = (1.0 / torch.tensor(latents_std)).view(shape).to(z.device, z.dtype)
    return (z - mean) * inv_std


class WanDecoder(nn.Module):
    """diffusers ``WanDecoder3d`` (Wan 2.1): one chunk of latent frames [B, z, t, h, w] ->
    its video frames [B, out_channels, t', 8h, 8w], continuing the video held in ``cache``."""

    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        widths = cfg.decoder_widths
        self.conv_in = CausalConv3d(cfg.z_dim, widths[0], 3)
        self.mid_block = MidBlock(widths[0])
        n_up = len(cfg.dim_mult) - 1
        levels = []
        for i in range(len(cfg.dim_mult)):
            # Level 0 reads the mid block's width; later levels read the previous upsampler's
            # output, which halved its level's width.
            cin = widths[0] if i == 0 else widths[i] // 2
            mode = None if i == n_up else ("3d" if cfg.temporal_upsample[i] else "2d")
            levels.append(UpBlock(cin, widths[i + 1], cfg.num_res_blocks + 1, mode))
        self.up_blocks = nn.ModuleList(levels)
        self.norm_out = ChannelRMSNorm(widths[-1], 3)
        self.conv_out = CausalConv3d(widths[-1], cfg.out_channels, 3)

    def forward(self, z: Tensor, cache: CausalCache) -> Tensor:
        x = self.conv_in(cache.window(self.conv_in, z))
        x = self.mid_block(x, cache)
        for level in self.up_blocks:
            x = level(x, cache)
        return self.conv_out(cache.window(self.conv_out, F.silu(self.norm_out(x))))


class WanVAE(nn.Module):
    """``AutoencoderKLWan``: ``post_quant_conv`` and ``decoder``; with ``encoder=True`` also
    ``encoder`` and ``quant_conv`` (image-to-video's reference frame).

    Built like any module (on the meta device by the loader, which then assigns the
    checkpoint's tensors by name; without the encoder, keys under ``IGNORED_CHECKPOINT_PREFIXES``
    have no counterpart here).
    """

    def __init__(self, cfg: WanVAEConfig, encoder: bool = False):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        if encoder:
            self.encoder = WanEncoder(cfg)
            self.quant_conv = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = WanDecoder(cfg)

    def encode(self, video: Tensor) -> Tensor:
        """Video [B, in_channels, 1 + 4k, H, W] in [-1, 1] -> normalized latents [B, z, 1 + k,
        H / 8, W / 8]: the posterior's mean (diffusers' ``retrieve_latents(sample_mode="argmax")``),
        normalized as WanImageToVideoPipeline does. Encoded as diffusers does, chunk by chunk
        carrying a ``CausalCache``: the first frame alone, then ``temporal_factor`` frames at a time."""
        w = self.quant_conv.weight
        x = video.to(w.device, w.dtype)
        step = self.cfg.temporal_factor
        if x.dim() != 5 or (x.shape[2] - 1) % step:
            raise ValueError(f"expected a video [B, C, {step}k + 1, H, W], got shape {tuple(x.shape)}")
        cache = CausalCache()
        chunks = [x[:, :, :1]] + (list(x[:, :, 1:].split(step, dim=2)) if x.shape[2] > 1 else [])
        moments = self.quant_conv(torch.cat([self.encoder(c, cache) for c in chunks], dim=2))
        return normalize_latents(moments[:, :self.cfg.z_dim], self.cfg.latents_mean, self.cfg.latents_std)

    def decode(self, latents: Tensor, chunk_frames: int = 1) -> Tensor:
        """Normalized latents [B, z, T, h, w], as WanPipeline hands them over after denoising,
        -> video [B, out_channels, 1 + 4 (T - 1), 8h, 8w] in [-1, 1].

        The latents are cast to the VAE's device and dtype, un-normalized there
        (``unnormalize_latents``) and decoded (``decode_unnormalized``), as the pipeline does.
        """
        w = self.post_quant_conv.weight
        z = unnormalize_latents(latents.to(w.device, w.dtype), self.cfg.latents_mean, self.cfg.latents_std)
        return self.decode_unnormalized(z, chunk_frames)

    def decode_unnormalized(self, z: Tensor, chunk_frames: int = 1) -> Tensor:
        """``AutoencoderKLWan.decode``: VAE-space latents [B, z, T, h, w] -> video clamped to [-1, 1].

        ``chunk_frames``: latent frames per decoder pass (1, the default, is diffusers' order
        and bounds memory; larger values trade memory for fewer, larger kernels; the result
        is the same up to floating-point summation order).
        """
        if z.dim() != 5 or z.shape[1] != self.cfg.z_dim:
            raise ValueError(f"expected latents [B, {self.cfg.z_dim}, T, h, w], got shape {tuple(z.shape)}")
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        cache = CausalCache()
        frames = []
        for chunk in z.split(chunk_frames, dim=2):
            frames.append(self.decoder(self.post_quant_conv(chunk), cache))
            cache.started = True
        return torch.cat(frames, dim=2).clamp_(-1.0, 1.0)
