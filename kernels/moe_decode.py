"""Low-latency MoE for decode (T = 1..16 tokens): read only the selected experts' weights.

Same conventions and signature as `kernels.moe_multi_micro` (weights [M, E, 2I, H] and
[M, E, H, I], ``down(x1 * silu(x2))``, output summed over micros, each routing weight
applied once after the micro sum). At decode the op is memory-bound: the floor is reading
the distinct selected experts' weights once (T=1, HunyuanImage-3 AR micro: 8 experts x
3 x 768 x 4096 x 2 B = 151 MB, read at the GPU's memory bandwidth). No routing prep, no sort: the kernels
read topk_ids directly.

Tokens are taken in chunks of BLOCK_T = 16 (one tensor-core tile; T <= 16 is one chunk).
Within a chunk, the first pair routed to an expert *owns* it: only the owner's programs
compute that expert, for every token of the chunk that picked it, so each selected
expert's weights are read once per chunk however many tokens share it. Non-owner
programs exit at once.

- Stage 1 (`_decode_gate_up_kernel`), grid (pairs of a chunk, chunks, M * I-blocks):
  ``act[m, t*K + k, I-block] = u1 * silu(u2)`` from BLOCK_I rows of x1 and of x2,
  streaming along H in wide coalesced tiles.
- Stage 2 (`_decode_down_kernel`), grid (H-blocks, pairs of a chunk, chunks):
  ``y[t*K + k, H-block] = sum_m w_down[m, e][H-block] @ act[m, t*K + k]`` in float32.
- The multi-micro finalize kernel (rows already in pair order) applies each routing
  weight once and sums over k: out[t] = sum_k w[t, k] * y[t*K + k].

Splitting stage 2 over (H-block, expert), rather than looping over the experts inside
one program per H-block, keeps enough programs streaming at T=1 to read w_down near the
memory bandwidth, which the looping version falls well short of (`python -m bench kernels moe
--part decode`; each kernel's time: bench/results/h200-2026-12-01-moe-targets/bench_moe_decode_profile*.json).
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_DTYPE
from kernels.moe_multi_micro import (
    check_fp8_scales,
    check_moe_inputs,
    dequantize_experts,
    dot_precision,
    moe_finalize,
    moe_multi_micro_reference,
    require_triton_device,
)

DECODE_IMPLS = ("auto", "reference", "triton")
BLOCK_T = 16  # tokens per chunk: the smallest tensor-core tile edge


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes (tl.dot needs every edge >= 16), from a sweep on an H200 at T = 1 and 16.
    Stage 1 tiles: [block_i rows of x1 (and of x2), block_h along H].
    Stage 2 tiles: [block_ho rows of w_down, block_i2 along I]."""

    block_i: int = 32
    block_h: int = 256
    stage1_warps: int = 4
    stage1_stages: int = 3
    fp8_dot_f16: bool = False  # e4m3 weights: stage 1 converts them (and x) to float16, not x's dtype
    stage2_fp8_via_f16: bool = False  # e4m3 weights: stage 2 converts them to float16, then to act's dtype
    block_ho: int = 64
    block_i2: int = 128
    stage2_warps: int = 4
    stage2_stages: int = 3


DEFAULT_DECODE_CONFIG = DecodeConfig()
# e4m3 weights, their tiles swept apart per recipe (`python -m bench kernels moe --part decode`, one
# H200; the times: bench/results/h200-2026-12-01-moe-targets/ and
# h200x2-2026-12-01-fp8-decode/bench_moe_decode.json; the op: table `hunyuan-h200-kernels` in docs/performance.md):
# - stage 1 converts e4m3 to float16 for its dot (not to bf16): that takes it off its
#   conversion bound, at the same error against bf16;
# - stage 2 converts e4m3 through float16 (one instruction per pair) before bf16, and
#   stage 1 keeps more bytes in flight (256-wide H tiles, 4 stages).
# Block scales need tiles inside one 128 block along each GEMM's K (block_h and block_i2
# divide 128), so their stage 1 deepens its pipeline instead.
FP8_CHANNELS_DECODE_CONFIG = DecodeConfig(block_i=64, block_h=256, stage1_stages=4, fp8_dot_f16=True,
                                          stage2_fp8_via_f16=True)
