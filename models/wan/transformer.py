"""The Wan 2.1 / 2.2 DiT (diffusers' `WanTransformer3DModel`), text- and image-to-video, as plain modules.

No module here knows about process groups. Parameter names and shapes are exactly diffusers'
state-dict keys, so a diffusers checkpoint loads by name:

    patch_embedding.{weight [D, C_in, pt, ph, pw], bias}      Conv3d, stride = kernel
    condition_embedder.time_embedder.linear_{1,2}.{weight, bias}   sinusoid(freq_dim) -> D -> D
    condition_embedder.time_proj.{weight [6D, D], bias}       SiLU(temb) -> 6 modulation vectors
    condition_embedder.text_embedder.linear_{1,2}.{weight, bias}   text_dim -> D -> D (GELU-tanh)
    blocks.N.scale_shift_table [1, 6, D]                      added to the block's modulation
    blocks.N.attn{1,2}.to_{q,k,v}.{weight [D, D], bias}       attn1: self, attn2: video -> text
    blocks.N.attn{1,2}.to_out.0.{weight, bias}
    blocks.N.attn{1,2}.norm_{q,k}.weight [D]                  RMSNorm over ALL heads (D = heads * hd)
    blocks.N.norm2.{weight, bias} [D]                         only with cross_attn_norm
    blocks.N.ffn.net.0.proj.{weight [ffn, D], bias}, blocks.N.ffn.net.2.{weight [D, ffn], bias}
    proj_out.{weight [pt*ph*pw*C_out, D], bias}, scale_shift_table [1, 2, D]
  Wan2.1-I2V only (image_dim, added_kv_proj_dim set):
    condition_embedder.image_embedder.{norm1, norm2}.{weight, bias}, .ff.net.0.proj, .ff.net.2
                                                              CLIP features -> D (LN, GELU MLP, LN)
    blocks.N.attn2.add_{k,v}_proj.{weight [D, added_kv], bias}, blocks.N.attn2.norm_added_k.weight [D]

Forward, in three separately callable pieces (how the framework shards the token rows over
sequence-parallel ranks: every rank runs `blocks_forward` on its rows with those rows' RoPE):
    embed(video, timestep, text)  -> WanInputs(tokens [B, S, D], temb, temb_proj, text, rope, grid)
    blocks_forward(tokens, temb_proj, text, rope, attention_meta[, start, stop])  -> tokens
    final_layer(tokens, temb) -> [B, S, pt*ph*pw*C_out];  unpatchify(x, grid) -> [B, C_out, F, H, W]
Tokens are the patches in (frame, row, column) order. The self-attention (attn1) goes through
`Attention.core` with the dtgen contract (q, k, v [B, S, heads, hd], already normed and
rotated); the whole video is ONE bidirectional image block of the `AttentionMeta`. Rows past
the real sequence (sequence-parallel padding) are harmless: everything else is per row, and
the meta's image block hides them from the real rows. Cross-attention (attn2) attends each
video row to all text rows without a mask (as diffusers does) and stays local; with image tokens
it also attends each row to the image rows through their own key / value projections and adds
the two attentions' outputs before `to_out` (diffusers' I2V processor). Image to video's
condition channels (mask and reference latents) are input channels like the noise's: only
`in_channels` (36) says so.

RoPE is 3-D: head_dim hd splits into t = hd - 4*(hd // 6), h = w = 2*(hd // 6) channels (128 ->
44 / 42 / 42), each axis with its own frequencies theta^(-2i/dim) over its own dim, and the
rotation pairs ADJACENT channels (2i, 2i+1), not halves. Tables are per row, [S, hd / 2].

Tensor parallelism over heads is NOT supported: norm_q/norm_k are RMSNorms across all heads
(over the full D), so a head shard would need the other heads' sums of squares. Head counts are
still read off the weights (house style), never stored.

Dtypes follow diffusers (what it keeps in float32 when loading a bf16 checkpoint is `KEEP_FP32`):
the timestep sinusoid is float32 and runs through `time_embedder` in that module's dtype; the
LayerNorms, the modulation (scale_shift_table + temb) and the residual adds with gates run in
float32 and are cast back to the activation dtype; RoPE is computed in float64 and applied in
float32; the QK RMSNorms are torch's `rms_norm` in the activation dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.attention import AttentionMeta, LocalAttention
from dtgen.layers.config import JsonConfig, config_values
from dtgen.layers.embeddings import TwoLayerMLP, timestep_sinusoid
from dtgen.layers.linear import FeedForward, Linear, empty_param
from dtgen.layers.norms import RMSNorm, layer_norm_f32
from dtgen.layers.rope import apply_rope, grid_positions, rope_angles
from dtgen.seq_split import GatherRows, SeqSplits, SplitRows

# Keys whose only supported value is "unset": FLF2V's learned positions of its two images.
_MUST_BE_NONE = ("pos_embed_seq_len",)


@dataclass(frozen=True)
class WanTransformerConfig(JsonConfig):
    """The DiT's `transformer/config.json`: field names and defaults are diffusers'
    `WanTransformer3DModel.__init__` arguments. Text-to-video (Wan 2.1 T2V, Wan 2.2 T2V A14B,
    TI2V-5B used for text-to-video) and image-to-video: Wan2.1-I2V's image tokens (`image_dim`:
    the CLIP features' width, embedded and attended through the cross-attention's added key /
    value projections of width `added_kv_proj_dim`) and the condition channels on the input
    (`in_channels` 36: 16 noise, 4 mask, 16 condition latents; Wan2.2-I2V-A14B has those alone).
    FLF2V's image positions (`pos_embed_seq_len`) are refused by key, as is any key this module
    does not know: a silent default could change the architecture."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    # Not a config.json key: diffusers hard-codes it (WanRotaryPosEmbed's theta).
    rope_theta: float = 10000.0
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanTransformerConfig":
        for key in _MUST_BE_NONE:
            if d.get(key) is not None:
                raise ValueError(f"Wan transformer config: '{key}'={d[key]!r} (first-last-frame positions) "
                                 "is not supported")
        if (d.get("image_dim") is None) != (d.get("added_kv_proj_dim") is None):
            raise ValueError("Wan transformer config: 'image_dim' and 'added_kv_proj_dim' are set together "
                             "(image tokens need both the embedder and the added K/V projections)")
        qk_norm = d.get("qk_norm", "rms_norm_across_heads")
        if qk_norm != "rms_norm_across_heads":
            raise ValueError(f"Wan transformer config: 'qk_norm'={qk_norm!r} is not supported "
                             "(only 'rms_norm_across_heads')")
        kw = config_values(cls, d, "Wan transformer config", exclude={"raw", "rope_theta"}, also_known=_MUST_BE_NONE)
        if "patch_size" in kw:
            kw["patch_size"] = tuple(int(p) for p in kw["patch_size"])
            if len(kw["patch_size"]) != 3:
                raise ValueError(f"Wan transformer config: 'patch_size'={d['patch_size']!r} must have 3 entries")
        if kw.get("out_channels") is None:
            # diffusers: `out_channels = out_channels or in_channels`
            kw["out_channels"] = kw.get("in_channels", cls.in_channels)
        if kw.get("attention_head_dim", cls.attention_head_dim) % 2:
            raise ValueError("Wan transformer config: 'attention_head_dim' must be even (RoPE pairs)")
        return cls(**kw, raw=dict(d))

    @property
    def image_tokens(self) -> bool:
        """Whether the cross-attention also attends to image tokens (Wan2.1-I2V)."""
        return self.image_dim is not None


