"""The HunyuanImage-3 decoder stack as plain modules.

No module here knows about process groups. Shapes that tensor parallelism changes (local
heads, local intermediate width, micro packs) are read off the weights, never off a world
size: the same code runs the full model and every rank's shard of it.

Parameter layouts (the loader packs the official checkpoint into these):
- `self_attn.qkv_proj.weight` [rows, H]: the official row layout, grouped per KV head
  (G query heads, then K, then V, for each KV group). A TP shard is a block of whole groups.
- `mlp.shared_mlp.gate_and_up_proj` [M, 2*I_m, H] and `mlp.experts.gate_and_up_proj`
  [M, E, 2*I_m, H]: M "micro packs", each [x1 rows; x2 rows] of one column block of the
  intermediate dimension. Single process: M = 1 and the pack is the official [x1; x2].
- `down_proj` weights hold the matching column blocks, micro-major.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_linear import fp8_linear
from kernels.moe_router import TRITON_MAX_TOKENS as ROUTE_KERNEL_MAX_TOKENS
from kernels.moe_router import moe_route_topk, route_from_logits
from kernels.qk_norm_rope_kv import qk_norm_rope_kv
from kernels.split_kv_decode import split_kv_decode

from dtgen.attention import AttentionMeta, DecodeBatch, KVCache, LayerKVCache, LocalAttention
from dtgen.layers.linear import ProductSite, empty_param
from dtgen.layers.norms import RMSNorm   # rounding "input": variance in float32, cast back before the weight
from dtgen.layers.rope import apply_rope
from dtgen.seq_split import GatherRows, SeqSplits, SplitRows

from .rope import rope_cos_sin
from .config import HunyuanImage3Config


class Attention(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.num_query_groups
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.qkv_rows, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.use_qk_norm = cfg.use_qk_norm
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # Swapped per phase by the parallel runtime (Ulysses, ring, ...); same signature.
        self.core: nn.Module = LocalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
                cache: LayerKVCache | None) -> torch.Tensor:
        if meta.decode is not None:
            return self.decode(x, cos, sin, meta.decode, cache)
        B, S, _ = x.shape
        D, G = self.head_dim, self.group
        # [B, S, kv_heads, G + 2, D]: whatever number of KV groups this weight holds.
        qkv = self.qkv_proj(x).view(B, S, -1, G + 2, D)
        q = qkv[:, :, :, :G].reshape(B, S, -1, D)  # query head index = group * G + j
        k = qkv[:, :, :, G]
        v = qkv[:, :, :, G + 1]
        # RoPE first, then the per-head QK RMSNorm (the official order).
        q = apply_rope(q, cos, sin, pairs="halves")
        k = apply_rope(k, cos, sin, pairs="halves")
        if self.use_qk_norm:
            q = self.query_layernorm(q)
            k = self.key_layernorm(k)
        out = self.core(q, k, v, meta, cache)
        return self.o_proj(out.reshape(B, S, -1))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: DecodeBatch,
               cache: LayerKVCache) -> torch.Tensor:
        """A batched decode step (x [B, 1, H], one row per request): the prologue as one op
        (split, RoPE, QK norm, K/V written at each row's own slot), then split-KV attention
        over each row's own keys. The same math as `forward` (the ops' references are the
        same torch ops, in the same order); the heads are whatever this weight holds."""
        if not isinstance(self.core, LocalAttention):
            raise ValueError(f"a batched decode step attends over local heads only; this phase's attention core "
                             f"is {type(self.core).__name__} (sequence parallel)")
        B, S, _ = x.shape
        if S != 1 or cache is None:
            raise ValueError(f"a batched decode step takes one row per request and a KV cache, got {S} rows"
                             + ("" if cache is not None else " and no cache"))
        norm = (self.query_layernorm.weight, self.key_layernorm.weight) if self.use_qk_norm else (None, None)
        eps = self.query_layernorm.eps if self.use_qk_norm else 0.0
        q = qk_norm_rope_kv(self.qkv_proj(x), cos, sin, *norm, eps, cache.k, cache.v, step.positions[:, None],
                            self.group, impl=step.impl)
        out = split_kv_decode(q[:, 0], cache.k, cache.v, step.lengths, step.schedule, impl=step.impl)
        return self.o_proj(out.reshape(B, 1, -1))


def gated_act(u: torch.Tensor) -> torch.Tensor:
    """[..., M, 2, I] -> [..., M * I]: x1 * silu(x2); SiLU on the SECOND half."""
    return (u[..., 0, :] * F.silu(u[..., 1, :])).flatten(-2)


class GatedMLP(nn.Module):
    """down(x1 * silu(x2)) with the gate/up weight held as M micro packs [M, 2*I_m, H]."""

    # Each weight's product passes through a site (the identity) where a LoRA pair on the
    # official `gate_and_up_proj` / `down_proj` linear adds its delta (dtgen/lora).
    lora_sites = {"gate_and_up_proj": "gate_and_up_out", "down_proj": "down_out"}

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_and_up_proj = empty_param(1, 2 * intermediate, hidden)
        self.down_proj = empty_param(hidden, intermediate)
        self.gate_and_up_out = ProductSite()
        self.down_out = ProductSite()
        # FP8 (`use_fp8`): both weights in e4m3 with one scale per output channel,
        # gate_and_up_scale [M, 2*I_m] (packed like its rows), down_scale [H].
        self.gate_and_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None

    def use_fp8(self) -> None:
        self.gate_and_up_scale = empty_param(1, 0, dtype=torch.float32)
        self.down_scale = empty_param(0, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packs = self.gate_and_up_proj.shape[0]
        if self.gate_and_up_scale is not None:
            u = self.gate_and_up_out(x, fp8_linear(x, self.gate_and_up_proj.flatten(0, 1),
                                                   self.gate_and_up_scale.flatten()))
            h = gated_act(u.unflatten(-1, (packs, 2, -1)))
            return self.down_out(h, fp8_linear(h, self.down_proj, self.down_scale))
        u = self.gate_and_up_out(x, F.linear(x, self.gate_and_up_proj.flatten(0, 1))).unflatten(-1, (packs, 2, -1))
        h = gated_act(u)
        return self.down_out(h, F.linear(h, self.down_proj))


def experts_eager(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_and_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Plain-torch routed experts: for each micro pack and expert, its tokens' partial sums.

    x [T, H]; topk_ids/topk_weights [T, K]; gate_and_up [M, E, 2I, H]; down [M, E, H, I].
    Accumulates in float32 and applies each routing weight to the summed micro partials.
    """
    M, E = gate_and_up.shape[:2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(E):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        xe = x.index_select(0, token)
        ye = torch.zeros(token.numel(), x.shape[1], dtype=torch.float32, device=x.device)
        for m in range(M):
            u = F.linear(xe, gate_and_up[m, e]).unflatten(-1, (1, 2, -1))
            ye += F.linear(gated_act(u), down[m, e]).float()
        out.index_add_(0, token, ye * topk_weights[token, slot].unsqueeze(-1))
    return out.to(x.dtype)


class Experts(nn.Module):
    """Routed experts stacked as [M, E, ...] micro packs; `impl` picks the implementation.

    FP8 experts (`use_fp8`): the two weights in e4m3 plus their scales, packed like them
    (`kernels.fp8_quant`'s recipes); `impl_fp8` then takes the scales too.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_and_up_proj = empty_param(1, num_experts, 2 * intermediate, hidden)
        self.down_proj = empty_param(1, num_experts, hidden, intermediate)
        self.gate_and_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        # Callables with experts_eager's signature (impl_fp8: with each weight's scales after
        # it); the runtime sets kernel ops here.
        self.impl = experts_eager
        self.impl_fp8 = None

    def use_fp8(self) -> None:
        """Give the module scale parameters (their shapes come from the storage's recipe)."""
        self.gate_and_up_scale = empty_param(0, dtype=torch.float32)
        self.down_scale = empty_param(0, dtype=torch.float32)

    def forward(self, x, topk_ids, topk_weights):
        if self.gate_and_up_scale is not None:
            return self.impl_fp8(x, topk_ids, topk_weights, self.gate_and_up_proj, self.gate_and_up_scale,
                                 self.down_proj, self.down_scale)
        return self.impl(x, topk_ids, topk_weights, self.gate_and_up_proj, self.down_proj)


class Router(nn.Module):
    """`gate.wg`: expert logits computed in float32 (bf16 routing flips expert choices)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32)
        # a LoRA pair would not reach the logits: `MoE.route` reads the weight itself (the fused
        # top-k op on GPU), never calls this linear
        self.wg.lora_refused = "is the MoE router, whose logits are computed from its weight directly"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.wg.weight.float())


class MoE(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config, layer: int):
        super().__init__()
        self.top_k = cfg.moe_topk[layer]
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size[layer])
        self.shared_mlp = (GatedMLP(cfg.hidden_size, cfg.shared_intermediate_size(layer))
                           if cfg.use_mixed_mlp_moe else None)
        # Tokens per routed-experts call (None: all at once). The experts' dispatch buffers
        # grow with tokens x top_k (gate/up, activation, partial sums: ~1.6 GB for a 5.6k-row
        # denoise branch at the released shapes); chunks bound them. Every token's output is
        # its own, so chunks change no value beyond the kernels' row tiling.
        self.token_chunk: int | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (ids int64 [T, K], weights float32 [T, K]): softmax of the float32
        logits, top-k (descending), then the K weights renormalised (K > 1 and norm_topk_prob)
        or scaled. On a GPU up to ROUTE_KERNEL_MAX_TOKENS tokens (decode) the fused router op
        (the same math, two launches instead of ~6); elsewhere the torch ops."""
        if x.is_cuda and x.shape[0] <= ROUTE_KERNEL_MAX_TOKENS:
            return moe_route_topk(x, self.gate.wg.weight, self.top_k, self.norm_topk_prob,
                                  self.routed_scaling_factor)
        return route_from_logits(self.gate(x), self.top_k, self.norm_topk_prob, self.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(flat)
        chunk = self.token_chunk
        if chunk is None or flat.shape[0] <= chunk:
            out = self.experts(flat, ids, weights)
        else:
            out = torch.cat([self.experts(flat[i:i + chunk], ids[i:i + chunk], weights[i:i + chunk])
                             for i in range(0, flat.shape[0], chunk)])
        if self.shared_mlp is not None:   # on x's own rows: a LoRA delta on it may differ per batch row
            out = out + self.shared_mlp(x).view_as(flat)
        return out.view_as(x)


class DecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += moe(norm(x))."""

    def __init__(self, cfg: HunyuanImage3Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, layer)

    def forward(self, h, cos, sin, meta: AttentionMeta, cache: LayerKVCache | None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HunyuanImage3Transformer(nn.Module):
    """`model.*` of the checkpoint: token embedding, decoder layers and ln_f."""

    # Under sequence parallelism (dtgen/seq_split.py) each rank runs the layers on its chunk of
    # the fed rows: the embeddings and their RoPE positions are split along the rows, the last
    # hidden state gathered back. The attention meta comes from the KV-cache slots of the rows
    # (the caller's), not from the split: AR and denoise rows sit at their sequence positions.
    seq_splits = SeqSplits(inputs={"embeds": SplitRows(1), "rope_pos": SplitRows(-2)}, attention=("embeds",),
                           output=GatherRows(1))

    def __init__(self, cfg: HunyuanImage3Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # How a layer is called: `run_layer`, or what a runtime puts here instead (the same
        # function compiled once for all layers: regional compilation).
        self.run_layer = run_layer

    def forward(self, h: torch.Tensor, rope_pos: torch.Tensor, meta: AttentionMeta,
                cache: KVCache | None = None) -> torch.Tensor:
        """h: [B, S, H] input embeddings; rope_pos: [S, 2] (y, x) of these rows, or [B, S, 2]
        (each batch row its own: batched requests whose text lengths differ).

        Returns the last layer's output WITHOUT ln_f (image tokens skip it).
        """
        cos, sin = rope_cos_sin(rope_pos, self.cfg.head_dim, self.cfg.rope_theta)
        for i, layer in enumerate(self.layers):
            h = self.run_layer(layer, h, cos, sin, meta, None if cache is None else cache[i])
        return h


def run_layer(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
              cache: LayerKVCache | None) -> torch.Tensor:
    """One decoder layer, as a free function: the unit a runtime may compile once and reuse
    for every layer (the layer's weights are its inputs, not its constants)."""
    return layer(h, cos, sin, meta, cache)
