"""FP8 attention (forward, non-causal, every query sees every key), SageAttention2-style.

    out = fp8_attention(q, k, v)     # q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] -> [B, Hq, Sq, D]

For full bidirectional attention (the Wan DiT's self-attention, HunyuanImage-3's image rows
over their key prefix), head_dim up to 128 (a smaller head runs zero-padded to 64 or 128,
which changes no logit and no output column; a larger one is refused in one line), GQA (Hq a
multiple of Hkv: each query head reads its group's K/V, nothing is expanded); softmax scale
1/sqrt(D). Both matmuls run on 8-bit tensor cores:

- QK^T in INT8 (int32 accumulation), one scale per block of rows (SCALE_M query rows,
  SCALE_N key rows of a head). K is first smoothed: its mean over the tokens (per KV head and
  channel) is subtracted, which leaves every softmax row unchanged (it adds q . mean_k to
  all of a row's logits) and removes the common offset that would otherwise take most of
  the 8-bit range (SageAttention's observation). The softmax scale and log2(e) are folded
  into Q's scales, so the kernel's softmax is exp2 of the scaled logits. INT8 rather than
  e4m3 for QK: at these per-block scales e4m3's 3 mantissa bits cost the output about three
  times INT8's relative L2, on random q, k, v and on sharper logits alike (the references
  here, at S = 1024, D = 128, show it).
- PV in FP8 e4m3 (float32 accumulation): P (the online-softmax probabilities against the
  running row max) is made as P * 448 (e4m3's whole range: the row max lowered by log2 448,
  which the row sums carry too, so it cancels), V with one scale per channel over all tokens
  (a head's channel), stored transposed [D, Sk] so that the dot takes K-major operands as
  Hopper's FP8 MMA needs. The row sums use P before its rounding. `pv="fp16"` keeps P and V
  in fp16 instead (SageAttention1's split), for comparison (fp16, not bf16: Triton's
  interpreter multiplies bf16 dots wrongly, seen with triton 3.9).

The softmax is what bounds an 8-bit attention kernel on Hopper (the tensor cores are twice as
fast as bf16's, the exp2 and conversion units are not), so the loop spends few slow ops per
logit: the int32 logits are read as float32 through the 1.5 * 2^23 bit trick (the dot's
accumulator starts at those bits; one FFMA then scales and subtracts) instead of a
quarter-rate int-to-float conversion; the row max is taken on the integers; only the last key
block is masked.

`fp8_attention_reference` quantizes alike in torch and computes in float32 with the exact
row max, so its P rounding differs from the kernel's only in which max P is scaled by: a
test bound, not an identity. `attention_fp8_problem` says in one line why an input is not
taken (head size, shapes, device). On sm90 the same op also runs as a Gluon kernel
(kernels/fp8_attention_gluon.py: warp-specialized, the softmax overlapped with the MMAs;
`impl="gluon"`). The kernel is registered as
``dtgen::fp8_attention_quantized`` (one node under ``torch.compile``) over the operands of
`quantize_qkv`, which are torch ops outside it: a compiled region fuses them with what comes
before (eagerly they are ~10 passes over Q, K, V).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .fp8_attention_constants import (HEAD_DIMS, INT8_MAX, LOG2_FP8_MAX_C, LOG2E, MAGIC_BITS, MAGIC_FLOAT,
                                      MAX_HEAD_DIM, SCALE_M, SCALE_N)
from .fp8_attention_gluon import fp8_attention_gluon, gluon_problem
from .fp8_quant import FP8_DTYPE, FP8_MAX, INTERPRETED, fp8_support_problem, to_fp8


@dataclass(frozen=True)
class AttentionTiles:
    """The kernel's launch parameters: query rows a program, key rows a loop step (each
    divides its scale block), warps, pipeline stages; `tma`: Q, K and V read through TMA
    descriptors (else pointers); `magic`: the int32 logits read as float32 through the bit
    trick (else converted: I2F runs at a quarter of the FP32 rate on Hopper; it also takes
    ~20 more registers a thread); `maxnreg`: a cap on the registers a thread (more programs an
    SM, at the price of spills).

    Not options, and why (`python -m bench kernels fp8-attention --sweep` on one H200): summing each key
    block's FP8 PV products apart before the float32 accumulator (Triton's
    max_num_imprecise_acc = block_n; on sm_90 the tensor cores' reduced-precision
    accumulation otherwise carries the row, as FlashAttention-3's FP8 does) leaves the error
    where it is and costs time: the error is P's e4m3 rounding, not the accumulation. Issuing
    the next key block's Q K^T before this block's softmax (FlashAttention-3's overlap, by
    hand) overlaps nothing with Triton 3.6: its SASS waits on that dot at once. P's exp2 as
    ex2.approx.f16x2 (inline PTX) is no faster: ptxas emits two MUFU.EX2.F16 a pair on sm_90."""

    block_m: int = SCALE_M
    block_n: int = SCALE_N
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = True
    magic: bool = True
    maxnreg: int | None = None

    def problem(self) -> str | None:
        if SCALE_M % self.block_m or SCALE_N % self.block_n:
            return (f"FP8 attention tiles {self.block_m} x {self.block_n} must divide the scale blocks "
                    f"{SCALE_M} x {SCALE_N}")
        if self.tma and self.block_n < 16:
            return f"FP8 attention tiles read by TMA need block_n >= 16 (16-byte rows of V^T), got {self.block_n}"
        return None


# GPU: the best of `python -m bench kernels fp8-attention --sweep` at Wan's shapes (one H200,
# bench/results/h200-2026-12-03-fp8-attention/): 64 query rows a program, one warpgroup, 3 stages: two
# programs fit an SM (registers and shared memory), and one's softmax runs while the other's tensor-core
# work does.
DEFAULT_TILES = (AttentionTiles(num_stages=1, tma=False) if INTERPRETED else
                 AttentionTiles(block_m=64, block_n=128, num_warps=4, num_stages=3))
# Long key sequences (Wan's 32760 keys at 480p): 2 stages and at most 168 registers a thread (no
# spills) let three programs share an SM: 7.96 / 8.08 ms against 8.21-8.36 at Wan 1.3B's shape
# (bench/results/h200-2026-12-03-fp8-attention/default-tiles/ and h200-2026-12-03-side-stream-cfg/lazy-rescale/,
# bench_fp8_attention_sweep.json); at HunyuanImage-3's 5606 / 9702 keys the default's
# deeper pipeline is faster (0.56-0.60 against 0.63-0.68 ms; 0.92 against 0.94).
LONG_KEYS = 16384
LONG_KEY_TILES = AttentionTiles(block_m=64, block_n=128, num_warps=4, num_stages=2, maxnreg=168)


def default_tiles(sk: int, gpu: bool = not INTERPRETED) -> AttentionTiles:
    """The kernel's tiles for `sk` keys: LONG_KEY_TILES from LONG_KEYS keys on (GPU), else DEFAULT_TILES."""
    return LONG_KEY_TILES if gpu and sk >= LONG_KEYS else DEFAULT_TILES


