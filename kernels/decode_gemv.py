"""Decode GEMV: y = x W^T (+ b) for a few rows of x (M <= 16), bandwidth-bound, bf16/fp16 or FP8 W.

At AR decode a dense linear reads its whole weight to produce one row (or a few) of output:
the floor is the weight's bytes at HBM bandwidth (the HunyuanImage-3 QKV, 6144 x 4096 bf16:
50 MB, 11.7 us at 4.3 TB/s). cuBLAS runs these at ~3.1 TB/s; with FP8 weights
`torch._scaled_mm` at M = 1 plus the separate quantization of x did not pay at all.

    y = decode_gemv(x, weight)                       # weight [N, K] bf16/fp16, x [..., K] same dtype
    y = decode_gemv(x, weight, weight_scale, bias)   # weight [N, K] float8_e4m3fn, weight_scale [N] fp32

x ``[..., K]`` with M = prod(leading dims) <= 16 rows (the torch reference takes any M) ->
``[..., N]`` in x's dtype.

- 16-bit weight (weight_scale None): x must have the weight's dtype; products accumulated in
  float32, the bias added in float32, one rounding to x's dtype.
- e4m3 weight: exactly the numerics of `kernels.fp8_linear.fp8_linear_reference`: x quantized
  per row (scale = amax / 448, 1 for an all-zero row; x / scale clamped to +-448 and rounded
  to e4m3, ties to even), the e4m3 products accumulated in float32, times
  scale_x[m] * scale_w[n], the bias added, cast to x's dtype (float32, bf16 or fp16). The
  kernels round to e4m3 in float32 arithmetic (`_round_to_e4m3`: bit-exact with the cast, and
  the same code under the Triton interpreter, whose float -> fp8 cast rounds wrongly near
  powers of two) and divide with `div_rn` (IEEE, as torch; Triton's `/` is approximate).

The kernel (`_gemv_kernel`): grid (N / BLOCK_N, splits); each program owns BLOCK_N output
channels (small, so N = 4096 gives >= 2 programs per SM on 132 SMs) and streams their weight
rows along K in BLOCK_K chunks, each weight byte loaded once and upcast in registers:
- few rows (`dot=False`, the M = 1 default): per row of x, ``tl.sum(w * x_row)`` over the
  chunk on the CUDA cores (no tensor cores: at M = 1 they would idle 15 of 16 rows);
- more rows (`dot=True`, the M > 1 default): ``tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, 16])``
  with x's rows padded to 16 (N takes the MMA's long edge, "swap AB"); e4m3 operands go to
  float16 for the dot (every e4m3 value is exact in float16, products are exact, fp32
  accumulate), so the dot does the reference's arithmetic.
FP8 x: by default every program computes its rows' amax itself (x is M x K, a few KB,
L2-resident; at M = 1 that is 1/BLOCK_N of the work on the weight) and quantizes each chunk
as it goes; `prequant=True` (the M > 1 default, where the per-program division and rounding of
16 rows would cost as much as converting the weight) runs a tiny first kernel that writes x
in e4m3 with its scales once, and the GEMV reads that.
Split-K (only where N / BLOCK_N programs would not fill the GPU, or asked for): each split
writes float32 partials (already scaled), a second kernel sums them in a fixed order, adds
the bias and casts: deterministic, no atomics.

The persistent kernels (a config's `stream` / `tma`; CUDA-core sums, x in e4m3 first for e4m3
weights): min(N tiles, SMs x programs_per_sm) programs, program p owning N tiles
[p T / P, (p + 1) T / P) (an even split of the bytes to within one tile, no split-K and so no
second launch or cross-program reduction), read as one flat sequence of (tile, K chunk)
blocks so that the loads run ahead across tile boundaries and no program idles at the end of
a tile. `_gemv_stream_kernel` issues each block's 16-byte loads two blocks before its use
(registers: 2 blocks in flight a program); `kernels.decode_gemv_tma` copies the blocks by TMA
into a shared-memory ring of num_stages blocks (Gluon, Hopper only). At one row of x both
accumulate the products elementwise and reduce once a tile. Both run slower than the table's
`_gemv_kernel` on one H100 at every candidate config of `python -m bench kernels gemv --sweep`
(e4m3, one row, the dense GEMVs of a decode token: the table's 1221 us, the fastest TMA config
1418, the fastest stream config 1884; at 6144 x 4096 2.25 TB/s against at best 1.97 and 1.43:
`bench/results/h100-2026-12-05-hopper-profile/gemv_sweep.json`), so no table entry picks them.

Block sizes: `config_for` (a small table, `GEMV_CONFIGS`, keyed by (N, K, weight kind, rows
class), over per-kind defaults); no autotuning at import or call: the entries are the fastest of a
few candidates per shape, timed on one H200
(`bench/results/h200-2026-12-02-qwen-peers/rope-real/bench_decode_gemv.json`).

CPU runs the torch reference; CUDA runs Triton; ``impl="triton"`` forces Triton (on CPU only
under TRITON_INTERPRET=1). Registered as ``dtgen::decode_gemv``: one node under
``torch.compile(fullgraph=True)``; no host sync (CUDA-graph safe). `kernels.fp8_linear.fp8_linear`
dispatches FP8 linears of <= DECODE_GEMV_MAX_ROWS rows on CUDA here; bf16 linears are not
rewired (`decode_linear` is the drop-in for F.linear to put at a call site).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime import JITFunction

from .decode_gemv_tma import launch_tma, require_tma, tma_problem
from .fp8_quant import FP8_DTYPE, quantize_activation_rows

IMPLS = ("auto", "reference", "triton")
DECODE_GEMV_MAX_ROWS = 16          # M above this: not a GEMV (the Triton path refuses it)
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_X_DTYPES_FP8 = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_SMS = 132                 # an H200/H100 SXM; the CPU (interpreter) uses it for the split heuristic


# ------------------------------------------------------------------------------ checks


def _rows(x: torch.Tensor) -> int:
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows


def check_gemv_inputs(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                      bias: torch.Tensor | None) -> None:
    """Raise a one-line ValueError naming the problem when the operands do not fit."""
    if weight.dim() != 2:
        raise ValueError(f"decode_gemv: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"decode_gemv: x has {x.shape[-1] if x.dim() else 0} features (shape {tuple(x.shape)}), "
                         f"the weight {tuple(weight.shape)} takes {k}")
    if x.dtype == FP8_DTYPE and weight.dtype != FP8_DTYPE:
        raise ValueError(f"decode_gemv: an e4m3 x (already quantized) needs an e4m3 weight, got {weight.dtype}")
    if weight.dtype == FP8_DTYPE:
        if weight_scale is None:
            raise ValueError(f"decode_gemv: an e4m3 weight needs weight_scale float32 [{n}] (one per output channel)")
        if weight_scale.dtype != torch.float32 or weight_scale.dim() != 1 or weight_scale.shape[0] != n:
            raise ValueError(f"decode_gemv: weight_scale must be float32 [{n}] (one per output channel), "
                             f"got {tuple(weight_scale.shape)} {weight_scale.dtype}")
        if x.dtype not in _X_DTYPES_FP8 + (FP8_DTYPE,):
            raise ValueError(f"decode_gemv: with an e4m3 weight x must be one of {_X_DTYPES_FP8} or e4m3 (with "
                             f"x_scale), got {x.dtype}")
    elif weight.dtype in _HALF_DTYPES:
        if weight_scale is not None:
            raise ValueError(f"decode_gemv: a {weight.dtype} weight takes no weight_scale (only e4m3 weights do)")
        if x.dtype != weight.dtype:
            raise ValueError(f"decode_gemv: x is {x.dtype} but the weight is {weight.dtype} (they must match)")
    else:
        raise ValueError(f"decode_gemv: weight dtype must be bfloat16, float16 or {FP8_DTYPE}, got {weight.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.dtype.is_floating_point):
        raise ValueError(f"decode_gemv: bias must be a float [{n}] tensor, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"decode_gemv: x is on {x.device} but {name} on {t.device}")


def check_quantized_x(x: torch.Tensor, x_scale: torch.Tensor | None, out_dtype: torch.dtype | None) -> None:
    """x already in e4m3 comes with its per-row scales and the output dtype; other x with neither."""
    if x.dtype != FP8_DTYPE:
        if x_scale is not None or out_dtype is not None:
            raise ValueError(f"decode_gemv: x_scale and out_dtype go with an e4m3 x only, x is {x.dtype}")
        return
    rows = _rows(x)
    if x_scale is None or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (rows,):
        got = None if x_scale is None else (tuple(x_scale.shape), x_scale.dtype)
        raise ValueError(f"decode_gemv: an e4m3 x needs x_scale float32 [{rows}] (one per row), got {got}")
    if out_dtype not in _X_DTYPES_FP8:
        raise ValueError(f"decode_gemv: an e4m3 x needs out_dtype, one of {_X_DTYPES_FP8}; got {out_dtype}")
    if x_scale.device != x.device:
        raise ValueError(f"decode_gemv: x is on {x.device} but x_scale on {x_scale.device}")


def check_gemv_rows(x: torch.Tensor) -> None:
    rows = _rows(x)
    if rows > DECODE_GEMV_MAX_ROWS:
        raise ValueError(f"decode_gemv: the Triton GEMV takes at most {DECODE_GEMV_MAX_ROWS} rows, x {tuple(x.shape)} "
                         f"has {rows} (use a GEMM)")


# ---------------------------------------------------------------------------- reference


def decode_gemv_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op in torch (any number of rows). 16-bit: F.linear in float32, cast once. e4m3:
    `kernels.fp8_linear.fp8_linear_reference`'s arithmetic, line for line (x quantized per
    row, both operands dequantized, float32 matmul; tests/framework/test_decode_gemv.py checks the two
    agree bit for bit; importing it here would close an import circle)."""
    check_gemv_inputs(x, weight, weight_scale, bias)
    check_quantized_x(x, x_scale, out_dtype)
    if weight.dtype != FP8_DTYPE:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    flat = x.reshape(-1, x.shape[-1])
    if x.dtype == FP8_DTYPE:
        q, scale = flat, x_scale[:, None]
    else:
        q, scale, out_dtype = *quantize_activation_rows(flat), x.dtype
    y = (q.float() * scale) @ (weight.float() * weight_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------ configs


@dataclass(frozen=True)
class GemvConfig:
    """Tiles and launch of one GEMV. block_n: output channels per program; block_k: K chunk;
    split_k: 0 picks it (`split_count`), n >= 1 forces n (capped at the number of K chunks);
    dot: tensor cores with x padded to 16 rows, else CUDA-core sums per row; prequant (e4m3
    weights): quantize x once in a first kernel instead of in every program. stream: the
    persistent kernel (`_gemv_stream_kernel`: programs_per_sm programs a SM, an even split of the
    N tiles, each chunk loaded two chunks ahead; CUDA-core sums, x quantized first for e4m3
    weights; num_stages and split_k do not apply to it; a weight that is not K-contiguous takes
    `_gemv_kernel`). tma: the same schedule with the weight copied by TMA into a ring of
    num_stages blocks (`kernels.decode_gemv_tma`, Hopper only)."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 0
    dot: bool = False
    prequant: bool = False
    stream: bool = False
    tma: bool = False
    programs_per_sm: int = 2


# Defaults per (weight kind, rows class): "16bit" / "fp8"; "m1" (one row) / "m16" (2..16 rows).
# Guesses from the design (not yet swept on a GPU): one row on the CUDA cores with 16 KB of
# weight per chunk per program (N = 4096 -> 256 programs, ~2 per SM, ~32 KB in flight per SM);
# more rows on tensor cores with a pipelined (num_stages) 8 KB chunk.
DEFAULT_CONFIGS: dict[tuple[str, str], GemvConfig] = {
    ("16bit", "m1"): GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=2),
    ("fp8", "m1"): GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=2),
    ("16bit", "m16"): GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=3, dot=True),
    ("fp8", "m16"): GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, dot=True, prequant=True),
}
# Per-shape overrides, (N, K, kind, rows class) -> GemvConfig, from a sweep of a few candidate
# tiles per shape on the target GPU: the fastest tiles of one H200
# at M = 1 for the HunyuanImage-3 decode shapes, e4m3 x passed in quantized as fp8_linear does.
# Each one's time against the default's:
# `bench/results/h200-2026-12-02-qwen-peers/rope-real/bench_decode_gemv.json` (the bf16
# lm_head has no entry: the default is its fastest). M > 1 keeps the defaults (not swept).
GEMV_CONFIGS: dict[tuple[int, int, str, str], GemvConfig] = {
    (6144, 4096, "16bit", "m1"): GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=1),
    (6144, 4096, "fp8", "m1"): GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=1),
    (4096, 4096, "16bit", "m1"): GemvConfig(block_n=16, block_k=1024, num_warps=8, num_stages=2),
    (4096, 4096, "fp8", "m1"): GemvConfig(block_n=16, block_k=2048, num_warps=8, num_stages=2),
    (4096, 3072, "16bit", "m1"): GemvConfig(block_n=16, block_k=1024, num_warps=8, num_stages=2),
    (4096, 3072, "fp8", "m1"): GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=1),
    (133120, 4096, "fp8", "m1"): GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=2),
}


def weight_kind(weight: torch.Tensor) -> str:
    return "fp8" if weight.dtype == FP8_DTYPE else "16bit"


def rows_class(rows: int) -> str:
    return "m1" if rows <= 1 else "m16"


def config_for(n: int, k: int, kind: str, rows: int) -> GemvConfig:
    cls = rows_class(rows)
    return GEMV_CONFIGS.get((n, k, kind, cls), DEFAULT_CONFIGS[(kind, cls)])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def split_count(n: int, k: int, cfg: GemvConfig, device: torch.device) -> tuple[int, int]:
    """(splits, K columns per split, a multiple of block_k). Without a forced split_k: 1 while
    the N blocks alone fill every SM; else enough splits for ~2 programs per SM, each split
    keeping >= 2 chunks of K."""
    chunks = triton.cdiv(k, cfg.block_k)
    if cfg.split_k > 0:
        want = cfg.split_k
    else:
        n_blocks, sms = triton.cdiv(n, cfg.block_n), _sm_count(device)
        want = 1 if n_blocks >= sms else max(1, min(triton.cdiv(2 * sms, n_blocks), chunks // 2))
    per_split = triton.cdiv(chunks, min(want, chunks))
    return triton.cdiv(chunks, per_split), per_split * cfg.block_k


# ------------------------------------------------------------------------------ Triton


@triton.jit
def _round_to_e4m3(v):
    """v float32 with |v| <= 448 -> the nearest e4m3 value (ties to even), as float32.
    Adding and subtracting 1.5 * 2^23 * spacing rounds to a multiple of the spacing of e4m3
    values around |v| (2^(e-3) for normal e4m3, e >= -6; 2^-9 below: subnormals): one IEEE
    round-to-nearest-even each way, no multiply (nothing to contract)."""
    a = tl.abs(v)
    exponent = (a.to(tl.int32, bitcast=True) >> 23) - 127          # a >= 0: no sign bit
    spacing = tl.maximum(exponent, -6) - 3
    magic = (((spacing + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize(xf, sx):
    """The reference's per-row quantization of x (float32) by its row scale, as float32 values."""
    return _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(xf, sx), -448.0), 448.0))


