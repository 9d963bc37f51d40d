"""The MoE's two grouped GEMMs with their neighbours fused in, for prefill and denoise.

Conventions as in `kernels.moe_multi_micro`: ``w_gate_up [M, E, 2I, H]`` (per micro and
expert the rows ``[x1 (I); x2 (I)]``), ``w_down [M, E, H, I]``, and the slots: the T*K
(token, k) pairs sorted by expert, expert e owning the slots
``[expert_ends[e-1], expert_ends[e])`` (`kernels.moe_routing`).

- `gate_up_act`: ``act[m, s] = x1 * silu(x2)`` with ``[x1; x2] = w_gate_up[m, e(s)] @ x[token(s)]``.
  The A rows are read from x through the slot -> token index (no gathered copy of x),
  each program computes matching column blocks of x1 and of x2 so that the activation is
  its epilogue (u never reaches memory), and all micros go in one launch.
- `down_sum`: ``y[s] = sum_m w_down[m, e(s)] @ act[m, s]``: the micro sum is the K loop
  (K = M*I), so each slot gets one partial, accumulated in float32 and rounded once.

Scheduling. A row tile never straddles two experts: expert e gets ceil(n_e / BLOCK_R) tiles
of its own rows and an expert with no token gets none, so no tile computes rows it then
throws away (the straddling kernel in moe_multi_micro does). The work items are
(expert, column tile, row tile) with the row tile fastest: programs that run at the same
time share the expert's weight tiles through L2. The item count comes from the device
(``tile_ends``), so the grid is static and there is no host sync (CUDA-graph safe); a
persistent grid walks the items, or one program per possible item exits when it has none.

Out-of-range rows and columns are clamped to valid ones for the loads (no load masks,
which keeps the loads wide) and masked at the store. The weights (and, optionally, the rows)
can come through TMA descriptors (`GemmTiles.weights_tma` / `rows_tma`).

FP8 (e4m3 operands, `kernels.fp8_quant`): with block scales each K step's product is scaled
before it is added, which breaks the tensor cores' accumulate chain (the kernels run at
bf16's rate); with channel scales the K loop is a plain chain and the scales apply in the
epilogue (~1.7x bf16 on an H200: docs/performance.md, table `hunyuan-h200-kernels`).

References: `gate_up_act_reference` and `down_sum_reference` (torch, one host sync each),
and their FP8 forms.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP,
    INTERPRETED,
    dequantize,
    quantize_row_groups_reference,
    quantize_rows_by_amax_reference,
    to_fp8,
)


@dataclass(frozen=True)
class GemmTiles:
    """One kernel's tile and launch: rows (slots) x columns x K step, warps, pipeline depth.
    ``persistent``: one program per SM (times ``programs_per_sm``) walking the work items;
    otherwise one program per possible item. ``weights_tma``: the weight tiles come through
    TMA descriptors (Hopper's bulk tensor copies) rather than pointer loads. ``rows_tma``:
    the A rows too; the gate/up GEMM then reads a gathered copy of x (one more pass) since
    TMA on Hopper cannot gather rows."""

    block_r: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    persistent: bool = True
    programs_per_sm: int = 1
    weights_tma: bool = False
    rows_tma: bool = False
    # Persistent grids: the loop over work items and the K loop pipelined as one, so that the
    # next item's first loads are in flight during this item's epilogue (tl.range flatten).
    flatten: bool = False


@dataclass(frozen=True)
class FusedMoeConfig:
    """The two kernels' tiles. gate_up's block_n is per half: the program holds two
    [block_r, block_n] accumulators (x1 and x2)."""

    gate_up: GemmTiles
    down: GemmTiles


# bf16 on an H200 at HunyuanImage-3's denoise shapes, the best of `python -m bench kernels grouped-gemm
# --sweep` (bench/results/h200-2026-12-01-moe/bench_grouped_gemm.json; TMA for the weights: +10%; for the down
# GEMM's rows: +7%).
DEFAULT_FUSED_CONFIG = FusedMoeConfig(
    gate_up=GemmTiles(block_r=128, block_n=128, block_k=64, num_warps=8, num_stages=4, weights_tma=True),
    down=GemmTiles(block_r=128, block_n=256, block_k=64, num_warps=8, num_stages=3, weights_tma=True, rows_tma=True))
# e4m3 with block scales: K steps of one scale group; gate/up's block_n is the activation's
# scale group. Each K step's product is scaled before it is added, so a program holds a
# second accumulator-sized temporary and waits for every MMA: 128-row gate/up tiles spill
# registers (80-200 TFLOP/s on an H200), and the best tiles run at bf16's rate (459/474).
# The down GEMMs flattened (tl.range flatten: the next item's loads overlap this item's
# epilogue): -4% blocks, -9% channels; the gate/up GEMMs lost with it (bf16 too).
FP8_FUSED_CONFIG = FusedMoeConfig(
    gate_up=GemmTiles(block_r=64, block_n=128, block_k=128, num_warps=8, num_stages=4, weights_tma=True),
    down=GemmTiles(block_r=64, block_n=256, block_k=128, num_warps=8, num_stages=4, weights_tma=True, rows_tma=True,
                   flatten=True))
# e4m3 with channel scales: plain accumulate chains, scaled once in the epilogue; the best of
# `python -m bench kernels grouped-gemm --sweep --flatten` on an H200
# (bench/results/h200-2026-12-01-moe-targets/grouped_gemm_sweep_flatten.json): gate/up 842 TFLOP/s,
# down 868 (flattened; 794 not).
FP8_CHANNELS_CONFIG = FusedMoeConfig(
    gate_up=GemmTiles(block_r=64, block_n=256, block_k=128, num_warps=8, num_stages=3, weights_tma=True, rows_tma=True),
    down=GemmTiles(block_r=128, block_n=256, block_k=128, num_warps=8, num_stages=3, weights_tma=True, rows_tma=True,
                   flatten=True))
# float32 operands (tests; the interpreter) need twice the shared memory per stage.
FP32_FUSED_CONFIG = FusedMoeConfig(
    gate_up=GemmTiles(block_r=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
    down=GemmTiles(block_r=64, block_n=128, block_k=32, num_warps=4, num_stages=2))


# ---------------------------------------------------------------------------- schedule


def row_tile_ends(expert_ends: torch.Tensor, block_r: int) -> torch.Tensor:
    """[E] int32: cumulative row tiles, expert e owning ceil(n_e / block_r) of them.
    Plain torch, no sync: the kernels read the total off the last entry."""
    counts = torch.diff(expert_ends, prepend=expert_ends.new_zeros(1))
    return torch.cumsum(torch.div(counts + block_r - 1, block_r, rounding_mode="floor"), 0, dtype=torch.int32)


def _grid(tiles: GemmTiles, num_slots: int, num_experts: int, col_tiles: int, device: torch.device) -> tuple[int]:
    # At most ceil(n_e / R) <= n_e / R + 1 tiles per expert: cdiv(slots, R) + E in all.
    most_items = (triton.cdiv(num_slots, tiles.block_r) + num_experts) * col_tiles
    if not tiles.persistent:
        return (most_items,)
    return (min(most_items, _program_slots(device) * tiles.programs_per_sm),)


_SM_COUNTS: dict[int, int] = {}


def _program_slots(device: torch.device) -> int:
    """SMs on a CUDA device; under the interpreter a few, so that tests walk several items
    per program."""
    if device.type != "cuda":
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


@triton.jit
def _work_item(work, tile_ends_ptr, expert_ends_ptr, num_experts, col_tiles,
               BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Work item -> (expert, column tile, first row, end of the expert's rows). Items are
    expert-major, then column tile, then row tile."""
    experts = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_ends_ptr + experts, mask=experts < num_experts, other=0)
    item_ends = tl.where(experts < num_experts, tile_ends * col_tiles, 2147483647)
    expert = tl.sum((item_ends <= work).to(tl.int32))
    tile_start = tl.load(tile_ends_ptr + expert - 1, mask=expert > 0, other=0)
    tiles = tl.load(tile_ends_ptr + expert) - tile_start
    local = work - tile_start * col_tiles
    row_start = tl.load(expert_ends_ptr + expert - 1, mask=expert > 0, other=0) + (local % tiles) * BLOCK_R
    return expert, local // tiles, row_start, tl.load(expert_ends_ptr + expert)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _gate_up_act_kernel(
    x_ptr, x_scale_ptr, token_ptr, w_ptr, w_scale_ptr, act_ptr, act_scale_ptr, amax_ptr, expert_ends_ptr, tile_ends_ptr,
    x_desc, w_desc, hidden, inter, num_experts,
    stride_x_row, stride_xs_row, stride_w_micro, stride_w_expert, stride_w_row,
    stride_ws_micro, stride_ws_expert, stride_ws_row, stride_ws_col,
    stride_act_micro, stride_act_row, stride_as_micro, stride_as_row, stride_amax_row,
    NUM_MICROS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROWS_TMA: tl.constexpr, WEIGHTS_TMA: tl.constexpr,
    FP8: tl.constexpr, CHANNEL_SCALES: tl.constexpr, OUT_FP8: tl.constexpr, OUT_AMAX: tl.constexpr,
    GROUP: tl.constexpr, ROUND_FIRST: tl.constexpr, FLATTEN: tl.constexpr,
):
    """x_desc (ROWS_TMA): the gathered rows [S, H]; w_desc (WEIGHTS_TMA): w_gate_up as
    [M*E*2I, H]. TMA zero-fills past the end and the clamped rows are dropped at the store.
    FP8: x and the weights are e4m3 with scales per row and GROUP columns (x_scale, [T, H/G],
    or [S, H/G] when ROWS_TMA) and per GROUP x GROUP block (w_scale, [M, E, 2I/G, H/G]);
    each K step's product is scaled before it is added. FP8 with CHANNEL_SCALES: one scale
    per x row (x_scale [T] or [S]) and per weight row (w_scale [M, E, 2I]), applied once
    after the K loop. OUT_FP8: act is stored as e4m3 with one scale per row and GROUP
    columns (BLOCK_N == GROUP). OUT_AMAX: act in bf16, plus each tile row's max |act| in
    amax [S, M * column tiles] for the quantization that follows."""
    col_tiles_per_micro = tl.cdiv(inter, BLOCK_N)
    col_tiles = NUM_MICROS * col_tiles_per_micro
    total = tl.load(tile_ends_ptr + num_experts - 1) * col_tiles
    ks = tl.arange(0, BLOCK_K)
    for work in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        expert, col_tile, row_start, row_end = _work_item(
            work, tile_ends_ptr, expert_ends_ptr, num_experts, col_tiles, BLOCK_R, BLOCK_E)
        micro = col_tile // col_tiles_per_micro
        col0 = (col_tile % col_tiles_per_micro) * BLOCK_N
        rows = row_start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        # Rows past the expert's run read token 0, columns past I read row 0: valid
        # memory, so the loads need no mask; the store drops them.
        tokens = tl.load(token_ptr + rows, mask=row_ok, other=0)
        a_ptrs = x_ptr + tl.cast(tokens, tl.int64)[:, None] * stride_x_row + ks[None, :]
        w_expert = w_ptr + tl.cast(micro, tl.int64) * stride_w_micro + tl.cast(expert, tl.int64) * stride_w_expert
        w_rows = tl.where(col_ok, cols, 0)
        b1_ptrs = w_expert + w_rows[None, :] * stride_w_row + ks[:, None]
        b2_ptrs = b1_ptrs + inter * stride_w_row
        w_row = (micro * num_experts + expert) * 2 * inter + col0
        if FP8:
            scale_rows = tl.where(row_ok, rows, row_start) if ROWS_TMA else tokens
            a_scales = x_scale_ptr + tl.cast(scale_rows, tl.int64) * stride_xs_row
            ws_expert = w_scale_ptr + micro * stride_ws_micro + expert * stride_ws_expert
            if CHANNEL_SCALES:
                b1_scales = ws_expert + w_rows * stride_ws_row
                b2_scales = ws_expert + (w_rows + inter) * stride_ws_row
            else:
                b1_scales = ws_expert + (w_rows // GROUP) * stride_ws_row
                b2_scales = ws_expert + ((w_rows + inter) // GROUP) * stride_ws_row
        acc1 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if ROWS_TMA:
                a = x_desc.load([row_start, k0])
            if WEIGHTS_TMA:
                b1 = w_desc.load([w_row, k0]).T
                b2 = w_desc.load([w_row + inter, k0]).T
            if EVEN_K:
                if not ROWS_TMA:
                    a = tl.load(a_ptrs)
                if not WEIGHTS_TMA:
                    b1 = tl.load(b1_ptrs)
                    b2 = tl.load(b2_ptrs)
            else:
                k_ok = (k0 + ks) < hidden
                if not ROWS_TMA:
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                if not WEIGHTS_TMA:
                    b1 = tl.load(b1_ptrs, mask=k_ok[:, None], other=0.0)
                    b2 = tl.load(b2_ptrs, mask=k_ok[:, None], other=0.0)
            if FP8 and not CHANNEL_SCALES:
                k_group = k0 // GROUP
                a_scale = tl.load(a_scales + k_group)[:, None]
                acc1 += tl.dot(a, b1) * (a_scale * tl.load(b1_scales + k_group * stride_ws_col)[None, :])
                acc2 += tl.dot(a, b2) * (a_scale * tl.load(b2_scales + k_group * stride_ws_col)[None, :])
            elif FP8:
                acc1 = tl.dot(a, b1, acc1)
                acc2 = tl.dot(a, b2, acc2)
            else:
                acc1 = tl.dot(a, b1, acc1, input_precision=DOT_PRECISION)
                acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b1_ptrs += BLOCK_K
            b2_ptrs += BLOCK_K
        if CHANNEL_SCALES:
            a_scale = tl.load(a_scales)[:, None]
            acc1 = acc1 * (a_scale * tl.load(b1_scales)[None, :])
            acc2 = acc2 * (a_scale * tl.load(b2_scales)[None, :])
        act = acc1 * acc2 * tl.sigmoid(acc2)  # x1 * silu(x2), on the float32 accumulators
        dst = act_ptr + tl.cast(micro, tl.int64) * stride_act_micro + tl.cast(rows, tl.int64)[:, None] * stride_act_row + cols[None, :]
        if OUT_AMAX:
            tile_amax = tl.max(tl.abs(tl.where(col_ok[None, :], act, 0.0)), axis=1)
            tl.store(amax_ptr + tl.cast(rows, tl.int64) * stride_amax_row + col_tile, tile_amax, mask=row_ok)
        if OUT_FP8:
            act = tl.where(col_ok[None, :], act, 0.0)
            amax = tl.max(tl.abs(act), axis=1)
            out_scale = tl.where(amax > 0, amax / 448.0, 1.0)
            q = to_fp8(tl.clamp(act / out_scale[:, None], -448.0, 448.0), act_ptr.dtype.element_ty, ROUND_FIRST)
            tl.store(dst, q, mask=row_ok[:, None] & col_ok[None, :])
            tl.store(act_scale_ptr + micro * stride_as_micro + tl.cast(rows, tl.int64) * stride_as_row + col0 // GROUP,
                     out_scale, mask=row_ok)
        else:
            tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_sum_kernel(
    act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, y_ptr, expert_ends_ptr, tile_ends_ptr, act_desc, w_desc,
    hidden, inter, num_experts, num_slots,
    stride_act_micro, stride_act_row, stride_as_micro, stride_as_row,
    stride_w_micro, stride_w_expert, stride_w_row, stride_ws_micro, stride_ws_expert, stride_ws_row, stride_ws_col,
    stride_y_row,
    NUM_MICROS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROWS_TMA: tl.constexpr, WEIGHTS_TMA: tl.constexpr, FP8: tl.constexpr, CHANNEL_SCALES: tl.constexpr,
    GROUP: tl.constexpr, FLATTEN: tl.constexpr,
):
    """act_desc (ROWS_TMA): act as [M*S, I]; w_desc (WEIGHTS_TMA): w_down as [M*E*H, I].
    FP8: act and the weights are e4m3, act_scale [M, S, I/G], w_scale [M, E, H/G, I/G].
    FP8 with CHANNEL_SCALES: act_scale [S] (one per slot over all micros) and w_scale [E, H]
    (one per output channel over all micros), applied once after the K loop."""
    col_tiles = tl.cdiv(hidden, BLOCK_N)
    k_tiles = tl.cdiv(inter, BLOCK_K)
    total = tl.load(tile_ends_ptr + num_experts - 1) * col_tiles
    ks = tl.arange(0, BLOCK_K)
    for work in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        expert, col_tile, row_start, row_end = _work_item(
            work, tile_ends_ptr, expert_ends_ptr, num_experts, col_tiles, BLOCK_R, BLOCK_E)
        rows = row_start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        safe_rows = tl.cast(tl.where(row_ok, rows, row_start), tl.int64)
        safe_cols = tl.where(col_ok, cols, 0)
        a_rows = act_ptr + safe_rows[:, None] * stride_act_row
        b_rows = w_ptr + tl.cast(expert, tl.int64) * stride_w_expert + safe_cols[None, :] * stride_w_row
        if FP8 and not CHANNEL_SCALES:
            a_scale_rows = act_scale_ptr + safe_rows * stride_as_row
            b_scale_cols = w_scale_ptr + expert * stride_ws_expert + (safe_cols // GROUP) * stride_ws_row
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        # One K loop over (micro, K block): the micro sum happens in the accumulator.
        for step in range(0, NUM_MICROS * k_tiles):
            micro = step // k_tiles
            k0 = (step % k_tiles) * BLOCK_K
            kk = k0 + ks
            if ROWS_TMA:
                a = act_desc.load([micro * num_slots + row_start, k0])
            elif EVEN_K:
                a = tl.load(a_rows + tl.cast(micro, tl.int64) * stride_act_micro + kk[None, :])
            else:
                a = tl.load(a_rows + tl.cast(micro, tl.int64) * stride_act_micro + kk[None, :],
                            mask=kk[None, :] < inter, other=0.0)
            if WEIGHTS_TMA:
                b = w_desc.load([(micro * num_experts + expert) * hidden + col_tile * BLOCK_N, k0]).T
            elif EVEN_K:
                b = tl.load(b_rows + tl.cast(micro, tl.int64) * stride_w_micro + kk[:, None])
            else:
                b = tl.load(b_rows + tl.cast(micro, tl.int64) * stride_w_micro + kk[:, None],
                            mask=kk[:, None] < inter, other=0.0)
            if FP8 and not CHANNEL_SCALES:
                k_group = k0 // GROUP
                a_scale = tl.load(a_scale_rows + micro * stride_as_micro + k_group)
                b_scale = tl.load(b_scale_cols + micro * stride_ws_micro + k_group * stride_ws_col)
                acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
            elif FP8:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if CHANNEL_SCALES:
            a_scale = tl.load(act_scale_ptr + safe_rows * stride_as_row)
            b_scale = tl.load(w_scale_ptr + expert * stride_ws_expert + safe_cols * stride_ws_row)
            acc = acc * (a_scale[:, None] * b_scale[None, :])
        dst = y_ptr + tl.cast(rows, tl.int64)[:, None] * stride_y_row + cols[None, :]
        tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# --------------------------------------------------------------------------- launchers


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 operands get IEEE products (Triton's default for them is TF32, ~1e-3).
    return "ieee" if dtype == torch.float32 else "tf32"


def _unit_stride_last(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"fused MoE GEMMs need unit stride along the last dim, got strides {t.stride()}")


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a contiguous tensor with 16-byte rows and a 16-byte aligned start; where a
    tensor has neither (odd widths), the kernels fall back to pointer loads."""
    return t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _descriptor(t2d: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), list(block))


def _check_fp8(tiles: GemmTiles, operands: dict[str, torch.Tensor | None]) -> bool:
    """Whether this call runs on e4m3 operands: all named scales given, or none."""
    given = [name for name, scale in operands.items() if scale is not None]
    if not given:
        return False
    if len(given) != len(operands):
        missing = sorted(set(operands) - set(given))
        raise ValueError(f"FP8 MoE GEMM: {', '.join(given)} given but {', '.join(missing)} missing")
    return True


def _check_block_k(tiles: GemmTiles) -> None:
    if GROUP % tiles.block_k:
        raise ValueError(f"FP8 MoE GEMM with block scales: block_k {tiles.block_k} must divide the scale group {GROUP}")


def gate_up_act(x: torch.Tensor, token_of_slot: torch.Tensor, w_gate_up: torch.Tensor, expert_ends: torch.Tensor,
                tiles: GemmTiles, *, x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                quantize_out: bool = False, row_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """act [M, S, I]: ``act[m, s] = x1 * silu(x2)``, ``[x1; x2] = w_gate_up[m, e(s)] @ x[token_of_slot[s]]``.
    x [T, H]; token_of_slot [S] int32; w_gate_up [M, E, 2I, H]; expert_ends [E] int32.

    bf16/fp16/fp32: act in x's dtype. FP8 (`kernels.fp8_quant`): x and w_gate_up in e4m3,
    with block scales (x_scale [T, H/128], w_scale [M, E, 2I/128, H/128]) or channel scales
    (x_scale [T], w_scale [M, E, 2I]); act in bf16, or with ``quantize_out`` (block scales)
    in e4m3 with per-row, per-128-column scales. ``row_amax``: act in bf16 plus each tile
    row's max |act|, [S, M * ceil(I / block_n)], for `quantize_rows_by_amax`.
    Returns (act, its scale or amax partials or None).
    """
    micros, experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    slots = token_of_slot.shape[0]
    _unit_stride_last(x, w_gate_up)
    fp8 = _check_fp8(tiles, {"x_scale": x_scale, "w_scale": w_scale})
    channel = fp8 and w_scale.dim() == 3
    if fp8 and not channel:
        _check_block_k(tiles)
    if quantize_out and (channel or tiles.block_n != GROUP):
        raise ValueError(f"an FP8 activation needs block scales and block_n == {GROUP} (one scale per tile row), "
                         f"got {'channel scales' if channel else f'block_n {tiles.block_n}'}")
    act_dtype = FP8_DTYPE if quantize_out else (torch.bfloat16 if fp8 else x.dtype)
    act = torch.empty((micros, slots, inter), dtype=act_dtype, device=x.device)
    act_scale = (torch.empty((micros, slots, triton.cdiv(inter, GROUP)), dtype=torch.float32, device=x.device)
                 if quantize_out else None)
    col_tiles = micros * triton.cdiv(inter, tiles.block_n)
    amax = torch.empty((slots, col_tiles), dtype=torch.float32, device=x.device) if row_amax else None
    tile_ends = row_tile_ends(expert_ends, tiles.block_r)
    x_desc = w_desc = None
    rows_tma = tiles.rows_tma and _tma_ok(x)
    if rows_tma:
        x_desc = _descriptor(x.index_select(0, token_of_slot), (tiles.block_r, tiles.block_k))
        if fp8:
            x_scale = x_scale.index_select(0, token_of_slot)
    weights_tma = tiles.weights_tma and _tma_ok(w_gate_up)
    if weights_tma:
        w_desc = _descriptor(w_gate_up.view(-1, hidden), (tiles.block_n, tiles.block_k))
    ws_strides = (*w_scale.stride(), 0)[:4] if fp8 else (0, 0, 0, 0)
    _gate_up_act_kernel[_grid(tiles, slots, experts, col_tiles, x.device)](
        x, x_scale, token_of_slot, w_gate_up, w_scale, act, act_scale, amax, expert_ends, tile_ends, x_desc, w_desc,
        hidden, inter, experts,
        x.stride(0), x_scale.stride(0) if fp8 else 0, w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2),
        *ws_strides, act.stride(0), act.stride(1),
        act_scale.stride(0) if quantize_out else 0, act_scale.stride(1) if quantize_out else 0,
        amax.stride(0) if row_amax else 0,
        NUM_MICROS=micros, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        BLOCK_E=triton.next_power_of_2(experts), EVEN_K=hidden % tiles.block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype), ROWS_TMA=rows_tma, WEIGHTS_TMA=weights_tma,
        FP8=fp8, CHANNEL_SCALES=channel, OUT_FP8=quantize_out, OUT_AMAX=row_amax, GROUP=GROUP,
        ROUND_FIRST=INTERPRETED, FLATTEN=tiles.flatten, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return act, act_scale if quantize_out else amax


def down_sum(act: torch.Tensor, w_down: torch.Tensor, expert_ends: torch.Tensor, tiles: GemmTiles, *,
             act_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [S, H]: ``y[s] = sum_m w_down[m, e(s)] @ act[m, s]``, float32 inside.
    act [M, S, I]; w_down [M, E, H, I]; expert_ends [E] int32. FP8: act and w_down in e4m3,
    with block scales (act_scale [M, S, I/128], w_scale [M, E, H/128, I/128]) or channel
    scales (act_scale [S], w_scale [E, H]: one per slot and per output channel, each over
    all micros). y in out_dtype (default: act's dtype, bf16 for FP8)."""
    micros, experts, hidden, inter = w_down.shape
    slots = act.shape[1]
    _unit_stride_last(act, w_down)
    fp8 = _check_fp8(tiles, {"act_scale": act_scale, "w_scale": w_scale})
    channel = fp8 and w_scale.dim() == 2
    if fp8 and not channel:
        _check_block_k(tiles)
    if channel:  # no micro dim in the scales: strides (micro, row) for act, (micro, expert, row, col) for w
        as_strides, ws_strides = (0, act_scale.stride(0)), (0, *w_scale.stride(), 0)
    else:
        as_strides = act_scale.stride()[:2] if fp8 else (0, 0)
        ws_strides = w_scale.stride() if fp8 else (0, 0, 0, 0)
    y = torch.empty((slots, hidden), dtype=out_dtype or (torch.bfloat16 if fp8 else act.dtype), device=act.device)
    tile_ends = row_tile_ends(expert_ends, tiles.block_r)
    col_tiles = triton.cdiv(hidden, tiles.block_n)
    rows_tma = tiles.rows_tma and _tma_ok(act)
    weights_tma = tiles.weights_tma and _tma_ok(w_down)
    act_desc = _descriptor(act.view(-1, inter), (tiles.block_r, tiles.block_k)) if rows_tma else None
    w_desc = _descriptor(w_down.view(-1, inter), (tiles.block_n, tiles.block_k)) if weights_tma else None
    _down_sum_kernel[_grid(tiles, slots, experts, col_tiles, act.device)](
        act, act_scale, w_down, w_scale, y, expert_ends, tile_ends, act_desc, w_desc, hidden, inter, experts, slots,
        act.stride(0), act.stride(1), *as_strides, w_down.stride(0), w_down.stride(1), w_down.stride(2), *ws_strides,
        y.stride(0),
        NUM_MICROS=micros, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        BLOCK_E=triton.next_power_of_2(experts), EVEN_K=inter % tiles.block_k == 0,
        DOT_PRECISION=_dot_precision(act.dtype), ROWS_TMA=rows_tma, WEIGHTS_TMA=weights_tma,
        FP8=fp8, CHANNEL_SCALES=channel, GROUP=GROUP, FLATTEN=tiles.flatten, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return y


# Under the interpreter (CPU tests) the cost is the elements a tile touches, padding
# included: small tiles; gate/up keeps block_n 128 where it writes e4m3 (one scale group).
INTERPRETER_CONFIG = FusedMoeConfig(gate_up=GemmTiles(16, 32, 32, 4, 1), down=GemmTiles(16, 32, 32, 4, 1))
INTERPRETER_FP8_BLOCKS_CONFIG = FusedMoeConfig(gate_up=GemmTiles(16, 128, 32, 4, 1), down=GemmTiles(16, 32, 32, 4, 1))


def fused_config_for(dtype: torch.dtype, device: torch.device, fp8_recipe: str | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> FusedMoeConfig:
    """The tiles for operands of `dtype` (e4m3: with its scale recipe) on `device`, the down
    GEMM writing `out_dtype`."""
    if device.type != "cuda":
        return INTERPRETER_FP8_BLOCKS_CONFIG if fp8_recipe == "blocks" else INTERPRETER_CONFIG
    if fp8_recipe is not None:
        config = FP8_CHANNELS_CONFIG if fp8_recipe == "channels" else FP8_FUSED_CONFIG
        if out_dtype.itemsize > 2:  # a float32 output tile beside the flattened pipeline's buffers
            config = replace(config, down=replace(config.down, flatten=False))  # overflows shared memory (H200)
        return config
    return FP32_FUSED_CONFIG if dtype == torch.float32 else DEFAULT_FUSED_CONFIG


# -------------------------------------------------------------------------- references


def gate_up_act_reference(x, token_of_slot, w_gate_up, expert_ends):
    """`gate_up_act` in torch, float32 math, rounded once to x's dtype."""
    micros, experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    act = torch.zeros((micros, token_of_slot.shape[0], inter), dtype=torch.float32, device=x.device)
    bounds = [0] + expert_ends.tolist()
    for e in range(experts):
        start, end = bounds[e], bounds[e + 1]
        if start == end:
            continue
        x_e = x[token_of_slot[start:end].long()].float()
        for m in range(micros):
            u = x_e @ w_gate_up[m, e].float().T
            act[m, start:end] = u[:, :inter] * F.silu(u[:, inter:])
    return act.to(x.dtype)


def down_sum_reference(act, w_down, expert_ends):
    """`down_sum` in torch, float32 math, rounded once to act's dtype."""
    micros, experts, hidden, _ = w_down.shape
    y = torch.zeros((act.shape[1], hidden), dtype=torch.float32, device=act.device)
    bounds = [0] + expert_ends.tolist()
    for e in range(experts):
        start, end = bounds[e], bounds[e + 1]
        for m in range(micros):
            if start < end:
                y[start:end] += act[m, start:end].float() @ w_down[m, e].float().T
    return y.to(act.dtype)


def gate_up_act_fp8_reference(x_q, x_scale, token_of_slot, w_q, w_scale, expert_ends, quantize_out: bool):
    """`gate_up_act` on e4m3 operands in torch: dequantize, float32 math, then bf16 or (with
    quantize_out) e4m3 per row and 128 columns."""
    act = gate_up_act_reference(dequantize(x_q, x_scale, 1), token_of_slot, dequantize(w_q, w_scale, GROUP),
                                expert_ends)
    if not quantize_out:
        return act.to(torch.bfloat16), None
    q, scale = quantize_row_groups_reference(act.flatten(0, 1))
    return q.view(act.shape), scale.view(*act.shape[:2], -1)


def down_sum_fp8_reference(act_q, act_scale, w_q, w_scale, expert_ends, out_dtype=torch.bfloat16):
    """`down_sum` on e4m3 operands in torch: dequantize, float32 math."""
    return down_sum_reference(dequantize(act_q, act_scale, 1), dequantize(w_q, w_scale, GROUP), expert_ends).to(out_dtype)


def moe_experts_fp8_channels_reference(x_q, x_scale, token_of_slot, w_gate_up, w_gate_up_scale, w_down,
                                       w_down_scale, expert_ends, out_dtype=torch.bfloat16):
    """Both GEMMs on e4m3 operands with channel scales, in torch: x per token ([T]), gate/up
    weights per row ([M, E, 2I]), the activation per slot over all micros (from its float32
    row maxima, stored as bf16 first, as the kernels do), down weights per output channel ([E, H])."""
    x = x_q.float() * x_scale[:, None]
    act = gate_up_act_reference(x, token_of_slot, w_gate_up.float() * w_gate_up_scale[..., None], expert_ends)
    amax = act.abs().amax(dim=(0, 2))[:, None]
    act_q, act_scale = quantize_rows_by_amax_reference(act.to(torch.bfloat16), amax)
    w = w_down.float() * w_down_scale[None, :, :, None]
    return down_sum_reference(act_q.float() * act_scale[None, :, None], w, expert_ends).to(out_dtype)
