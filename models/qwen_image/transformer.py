"""Qwen-Image's MMDiT (diffusers' `QwenImageTransformer2DModel`) as plain modules.

No module here knows about process groups. Parameter names are diffusers' state-dict keys:

    img_in, txt_in (Linear), txt_norm.weight (RMSNorm over the text encoder's width)
    time_text_embed.timestep_embedder.linear_{1,2}   sinusoid(256) -> D -> D (SiLU)
    transformer_blocks.N.{img,txt}_mod.1              SiLU(temb) -> 6 D: shift, scale, gate x 2
    transformer_blocks.N.attn.to_{q,k,v}, to_out.0   the image stream's projections
    transformer_blocks.N.attn.add_{q,k,v}_proj, to_add_out   the text stream's
    transformer_blocks.N.attn.norm_{q,k}, norm_added_{q,k}    RMSNorm over ONE head (head_dim)
    transformer_blocks.N.{img,txt}_mlp.net.0.proj, net.2      GELU-tanh MLP, 4 D
    norm_out.linear (AdaLayerNormContinuous: scale, then shift), proj_out

A dual-stream block: each stream is LayerNorm-modulated by its own `*_mod`, both streams'
q, k, v go through ONE joint attention over [text rows, image rows] (bidirectional; a batch of
prompts of different lengths hides each row's text padding through the meta's per-row hole,
dtgen/seq_split.py `padded_rows`), then each stream
has its own output projection, gate and MLP. The attention goes through `Attention.core`
(the dtgen contract); under sequence parallelism each rank holds a chunk of the text rows
and a chunk of the image rows, and the `AttentionMeta` says which rows these are.

QK norms are per head, so the heads split over TP ranks (unlike Wan's all-heads norms);
head counts are read off the weights.

RoPE (`QwenEmbedRope`, scale_rope=True): head_dim splits into axes_dims_rope (16, 56, 56) for
(frame, row, column); patch row y of h sits at position y - (h - h // 2) (rows and columns
centred on 0, negative above / left of the centre), frame 0; text row i sits at
max(h // 2, w // 2) + i on all three axes. Angles are float32 as diffusers
builds its table; the rotation pairs adjacent channels (its complex view).

Dtypes follow diffusers: everything in the activation dtype (no float32 modulation), the
sinusoid float32 and cast to the activation dtype before the time MLP, RMSNorms computed in
float32 and cast to the weight's dtype when that is half precision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.attention import AttentionMeta, LocalAttention
from dtgen.layers.config import JsonConfig, config_values
from dtgen.layers.embeddings import TwoLayerMLP, timestep_sinusoid
from dtgen.layers.linear import FeedForward, Linear
from dtgen.layers.norms import RMSNorm
from dtgen.layers.rope import apply_rope, grid_positions, rope_angles
from dtgen.seq_split import GatherRows, SeqSplits, SplitRows


@dataclass(frozen=True)
class QwenImageTransformerConfig(JsonConfig):
    """diffusers' `QwenImageTransformer2DModel.__init__` arguments (names and defaults)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> "QwenImageTransformerConfig":
        kw = config_values(cls, d, "Qwen-Image transformer config")
        # The edit / layered variants' switches: text-to-image runs none of them.
        for key in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if kw.get(key):
                raise ValueError(f"Qwen-Image transformer config: '{key}'=true is not supported (text-to-image only)")
        kw["axes_dims_rope"] = tuple(kw.get("axes_dims_rope", cls.axes_dims_rope))
        if sum(kw["axes_dims_rope"]) != kw.get("attention_head_dim", cls.attention_head_dim):
            raise ValueError(f"Qwen-Image transformer config: axes_dims_rope {list(kw['axes_dims_rope'])} must sum "
                             f"to attention_head_dim={kw.get('attention_head_dim', cls.attention_head_dim)}")
        kw["out_channels"] = kw.get("out_channels") or kw.get("in_channels", cls.in_channels)
        return cls(**kw)


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def rope_cos_sin(height: int, width: int, text_rows: int, axes: tuple[int, int, int], theta: float = 10000.0,
                 device=None) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((cos, sin) of the h*w image rows, (cos, sin) of the text rows), each [rows, head_dim / 2]
    float32, as diffusers' QwenEmbedRope(scale_rope=True) builds them."""
    def centred(n: int) -> torch.Tensor:   # scale_rope: positions -(n - n // 2) .. n // 2 - 1
        return torch.arange(n, device=device) - (n - n // 2)

    frame = torch.zeros(1, dtype=torch.long, device=device)   # an image is frame 0
    img = rope_angles(grid_positions(frame, centred(height), centred(width)), axes, theta)
    pos = torch.arange(text_rows, device=device) + max(height // 2, width // 2)
    txt = rope_angles(pos[:, None].expand(-1, len(axes)), axes, theta)
    return (img.cos(), img.sin()), (txt.cos(), txt.sin())


class Attention(nn.Module):
    """The joint attention of both streams (diffusers' QwenDoubleStreamAttnProcessor2_0)."""

    def __init__(self, dim: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, Linear(dim, dim))
        self.to_out = nn.ModuleList([Linear(dim, dim)])  # diffusers' [Linear, Dropout]: key to_out.0
        self.to_add_out = Linear(dim, dim)
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            # diffusers' RMSNorm: rounded to the weight's dtype only when that is half precision.
            setattr(self, name, RMSNorm(head_dim, eps, rounding="half_weight"))
        self.core: nn.Module = LocalAttention()             # swapped per phase (Ulysses, ring, ...)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, rope_img, rope_txt,
                meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        def heads(proj, norm, x, rope):
            y = proj(x).unflatten(-1, (-1, self.head_dim))
            return apply_rope(norm(y), *rope, pairs="complex") if norm is not None else y
        q = torch.cat([heads(self.add_q_proj, self.norm_added_q, txt, rope_txt),
                       heads(self.to_q, self.norm_q, img, rope_img)], dim=1)
        k = torch.cat([heads(self.add_k_proj, self.norm_added_k, txt, rope_txt),
                       heads(self.to_k, self.norm_k, img, rope_img)], dim=1)
        v = torch.cat([heads(self.add_v_proj, None, txt, None), heads(self.to_v, None, img, None)], dim=1)
        out = self.core(q, k, v, meta, None).flatten(2).to(q.dtype)
        L = txt.shape[1]
        return self.to_out[0](out[:, L:].contiguous()), self.to_add_out(out[:, :L].contiguous())


def _modulate(x: torch.Tensor, mod: torch.Tensor, eps: float = 1e-6):
    shift, scale, gate = mod.chunk(3, dim=-1)
    return layer_norm(x, eps) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)


class Block(nn.Module):
    """QwenImageTransformerBlock: (img, txt) -> (img, txt)."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.attn = Attention(dim, head_dim)
        self.img_mlp = FeedForward(dim, 4 * dim)
        self.txt_mlp = FeedForward(dim, 4 * dim)

    def forward(self, img, txt, temb, rope_img, rope_txt, meta):
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_in, img_gate1 = _modulate(img, img_mod1)
        txt_in, txt_gate1 = _modulate(txt, txt_mod1)
        img_attn, txt_attn = self.attn(img_in, txt_in, rope_img, rope_txt, meta)
        img = img + img_gate1 * img_attn
        txt = txt + txt_gate1 * txt_attn
        img_in, img_gate2 = _modulate(img, img_mod2)
        img = img + img_gate2 * self.img_mlp(img_in)
        txt_in, txt_gate2 = _modulate(txt, txt_mod2)
        txt = txt + txt_gate2 * self.txt_mlp(txt_in)
        if img.dtype == torch.float16:   # diffusers clips fp16 activations
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


def run_block(block: Block, img, txt, temb, rope_img, rope_txt, meta):
    """One block as a free function: the unit a runtime may compile once for every block."""
    return block(img, txt, temb, rope_img, rope_txt, meta)


class QwenInputs(NamedTuple):
    img: torch.Tensor        # [B, N, D] image tokens (packed 2x2 latent patches, row-major)
    txt: torch.Tensor        # [B, L, D] text tokens
    temb: torch.Tensor       # [B, D]
    rope_img: tuple[torch.Tensor, torch.Tensor]
    rope_txt: tuple[torch.Tensor, torch.Tensor]


def joint_meta(rows: int, device=None) -> AttentionMeta:
    """One process: the [text, image] rows as one bidirectional block."""
    return AttentionMeta(slots=torch.arange(rows, device=device), image_blocks=((0, rows),), slot_runs=((0, rows),))


class QwenImageTransformer(nn.Module):
    """diffusers' QwenImageTransformer2DModel (text-to-image), same parameter names."""

    # Under sequence parallelism (dtgen/seq_split.py; diffusers' `_cp_plan` splits the same):
    # both streams and their RoPE rows are split along their rows, each stream alone, the
    # joint attention sees [text, image], and `final_layer`'s image rows are gathered back.
    seq_splits = SeqSplits(inputs={"img": SplitRows(1), "txt": SplitRows(1), "rope_img": SplitRows(0),
                                   "rope_txt": SplitRows(0)}, attention=("txt", "img"), output=GatherRows(1))

    def __init__(self, cfg: QwenImageTransformerConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.inner_dim
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = TwoLayerMLP(256, D, "silu")
        self.txt_norm = RMSNorm(cfg.joint_attention_dim, rounding="half_weight")
        self.img_in = Linear(cfg.in_channels, D)
        self.txt_in = Linear(cfg.joint_attention_dim, D)
        self.transformer_blocks = nn.ModuleList(Block(D, cfg.attention_head_dim) for _ in range(cfg.num_layers))
        self.norm_out = nn.Module()
        self.norm_out.linear = Linear(D, 2 * D)
        self.proj_out = Linear(D, cfg.patch_size ** 2 * cfg.out_channels)
        self.run_block = run_block   # or a compiled region (the same function for every block)

    def joint_attentions(self) -> list[nn.Module]:
        """The blocks' joint attention modules (what `dtgen.fp8.use_fp8_attention` may run in FP8)."""
        return [block.attn for block in self.transformer_blocks]

    def time_embedding(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """timestep [B] (sigma, i.e. the scheduler's t / 1000) -> temb [B, D] in `dtype`."""
        t = timestep.to(dtype)
        # diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000), the
        # frequencies rounded to t's dtype (bf16 in a bf16 run) before the product.
        sinus = timestep_sinusoid(t, 256, scale=1000.0, freqs_dtype=t.dtype).to(dtype)
        return self.time_text_embed.timestep_embedder(sinus)

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
              height: int, width: int) -> QwenInputs:
        """latents [B, h*w, C*4] packed (QwenImagePipeline's layout), timestep [B] = t / 1000,
        text [B, L, joint_attention_dim]; height, width: the patch grid (h, w)."""
        img = self.img_in(latents)
        txt = self.txt_in(self.txt_norm(text))
        rope_img, rope_txt = rope_cos_sin(height, width, text.shape[1], self.cfg.axes_dims_rope, device=img.device)
        return QwenInputs(img, txt, self.time_embedding(timestep, img.dtype), rope_img, rope_txt)

    def blocks_forward(self, img, txt, temb, rope_img, rope_txt, meta: AttentionMeta | None = None,
                       start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if meta is None:
            meta = joint_meta(txt.shape[1] + img.shape[1], img.device)
        for block in self.transformer_blocks[start:stop]:
            img, txt = self.run_block(block, img, txt, temb, rope_img, rope_txt, meta)
        return img, txt

    def final_layer(self, img: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """norm_out (AdaLayerNormContinuous: scale first, then shift) and proj_out, per row."""
        scale, shift = self.norm_out.linear(F.silu(temb).to(img.dtype)).chunk(2, dim=-1)
        return self.proj_out(layer_norm(img) * (1 + scale[:, None]) + shift[:, None])

    # ---- split points (dtgen/denoiser_calls.py); `args` are embed's (latents, timestep, text, h, w) ----
    @property
    def num_blocks(self) -> int:
        return len(self.transformer_blocks)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (img_in stays in it: the FP8 linears are the blocks')."""
        return self.img_in.weight.dtype

    def embed_time(self, latents, timestep, text, height: int, width: int) -> torch.Tensor:
        """`embed`'s temb alone (a step that runs no block)."""
        return self.time_embedding(timestep, self.dtype)

    def block_input(self, inputs: QwenInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.img, inputs.txt   # the image rows (what a step cache keeps); the text stream rides along

    def blocks_between(self, inputs: QwenInputs, meta: AttentionMeta, img, txt, start: int,
                       stop: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks_forward(img, txt, inputs.temb, inputs.rope_img, inputs.rope_txt, meta, start, stop)

    def stream_rows(self, latents, timestep, text, height: int, width: int) -> int:
        return height * width

    def forward(self, latents, timestep, text, height: int, width: int) -> torch.Tensor:
        """The prediction [B, h*w, C_out*4] (diffusers' `.sample`, img_shapes [(1, height, width)])."""
        e = self.embed(latents, timestep, text, height, width)
        img, _ = self.blocks_forward(e.img, e.txt, e.temb, e.rope_img, e.rope_txt)
        return self.final_layer(img, e.temb)