@triton.jit
def _row_scale(amax):
    """amax / 448 (IEEE division, as torch), 1 for an all-zero row."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, BLOCK_K: tl.constexpr):
    """One program per row of x: its scale (amax / 448) and the row in e4m3 (q contiguous [M, K])."""
    row = tl.program_id(0)
    x_row = x_ptr + tl.cast(row, tl.int64) * stride_xm
    ks = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)))
    sx = _row_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        xf = tl.load(x_row + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + tl.cast(row, tl.int64) * K + kk, _quantize(xf, sx).to(q_ptr.dtype.element_ty), mask=kk < K)
    tl.store(s_ptr + row, sx)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
):
    """Program (n-block, split): y[:, n-block] over the split's K range (module docstring).
    Rows past N (and past M) load a clamped valid row, so the weight stream has no mask unless
    K is not a multiple of BLOCK_K (EVEN_K); their results are never stored. FP8: x_ptr is x
    (X_QUANTIZED False: amax and quantization here) or its e4m3 copy with scales xs_ptr [M].
    PARTIAL: write float32 partials [split, M, N] (scaled, no bias) for `_split_reduce_kernel`."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ns_safe = tl.minimum(ns, N - 1)
    ms = tl.arange(0, BLOCK_M)
    ms_safe = tl.minimum(ms, M - 1)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.cast(ns_safe, tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + ms_safe * stride_xm

    if FP8:
        if X_QUANTIZED:
            sx = tl.load(xs_ptr + ms_safe)
        else:
            amax = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                xt = tl.load(x_rows[:, None] + kk[None, :] * stride_xk, mask=kk[None, :] < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(xt.to(tl.float32)))
            sx = _row_scale(tl.max(amax, axis=1))          # [BLOCK_M]

    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :] * stride_wk)
        else:
            w = tl.load(w_rows + kk[None, :] * stride_wk, mask=kk[None, :] < k_hi, other=0.0)
        if USE_DOT:
            x_ptrs = x_rows[None, :] + kk[:, None] * stride_xk                 # x^T chunk [BLOCK_K, BLOCK_M]
            if EVEN_K:
                xt = tl.load(x_ptrs)
            else:
                xt = tl.load(x_ptrs, mask=kk[:, None] < k_hi, other=0.0)
            if FP8:
                if not X_QUANTIZED:
                    xt = _quantize(xt.to(tl.float32), sx[None, :])
                acc += tl.dot(w.to(tl.float16), xt.to(tl.float16))
            elif DOT_F32:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        else:
            wf = w.to(tl.float32)
            for r in tl.static_range(ROWS):
                if EVEN_K:
                    xr = tl.load(x_ptr + r * stride_xm + kk * stride_xk).to(tl.float32)
                else:
                    xr = tl.load(x_ptr + r * stride_xm + kk * stride_xk, mask=kk < k_hi, other=0.0).to(tl.float32)
                if FP8:
                    if not X_QUANTIZED:
                        xr = _quantize(xr, tl.sum(tl.where(ms == r, sx, 0.0), axis=0))
                part = tl.sum(wf * xr[None, :], axis=1)                          # [BLOCK_N]
                acc += tl.where(ms[None, :] == r, part[:, None], 0.0)

    if FP8:
        acc = acc * tl.load(ws_ptr + ns_safe)[:, None] * sx[None, :]
    out_mask = (ns[:, None] < N) & (ms[None, :] < M)
    y_ptrs = y_ptr + split * stride_ys + ms[None, :] * stride_ym + ns[:, None]
    if PARTIAL:
        tl.store(y_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + ns_safe).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """y[m, n] = sum over splits in order of part[s, m, n] (+ bias[n]), cast to y's dtype."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * M * N + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + idx % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _stream_chunk(w_ptr, i, t_lo, k_chunks, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """Chunk i of a program's flat (tile, K chunk) sequence: the weight block [BLOCK_N, BLOCK_K]
    (rows past N read row N - 1, never stored; columns past K read 0)."""
    tile = t_lo + i // k_chunks
    ns = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    kk = (i % k_chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + tl.cast(ns, tl.int64)[:, None] * stride_wn + kk[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=kk[None, :] < K, other=0.0)


@triton.jit
def _gemv_stream_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr,
    M, N, K, n_tiles, k_chunks,
    stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Persistent program p of P (module docstring, `stream`): the weight tiles [BLOCK_N, K]
    t_lo .. t_hi - 1 (an even split of the N tiles: every program streams the same bytes to
    within one tile), read as one flat sequence of (tile, K chunk) blocks, each issued two
    chunks before it is used (chunks i + 1 and i + 2 in flight while chunk i is summed, across
    tile boundaries too). One row: x's chunks are read one ahead, the products accumulate
    elementwise [BLOCK_N, BLOCK_K] and reduce once a tile (no per-chunk cross-warp sum); more
    rows: one sum per chunk and row. FP8: x is e4m3 with scales xs_ptr [M]; the epilogue is
    `_gemv_kernel`'s. x and the weight are K-contiguous."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t_lo = pid * n_tiles // nprog
    t_hi = (pid + 1) * n_tiles // nprog
    total = (t_hi - t_lo) * k_chunks
    last = tl.maximum(total - 1, 0)
    ks = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    ms_safe = tl.minimum(ms, M - 1)
    if FP8:
        sx = tl.load(xs_ptr + ms_safe)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if ROWS == 1:
        if EVEN_K:
            x_next = tl.load(x_ptr + ks)
        else:
            x_next = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    w0 = _stream_chunk(w_ptr, 0, t_lo, k_chunks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
    w1 = _stream_chunk(w_ptr, tl.minimum(1, last), t_lo, k_chunks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
    for i in range(0, total):
        # past the end it re-reads the last chunk (cached, never used) rather than branching
        w2 = _stream_chunk(w_ptr, tl.minimum(i + 2, last), t_lo, k_chunks, N, K, stride_wn, BLOCK_N, BLOCK_K,
                           EVEN_K)
        kc = i % k_chunks
        kk = kc * BLOCK_K + ks
        wf = w0.to(tl.float32)
        if ROWS == 1:
            xr = x_next.to(tl.float32)
            k_next = ((i + 1) % k_chunks) * BLOCK_K + ks      # x's next chunk, one ahead (an L2 read)
            if EVEN_K:
                x_next = tl.load(x_ptr + k_next)
            else:
                x_next = tl.load(x_ptr + k_next, mask=k_next < K, other=0.0)
            acc2 += wf * xr[None, :]
        else:
            for r in tl.static_range(ROWS):
                if EVEN_K:
                    xr = tl.load(x_ptr + r * stride_xm + kk).to(tl.float32)
                else:
                    xr = tl.load(x_ptr + r * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
                part = tl.sum(wf * xr[None, :], axis=1)                          # [BLOCK_N]
                acc += tl.where(ms[None, :] == r, part[:, None], 0.0)
        w0 = w1
        w1 = w2
        if kc == k_chunks - 1:
            if ROWS == 1:
                acc = tl.sum(acc2, axis=1)[:, None] + tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            ns = (t_lo + i // k_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
            ns_safe = tl.minimum(ns, N - 1)
            if FP8:
                acc = acc * tl.load(ws_ptr + ns_safe)[:, None] * sx[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + ns_safe).to(tl.float32)[:, None]
            out_mask = (ns[:, None] < N) & (ms[None, :] < M)
            tl.store(y_ptr + ms[None, :] * stride_ym + ns[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)


TRITON_INTERPRETED = not isinstance(_gemv_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"the Triton decode GEMV needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                           f"set before triton is first imported; got a tensor on {x.device}")


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M] float32), `quantize_activation_rows`'s numerics (the
    `prequant` first kernel)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), x.stride(1),
                                    BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4)
    return q, scale


def decode_gemv_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, config: GemvConfig | None = None,
                       x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton GEMV; `config` overrides the table (`config_for`), e.g. for a sweep."""
    check_gemv_inputs(x, weight, weight_scale, bias)
    check_quantized_x(x, x_scale, out_dtype)
    check_gemv_rows(x)
    require_triton_device(x)
    n, k = weight.shape
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    if k == 0:
        y.copy_(torch.zeros_like(y) if bias is None else bias.to(y.dtype).expand(m, n))
        return y.view(*x.shape[:-1], n)
    fp8 = weight.dtype == FP8_DTYPE
    cfg = config or config_for(n, k, weight_kind(weight), m)
    if config is None and cfg.tma and tma_problem(flat, weight):
        # the table's TMA entry where TMA cannot run (not Hopper, the interpreter, a misaligned
        # weight): the same schedule with register loads; an explicit config is refused instead
        cfg = replace(cfg, tma=False, stream=True)
    if cfg.dot and cfg.block_n < 16:
        raise ValueError(f"decode_gemv: tl.dot needs block_n >= 16, the config has {cfg.block_n}")
    if cfg.stream + cfg.tma + cfg.dot > 1:
        raise ValueError("decode_gemv: a config takes at most one of stream, tma (CUDA-core sums) and dot "
                         "(tensor cores)")
    if (cfg.stream or cfg.tma) and cfg.programs_per_sm < 1:
        raise ValueError(f"decode_gemv: programs_per_sm must be >= 1, the config has {cfg.programs_per_sm}")
    if cfg.tma or (cfg.stream and weight.stride(1) == 1):
        _launch_stream(flat, weight, weight_scale, bias, x_scale, y, cfg)
        return y.view(*x.shape[:-1], n)
    splits, k_per_split = split_count(n, k, cfg, x.device)
    quantized = fp8 and (cfg.prequant or x.dtype == FP8_DTYPE)
    xs = x_scale
    if quantized and x.dtype != FP8_DTYPE:
        flat, xs = quantize_rows_triton(flat)
    block_m = 16 if cfg.dot else triton.next_power_of_2(m)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    dummy = y   # unused pointer arguments (their constexpr branch is off)
    grid = (triton.cdiv(n, cfg.block_n), splits)
    _gemv_kernel[grid](
        flat, weight, weight_scale if fp8 else dummy, xs if quantized else dummy,
        bias if bias is not None else dummy, out,
        m, n, k, k_per_split,
        flat.stride(0), flat.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0) if splits > 1 else 0, out.stride(-2),
        ROWS=0 if cfg.dot else m,      # the sums' unrolled rows; the dot pads to 16 (one compile for any M)
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FP8=fp8, X_QUANTIZED=quantized, USE_DOT=cfg.dot,
        DOT_F32=TRITON_INTERPRETED and weight.dtype == torch.bfloat16,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else dummy, y, m, n, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], n)


