"""Multi-micro MoE for prefill and denoise: experts stored as M micro sub-shards.

Conventions (fixed; the model calls exactly these):
- ``w_gate_up: [M, E, 2*I, H]``: for micro m and expert e the rows are ``[x1 (I); x2 (I)]``
  and the expert computes ``down(x1 * silu(x2))`` (SiLU on the SECOND half).
- ``w_down: [M, E, H, I]``. The M micros are disjoint column blocks of each expert's
  intermediate dimension, so an expert's output is the SUM over micros:
  ``y_e(x) = sum_m w_down[m, e] @ (u1_m * silu(u2_m))`` with ``u_m = w_gate_up[m, e] @ x``.
- ``topk_ids: [T, K]`` (int32 or int64, distinct experts per row), ``topk_weights: [T, K]``
  float32, already renormalised. ``out[t] = sum_k topk_weights[t, k] * y_{topk_ids[t, k]}(x[t])``,
  [T, H] in x's dtype; partials are summed in float32 and each routing weight is applied
  once, after the micro partials are summed.

The fast path (impl "fused", the default on CUDA; CPU under TRITON_INTERPRET=1):
1. routing once (`kernels.moe_routing`): sort the T*K pairs by expert (no gather);
2. ONE gate/up launch for all micros (`kernels.moe_grouped_gemm`): A rows read from x
   through the slot -> token index, ``x1 * silu(x2)`` in the epilogue, the activation
   [M, T*K, I] stored in x's dtype;
3. ONE down launch whose K loop runs over (micro, I): the micro sum in the accumulator,
   one partial per slot, rounded once;
4. ONE Triton finalize kernel: for each token, apply each routing weight once and sum
   over k (un-permute and weighted reduce, fused; gathers by slot, so no atomics and a
   deterministic result).

Its time on an H200 at HunyuanImage-3's denoise shapes (two micros of 768), against
`torch._grouped_mm` per micro with separate activation and down GEMMs:
bench/results/h200-2026-12-01-moe/ (bench_moe_prefill.json, bench_grouped_gemm.json).

FP8 experts (`moe_multi_micro_fp8`, bottom of this file): the same pipeline on e4m3 in
either recipe of `kernels.fp8_quant`; with channel scales, impl "scaled_grouped_mm" runs the
two GEMMs in torch's CUTLASS kernel instead (`kernels.moe_scaled_grouped_mm`), impl "gluon" the
same pipeline with our Gluon kernel for sm90 (`kernels.moe_grouped_gemm_gluon`).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime import JITFunction

from kernels.fp8_quant import (
    FP8_DTYPE,
    dequantize,
    fp8_support_problem,
    quantize_row_groups,
    quantize_row_groups_reference,
    quantize_rows,
    quantize_rows_by_amax,
)
from kernels.fp8_quant import GROUP as FP8_GROUP
from kernels.moe_grouped_gemm import (
    down_sum,
    down_sum_fp8_reference,
    fused_config_for,
    gate_up_act,
    gate_up_act_fp8_reference,
    moe_experts_fp8_channels_reference,
)
from kernels.moe_grouped_gemm_gluon import grouped_gemm_fp8, gluon_problem
from kernels.moe_grouped_gemm_gluon import shape_problem as gluon_shape_problem
from kernels.moe_routing import MoeRouting, moe_route
from kernels.moe_scaled_grouped_mm import experts_partials, scaled_grouped_mm_problem, shape_problem

MULTI_MICRO_IMPLS = ("auto", "reference", "fused", "grouped_mm", "triton", "two_dispatch", "flashinfer")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- inputs


class MoeDims(NamedTuple):
    tokens: int
    hidden: int
    top_k: int
    micros: int
    experts: int
    inter: int  # I: intermediate size of one micro


def check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, weight_dtype: torch.dtype | None = None) -> MoeDims:
    """Check shapes, dtypes and devices; raise ValueError naming the tensor. No sync:
    expert ids are not range-checked (ids outside [0, E) give undefined rows).
    weight_dtype: the experts' dtype when it differs from x's (FP8 experts)."""

    def fail(message: str):
        raise ValueError(f"MoE inputs: {message}")

    if x.dim() != 2 or x.shape[0] == 0:
        fail(f"x must be [T, H] with T >= 1, got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        fail(f"topk_ids must be [T, K] with T = {tokens} (x's tokens), got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape:
        fail(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if w_gate_up.dim() != 4 or w_gate_up.shape[3] != hidden or w_gate_up.shape[2] % 2:
        fail(f"w_gate_up must be [M, E, 2*I, H] with H = {hidden} (x's hidden size), got shape {tuple(w_gate_up.shape)}")
    micros, experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    if tuple(w_down.shape) != (micros, experts, hidden, inter):
        fail(f"w_down must be [M, E, H, I] = {(micros, experts, hidden, inter)} to match w_gate_up "
             f"{tuple(w_gate_up.shape)} and x, got shape {tuple(w_down.shape)}")
    if not 1 <= top_k <= experts:
        fail(f"top-k K = {top_k} must be between 1 and the number of experts E = {experts}")
    if x.dtype not in _FLOAT_DTYPES:
        fail(f"x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if weight_dtype is not None:
        if w_gate_up.dtype != weight_dtype or w_down.dtype != weight_dtype:
            fail(f"w_gate_up {w_gate_up.dtype} and w_down {w_down.dtype} must both be {weight_dtype}")
    elif w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        fail(f"dtype mismatch: x {x.dtype}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype} must be equal")
    if topk_ids.dtype not in _ID_DTYPES:
        fail(f"topk_ids dtype must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        fail(f"topk_weights dtype must be float32, got {topk_weights.dtype}")
    devices = {t.device for t in (x, topk_ids, topk_weights, w_gate_up, w_down)}
    if len(devices) != 1:
        fail(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    return MoeDims(tokens, hidden, top_k, micros, experts, inter)


# ------------------------------------------------------------------------ references


def moe_naive(x, topk_ids, topk_weights, w_gate_up, w_down):
    """Ground truth for tests, straight from the formula: per token, per k, per micro."""
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(dims.tokens):
        for k in range(dims.top_k):
            e = int(topk_ids[t, k])
            y = torch.zeros(dims.hidden, dtype=torch.float32, device=x.device)
            for m in range(dims.micros):
                u = w_gate_up[m, e].float() @ x[t].float()
                y += w_down[m, e].float() @ (u[: dims.inter] * F.silu(u[dims.inter:]))
            out[t] += topk_weights[t, k] * y
    return out.to(x.dtype)


def moe_multi_micro_reference(x, topk_ids, topk_weights, w_gate_up, w_down):
    """Readable torch: route once, loop over experts and micros, float32 math throughout.

    One host sync (the run lengths), so it is for CPU and for checking, not for speed.
    """
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    routing = moe_route(x, topk_ids, dims.experts)
    run_bounds = [0] + routing.expert_ends.tolist()
    expert_out = torch.zeros(routing.x_sorted.shape, dtype=torch.float32, device=x.device)
    for e in range(dims.experts):
        start, end = run_bounds[e], run_bounds[e + 1]
        if start == end:  # an expert that got no token
            continue
        x_e = routing.x_sorted[start:end].float()
        for m in range(dims.micros):
            u = x_e @ w_gate_up[m, e].float().T
            act = u[:, : dims.inter] * F.silu(u[:, dims.inter:])
            expert_out[start:end] += act @ w_down[m, e].float().T
    per_pair = expert_out[routing.slot_of_pair].view(dims.tokens, dims.top_k, dims.hidden)
    return (topk_weights.unsqueeze(-1) * per_pair).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------- Triton kernels


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, ends_ptr,
    num_rows, n_out, k_dim, num_experts,
    stride_a_micro, stride_a_row, stride_a_k,
    stride_b_micro, stride_b_expert, stride_b_n, stride_b_k,
    stride_c_micro, stride_c_row, stride_c_n,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[m, r] = a[m, r] @ b[m, e(r)].T, where e(r) is the expert whose run holds row r.

    A row tile may straddle several experts' runs: it loops over exactly those experts,
    masking the rows of the others, so runs need no padding and the grid is static.
    """
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    micro = tl.cast(tl.program_id(2), tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows64 = tl.cast(rows, tl.int64)

    # Experts from the one whose run holds the tile's first row to the one holding its last.
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=num_rows + 1)
    first_row = pid_r * BLOCK_R
    last_row = tl.minimum(first_row + BLOCK_R, num_rows) - 1
    first_expert = tl.sum((ends <= first_row).to(tl.int32))
    last_expert = tl.sum((ends <= last_row).to(tl.int32))

    a_rows = a_ptr + micro * stride_a_micro + rows64[:, None] * stride_a_row
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for e in range(first_expert, last_expert + 1):
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        in_run = (rows >= start) & (rows < end)
        b_expert = b_ptr + micro * stride_b_micro + tl.cast(e, tl.int64) * stride_b_expert
        for k0 in range(0, k_dim, BLOCK_K):
            kk = k0 + ks
            a = tl.load(a_rows + kk[None, :] * stride_a_k,
                        mask=in_run[:, None] & (kk[None, :] < k_dim), other=0.0)
            b = tl.load(b_expert + cols[None, :] * stride_b_n + kk[:, None] * stride_b_k,
                        mask=(cols[None, :] < n_out) & (kk[:, None] < k_dim), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    c = c_ptr + micro * stride_c_micro + rows64[:, None] * stride_c_row + cols[None, :] * stride_c_n
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < num_rows) & (cols[None, :] < n_out))