def attention_fp8_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why fp8_attention does not take these inputs, in one line, or None."""
    if q.dim() != 4 or k.dim() != 4 or tuple(k.shape) != tuple(v.shape):
        return (f"FP8 attention takes q [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D], got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        return f"FP8 attention needs equal batch and head_dim in q {tuple(q.shape)} and k {tuple(k.shape)}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return (f"FP8 attention needs the query heads ({q.shape[1]}) a multiple of the KV heads ({k.shape[1]}) "
                f"(GQA)")
    if q.shape[3] > MAX_HEAD_DIM:
        return f"FP8 attention handles head_dim up to {MAX_HEAD_DIM}, not {q.shape[3]}"
    if k.shape[2] == 0:
        return "FP8 attention needs at least one key"
    # The device once, eagerly (a compiled region has had it checked at load: the device
    # queries would be graph breaks there).
    return None if torch.compiler.is_compiling() else fp8_support_problem(q.device)


def kernel_head_dim(head_dim: int) -> int:
    """The kernel's head size for a model's: the smallest of HEAD_DIMS that holds it."""
    return next(d for d in HEAD_DIMS if d >= head_dim)


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


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "fp8"):
    """The kernel's operands, the head padded to Dk = kernel_head_dim(D) (zeros; the softmax
    scale is the model's D): (q8 [B, Hq, Sq_pad, Dk] int8, q_scale [B, Hq, Sq_pad/SCALE_M]
    (softmax scale and log2 e folded in), k8 [B, Hkv, Sk_pad, Dk] int8 (smoothed), k_scale
    [B, Hkv, Sk_pad/SCALE_N], vt [B, Hkv, Dk, Sk_pad] (transposed, zero-padded; e4m3, or fp16
    for pv="fp16"), v_scale [B, Hkv, Dk]: one amax / 448 per channel)."""
    D = q.shape[-1]
    pad = (0, kernel_head_dim(D) - D)
    q8, q_scale = _int8_blocks(F.pad(q.float() * (LOG2E / math.sqrt(D)), pad), SCALE_M)
    kf = k.float()
    k8, k_scale = _int8_blocks(F.pad(kf - kf.mean(dim=2, keepdim=True), pad), SCALE_N)
    vf = F.pad(v.float(), pad)
    amax = vf.abs().amax(dim=2)                                                  # [B, Hkv, Dk]
    v_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    vf = (vf / v_scale[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX)
    vt = F.pad(vf, (0, 0, 0, -v.shape[2] % SCALE_N)).transpose(2, 3)
    vt = vt.to(FP8_DTYPE if pv == "fp8" else torch.float16).contiguous()
    return q8, q_scale, k8, k_scale, vt, v_scale.contiguous()


def fp8_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "fp8") -> torch.Tensor:
    """The same quantization, float32 math with the exact row max; P * 448 rounded to e4m3
    (pv="fp8") or to fp16."""
    Sq, Sk, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    q8, q_scale, k8, k_scale, vt, v_scale = quantize_qkv(q, k, v, pv)
    qd = (q8.float().unflatten(2, (-1, SCALE_M)) * q_scale[..., None, None]).flatten(2, 3)[:, :, :Sq]
    kd = (k8.float().unflatten(2, (-1, SCALE_N)) * k_scale[..., None, None]).flatten(2, 3)[:, :, :Sk]
    kd, vt, v_scale = (t.repeat_interleave(group, dim=1) for t in (kd, vt, v_scale))
    s = qd @ kd.transpose(-1, -2)                        # log2-domain logits
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True)) * FP8_MAX
    out = (p.to(vt.dtype).float() @ vt.float()[..., :Sk].transpose(-1, -2)) / p.sum(-1, keepdim=True)
    return (out * v_scale[:, :, None, :])[..., :D].to(q.dtype)


@triton.jit
def _logits(q, k_desc, k_ptr, kv_row0, n0, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            TMA: tl.constexpr, MAGIC: tl.constexpr):
    """Q K^T over key rows [n0, n0 + BLOCK_N), int32 (MAGIC: offset by MAGIC_BITS, the dot's
    accumulator starting there)."""
    if TMA:
        k = k_desc.load([(kv_row0 + n0).to(tl.int32), 0])                                  # [BLOCK_N, D] int8
    else:
        k = tl.load(k_ptr + (kv_row0 + n0 + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM
                    + tl.arange(0, HEAD_DIM)[None, :])
    if MAGIC:
        return tl.dot(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), MAGIC_BITS, tl.int32), out_dtype=tl.int32)
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def _softmax_pv(acc, l_i, m_i, s, scale, vt_desc, vt_ptr, vt_row0, stride_vd, n0, sk,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PV_FP8: tl.constexpr,
                TMA: tl.constexpr, MAGIC: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One step of the online softmax: the int32 logits `s` of key block n0 (times `scale`,
    log2 domain) into the row max m_i, the row sums l_i and acc += P V; MASKED: keys >= sk
    hidden (the last, partial block only)."""
    cols = tl.arange(0, BLOCK_N)
    if MAGIC:
        if MASKED:
            s = tl.where((n0 + cols)[None, :] < sk, s, MAGIC_BITS - (1 << 22))
        m_new = tl.maximum(m_i, (tl.max(s, axis=1) - MAGIC_BITS).to(tl.float32) * scale)
        # P * 448: exp2(logit * scale - (row max - log2 448)), the logit read from the bits
        shift = MAGIC_FLOAT * scale + (m_new - LOG2_FP8_MAX_C)
        p = tl.exp2(s.to(tl.float32, bitcast=True) * scale - shift[:, None])
    else:
        s = s.to(tl.float32) * scale
        if MASKED:
            s = tl.where((n0 + cols)[None, :] < sk, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - (m_new - LOG2_FP8_MAX_C)[:, None])
    if MASKED:
        p = tl.where((n0 + cols)[None, :] < sk, p, 0.0)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if TMA:
        vt = vt_desc.load([vt_row0.to(tl.int32), n0])                                      # [D, BLOCK_N]
    else:
        vt = tl.load(vt_ptr + (vt_row0 + tl.arange(0, HEAD_DIM))[:, None] * stride_vd + (n0 + cols)[None, :])
    if PV_FP8:
        p_op = to_fp8(p, vt.dtype, ROUND_FIRST)
    else:
        p_op = p.to(vt.dtype)
    acc = tl.dot(p_op, tl.trans(vt), acc)
    return acc, l_i, m_new