def _launch_stream(flat: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                   bias: torch.Tensor | None, x_scale: torch.Tensor | None, y: torch.Tensor, cfg: GemvConfig) -> None:
    """`_gemv_stream_kernel` (or with cfg.tma the TMA kernel) into y [M, N]: min(N tiles, SMs x
    programs_per_sm) programs; an e4m3 weight takes x in e4m3 (quantized here by
    `quantize_rows_triton` unless it comes so)."""
    if cfg.tma:
        require_tma(flat, weight)   # before quantizing x: the refusal costs nothing
    n, k = weight.shape
    m = flat.shape[0]
    fp8 = weight.dtype == FP8_DTYPE
    xs = x_scale
    if fp8 and flat.dtype != FP8_DTYPE:
        flat, xs = quantize_rows_triton(flat)
    flat = flat.contiguous()
    n_tiles = triton.cdiv(n, cfg.block_n)
    programs = min(n_tiles, _sm_count(flat.device) * cfg.programs_per_sm)
    if cfg.tma:
        launch_tma(flat, weight, weight_scale, bias, xs, y, cfg.block_n, cfg.block_k, cfg.num_warps,
                   cfg.num_stages, programs)
        return
    _gemv_stream_kernel[(programs,)](
        flat, weight, weight_scale if fp8 else y, xs if fp8 else y, bias if bias is not None else y, y,
        m, n, k, n_tiles, triton.cdiv(k, cfg.block_k),
        flat.stride(0), weight.stride(0), y.stride(0),
        ROWS=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FP8=fp8, EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=1)


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::decode_gemv", mutates_args=())
def _decode_gemv_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                    bias: torch.Tensor | None, impl: str, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return decode_gemv_reference(x, weight, weight_scale, bias, x_scale, out_dtype).contiguous()
    return decode_gemv_triton(x, weight, weight_scale, bias, x_scale=x_scale, out_dtype=out_dtype)