# diffusers' `_keep_in_fp32_modules` (less "rope", whose tables are computed, not stored): the
# parameters under these module names stay float32 when the rest is loaded in bf16.
KEEP_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def keeps_fp32(name: str) -> bool:
    """Whether the parameter `name` stays float32 in a low-precision load (diffusers' rule)."""
    return any(m in name.split(".") for m in KEEP_FP32)


class CrossAttnNorm(nn.Module):
    """`norm2`: the affine float32 LayerNorm before the cross-attention (cross_attn_norm=True)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim)
        self.bias = empty_param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_f32(x, self.eps, self.weight, self.bias).to(x.dtype)


# --------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------
def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of head_dim given to (frame, row, column): 128 -> (44, 42, 42)."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_cos_sin(grid: tuple[int, int, int], head_dim: int, theta: float = 10000.0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [f*h*w, head_dim // 2] (float32) for the patch grid (f, h, w), row-major.

    Pair i of a head (channels 2i, 2i+1) rotates by angle pos_axis * theta^(-2j/dim_axis),
    where the first t/2 pairs take the frame index, the next h/2 the row, the last w/2 the
    column. Angles in float64, as diffusers builds its table, so bf16/fp32 runs agree with it.
    """
    pos = grid_positions(*(torch.arange(n, dtype=torch.float64, device=device) for n in grid))
    angles = rope_angles(pos, rope_axis_dims(head_dim), theta, torch.float64)
    return angles.cos().float(), angles.sin().float()


