"""FP8 attention (forward, non-causal, every query sees every key), SageAttention2-style.

    out = fp8_attention(q, k, v)     # q [B, H, Sq, D], k/v [B, H, Sk, D] -> [B, H, Sq, D]

For full bidirectional attention (the Wan DiT's self-attention, an image block), head_dim
64 or 128 (others are refused in one line); softmax scale 1/sqrt(D). Both matmuls run on
8-bit tensor cores:

- QK^T in INT8 (int32 accumulation), one scale per block of rows (BLOCK_M query rows,
  BLOCK_N key rows of a head). K is first smoothed: its mean over the tokens (per head and
  channel) is subtracted, which leaves every softmax row unchanged (it adds q . mean_k to
  all of a row's logits) and removes the common offset that would otherwise take most of
  the 8-bit range (SageAttention's observation). The softmax scale and log2(e) are folded
  into Q's scales, so the kernel's softmax is exp2 of the scaled logits. INT8 rather than
  e4m3 for QK: at these per-block scales e4m3's 3 mantissa bits cost 3.9% relative L2 of
  the output (random q, k, v; 7.8% at 3x sharper logits), INT8 1.3% (2.6%): measured with
  the references here at S = 1024, D = 128.
- PV in FP8 e4m3 (float32 accumulation): P (the online-softmax probabilities, in [0, 1]
  against the running row max) is cast as P * 448 (the full range), V with one scale per
  channel over all tokens (a head's channel), stored transposed [D, Sk] so that the dot
  takes K-major operands as Hopper's FP8 MMA needs. The row sums use P before its rounding.
  `pv="fp16"` keeps P and V in fp16 instead (SageAttention1's split), for comparison (fp16,
  not bf16: Triton's interpreter multiplies bf16 dots wrongly, seen with triton 3.9).

`fp8_attention_reference` quantizes alike in torch and computes in float32 with the exact
row max, so its P rounding differs from the kernel's only in which max P is scaled by: a
test bound, not an identity. `attention_fp8_problem` says in one line why an input is not
taken (head size, shapes, device). The kernel is registered as
``dtgen::fp8_attention_quantized`` (one node under ``torch.compile``) over the operands of
`quantize_qkv`, which are torch ops outside it: a compiled region fuses them with what comes
before (eagerly they are ~10 passes over Q, K, V).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_quant import FP8_DTYPE, FP8_MAX, INTERPRETED, fp8_support_problem, to_fp8

HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
INT8_MAX = 127.0
# Tiles: query rows a program, key rows a loop step (also the Q and K scale blocks). The
# interpreter runs small tiles (it is slow per element, and the tests use odd lengths).
BLOCK_M, BLOCK_N = (16, 16) if INTERPRETED else (128, 128)


def attention_fp8_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why fp8_attention does not take these inputs, in one line, or None."""
    if q.dim() != 4 or k.dim() != 4 or tuple(k.shape) != tuple(v.shape):
        return (f"FP8 attention takes q [B, H, Sq, D] and k, v [B, H, Sk, D], got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        return (f"FP8 attention needs equal batch, heads and head_dim in q {tuple(q.shape)} and k {tuple(k.shape)} "
                f"(no GQA)")
    if q.shape[3] not in HEAD_DIMS:
        return f"FP8 attention handles head_dim {HEAD_DIMS}, not {q.shape[3]}"
    if k.shape[2] == 0:
        return "FP8 attention needs at least one key"
    # The device once, eagerly (a compiled region has had it checked at load: the device
    # queries would be graph breaks there).
    return None if torch.compiler.is_compiling() else fp8_support_problem(q.device)