FP8_BLOCKS_DECODE_CONFIG = DecodeConfig(block_i=64, block_h=128, stage1_stages=4, fp8_dot_f16=True,
                                        stage2_fp8_via_f16=True)


@triton.jit
def _chunk_expert(ids_ptr, num_tokens, chunk, local_pair,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The expert of the chunk's local pair, whether this pair owns it (the chunk's first
    pair on it), the chunk's tokens [BLOCK_T], which of them picked it, and their pair
    slots t*K + k."""
    first_token = chunk * BLOCK_T
    tokens = first_token + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    pairs = tokens[:, None] * TOP_K + ks[None, :]
    ids = tl.load(ids_ptr + pairs, mask=(tokens[:, None] < num_tokens) & (ks[None, :] < TOP_K), other=-1)
    pair = first_token * TOP_K + local_pair
    valid = pair < num_tokens * TOP_K
    expert = tl.load(ids_ptr + pair, mask=valid, other=-2)  # -2 matches no id, not even padding
    match = ids == expert
    is_owner = valid & (tl.sum((match & (pairs < pair)).to(tl.int32)) == 0)
    routed = tl.sum(match.to(tl.int32), axis=1) > 0
    slots = tokens * TOP_K + tl.sum(tl.where(match, ks[None, :], 0), axis=1)
    return expert, is_owner, tokens, routed, slots


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, act_ptr, ws_ptr,
    num_tokens, hidden, inter,
    stride_x_row, stride_x_col,
    stride_w_micro, stride_w_expert, stride_w_row, stride_w_col,
    stride_ws_micro, stride_ws_expert, stride_ws_row, stride_ws_col,
    stride_act_micro, stride_act_row,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, W_SCALES: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    """W_SCALES (e4m3 weights, converted in registers; x stays in its dtype): 1, one scale
    per weight row (ws [M, E, 2I]), applied after the K loop; 2, one per 128 x 128 block
    (ws [M, E, 2I/128, H/128]), applied to each tile's product (BLOCK_H divides 128, so a
    tile's columns share one block: a [BLOCK_I] vector of scales, not one per weight).
    DOT_F16 (e4m3 weights): x and the weights go to float16 for the dot (an e4m3 value is
    exact in float16, and the conversion is one instruction per pair; x is RMS-normalised,
    far inside float16's range)."""
    if W_SCALES == 2:
        tl.static_assert(128 % BLOCK_H == 0)
    expert, is_owner, tokens, routed, slots = _chunk_expert(
        ids_ptr, num_tokens, tl.program_id(1), tl.program_id(0), TOP_K, BLOCK_T, BLOCK_K)
    if is_owner:
        i_blocks = tl.cdiv(inter, BLOCK_I)
        micro = tl.program_id(2) // i_blocks
        rows = (tl.program_id(2) % i_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)
        row_ok = rows < inter
        w_expert = w_ptr + tl.cast(micro, tl.int64) * stride_w_micro + tl.cast(expert, tl.int64) * stride_w_expert
        w1_rows = w_expert + rows[:, None] * stride_w_row
        w2_rows = w_expert + (rows[:, None] + inter) * stride_w_row
        x_rows = x_ptr + tokens[:, None] * stride_x_row
        if W_SCALES > 0:
            ws_expert = ws_ptr + micro * stride_ws_micro + expert * stride_ws_expert
        acc1 = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_ok = cols[None, :] < hidden
            xt = tl.load(x_rows + cols[None, :] * stride_x_col, mask=routed[:, None] & col_ok, other=0.0)
            w1 = tl.load(w1_rows + cols[None, :] * stride_w_col, mask=row_ok[:, None] & col_ok, other=0.0)
            w2 = tl.load(w2_rows + cols[None, :] * stride_w_col, mask=row_ok[:, None] & col_ok, other=0.0)
            if DOT_F16:
                xt = xt.to(tl.float16)
                w1 = w1.to(tl.float16)
                w2 = w2.to(tl.float16)
            else:
                w1 = w1.to(x_ptr.dtype.element_ty)
                w2 = w2.to(x_ptr.dtype.element_ty)
            if W_SCALES == 2:  # the tile lies in one column block; its rows may span two row blocks
                block_col = ws_expert + (h0 // 128) * stride_ws_col
                s1 = tl.load(block_col + (rows // 128) * stride_ws_row, mask=row_ok, other=0.0)
                s2 = tl.load(block_col + ((rows + inter) // 128) * stride_ws_row, mask=row_ok, other=0.0)
                acc1 += tl.dot(xt, tl.trans(w1), input_precision=DOT_PRECISION) * s1[None, :]
                acc2 += tl.dot(xt, tl.trans(w2), input_precision=DOT_PRECISION) * s2[None, :]
            else:
                acc1 = tl.dot(xt, tl.trans(w1), acc1, input_precision=DOT_PRECISION)
                acc2 = tl.dot(xt, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
        if W_SCALES == 1:
            acc1 = acc1 * tl.load(ws_expert + rows * stride_ws_row, mask=row_ok, other=0.0)[None, :]
            acc2 = acc2 * tl.load(ws_expert + (rows + inter) * stride_ws_row, mask=row_ok, other=0.0)[None, :]
        act = acc1 * acc2 * tl.sigmoid(acc2)
        dst = act_ptr + micro * stride_act_micro + slots[:, None] * stride_act_row + rows[None, :]
        tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=routed[:, None] & row_ok[None, :])


@triton.jit
def _decode_down_kernel(
    act_ptr, ids_ptr, w_ptr, y_ptr, ws_ptr,
    num_tokens, hidden, inter, num_micros,
    stride_act_micro, stride_act_row,
    stride_w_micro, stride_w_expert, stride_w_row, stride_w_col,
    stride_ws_micro, stride_ws_expert, stride_ws_row, stride_ws_col,
    stride_y_row,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_HO: tl.constexpr, BLOCK_I: tl.constexpr, DOT_PRECISION: tl.constexpr, W_SCALES: tl.constexpr,
    VIA_F16: tl.constexpr,
):
    """W_SCALES: 1, one scale per output channel over all micros (ws [E, H]), applied at
    the end; 2, one per 128 x 128 block (ws [M, E, H/128, I/128]), applied to each tile's
    product (BLOCK_I divides 128)."""
    if W_SCALES == 2:
        tl.static_assert(128 % BLOCK_I == 0)
    expert, is_owner, tokens, routed, slots = _chunk_expert(
        ids_ptr, num_tokens, tl.program_id(2), tl.program_id(1), TOP_K, BLOCK_T, BLOCK_K)
    if is_owner:
        cols = tl.program_id(0) * BLOCK_HO + tl.arange(0, BLOCK_HO)
        col_ok = cols < hidden
        act_rows = act_ptr + slots[:, None] * stride_act_row
        w_rows = w_ptr + tl.cast(expert, tl.int64) * stride_w_expert + cols[None, :] * stride_w_row
        if W_SCALES > 0:
            ws_expert = ws_ptr + expert * stride_ws_expert
        acc = tl.zeros((BLOCK_T, BLOCK_HO), dtype=tl.float32)
        for micro in range(num_micros):  # the micro sum, in float32
            for i0 in range(0, inter, BLOCK_I):
                ii = i0 + tl.arange(0, BLOCK_I)
                i_ok = ii < inter
                a = tl.load(act_rows + ii[None, :], mask=routed[:, None] & i_ok[None, :], other=0.0)
                w = tl.load(w_rows + ii[:, None] * stride_w_col, mask=i_ok[:, None] & col_ok[None, :], other=0.0)
                if VIA_F16:  # e4m3 -> float16 is one instruction per pair, and exact
                    w = w.to(tl.float16)
                w = w.to(act_ptr.dtype.element_ty)
                if W_SCALES == 2:  # the tile lies in one I block; its columns may span two
                    s = tl.load(ws_expert + micro * stride_ws_micro + (cols // 128) * stride_ws_row
                                + (i0 // 128) * stride_ws_col, mask=col_ok, other=0.0)
                    acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
                else:
                    acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            act_rows += stride_act_micro
            w_rows += stride_w_micro
        if W_SCALES == 1:
            acc = acc * tl.load(ws_expert + cols * stride_ws_row, mask=col_ok, other=0.0)[None, :]
        dst = y_ptr + slots[:, None] * stride_y_row + cols[None, :]
        tl.store(dst, acc, mask=routed[:, None] & col_ok[None, :])


def _scale_args(scale: torch.Tensor | None, rows_dim_only: bool) -> tuple:
    """(W_SCALES, the scale tensor, its 4 strides as (micro, expert, row, col))."""
    if scale is None:
        return 0, None, (0, 0, 0, 0)
    if scale.dim() == 4:                      # blocks: [M, E, rows/128, cols/128]
        return 2, scale, scale.stride()
    if rows_dim_only:                         # channels, down: [E, H]
        return 1, scale, (0, scale.stride(0), scale.stride(1), 0)
    return 1, scale, (*scale.stride(), 0)     # channels, gate/up: [M, E, 2I]


def decode_config_for(w_gate_up_scale: torch.Tensor | None, x_dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """The swept tiles for bf16/fp32 weights (no scale) or e4m3 weights (by their scales'
    layout), for x of `x_dtype`."""
    if w_gate_up_scale is None:
        return DEFAULT_DECODE_CONFIG
    if w_gate_up_scale.dim() == 4:
        return FP8_BLOCKS_DECODE_CONFIG
    if x_dtype.itemsize > 2:  # float32 x tiles: 128-wide H tiles (shared memory)
        return replace(FP8_CHANNELS_DECODE_CONFIG, block_h=128, stage1_stages=3)
    return FP8_CHANNELS_DECODE_CONFIG


def moe_decode_triton(x, topk_ids, topk_weights, w_gate_up, w_down,
                      config: DecodeConfig | None = None, w_gate_up_scale=None,
                      w_down_scale=None) -> torch.Tensor:
    """The decode kernels (inputs assumed checked). Graph-capturable: no host sync.
    With scales: e4m3 weights (`kernels.fp8_quant`, either recipe), dequantized in
    registers; x and the activation stay in x's dtype (weight-only FP8: half the bytes).
    config: None picks `decode_config_for` the weights."""
    require_triton_device(x)
    config = config or decode_config_for(w_gate_up_scale, x.dtype)
    if w_gate_up_scale is not None and w_gate_up_scale.dim() == 4 and (128 % config.block_h or 128 % config.block_i2):
        raise ValueError(f"decode with 128x128 block scales needs block_h and block_i2 dividing 128, "
                         f"got {config.block_h} and {config.block_i2}")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    micros, _, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    ids = topk_ids.contiguous()
    pairs_per_chunk, chunks = min(tokens, BLOCK_T) * top_k, triton.cdiv(tokens, BLOCK_T)
    routing = dict(TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_K=triton.next_power_of_2(top_k))

    # Rows are pair slots t*K + k: every routed pair's row is written by its expert's owner.
    act = x.new_empty((micros, tokens * top_k, inter))
    grid1 = (pairs_per_chunk, chunks, micros * triton.cdiv(inter, config.block_i))
    mode1, scale1, scale1_strides = _scale_args(w_gate_up_scale, rows_dim_only=False)
    _decode_gate_up_kernel[grid1](
        x, ids, w_gate_up, act, scale1, tokens, hidden, inter,
        *x.stride(), *w_gate_up.stride(), *scale1_strides, act.stride(0), act.stride(1),
        **routing, BLOCK_I=config.block_i, BLOCK_H=config.block_h, DOT_PRECISION=dot_precision(x.dtype),
        W_SCALES=mode1, DOT_F16=config.fp8_dot_f16 and mode1 > 0, num_warps=config.stage1_warps, num_stages=config.stage1_stages)

    y = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    grid2 = (triton.cdiv(hidden, config.block_ho), pairs_per_chunk, chunks)
    mode2, scale2, scale2_strides = _scale_args(w_down_scale, rows_dim_only=True)
    _decode_down_kernel[grid2](
        act, ids, w_down, y, scale2, tokens, hidden, inter, micros,
        act.stride(0), act.stride(1), *w_down.stride(), *scale2_strides, y.stride(0),
        **routing, BLOCK_HO=config.block_ho, BLOCK_I=config.block_i2, DOT_PRECISION=dot_precision(x.dtype),
        W_SCALES=mode2, VIA_F16=config.stage2_fp8_via_f16 and mode2 > 0,
        num_warps=config.stage2_warps, num_stages=config.stage2_stages)
    return moe_finalize(y.unsqueeze(0), None, topk_weights, x.dtype)


@torch.library.custom_op("dtgen::moe_decode", mutates_args=())
def _moe_decode_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return moe_multi_micro_reference(x, topk_ids, topk_weights, w_gate_up, w_down)
    return moe_decode_triton(x, topk_ids, topk_weights, w_gate_up, w_down)


@_moe_decode_op.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, impl):
    return x.new_empty(x.shape)


def moe_decode(x, topk_ids, topk_weights, w_gate_up, w_down, impl: str = "auto") -> torch.Tensor:
    """Decode MoE for few tokens; same signature and result as `moe_multi_micro`.

    impl: "auto" (CPU: reference; CUDA: Triton), "reference" (= moe_multi_micro_reference),
    "triton" (on CPU only under TRITON_INTERPRET=1). ONE node of dtgen::moe_decode under
    torch.compile. Correct for any T; built for T <= 16 (more tokens: moe_multi_micro).
    """
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    if impl == "triton":
        require_triton_device(x)
    return torch.ops.dtgen.moe_decode(x, topk_ids, topk_weights, w_gate_up, w_down, impl)


# ------------------------------------------------------------------ FP8 (e4m3) experts


def moe_decode_fp8_reference(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale):
    """Weight-only FP8 in torch: the weights dequantized (float32), x and the activation not
    quantized, then the multi-micro reference."""
    gate_up = dequantize_experts(w_gate_up, w_gate_up_scale)
    down = dequantize_experts(w_down, w_down_scale)
    return moe_multi_micro_reference(x, topk_ids, topk_weights, gate_up.to(x.dtype), down.to(x.dtype))


@torch.library.custom_op("dtgen::moe_decode_fp8", mutates_args=())
def _moe_decode_fp8_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                       w_down_scale: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return moe_decode_fp8_reference(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale)
    return moe_decode_triton(x, topk_ids, topk_weights, w_gate_up, w_down,
                             w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)


@_moe_decode_fp8_op.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, impl):
    return x.new_empty(x.shape)


def moe_decode_fp8(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                   impl: str = "auto") -> torch.Tensor:
    """Decode MoE over e4m3 experts (either recipe of `kernels.fp8_quant`): weight-only FP8,
    the weights dequantized in registers, x and the activation in x's dtype. At decode the
    op reads weights, so FP8 halves its bytes. impl as for `moe_decode`. ONE node of
    dtgen::moe_decode_fp8 under torch.compile."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, weight_dtype=FP8_DTYPE)
    check_fp8_scales(dims, w_gate_up_scale, w_down_scale)
    if impl == "triton":
        require_triton_device(x)
    return torch.ops.dtgen.moe_decode_fp8(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down,
                                          w_down_scale, impl)