@triton.jit
def _attend_keys(acc, l_i, m_i, q, q_scale, k_desc, k_ptr, ks_ptr, vt_desc, vt_ptr, kv_row0, vt_row0,
                 stride_vd, lo, hi, sk,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_N: tl.constexpr,
                 MASKED: tl.constexpr, PV_FP8: tl.constexpr, TMA: tl.constexpr, MAGIC: tl.constexpr,
                 ROUND_FIRST: tl.constexpr):
    """The online softmax over key rows [lo, hi) in BLOCK_N steps."""
    for n0 in range(lo, hi, BLOCK_N):
        s = _logits(q, k_desc, k_ptr, kv_row0, n0, HEAD_DIM, BLOCK_M, BLOCK_N, TMA, MAGIC)
        scale = q_scale * tl.load(ks_ptr + n0 // SCALE_N)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, vt_desc, vt_ptr, vt_row0, stride_vd, n0, sk,
                                    HEAD_DIM, BLOCK_N, MASKED, PV_FP8, TMA, MAGIC, ROUND_FIRST)
    return acc, l_i, m_i


# sk is never specialized: Triton compiles an integer argument equal to 1 as a constant, and that
# one-key variant of this kernel gave NaN in the last query row of each program on sm90 (triton 3.6,
# TMA loads; measured at 30 of 30 calls, where every other key count was right). The key counts the
# models run are not multiples of 16 either, so the generic kernel is the one that always runs.
@triton.jit(do_not_specialize=["sk"])
def _fp8_attention_kernel(q_desc, q_ptr, qs_ptr, k_desc, k_ptr, ks_ptr, vt_desc, vt_ptr, vs_ptr, o_ptr,
                          heads, kv_heads, sq, sq_pad, sk, sk_pad, stride_qs_bh, stride_ks_bh, stride_vd,
                          stride_ob, stride_oh, stride_os,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SCALE_M: tl.constexpr, SCALE_N: tl.constexpr, PV_FP8: tl.constexpr, TMA: tl.constexpr,
                          MAGIC: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, query head), every key of its KV head.
    Q, K, V^T are read as 2-D [rows, D] / [D rows, keys] matrices (padded: no load masks)."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.cast(tl.program_id(1), tl.int64)
    b = bh // heads
    h = bh % heads
    kv_bh = b * kv_heads + h // (heads // kv_heads)
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    if TMA:
        q = q_desc.load([(bh * sq_pad + m0).to(tl.int32), 0])
    else:
        q = tl.load(q_ptr + (bh * sq_pad + rows)[:, None] * HEAD_DIM + dims[None, :])
    q_scale = tl.load(qs_ptr + bh * stride_qs_bh + m0 // SCALE_M)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    ks_ptr = ks_ptr + kv_bh * stride_ks_bh
    kv_row0 = kv_bh * sk_pad          # K's first row of this KV head (V^T's: vt_row0)
    vt_row0 = kv_bh * HEAD_DIM
    whole = sk - sk % BLOCK_N
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_scale, k_desc, k_ptr, ks_ptr, vt_desc, vt_ptr, kv_row0,
                                 vt_row0, stride_vd, 0, whole, sk, HEAD_DIM, BLOCK_M, BLOCK_N, SCALE_N, False,
                                 PV_FP8, TMA, MAGIC, ROUND_FIRST)
    if whole < sk:
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_scale, k_desc, k_ptr, ks_ptr, vt_desc, vt_ptr, kv_row0,
                                     vt_row0, stride_vd, whole, whole + BLOCK_N, sk, HEAD_DIM, BLOCK_M, BLOCK_N,
                                     SCALE_N, True, PV_FP8, TMA, MAGIC, ROUND_FIRST)
    v_scale = tl.load(vs_ptr + kv_bh * HEAD_DIM + dims)
    out = acc / l_i[:, None] * v_scale[None, :]     # P's 448 is in both acc and l_i
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None] < sq)