def _int8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] float32 -> (int8 [B, H, S_pad, D] zero-padded to whole blocks, scales
    [B, H, S_pad / block]): one amax / 127 per block of rows, rounded to nearest."""
    B, H, S, D = x.shape
    blocks = F.pad(x, (0, 0, 0, -S % block)).view(B, H, -1, block, D)
    amax = blocks.abs().amax(dim=(-2, -1))
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(blocks / scale[..., None, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(B, H, -1, D), scale.contiguous()


PV_DTYPES = ("fp8", "fp16")


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "fp8",
                 block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The kernel's operands: (q8 [B, H, Sq_pad, D] int8, q_scale [B, H, Sq_pad/block_m]
    (softmax scale and log2 e folded in), k8 [B, H, Sk_pad, D] int8 (smoothed), k_scale
    [B, H, Sk_pad/block_n], vt [B, H, D, Sk_pad] (transposed, zero-padded; e4m3, or fp16 for
    pv="fp16"), v_scale [B, H, D]: one amax / 448 per channel)."""
    D = q.shape[-1]
    q8, q_scale = _int8_blocks(q.float() * (LOG2E / math.sqrt(D)), block_m)
    kf = k.float()
    k8, k_scale = _int8_blocks(kf - kf.mean(dim=2, keepdim=True), block_n)
    vf = v.float()
    amax = vf.abs().amax(dim=2)                                                  # [B, H, D]
    v_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    vf = (vf / v_scale[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX)
    vt = F.pad(vf, (0, 0, 0, -v.shape[2] % block_n)).transpose(2, 3)
    vt = vt.to(FP8_DTYPE if pv == "fp8" else torch.float16).contiguous()
    return q8, q_scale, k8, k_scale, vt, v_scale.contiguous()


def fp8_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "fp8") -> torch.Tensor:
    """The same quantization, float32 math with the exact row max; P rounded to e4m3 as
    P * 448 (pv="fp8") or to fp16."""
    Sq, Sk = q.shape[2], k.shape[2]
    q8, q_scale, k8, k_scale, vt, v_scale = quantize_qkv(q, k, v, pv)
    qd = (q8.float().unflatten(2, (-1, BLOCK_M)) * q_scale[..., None, None]).flatten(2, 3)[:, :, :Sq]
    kd = (k8.float().unflatten(2, (-1, BLOCK_N)) * k_scale[..., None, None]).flatten(2, 3)[:, :, :Sk]
    s = qd @ kd.transpose(-1, -2)                        # log2-domain logits
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    p_scale = FP8_MAX if pv == "fp8" else 1.0
    p_op = (p * p_scale).to(vt.dtype).float()
    out = (p_op @ vt.float()[..., :Sk].transpose(-1, -2)) / p.sum(-1, keepdim=True)
    return (out * (v_scale[:, :, None, :] / p_scale)).to(q.dtype)


# GPU: the launch parameters tuned on first use per (head_dim, key count); the tiles stay
# 128 x 128 (they are the Q and K scale blocks). The interpreter: one small config.
_CONFIGS = ([triton.Config({}, num_warps=4, num_stages=1)] if INTERPRETED else
            [triton.Config({}, num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4)])