# --------------------------------------------------------------------------------------
# Conditioning
# --------------------------------------------------------------------------------------
class AffineLayerNorm(nn.Module):
    """diffusers' FP32LayerNorm with its affine weight and bias (eps 1e-5, torch's default)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim)
        self.bias = empty_param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_f32(x, self.eps, self.weight, self.bias).to(x.dtype)


class ImageEmbedder(nn.Module):
    """diffusers' `WanImageEmbedding` (no positions): norm1 -> Linear, GELU (erf), Linear ->
    norm2, the CLIP features [B, N, image_dim] -> [B, N, D]."""

    def __init__(self, image_dim: int, dim: int):
        super().__init__()
        self.norm1 = AffineLayerNorm(image_dim)
        self.ff = nn.Module()   # diffusers' FeedForward(mult=1, "gelu"): keys ff.net.0.proj, ff.net.2
        self.ff.net = nn.ModuleList([nn.Module(), nn.Identity(), Linear(image_dim, dim)])
        self.ff.net[0].proj = Linear(image_dim, image_dim)
        self.norm2 = AffineLayerNorm(dim)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.ff.net[0].proj(self.norm1(image)))
        return self.norm2(self.ff.net[2](h))


class ConditionEmbedder(nn.Module):
    def __init__(self, cfg: WanTransformerConfig):
        super().__init__()
        D = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = TwoLayerMLP(cfg.freq_dim, D, "silu")
        self.time_proj = Linear(D, 6 * D)
        self.text_embedder = TwoLayerMLP(cfg.text_dim, D, "gelu_tanh")
        self.image_embedder = ImageEmbedder(cfg.image_dim, D) if cfg.image_tokens else None

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B, T] -> temb [B, T, D] (in `dtype`), temb_proj [B, T, 6, D]."""
        B, T = timestep.shape
        sinus = timestep_sinusoid(timestep.flatten(), self.freq_dim)
        # The sinusoid enters time_embedder in that module's dtype (float32 in a diffusers load)
        # and its output is cast to the activation dtype, as diffusers does.
        temb = self.time_embedder(sinus.to(self.time_embedder.linear_1.weight.dtype)).to(dtype)
        temb_proj = self.time_proj(F.silu(temb))
        return temb.view(B, T, -1), temb_proj.view(B, T, 6, -1)


