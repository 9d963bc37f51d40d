"""MoE router of a decode step: fp32 logits, softmax, top-k and the weights' normalisation, fused.

``moe_route_topk(x [T, H], weight [E, H], top_k, normalize, scaling_factor)`` -> ``ids``
int64 [T, K] and ``weights`` float32 [T, K], exactly the math of HunyuanImage-3's
``MoE.route``::

    probs = softmax(x.float() @ weight.float().T)         # logits in float32
    weights, ids = topk(probs, K)                          # descending, as torch.topk sorted=True
    weights = weights / max(weights.sum(-1), tiny)   if K > 1 and normalize
    weights = weights * scaling_factor               otherwise

Why fused: on an H200 the torch ops of one AR decode step's route (batch 1, CUDA graph) take
~14 us per layer (cuBLAS dot + reduce 3.9 us, softmax 1.35 us, topk's gatherTopK + bitonic
sort 8.5 us), 0.44 ms of a 6.2 ms step over 32 layers, for a 1 MB weight and 64 values.

Two launches, deterministic (no atomics), no host sync (CUDA-graph safe):

- `_router_logits_kernel`, grid (E-blocks, H-blocks, token chunks of BLOCK_T <= 16): one
  program loads one [BLOCK_E, BLOCK_H] tile of the weight once (the 1 MB weight is spread
  over ~128 programs at the released shapes: E=64, H=4096, 16 x 128 tiles) and, for each
  token of its chunk, the dot of the tile's rows with the token's BLOCK_H values in float32.
  It writes ``partials[t, h_block, e]`` (float32 [T, S, E], S = H-blocks: 8 KB at T=1).
- `_router_topk_kernel`, grid (T,): one program per token sums its S partials in a fixed
  order (one [BLOCK_S, E] tile at a time), softmax over the E logits (masked to E, which
  need not be a power of two), then K rounds of one int64 max over keys that pack the
  probability's bits above the expert's index (probabilities are >= 0, so their bits order
  like the values), and the normalisation.

Numerics. float32 accumulation throughout (x in bf16/fp16/fp32 and a bf16 weight are
upcast when loaded; bf16 routing flips expert choices). The logits' sums run in another
order than cuBLAS's or the CPU's: they agree to ~1e-6 relative, so the chosen experts are
the reference's unless two probabilities are that close (random inputs: essentially never).
Weights: rtol ~1e-5 of the reference (exp and the sums in other orders). A token's result
does not depend on the other tokens of the batch (the tiling is per token).

Ties and order. Outputs come in descending weight, as torch.topk(sorted=True) returns them;
equal probabilities go to the lower expert index first. torch.topk documents no order for
ties (the CPU picks e.g. experts 44, 41, 42, ... of 64 equal values), so on exact ties the
ids can differ from the reference's while the weights are the same; NaN probabilities
rank above every number (as in torch.topk), and every id is in [0, E) whatever the input.
Downstream (`kernels.moe_decode`, `kernels.moe_multi_micro`, the eager experts) treats the
K pairs of a token as a set summed in slot order, so only that sum's rounding follows the order.

impl: "auto" (CUDA with T <= TRITON_MAX_TOKENS and E <= TRITON_MAX_EXPERTS: the Triton
kernels; otherwise, and on CPU, the reference torch ops), "reference", "triton" (on CPU
only under TRITON_INTERPRET=1). Registered as ``dtgen::moe_route_topk``: one node under
``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime import JITFunction

IMPLS = ("auto", "reference", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# "auto" (and HunyuanImage-3's MoE.route) take the Triton kernels up to this many tokens on a
# GPU: the decode shapes (one AR request, a batch of decode requests). Above it the torch ops
# (a cuBLAS GEMM, inductor's fused softmax under compile) are the path measured so far.
TRITON_MAX_TOKENS = 16
TRITON_MAX_EXPERTS = 1024   # the top-k kernel holds every expert of a token in registers
BLOCK_T = 16                # tokens per chunk of the logits kernel
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class RouterConfig:
    """Tile sizes and warps (block sizes are capped at the next power of two of E and H).
    Defaults (untimed: chosen from the sm_90 code, not a sweep): E=64, H=4096 -> a 4 x 32
    grid of 8 KB weight tiles per token chunk, each row of a tile summed within one warp
    (16-byte loads); the top-k kernel in one warp, whose reductions then need no barrier."""

    block_e: int = 16
    block_h: int = 128
    logits_warps: int = 4
    topk_warps: int = 1


# ------------------------------------------------------------------------------ checks


def check_router_inputs(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> None:
    """Raise a one-line ValueError naming the problem when the inputs do not fit."""
    if x.dim() != 2:
        raise ValueError(f"moe_route_topk: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"moe_route_topk: weight must be [experts, hidden], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"moe_route_topk: weight's hidden size {weight.shape[1]} != x's {x.shape[1]} "
                         f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if weight.shape[0] < 1:
        raise ValueError(f"moe_route_topk: weight has no experts, shape {tuple(weight.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= weight.shape[0]:
        raise ValueError(f"moe_route_topk: top_k must be an int in [1, {weight.shape[0]}] (the experts), "
                         f"got {top_k!r}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"moe_route_topk: x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"moe_route_topk: weight dtype must be one of {_FLOAT_DTYPES}, got {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"moe_route_topk: x on {x.device} but weight on {weight.device}")


# ---------------------------------------------------------------------------- reference


def route_from_logits(logits: torch.Tensor, top_k: int, normalize: bool,
                      scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax, topk and the normalisation of `MoE.route` on float32 logits [T, E]."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if top_k > 1 and normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    else:
        weights = weights * scaling_factor
    return ids, weights


def moe_route_topk_reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool = True,
                             scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The route in torch ops: float32 logits (`Router`), then `route_from_logits`."""
    check_router_inputs(x, weight, top_k)
    return route_from_logits(F.linear(x.float(), weight.float()), top_k, normalize, scaling_factor)