@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "sk", "PV_FP8"])
@triton.jit
def _fp8_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, vt_ptr, vs_ptr, o_ptr, heads, sq, sk,
                          stride_qbh, stride_qs_bh, stride_kbh, stride_ks_bh, stride_vbh, stride_vd, stride_vs_bh,
                          stride_ob, stride_oh, stride_os,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PV_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head), every key block in turn."""
    m_block = tl.program_id(0)
    bh = tl.cast(tl.program_id(1), tl.int64)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + bh * stride_qbh + rows[:, None] * HEAD_DIM + dims[None, :])   # padded: no mask
    q_scale = tl.load(qs_ptr + bh * stride_qs_bh + m_block)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, sk, BLOCK_N):
        k = tl.load(k_ptr + bh * stride_kbh + (n0 + cols)[:, None] * HEAD_DIM + dims[None, :])
        k_scale = tl.load(ks_ptr + bh * stride_ks_bh + n0 // BLOCK_N)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * (q_scale * k_scale)   # int8 x int8 -> int32
        s = tl.where((n0 + cols)[None, :] < sk, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        vt = tl.load(vt_ptr + bh * stride_vbh + dims[:, None] * stride_vd + (n0 + cols)[None, :])  # [D, BLOCK_N]
        if PV_FP8:
            p_op = to_fp8(p * 448.0, vt_ptr.dtype.element_ty, ROUND_FIRST)
        else:
            p_op = p.to(vt_ptr.dtype.element_ty)
        acc = tl.dot(p_op, tl.trans(vt), acc)
        m_i = m_new
    v_scale = tl.load(vs_ptr + bh * stride_vs_bh + dims)
    out = acc / l_i[:, None] * (v_scale[None, :] / (448.0 if PV_FP8 else 1.0))   # P's and V's scales
    b = bh // heads
    h = bh % heads
    ok = rows[:, None] < sq
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=ok)


def _fp8_attention_triton(q8, q_scale, k8, k_scale, vt8, v_scale, sq: int, sk: int, heads: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """The kernel over `quantize_qkv`'s operands -> out [B, Sq, H, D] (the attention cores' layout)."""
    B, D = q8.shape[0], q8.shape[3]
    out = torch.empty(B, sq, heads, D, dtype=dtype, device=q8.device)
    grid = (triton.cdiv(sq, BLOCK_M), B * heads)
    _fp8_attention_kernel[grid](
        q8, q_scale, k8, k_scale, vt8, v_scale, out, heads, sq, sk,
        q8.stride(1), q_scale.stride(1), k8.stride(1), k_scale.stride(1), vt8.stride(1), vt8.stride(2),
        v_scale.stride(1),
        out.stride(0), out.stride(2), out.stride(1),
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PV_FP8=vt8.dtype == FP8_DTYPE, ROUND_FIRST=INTERPRETED)
    return out


# The op takes the quantized operands: the quantization (`quantize_qkv`, ~10 torch passes over
# Q, K, V) stays outside it, so that a compiled region fuses it with the RoPE and norms before
# it (eager: 3.5 / 11.0 ms a call at Wan's 1.3B / 14B shapes; compiled alone: 0.5 / 1.0 ms,
# bench/bench_fp8_attention.py). Inside an opaque op it would always run eagerly.
@torch.library.custom_op("dtgen::fp8_attention_quantized", mutates_args=())
def _fp8_attention_op(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                      vt8: torch.Tensor, v_scale: torch.Tensor, sq: int, sk: int, heads: int,
                      dtype: torch.dtype) -> torch.Tensor:
    return _fp8_attention_triton(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype)


@_fp8_attention_op.register_fake
def _(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype):
    return q8.new_empty(q8.shape[0], sq, heads, q8.shape[3], dtype=dtype)


IMPLS = ("auto", "triton", "reference")


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str = "auto",
                  pv: str = "fp8") -> torch.Tensor:
    """Full attention of q [B, H, Sq, D] over k, v [B, H, Sk, D] in FP8 (module docstring) ->
    [B, H, Sq, D] in q's dtype. impl "auto": the Triton kernel on CUDA, the torch reference
    on the CPU; "triton" (CUDA, or the CPU under TRITON_INTERPRET=1); "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"fp8_attention: impl must be one of {IMPLS}, got {impl!r}")
    if pv not in PV_DTYPES:
        raise ValueError(f"fp8_attention: pv must be one of {PV_DTYPES}, got {pv!r}")
    problem = attention_fp8_problem(q, k, v)
    if problem:
        raise ValueError(f"fp8_attention: {problem}")
    if impl == "auto":
        impl = "triton" if q.is_cuda else "reference"
    if impl == "triton" and not (q.is_cuda or INTERPRETED):
        raise RuntimeError("fp8_attention: impl='triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    if impl == "reference":
        return fp8_attention_reference(q, k, v, pv)
    out = torch.ops.dtgen.fp8_attention_quantized(*quantize_qkv(q, k, v, pv), q.shape[2], k.shape[2], q.shape[1],
                                                  q.dtype)
    return out.transpose(1, 2)   # [B, H, Sq, D], a view of the [B, Sq, H, D] the cores transpose back to