def _fp8_attention_triton(q8, q_scale, k8, k_scale, vt8, v_scale, sq: int, sk: int, heads: int,
                          dtype: torch.dtype, tiles: AttentionTiles | None = None) -> torch.Tensor:
    """The kernel over `quantize_qkv`'s operands -> out [B, Sq, Hq, D] (the attention cores' layout);
    tiles None: `default_tiles(sk)`."""
    return launch_fp8_attention(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype, tiles)[0]


def launch_fp8_attention(q8, q_scale, k8, k_scale, vt8, v_scale, sq: int, sk: int, heads: int,
                         dtype: torch.dtype, tiles: AttentionTiles | None = None):
    """`_fp8_attention_triton`, and the compiled kernel it ran (a benchmark reads its registers
    and spills; the interpreter returns None)."""
    tiles = tiles or default_tiles(sk)
    problem = tiles.problem()
    if problem:
        raise ValueError(problem)
    B, _, sq_pad, D = q8.shape
    kv_heads, sk_pad = k8.shape[1], k8.shape[2]
    q2, k2, vt2 = q8.reshape(-1, D), k8.reshape(-1, D), vt8.reshape(-1, sk_pad)   # contiguous: views
    descs = ((TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [tiles.block_m, D]),
              TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [tiles.block_n, D]),
              TensorDescriptor(vt2, list(vt2.shape), list(vt2.stride()), [D, tiles.block_n]))
             if tiles.tma else (None, None, None))
    out = torch.empty(B, sq, heads, D, dtype=dtype, device=q8.device)
    grid = (triton.cdiv(sq, tiles.block_m), B * heads)
    compiled = _fp8_attention_kernel[grid](
        descs[0], q2, q_scale, descs[1], k2, k_scale, descs[2], vt2, v_scale, out,
        heads, kv_heads, sq, sq_pad, sk, sk_pad, q_scale.stride(1), k_scale.stride(1), vt2.stride(0),
        out.stride(0), out.stride(2), out.stride(1),
        HEAD_DIM=D, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SCALE_M=SCALE_M, SCALE_N=SCALE_N,
        PV_FP8=vt8.dtype == FP8_DTYPE, TMA=tiles.tma, MAGIC=tiles.magic,
        ROUND_FIRST=INTERPRETED,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({} if tiles.maxnreg is None or INTERPRETED else {"maxnreg": tiles.maxnreg}))
    return out, compiled