@_decode_gemv_op.register_fake
def _(x, weight, weight_scale, bias, impl, x_scale=None, out_dtype=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype or x.dtype)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, impl: str = "auto", x_scale: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for <= 16 rows of x (module docstring). impl: "auto" (CPU: reference,
    CUDA: Triton), "reference" (any rows), "triton". `x_scale`, `out_dtype`: x is already e4m3
    (`quantize_activation_rows`' q, its scale [M] flattened), e.g. quantized by torch ops that
    inductor fuses into x's producer; the GEMV then only streams the weight."""
    if impl not in IMPLS:
        raise ValueError(f"decode_gemv: impl must be one of {IMPLS}, got {impl!r}")
    check_gemv_inputs(x, weight, weight_scale, bias)
    check_quantized_x(x, x_scale, out_dtype)
    if impl == "triton" or (impl == "auto" and x.is_cuda):
        check_gemv_rows(x)
    if impl == "triton":
        require_triton_device(x)
    return torch.ops.dtgen.decode_gemv(x, weight, weight_scale, bias, impl, x_scale, out_dtype)


def gemv_suits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear call should take the GEMV: CUDA, at most DECODE_GEMV_MAX_ROWS rows, a
    K-contiguous weight (coalesced rows)."""
    return (x.is_cuda and x.dim() >= 1 and _rows(x) <= DECODE_GEMV_MAX_ROWS and weight.dim() == 2
            and weight.stride(1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A drop-in for F.linear with a 16-bit weight: the GEMV on CUDA at <= 16 rows (same
    dtypes), F.linear otherwise (the CPU always). Not wired into any model yet."""
    if gemv_suits(x, weight) and weight.dtype in _HALF_DTYPES and x.dtype == weight.dtype:
        return decode_gemv(x, weight, None, bias)
    return F.linear(x, weight, bias)