# ------------------------------------------------------------------------------ Triton


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, part_ptr, tokens, experts, hidden, num_splits, s_xt, s_we,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """partials[t, h_block, e] = sum over the H-block of x[t, h] * w[e, h], float32."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    h_block = tl.program_id(1)
    h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    t0 = tl.program_id(2) * BLOCK_T
    e_ok = e < experts
    h_ok = h < hidden
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * s_we + h[None, :],
                mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_E, BLOCK_T), tl.float32)   # [expert, token]: w's row layout, no transpose
    # Unrolled over the chunk's tokens with no store in between, so that the (independent)
    # loads of x's rows can all be in flight at once.
    for i in tl.static_range(BLOCK_T):
        t = t0 + i
        # One compare with a scalar bound (the interpreter refuses `h_ok & (t < tokens)`'s mask).
        row_end = tl.where(t < tokens, hidden, 0)
        xt = tl.load(x_ptr + t.to(tl.int64) * s_xt + h, mask=h < row_end, other=0.0).to(tl.float32)
        part = tl.sum(w * xt[None, :], axis=1)
        acc = tl.where(cols[None, :] == i, part[:, None], acc)
    toks = t0 + cols
    dst = part_ptr + (toks[None, :].to(tl.int64) * num_splits + h_block) * experts + e[:, None]
    tl.store(dst, acc, mask=e_ok[:, None] & (toks[None, :] < tokens))


@triton.jit
def _router_topk_kernel(
    part_ptr, ids_ptr, wts_ptr, experts, num_splits, scaling_factor,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token: logits from the partials, softmax, top-k by packed keys, normalisation."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < experts
    s = tl.arange(0, BLOCK_S)
    base = part_ptr + t * num_splits * experts
    logits = tl.zeros((BLOCK_E,), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):   # a fixed order: deterministic
        ss = s0 + s
        tile = tl.load(base + ss[:, None] * experts + e[None, :],
                       mask=(ss[:, None] < num_splits) & e_ok[None, :], other=0.0)
        logits += tl.sum(tile, axis=0)
    logits = tl.where(e_ok, logits, float("-inf"))
    num = tl.exp(logits - tl.max(logits, axis=0))          # masked experts: exp(-inf) = 0
    probs = tl.math.div_rn(num, tl.sum(num, axis=0))

    # Key = |prob| bits (a float >= 0 orders like its bits; NaN above inf) << 32 | reversed
    # index (ties: the lower expert wins). Masked and taken experts: -1, below every key.
    bits = (probs.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
    key = tl.where(e_ok, (bits << 32) | (BLOCK_E - 1 - e).to(tl.int64), -1)
    kk = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), tl.int64)
    for k in range(TOP_K):
        best = tl.max(key, axis=0)
        chosen = tl.where(kk == k, best, chosen)
        key = tl.where(key == best, -1, key)
    k_ok = kk < TOP_K
    ids = (BLOCK_E - 1) - (chosen & 0xFFFF)
    w = tl.where(k_ok, (chosen >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    if NORMALIZE:
        w = tl.math.div_rn(w, tl.maximum(tl.sum(w, axis=0), 1.1754943508222875e-38))
    else:
        w = w * scaling_factor
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=k_ok)
    tl.store(wts_ptr + t * TOP_K + kk, w, mask=k_ok)


TRITON_INTERPRETED = not isinstance(_router_logits_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"moe_route_topk: the Triton kernels need CUDA tensors, or CPU tensors with "
                           f"TRITON_INTERPRET=1 set before triton is first imported; got a tensor on {x.device}")


def moe_route_topk_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool = True,
                          scaling_factor: float = 1.0,
                          config: RouterConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels (module docstring). Graph-capturable: no host sync."""
    check_router_inputs(x, weight, top_k)
    require_triton_device(x)
    config = config or RouterConfig()
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if experts > TRITON_MAX_EXPERTS:
        raise ValueError(f"moe_route_topk: the Triton kernels take at most {TRITON_MAX_EXPERTS} experts, "
                         f"got {experts}")
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return ids, weights
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block_e = min(config.block_e, triton.next_power_of_2(experts))
    block_h = min(config.block_h, triton.next_power_of_2(hidden))
    block_t = min(BLOCK_T, triton.next_power_of_2(tokens))
    splits = triton.cdiv(hidden, block_h)
    partials = torch.empty((tokens, splits, experts), dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(experts, block_e), splits, triton.cdiv(tokens, block_t))](
        x, weight, partials, tokens, experts, hidden, splits, x.stride(0), weight.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=config.logits_warps)
    block_ef = triton.next_power_of_2(experts)
    block_s = min(triton.next_power_of_2(splits), max(1, 4096 // block_ef))
    _router_topk_kernel[(tokens,)](
        partials, ids, weights, experts, splits, float(scaling_factor),
        TOP_K=top_k, NORMALIZE=bool(top_k > 1 and normalize), BLOCK_S=block_s, BLOCK_E=block_ef,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=config.topk_warps)
    return ids, weights


def triton_path_taken(x: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> bool:
    """Whether `moe_route_topk` with `impl` runs the Triton kernels for these inputs."""
    if impl == "triton":
        return True
    return (impl == "auto" and x.is_cuda and x.shape[0] <= TRITON_MAX_TOKENS
            and weight.shape[0] <= TRITON_MAX_EXPERTS)


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::moe_route_topk", mutates_args=())
def _moe_route_topk_op(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                       scaling_factor: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_path_taken(x, weight, impl):
        return moe_route_topk_triton(x, weight, top_k, normalize, scaling_factor)
    return moe_route_topk_reference(x, weight, top_k, normalize, scaling_factor)


@_moe_route_topk_op.register_fake
def _(x, weight, top_k, normalize, scaling_factor, impl):
    shape = (x.shape[0], top_k)
    return x.new_empty(shape, dtype=torch.int64), x.new_empty(shape, dtype=torch.float32)


def moe_route_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool = True,
                   scaling_factor: float = 1.0, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens x [T, H] over the experts of weight [E, H] (module docstring):
    -> (ids int64 [T, K], weights float32 [T, K]), descending weight.

    impl: "auto" (CUDA, T <= TRITON_MAX_TOKENS, E <= TRITON_MAX_EXPERTS: Triton; else the
    reference torch ops), "reference", "triton" (on CPU only under TRITON_INTERPRET=1).
    """
    if impl not in IMPLS:
        raise ValueError(f"moe_route_topk: impl must be one of {IMPLS}, got {impl!r}")
    check_router_inputs(x, weight, top_k)
    if impl == "triton":
        require_triton_device(x)
        if weight.shape[0] > TRITON_MAX_EXPERTS:
            raise ValueError(f"moe_route_topk: the Triton kernels take at most {TRITON_MAX_EXPERTS} experts, "
                             f"got {weight.shape[0]}")
    return torch.ops.dtgen.moe_route_topk(x, weight, top_k, bool(normalize), float(scaling_factor), impl)