# The op takes the quantized operands: the quantization (`quantize_qkv`, ~10 torch passes over
# Q, K, V) stays outside it, so that a compiled region fuses it with the RoPE and norms before
# it (eager: 3.5 / 11.0 ms a call at Wan's 1.3B / 14B shapes; compiled alone: 0.5 / 1.0 ms,
# bench/results/h200-2026-12-02/bench_fp8_attention.json). Inside an opaque op it would always run eagerly.
@torch.library.custom_op("dtgen::fp8_attention_quantized", mutates_args=())
def _fp8_attention_op(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                      vt8: torch.Tensor, v_scale: torch.Tensor, sq: int, sk: int, heads: int,
                      dtype: torch.dtype, kernel: str = "triton") -> torch.Tensor:
    # kernel "auto" is decided here, eagerly, also inside a compiled region (no device query is traced)
    if kernel == "gluon" or (kernel == "auto" and _auto_gluon(q8.device, vt8.dtype)):
        return fp8_attention_gluon(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype)
    return _fp8_attention_triton(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype)


@_fp8_attention_op.register_fake
def _(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype, kernel="triton"):
    return q8.new_empty(q8.shape[0], sq, heads, q8.shape[3], dtype=dtype)


IMPLS = ("auto", "triton", "gluon", "reference")
# "auto" on an sm90 GPU runs the Gluon kernel (kernels/fp8_attention_gluon.py) where this is True: once that
# kernel is measured correct there and faster than the Triton kernel.
AUTO_PICKS_GLUON = False