# --------------------------------------------------------------------------------------
# Block
# --------------------------------------------------------------------------------------
class Attention(nn.Module):
    """attn1 (self, through `core`, with RoPE) or attn2 (video rows -> text rows, local; with
    `added_kv_dim`, also -> image rows through their own key / value projections, the two
    attentions' outputs summed before to_out, as diffusers' I2V processor does)."""

    def __init__(self, dim: int, head_dim: int, eps: float, self_attention: bool, added_kv_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.to_q = Linear(dim, dim)
        self.to_k = Linear(dim, dim)
        self.to_v = Linear(dim, dim)
        self.to_out = nn.ModuleList([Linear(dim, dim)])  # diffusers' [Linear, Dropout]: key to_out.0
        # torch.nn.RMSNorm's numerics (diffusers uses it), over all heads at once.
        self.norm_q = RMSNorm(dim, eps, rounding="torch")
        self.norm_k = RMSNorm(dim, eps, rounding="torch")
        if self_attention:
            # Swapped per phase by the parallel runtime (Ulysses, ring, ...); same signature.
            self.core: nn.Module = LocalAttention()
        if added_kv_dim is not None:
            self.add_k_proj = Linear(added_kv_dim, dim)
            self.add_v_proj = Linear(added_kv_dim, dim)
            self.norm_added_k = RMSNorm(dim, eps, rounding="torch")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # Local head count read off the weights: [B, S, heads * hd] -> [B, S, heads, hd].
        return x.unflatten(-1, (-1, self.head_dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        # The QK norm runs over the full projection (all heads at once), before the head split.
        q = self._heads(self.norm_q(self.to_q(x)))
        k = self._heads(self.norm_k(self.to_k(x)))
        v = self._heads(self.to_v(x))
        q = apply_rope(q, *rope, pairs="adjacent")
        k = apply_rope(k, *rope, pairs="adjacent")
        out = self.core(q, k, v, meta, None)
        return self.to_out[0](out.flatten(2).to(q.dtype))

    def cross(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        q = self._heads(self.norm_q(self.to_q(x))).transpose(1, 2)
        k = self._heads(self.norm_k(self.to_k(text))).transpose(1, 2)
        v = self._heads(self.to_v(text)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2).to(q.dtype)
        if image is not None:
            k_img = self._heads(self.norm_added_k(self.add_k_proj(image))).transpose(1, 2)
            v_img = self._heads(self.add_v_proj(image)).transpose(1, 2)
            out = out + F.scaled_dot_product_attention(q, k_img, v_img).transpose(1, 2).flatten(2).to(q.dtype)
        return self.to_out[0](out)


class WanBlock(nn.Module):
    """x += gate * attn1(mod(LN(x))); x += attn2(norm2(x), text); x += c_gate * ffn(mod(LN(x)))."""

    def __init__(self, cfg: WanTransformerConfig):
        super().__init__()
        D = cfg.inner_dim
        self.eps = cfg.eps
        self.attn1 = Attention(D, cfg.attention_head_dim, cfg.eps, self_attention=True)
        self.attn2 = Attention(D, cfg.attention_head_dim, cfg.eps, self_attention=False,
                               added_kv_dim=cfg.added_kv_proj_dim)
        self.norm2 = CrossAttnNorm(D, cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(D, cfg.ffn_dim)
        self.scale_shift_table = empty_param(1, 6, D)

    def forward(self, x: torch.Tensor, temb_proj: torch.Tensor, text: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta,
                image: torch.Tensor | None = None) -> torch.Tensor:
        # Modulation in float32: temb_proj [B, T, 6, D] (T = 1, or one row per token) plus the
        # table, six [B, T, D] vectors broadcast over (or matching) the rows.
        mod = self.scale_shift_table.float() + temb_proj.float()
        shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(2)
        dtype = x.dtype

        h = (layer_norm_f32(x, self.eps) * (1 + scale) + shift).to(dtype)
        x = (x.float() + self.attn1(h, rope, meta) * gate).to(dtype)

        h = x if self.norm2 is None else self.norm2(x)
        x = x + self.attn2.cross(h, text, image)  # diffusers adds this residual in the activation dtype

        h = (layer_norm_f32(x, self.eps) * (1 + c_scale) + c_shift).to(dtype)
        return (x.float() + self.ffn(h).float() * c_gate).to(dtype)


def run_block(block: WanBlock, x: torch.Tensor, temb_proj: torch.Tensor, text: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta,
              image: torch.Tensor | None = None) -> torch.Tensor:
    """One block, as a free function: the unit a runtime may compile once and reuse for every
    block (the block's weights are its inputs, not its constants)."""
    return block(x, temb_proj, text, rope, meta, image)


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
class WanInputs(NamedTuple):
    """What `embed` returns; every per-token tensor has its token rows on dim 1 (rope: dim 0)."""

    tokens: torch.Tensor       # [B, S, D] patch tokens, activation dtype
    temb: torch.Tensor         # [B, T, D] time embedding (T = 1, or S for per-token timesteps)
    temb_proj: torch.Tensor    # [B, T, 6, D] the blocks' modulation
    text: torch.Tensor         # [B, L, D] projected text
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [S, hd / 2] float32
    grid: tuple[int, int, int]  # patch grid (f, h, w): S = f * h * w
    image: torch.Tensor | None = None   # [B, N, D] embedded image tokens (Wan2.1-I2V), else None


def full_sequence_meta(rows: int, real_rows: int | None = None, device=None) -> AttentionMeta:
    """The meta of a video sequence of `rows` rows whose first `real_rows` (default all) are real:
    one bidirectional block over the real rows; rows past it are padding no real row sees."""
    real = rows if real_rows is None else real_rows
    return AttentionMeta(slots=torch.arange(rows, device=device), image_blocks=((0, real),),
                         slot_runs=((0, rows),))


class WanTransformer(nn.Module):
    """diffusers' WanTransformer3DModel (text- and image-to-video), same parameter names."""

    # Under sequence parallelism (dtgen/seq_split.py, diffusers' `_cp_plan`): `embed`'s per-token
    # outputs are split along their token rows (temb and temb_proj only with per-token
    # timesteps), the text stays whole for the cross-attention, the video rows are the self-
    # attention's sequence, and `final_layer`'s rows are gathered back.
    seq_splits = SeqSplits(inputs={"tokens": SplitRows(1), "temb": SplitRows(1, only_per_row=True),
                                   "temb_proj": SplitRows(1, only_per_row=True), "rope": SplitRows(0)},
                           attention=("tokens",), output=GatherRows(1))

    def __init__(self, cfg: WanTransformerConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.inner_dim
        self.head_dim = cfg.attention_head_dim
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = empty_param(D, cfg.in_channels, *cfg.patch_size)
        self.patch_embedding.bias = empty_param(D)
        self.condition_embedder = ConditionEmbedder(cfg)
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.proj_out = Linear(D, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = empty_param(1, 2, D)
        # How a block is called: `run_block`, or what a runtime puts here instead (regional
        # compilation: the same function compiled once for all blocks).
        self.run_block = run_block

    def self_attentions(self) -> list[nn.Module]:
        """The blocks' self-attention modules (what `dtgen.fp8.use_fp8_attention` may run in FP8)."""
        return [block.attn1 for block in self.blocks]

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.patch_embedding.weight.shape[2:])

    def patch_grid(self, hidden_states: torch.Tensor) -> tuple[int, int, int]:
        """The patch grid (f, h, w) of latents [B, C, F, H, W]: S = f * h * w tokens."""
        pt, ph, pw = self.patch_size
        return hidden_states.shape[2] // pt, hidden_states.shape[3] // ph, hidden_states.shape[4] // pw

    def time_embedding(self, timestep: torch.Tensor, batch: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B] (or [B, S], or 0-d) -> temb [B, T, D] in `dtype`, temb_proj [B, T, 6, D]."""
        if timestep.ndim == 0:
            timestep = timestep.expand(batch)
        return self.condition_embedder.time(timestep.reshape(batch, -1), dtype)   # T = 1, or S per token

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              encoder_hidden_states_image: torch.Tensor | None = None) -> WanInputs:
        """hidden_states [B, C, F, H, W] latents (image-to-video: the noise with its condition
        channels); timestep [B] (or [B, S] per token, Wan 2.2 TI2V-5B); encoder_hidden_states
        [B, L, text_dim]; encoder_hidden_states_image [B, N, image_dim], the CLIP features
        (only and always on a DiT with image tokens). Returns the blocks' inputs."""
        if (encoder_hidden_states_image is not None) != self.cfg.image_tokens:
            raise ValueError("image tokens are " + ("required: this DiT attends to them" if self.cfg.image_tokens
                                                    else "not taken: this DiT has no image embedder"))
        B = hidden_states.shape[0]
        pt, ph, pw = self.patch_size
        grid = self.patch_grid(hidden_states)
        if max(grid) > self.cfg.rope_max_seq_len:
            raise ValueError(f"patch grid {grid} exceeds rope_max_seq_len={self.cfg.rope_max_seq_len}")
        w = self.patch_embedding.weight
        tokens = F.conv3d(hidden_states, w, self.patch_embedding.bias, stride=(pt, ph, pw))
        tokens = tokens.flatten(2).transpose(1, 2).contiguous()  # [B, S, D], (f, h, w) row-major

        temb, temb_proj = self.time_embedding(timestep, B, encoder_hidden_states.dtype)
        text = self.condition_embedder.text_embedder(encoder_hidden_states)
        rope = rope_cos_sin(grid, self.head_dim, self.cfg.rope_theta, device=hidden_states.device)
        image = None
        if encoder_hidden_states_image is not None:
            image = self.condition_embedder.image_embedder(encoder_hidden_states_image)
        return WanInputs(tokens, temb, temb_proj, text, rope, grid, image)

    def blocks_forward(self, tokens: torch.Tensor, temb_proj: torch.Tensor, text: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor], attention_meta: AttentionMeta | None = None,
                       start: int = 0, stop: int | None = None, image: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S, D] -> [B, S, D] through blocks start..stop-1 (default: every block; a
        step cache runs a part of them, dtgen/step_cache.py).

        rope: the cos/sin rows of these token rows. temb_proj [B, T, 6, D]: with T > 1 (per-token
        timesteps) it must hold the same rows as `tokens` (slice/pad it alike). Padding rows
        need finite values (zeros are fine): attention multiplies masked-out values by zero.
        image: the embedded image tokens [B, N, D] (Wan2.1-I2V), else None.
        """
        if attention_meta is None:
            attention_meta = full_sequence_meta(tokens.shape[1], device=tokens.device)
        for block in self.blocks[start:stop]:
            if image is None:   # the text-to-video call, as before
                tokens = self.run_block(block, tokens, temb_proj, text, rope, attention_meta)
            else:
                tokens = self.run_block(block, tokens, temb_proj, text, rope, attention_meta, image)
        return tokens

    def final_layer(self, tokens: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Output norm, modulation and proj_out, per row: [B, S, D] -> [B, S, pt*ph*pw*C_out]."""
        mod = self.scale_shift_table.float().unsqueeze(0) + temb.float().unsqueeze(2)  # [B, T, 2, D]
        shift, scale = mod.unbind(2)
        h = (layer_norm_f32(tokens, self.cfg.eps) * (1 + scale) + shift).to(tokens.dtype)
        return self.proj_out(h)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, pt*ph*pw*C] (channels last within a patch) -> [B, C, f*pt, h*ph, w*pw]."""
        B = x.shape[0]
        f, h, w = grid
        pt, ph, pw = self.patch_size
        x = x.reshape(B, f, h, w, pt, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, -1, f * pt, h * ph, w * pw)

    # ---- split points (dtgen/denoiser_calls.py); `args` are embed's (video, timestep, text) ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (a norm's weight: the linears' may be e4m3, --dense-dtype fp8)."""
        return self.blocks[0].attn1.norm_q.weight.dtype

    def embed_time(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                   encoder_hidden_states: torch.Tensor, *_) -> torch.Tensor:
        """`embed`'s temb alone (a step that runs no block)."""
        return self.time_embedding(timestep, hidden_states.shape[0], encoder_hidden_states.dtype)[0]

    def block_input(self, inputs: WanInputs) -> tuple[torch.Tensor, None]:
        return inputs.tokens, None   # the patch tokens; the blocks carry no second stream

    def blocks_between(self, inputs: WanInputs, meta: AttentionMeta, tokens: torch.Tensor, carried: None,
                       start: int, stop: int | None) -> tuple[torch.Tensor, None]:
        return self.blocks_forward(tokens, inputs.temb_proj, inputs.text, inputs.rope, meta, start, stop,
                                   inputs.image), None

    def select_rows(self, inputs: WanInputs, index: torch.Tensor) -> WanInputs:
        """The blocks' inputs of batch rows `index` (their modulation, text and image tokens; the
        rest is per token)."""
        image = None if inputs.image is None else inputs.image.index_select(0, index)
        return inputs._replace(temb_proj=inputs.temb_proj.index_select(0, index),
                               text=inputs.text.index_select(0, index), image=image)

    def stream_rows(self, hidden_states: torch.Tensor, *_) -> int:
        return math.prod(self.patch_grid(hidden_states))

    def output(self, out: torch.Tensor, hidden_states: torch.Tensor, *_) -> torch.Tensor:
        return self.unpatchify(out, self.patch_grid(hidden_states))

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None,
                attention_meta: AttentionMeta | None = None) -> torch.Tensor:
        """The model's prediction [B, C_out, F, H, W] (diffusers' `.sample`)."""
        e = self.embed(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        tokens = self.blocks_forward(e.tokens, e.temb_proj, e.text, e.rope, attention_meta, image=e.image)
        return self.unpatchify(self.final_layer(tokens, e.temb), e.grid)