@triton.jit
def _glu_kernel(
    u_ptr, act_ptr, num_rows, inter,
    stride_u_micro, stride_u_row, stride_u_col,
    stride_act_micro, stride_act_row, stride_act_col,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """act[m, r, i] = u[m, r, i] * silu(u[m, r, I + i]), in float32, stored in act's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    micro = tl.cast(tl.program_id(2), tl.int64)
    rows64 = tl.cast(rows, tl.int64)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < inter)
    u = u_ptr + micro * stride_u_micro + rows64[:, None] * stride_u_row
    x1 = tl.load(u + cols[None, :] * stride_u_col, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(u + (cols[None, :] + inter) * stride_u_col, mask=mask, other=0.0).to(tl.float32)
    act = x1 * x2 * tl.sigmoid(x2)
    dst = act_ptr + micro * stride_act_micro + rows64[:, None] * stride_act_row + cols[None, :] * stride_act_col
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finalize_kernel(
    part_ptr, slot_ptr, weight_ptr, out_ptr, hidden,
    stride_p_micro, stride_p_row, stride_p_col, stride_out_row,
    TOP_K: tl.constexpr, NUM_MICROS: tl.constexpr, PAIR_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k weight[t, k] * sum_m part[m, slot_of_pair[t*K + k]], float32 inside.

    One program per (token, block of H): it gathers its K slots, so the un-permute and
    the weighted reduce are one pass over the partials, without atomics. K and M are
    compile-time so that all K*M row loads are unrolled and in flight together.
    PAIR_ROWS: the partials are already in pair order (slot = t*K + k; slot_ptr unused).
    """
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        if PAIR_ROWS:
            slot = tl.cast(pair, tl.int64)
        else:
            slot = tl.cast(tl.load(slot_ptr + pair), tl.int64)
        part = part_ptr + slot * stride_p_row + cols * stride_p_col
        expert_out = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for _ in tl.static_range(NUM_MICROS):
            expert_out += tl.load(part, mask=col_ok, other=0.0).to(tl.float32)
            part += stride_p_micro
        acc += tl.load(weight_ptr + pair) * expert_out
    tl.store(out_ptr + tl.cast(token, tl.int64) * stride_out_row + cols,
             acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# The decorator picked the interpreter or the compiler when this module was imported.
TRITON_INTERPRETED = not isinstance(_finalize_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under the interpreter."""
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(
            f"the Triton MoE kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            f"set before triton is first imported; got a tensor on {x.device}")


# ---------------------------------------------------------------------------- launchers

# Triton grouped GEMM tile: 128 rows x 256 outputs, K step 64 (144 KiB of shared memory
# at 3 stages in bf16): the best of five tiles tried on an H200 (expert MLPs at T=4096:
# 3.3 ms, against 2.4 ms with _grouped_mm). It is the fallback and the CPU-tested path.
_GEMM_BLOCKS = dict(BLOCK_R=128, BLOCK_N=256, BLOCK_K=64)
_GEMM_LAUNCH = dict(num_warps=8, num_stages=3)
# float32 operands take twice the shared memory per stage: that tile needs 288 KiB, over
# the H200's 227 KiB (measured: OutOfResources), so halve the K step and drop a stage.
_GEMM_BLOCKS_FP32 = dict(BLOCK_R=128, BLOCK_N=128, BLOCK_K=32)
_GEMM_LAUNCH_FP32 = dict(num_warps=8, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands get IEEE float32 products: whoever picks fp32 wants fp32 accuracy,
    and Triton's default for them is TF32 (~1e-3 relative). 16-bit operands are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_ends: torch.Tensor, out: torch.Tensor) -> None:
    """out[m] = a[m] @ b[m, e].T on each expert's run. a: [M or broadcast, R, Kd],
    b: [M, E, N, Kd], out: [M, R, N]."""
    micros, experts, n_out, k_dim = b.shape
    num_rows = a.shape[1]
    wide = a.element_size() >= 4
    blocks = _GEMM_BLOCKS_FP32 if wide else _GEMM_BLOCKS
    launch = _GEMM_LAUNCH_FP32 if wide else _GEMM_LAUNCH
    grid = (triton.cdiv(num_rows, blocks["BLOCK_R"]), triton.cdiv(n_out, blocks["BLOCK_N"]), micros)
    _grouped_gemm_kernel[grid](
        a, b, out, expert_ends, num_rows, n_out, k_dim, experts,
        *a.stride(), *b.stride(), *out.stride(),
        BLOCK_E=triton.next_power_of_2(experts), DOT_PRECISION=dot_precision(a.dtype), **blocks, **launch)


def _glu(u: torch.Tensor, act: torch.Tensor) -> None:
    """act[m] = u[m, :, :I] * silu(u[m, :, I:]); u: [M, R, 2I], act: [M, R, I]."""
    micros, num_rows, inter = act.shape
    block_i = min(256, triton.next_power_of_2(inter))
    block_r = 16
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(inter, block_i), micros)
    _glu_kernel[grid](u, act, num_rows, inter, *u.stride(), *act.stride(), BLOCK_R=block_r, BLOCK_I=block_i)


def moe_finalize(partials: torch.Tensor, slot_of_pair: torch.Tensor | None, topk_weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Shared by both MoE ops: partials [M, T*K, H] (per slot and micro) -> out [T, H],
    ``out[t] = sum_k w[t, k] * sum_m partials[m, slot_of_pair[t*K + k]]``, float32 inside.
    slot_of_pair None: the rows are already in pair order t*K + k."""
    micros, _, hidden = partials.shape
    tokens, top_k = topk_weights.shape
    out = torch.empty((tokens, hidden), dtype=out_dtype, device=partials.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (tokens, triton.cdiv(hidden, block_h))
    _finalize_kernel[grid](
        partials, slot_of_pair, topk_weights.contiguous(), out, hidden,
        *partials.stride(), out.stride(0),
        TOP_K=top_k, NUM_MICROS=micros, PAIR_ROWS=slot_of_pair is None, BLOCK_H=block_h)
    return out


# ------------------------------------------------------------------------- fast path


def _grouped_mm_usable(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether torch._grouped_mm's fast path (CUTLASS, sm90+, bf16) takes these tensors:
    every row 16-byte aligned (H and I multiples of 8 for TMA), weights contiguous so that
    w_down's (M, E) dims flatten into M*E groups as a view, never a copy."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    hidden, inter = w_down.shape[2], w_down.shape[3]
    return (hidden % 8 == 0 and inter % 8 == 0
            and w_gate_up.is_contiguous() and w_down.is_contiguous()
            and _aligned_16(w_gate_up) and _aligned_16(w_down))


def _aligned_16(t: torch.Tensor) -> bool:
    """A 16-byte aligned start. Under torch.compile no pointer exists at trace time: there
    the check is skipped, which holds for dtgen's weights (each its own allocation, viewed
    at micro granularity: offsets are multiples of E*I*H elements, aligned when H and I
    are multiples of 8, which the caller checks)."""
    return torch.compiler.is_compiling() or t.data_ptr() % 16 == 0


def _expert_mlp_grouped_mm(routing: MoeRouting, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Per-slot, per-micro expert outputs [M, T*K, H] with torch._grouped_mm.

    mat_b is a transposed view ([E, H, 2I] of [E, 2I, H]): column-major, which the
    kernel takes without a copy. Offsets are the int32 run ends (length E).
    """
    micros, _, two_inter, _ = w_gate_up.shape
    num_rows = routing.x_sorted.shape[0]
    act = routing.x_sorted.new_empty((micros, num_rows, two_inter // 2))
    for m in range(micros):
        u = torch._grouped_mm(routing.x_sorted, w_gate_up[m].transpose(-2, -1), offs=routing.expert_ends)
        _glu(u.unsqueeze(0), act[m:m + 1])
    # All micros' down projections in one GEMM: group (m, e) reads act[m]'s run of
    # expert e, i.e. the run ends shifted by m * rows.
    shift = torch.arange(micros, device=act.device, dtype=torch.int32).unsqueeze(1) * num_rows
    down_ends = (routing.expert_ends.unsqueeze(0) + shift).reshape(-1)
    partials = torch._grouped_mm(act.flatten(0, 1), w_down.flatten(0, 1).transpose(-2, -1), offs=down_ends)
    return partials.unflatten(0, (micros, num_rows))


def _expert_mlp_triton(routing: MoeRouting, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Same as _expert_mlp_grouped_mm with the Triton grouped GEMM (micros on a grid axis)."""
    micros, _, two_inter, _ = w_gate_up.shape
    hidden = w_down.shape[2]
    x_sorted = routing.x_sorted
    num_rows = x_sorted.shape[0]
    u = x_sorted.new_empty((micros, num_rows, two_inter))
    _grouped_gemm(x_sorted.expand(micros, -1, -1), w_gate_up, routing.expert_ends, u)  # x shared: stride 0
    act = x_sorted.new_empty((micros, num_rows, two_inter // 2))
    _glu(u, act)
    partials = x_sorted.new_empty((micros, num_rows, hidden))
    _grouped_gemm(act, w_down, routing.expert_ends, partials)
    return partials


def _moe_fused(x, topk_ids, topk_weights, w_gate_up, w_down, out_dtype: torch.dtype) -> torch.Tensor:
    """`kernels.moe_grouped_gemm`: the gate/up GEMM reads x through the routing index and
    applies the activation in its epilogue, the down GEMM sums the micros in its K loop;
    then the finalize over one partial per slot."""
    routing = moe_route(x, topk_ids, w_gate_up.shape[1], gather=False)
    config = fused_config_for(x.dtype, x.device)
    token_of_slot = (routing.pair_of_slot // topk_ids.shape[1]).to(torch.int32)
    act, _ = gate_up_act(x, token_of_slot, w_gate_up, routing.expert_ends, config.gate_up)
    y = down_sum(act, w_down, routing.expert_ends, config.down)
    return moe_finalize(y.unsqueeze(0), routing.slot_of_pair, topk_weights, out_dtype)


def _moe_pass(x, topk_ids, topk_weights, w_gate_up, w_down, gemm: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Route once, run every micro's expert MLPs, finalize. gemm: "grouped_mm", "triton"
    or "fused" (`kernels.moe_grouped_gemm`)."""
    require_triton_device(x)
    if gemm == "fused":
        return _moe_fused(x, topk_ids, topk_weights, w_gate_up, w_down, out_dtype)
    routing = moe_route(x, topk_ids, w_gate_up.shape[1])
    expert_mlp = _expert_mlp_grouped_mm if gemm == "grouped_mm" else _expert_mlp_triton
    partials = expert_mlp(routing, w_gate_up, w_down)
    return moe_finalize(partials, routing.slot_of_pair, topk_weights, out_dtype)


# The fused kernels beat torch._grouped_mm at every measured size (H200, T = 2048 to
# 8192: 8-10% on the op, 15% on the denoise layer) and need no bf16 or sm90.
DEFAULT_GEMM = "fused"


def moe_two_dispatch(x, topk_ids, topk_weights, w_gate_up, w_down, gemm: str | None = None):
    """Ablation baseline: each micro routed, dispatched and combined on its own, the
    float32 results added. Applies each routing weight once per micro, so it differs
    from the op by rounding only. Runs the fast-path kernels (CUDA or the interpreter)."""
    check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    gemm = gemm or DEFAULT_GEMM
    total = None
    for m in range(w_gate_up.shape[0]):
        out_m = _moe_pass(x, topk_ids, topk_weights, w_gate_up[m:m + 1], w_down[m:m + 1], gemm, torch.float32)
        total = out_m if total is None else total + out_m
    return total.to(x.dtype)


def concat_micros(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the micros into ONE expert-major micro: [1, E, 2*M*I, H] and [1, E, H, M*I].

    The x1 rows of every micro, then their x2 rows, so ``x1 * silu(x2)`` still holds; the
    down columns follow the same micro order. This copy is what the multi-micro op avoids.
    """
    micros, experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    halves = w_gate_up.unflatten(2, (2, inter))  # [M, E, 2, I, H]
    gate_up = halves.permute(1, 2, 0, 3, 4).reshape(1, experts, 2 * micros * inter, hidden)
    down = w_down.permute(1, 2, 0, 3).reshape(1, experts, hidden, micros * inter)
    return gate_up, down


def _moe_flashinfer(x, topk_ids, topk_weights, w_gate_up, w_down):
    """FlashInfer's CUTLASS fused MoE, one call per micro (optional; untested here).

    Its fc1 is ``[up; gate]`` with SiLU on the second half: our ``[x1; x2]`` as stored.
    It applies the routing weights itself, so they are applied once per micro.
    Warning: the first call JIT-builds the sm90 fused-MoE module; on an H200 with 16
    cores that ran more than 9 minutes, so keep it off the default path.
    """
    try:
        from flashinfer.fused_moe import cutlass_fused_moe
    except ImportError as err:
        raise ImportError("impl='flashinfer' needs FlashInfer: pip install dtgen[flashinfer]") from err
    ids = topk_ids.to(torch.int32).contiguous()
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for m in range(w_gate_up.shape[0]):
        result = cutlass_fused_moe(x.contiguous(), ids, topk_weights.contiguous(),
                                   w_gate_up[m].contiguous(), w_down[m].contiguous(), x.dtype, quant_scales=None)
        total += (result[0] if isinstance(result, (list, tuple)) else result).float()
    return total.to(x.dtype)


# ---------------------------------------------------------- the fast path, traceable


def moe_multi_micro_graph(x, topk_ids, topk_weights, w_gate_up, w_down):
    """The grouped-GEMM fast path written as plain torch ops, for torch.compile to see inside.

    Same math and the same roundings as the op (u, the activation and each micro's partial
    in x's dtype; the micro sum and the weighted reduce in float32), but inductor gets the
    `torch._grouped_mm` calls themselves: with GEMM autotuning on (`CompileOptions.autotune`)
    it picks its Triton grouped-GEMM templates where they win. On an H200 at the denoise
    shapes they beat the CUTLASS kernel by 13-17% (`python -m bench kernels grouped-gemm --autotune`:
    bench/results/h200-2026-11-29-layers/bench_grouped_gemm.json).
    The activation becomes inductor's fused kernel; the finalize is ours. No host sync.
    The model uses it with MoE impl "graph" (`--compile-autotune` picks that).
    """
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    routing = moe_route(x, topk_ids, dims.experts)
    rows = routing.x_sorted.shape[0]
    acts = []
    for m in range(dims.micros):
        u = torch._grouped_mm(routing.x_sorted, w_gate_up[m].transpose(-2, -1), offs=routing.expert_ends)
        x1, x2 = u.float().chunk(2, dim=-1)          # [x1; x2]: SiLU on the second half
        acts.append((x1 * F.silu(x2)).to(x.dtype))
    act = torch.stack(acts)                           # [M, rows, I]
    # All micros' down projections in one GEMM over M*E groups, as in the op.
    shift = torch.arange(dims.micros, device=x.device, dtype=torch.int32).unsqueeze(1) * rows
    down_ends = (routing.expert_ends.unsqueeze(0) + shift).reshape(-1)
    partials = torch._grouped_mm(act.flatten(0, 1), w_down.flatten(0, 1).transpose(-2, -1), offs=down_ends)
    # The finalize stays our kernel (one graph node): inductor's fused gather-and-reduce ran
    # at a quarter of its speed (356 us against 92 us at the denoise layer's shapes).
    return torch.ops.dtgen.moe_finalize(partials.unflatten(0, (dims.micros, rows)), routing.slot_of_pair,
                                        topk_weights, x.dtype)


def moe_finalize_reference(partials: torch.Tensor, slot_of_pair: torch.Tensor, topk_weights: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """`moe_finalize` in torch: partials [M, T*K, H] -> [T, H], float32 inside."""
    tokens, top_k = topk_weights.shape
    per_pair = partials[:, slot_of_pair].float().sum(0).view(tokens, top_k, -1)
    return (topk_weights.unsqueeze(-1) * per_pair).sum(1).to(out_dtype)


@torch.library.custom_op("dtgen::moe_finalize", mutates_args=())
def _moe_finalize_op(partials: torch.Tensor, slot_of_pair: torch.Tensor, topk_weights: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    if partials.is_cuda or TRITON_INTERPRETED:
        return moe_finalize(partials, slot_of_pair, topk_weights, out_dtype)
    return moe_finalize_reference(partials, slot_of_pair, topk_weights, out_dtype)


@_moe_finalize_op.register_fake
def _(partials, slot_of_pair, topk_weights, out_dtype):
    return partials.new_empty((topk_weights.shape[0], partials.shape[2]), dtype=out_dtype)


def graph_path_usable(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Where `moe_multi_micro_graph` is the fast path: torch._grouped_mm's CUDA fast path."""
    return _grouped_mm_usable(x, w_gate_up, w_down)


# ------------------------------------------------------------------ op and public API


@torch.library.custom_op("dtgen::moe_multi_micro", mutates_args=())
def _moe_multi_micro_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w_gate_up: torch.Tensor, w_down: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return moe_multi_micro_reference(x, topk_ids, topk_weights, w_gate_up, w_down)
    if impl == "two_dispatch":
        return moe_two_dispatch(x, topk_ids, topk_weights, w_gate_up, w_down)
    if impl == "flashinfer":
        return _moe_flashinfer(x, topk_ids, topk_weights, w_gate_up, w_down)
    gemm = DEFAULT_GEMM if impl == "auto" else impl
    return _moe_pass(x, topk_ids, topk_weights, w_gate_up, w_down, gemm, x.dtype)


@_moe_multi_micro_op.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, impl):
    return x.new_empty(x.shape)


def moe_multi_micro(x, topk_ids, topk_weights, w_gate_up, w_down, impl: str = "auto") -> torch.Tensor:
    """MoE over experts stored as M micros (module docstring: conventions and fast path).

    impl: "auto" (CPU: reference; CUDA: "fused"), "reference", "fused"
    (`kernels.moe_grouped_gemm`: gather and activation inside the gate/up GEMM, micro sum
    inside the down GEMM; on CPU only under TRITON_INTERPRET=1), "grouped_mm" (the
    previous default: routing with a gather, `torch._grouped_mm` per micro, the activation
    kernel; CUDA bf16 on sm90+), "triton" (that pipeline with the older straddling Triton
    grouped GEMM), "two_dispatch" (ablation baseline), "flashinfer"
    (optional backend, `pip install dtgen[flashinfer]`; its first call JIT-builds a module
    for more than 9 minutes on an H200 with 16 cores). Every impl is ONE node of
    dtgen::moe_multi_micro under torch.compile.
    """
    if impl not in MULTI_MICRO_IMPLS:
        raise ValueError(f"impl must be one of {MULTI_MICRO_IMPLS}, got {impl!r}")
    check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    if impl in ("triton", "fused", "two_dispatch"):
        require_triton_device(x)
    if impl == "grouped_mm" and not _grouped_mm_usable(x, w_gate_up, w_down):
        raise ValueError("impl 'grouped_mm' needs torch._grouped_mm's fast path: CUDA bf16 tensors on sm90+, "
                         "H and I multiples of 8, contiguous 16-byte aligned weights")
    return torch.ops.dtgen.moe_multi_micro(x, topk_ids, topk_weights, w_gate_up, w_down, impl)


# ---------------------------------------------------------------- FP8 (e4m3) experts


def fp8_recipe(w_gate_up_scale: torch.Tensor) -> str:
    """"blocks" (scales [M, E, 2I/128, H/128] and [M, E, H/128, I/128]) or "channels"
    ([M, E, 2I] and [E, H]): `kernels.fp8_quant` has both."""
    return "channels" if w_gate_up_scale.dim() == 3 else "blocks"


def check_fp8_scales(dims: MoeDims, w_gate_up_scale: torch.Tensor, w_down_scale: torch.Tensor) -> str:
    """The scales' shapes for either recipe; returns the recipe."""
    blocks = lambda n: triton.cdiv(n, FP8_GROUP)  # noqa: E731
    recipe = fp8_recipe(w_gate_up_scale)
    if recipe == "channels":
        want_gate_up = (dims.micros, dims.experts, 2 * dims.inter)
        want_down = (dims.experts, dims.hidden)
        what = "one scale per output channel"
    else:
        want_gate_up = (dims.micros, dims.experts, blocks(2 * dims.inter), blocks(dims.hidden))
        want_down = (dims.micros, dims.experts, blocks(dims.hidden), blocks(dims.inter))
        what = f"one scale per {FP8_GROUP}x{FP8_GROUP} block"
    for name, scale, want in (("w_gate_up_scale", w_gate_up_scale, want_gate_up),
                              ("w_down_scale", w_down_scale, want_down)):
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(f"MoE inputs: {name} must be float32 {want} ({what}, FP8 recipe {recipe!r}), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    return recipe


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 experts [M, E, N, K] from either recipe's scales: blocks
    [M, E, N/128, K/128], channels [M, E, N] (gate/up) or [E, N] (down, over all micros)."""
    if scale.dim() == 4:
        return dequantize(w, scale, FP8_GROUP)
    return w.float() * (scale[..., None] if scale.dim() == 3 else scale[None, :, :, None])


def moe_multi_micro_fp8_reference(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale):
    """The FP8 path emulated in torch, float32 math. Blocks: x quantized per token and 128
    columns, the activation per slot and 128 columns. Channels: x per token, the activation
    per slot (over all micros). Then the finalize as in the bf16 op."""
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, weight_dtype=FP8_DTYPE)
    routing = moe_route(x, topk_ids, dims.experts, gather=False)
    token_of_slot = (routing.pair_of_slot // dims.top_k).to(torch.int32)
    if fp8_recipe(w_gate_up_scale) == "channels":
        x_q, x_scale = quantize_row_groups_reference(x, group=x.shape[1])
        y = moe_experts_fp8_channels_reference(x_q, x_scale[:, 0], token_of_slot, w_gate_up, w_gate_up_scale,
                                               w_down, w_down_scale, routing.expert_ends, torch.float32)
    else:
        x_q, x_scale = quantize_row_groups_reference(x)
        act_q, act_scale = gate_up_act_fp8_reference(x_q, x_scale, token_of_slot, w_gate_up, w_gate_up_scale,
                                                     routing.expert_ends, quantize_out=True)
        y = down_sum_fp8_reference(act_q, act_scale, w_down, w_down_scale, routing.expert_ends, torch.float32)
    return moe_finalize_reference(y.unsqueeze(0), routing.slot_of_pair, topk_weights, x.dtype)


def _moe_fp8_fused(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale):
    routing = moe_route(x, topk_ids, w_gate_up.shape[1], gather=False)
    token_of_slot = (routing.pair_of_slot // topk_ids.shape[1]).to(torch.int32)
    if fp8_recipe(w_gate_up_scale) == "channels":
        config = fused_config_for(FP8_DTYPE, x.device, "channels", x.dtype)
        x_q, x_scale = quantize_rows(x)
        act, amax = gate_up_act(x_q, token_of_slot, w_gate_up, routing.expert_ends, config.gate_up,
                                x_scale=x_scale, w_scale=w_gate_up_scale, row_amax=True)
        act_q, act_scale = quantize_rows_by_amax(act, amax)
    else:
        config = fused_config_for(FP8_DTYPE, x.device, "blocks", x.dtype)
        x_q, x_scale = quantize_row_groups(x)
        act_q, act_scale = gate_up_act(x_q, token_of_slot, w_gate_up, routing.expert_ends, config.gate_up,
                                       x_scale=x_scale, w_scale=w_gate_up_scale, quantize_out=True)
    y = down_sum(act_q, w_down, routing.expert_ends, config.down, act_scale=act_scale, w_scale=w_down_scale,
                 out_dtype=x.dtype)
    return moe_finalize(y.unsqueeze(0), routing.slot_of_pair, topk_weights, x.dtype)


# The grouped GEMM each channel-scale pipeline impl runs (`kernels.moe_scaled_grouped_mm.experts_partials`).
_PIPELINE_GEMMS = {"scaled_grouped_mm": None, "gluon": grouped_gemm_fp8}


def _moe_fp8_pipeline(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, impl):
    """`kernels.moe_scaled_grouped_mm`'s pipeline: x per token, the two grouped GEMMs (torch._scaled_grouped_mm
    for "scaled_grouped_mm", the Gluon kernel for "gluon"), one bf16 partial per micro and slot; the
    finalize sums them."""
    routing = moe_route(x, topk_ids, w_gate_up.shape[1], gather=False)
    x_q, x_scale = quantize_rows(x)
    partials = experts_partials(x_q, x_scale, routing.pair_of_slot // topk_ids.shape[1], w_gate_up, w_gate_up_scale,
                                w_down, w_down_scale, routing.expert_ends, gemm=_PIPELINE_GEMMS[impl])
    return moe_finalize(partials, routing.slot_of_pair, topk_weights, x.dtype)


def fp8_auto_impl(device: torch.device, recipe: str) -> str:
    """What impl "auto" runs for FP8 experts on a CUDA device in `recipe` ("channels" or "blocks"): the
    fused Triton kernels everywhere. The one place to pick another default per GPU and recipe (e.g.
    "gluon" for "channels" where `gluon_problem(device)` and `gluon_shape_problem` are None)."""
    return "fused"


@torch.library.custom_op("dtgen::moe_multi_micro_fp8", mutates_args=())
def _moe_multi_micro_fp8_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                            w_down_scale: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return moe_multi_micro_fp8_reference(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale)
    if impl == "auto":
        impl = fp8_auto_impl(x.device, fp8_recipe(w_gate_up_scale))
    if impl in _PIPELINE_GEMMS:
        return _moe_fp8_pipeline(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, impl)
    return _moe_fp8_fused(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale)


@_moe_multi_micro_fp8_op.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, impl):
    return x.new_empty(x.shape)


FP8_IMPLS = ("auto", "reference", "fused") + tuple(_PIPELINE_GEMMS)


def moe_multi_micro_fp8(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                        impl: str = "auto") -> torch.Tensor:
    """The multi-micro MoE over e4m3 experts, in either recipe of `kernels.fp8_quant`
    (picked by the scales' shapes, `check_fp8_scales`): "blocks" (128 x 128 weight blocks,
    or per-matrix scales expanded to that grid; x and the activation per row and 128
    columns, the activation quantized in the gate/up GEMM's epilogue) or "channels" (weights
    per output channel, x and the activation per row, scaled once after each GEMM's K loop).
    x stays bf16 (or fp16/fp32) and is quantized inside.
    impl: "auto" (CUDA: the fused kernels; CPU: the emulating reference), "reference",
    "fused" (on CPU only under TRITON_INTERPRET=1), "scaled_grouped_mm" (`kernels.moe_scaled_grouped_mm`:
    torch's CUTLASS rowwise FP8 grouped GEMM; channel scales, sm90), "gluon" (the same pipeline with
    `kernels.moe_grouped_gemm_gluon`'s kernel; channel scales, sm90). ONE node of dtgen::moe_multi_micro_fp8."""
    if impl not in FP8_IMPLS:
        raise ValueError(f"impl must be one of {FP8_IMPLS}, got {impl!r}")
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, weight_dtype=FP8_DTYPE)
    recipe = check_fp8_scales(dims, w_gate_up_scale, w_down_scale)
    problem = fp8_support_problem(x.device)
    if impl in _PIPELINE_GEMMS:
        if recipe != "channels":
            raise ValueError(f"impl {impl!r} takes one scale per weight row (FP8 recipe 'channels' or "
                             f"'tensor'), got {recipe!r} scales")
        if impl == "scaled_grouped_mm":
            problem = problem or scaled_grouped_mm_problem(x.device) or shape_problem(dims.micros, dims.experts,
                                                                                      dims.hidden, dims.inter)
        else:
            problem = problem or gluon_problem(x.device) or gluon_shape_problem(dims.hidden, dims.inter)
    if problem:
        raise RuntimeError(problem)
    if impl == "fused":
        require_triton_device(x)
    return torch.ops.dtgen.moe_multi_micro_fp8(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale,
                                               w_down, w_down_scale, impl)