def _auto_gluon(device: torch.device, pv_dtype: torch.dtype) -> bool:
    """Whether "auto" runs the Gluon kernel: AUTO_PICKS_GLUON, an sm90 GPU with Gluon, FP8 PV."""
    if not AUTO_PICKS_GLUON or pv_dtype != FP8_DTYPE:
        return False
    return gluon_problem(device) is None


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str = "auto",
                  pv: str = "fp8") -> torch.Tensor:
    """Full attention of q [B, Hq, Sq, D] over k, v [B, Hkv, Sk, D] in FP8 (module docstring)
    -> [B, Hq, Sq, D] in q's dtype. impl "auto": on CUDA the Triton kernel (or the Gluon one, see
    AUTO_PICKS_GLUON), on the CPU the torch reference; "triton" (CUDA, or the CPU under
    TRITON_INTERPRET=1); "gluon" (kernels/fp8_attention_gluon.py: sm90, pv="fp8"); "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"fp8_attention: impl must be one of {IMPLS}, got {impl!r}")
    if pv not in PV_DTYPES:
        raise ValueError(f"fp8_attention: pv must be one of {PV_DTYPES}, got {pv!r}")
    problem = attention_fp8_problem(q, k, v)
    if problem:
        raise ValueError(f"fp8_attention: {problem}")
    if impl == "auto" and not q.is_cuda:
        impl = "reference"
    if impl == "triton" and not (q.is_cuda or INTERPRETED):
        raise RuntimeError("fp8_attention: impl='triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    if impl == "gluon" and not torch.compiler.is_compiling():
        problem = gluon_problem(q.device) or (None if pv == "fp8" else "it runs P V in e4m3 (pv='fp8') only")
        if problem:
            raise RuntimeError(f"fp8_attention: impl='gluon' cannot run: {problem}")
    if impl == "reference":
        return fp8_attention_reference(q, k, v, pv)
    out = torch.ops.dtgen.fp8_attention_quantized(*quantize_qkv(q, k, v, pv), q.shape[2], k.shape[2], q.shape[1],
                                                  q.dtype, impl)
    # [B, Hq, Sq, D]: a view of the [B, Sq, Hq, Dk] the cores transpose back to (a padded
    # head's extra columns are zeros, left out)
    return out.transpose(1, 2)[..., :q.shape[3]]
