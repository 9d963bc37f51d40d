"""FP8 (e4m3) quantization for the MoE: two scale layouts, three weight recipes.

- Blocks (the DeepSeek-V3 recipe, also what vLLM and SGLang serve): weights in 128 x 128
  blocks, activations per token and group of 128 columns. The scales change along K, so a
  GEMM scales each K step's product before adding it.
- Channels: weights per output channel, activations per row. The scales are constant
  along K, so a GEMM accumulates plain products and scales once in its epilogue, which
  keeps the tensor cores' accumulate chain unbroken (see kernels/moe_grouped_gemm.py).
- Tensor: one weight scale per expert matrix, the common form of FP8 checkpoints, held in
  the channel layout (each row holds its matrix's scale): activations and kernels as for
  channels, at the same speed.

A quantized tensor is a pair ``(q, scale)`` with ``q`` in float8_e4m3fn and ``scale``
float32, and ``value ~= q * scale`` block by block:
- weights ``[..., N, K]`` -> scales ``[..., ceil(N/128), ceil(K/128)]``, one per block
  (`quantize_weight_blocks`, run once at load, plain torch); or one per matrix
  (`quantize_weight_per_matrix`: scales ``[..., 1, 1]`` expanded to the same block grid
  with stride 0, so the kernels read both forms the same way);
- activations ``[T, K]`` -> scales ``[T, ceil(K/128)]`` (`quantize_row_groups`, a Triton
  kernel on the hot path; `quantize_row_groups_reference` beside it).

Each scale is amax / 448 (e4m3's largest finite value), so every block uses the full
range; an all-zero block gets scale 1 (its q is 0 either way).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # block edge for weights, group width for activations


def fp8_support_problem(device: torch.device) -> str | None:
    """Why FP8 (experts, linears, attention) cannot run on this device, in one line, or None.
    FP8 tensor-core matmuls need CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper); the CPU runs the torch
    emulation (or the kernels under the Triton interpreter)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (f"FP8 needs FP8 tensor cores (CUDA compute capability 8.9 or 9.0+); "
                    f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    elif device.type != "cpu":
        return f"FP8 runs on CUDA (compute capability 8.9+) or the CPU, not on {device.type}"
    return None


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, or 1 where amax is 0."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] float32): one scale per row, amax / 448
    (1 for an all-zero row). Float32 math. The dense FP8 linear's activations
    (kernels/fp8_linear.py, kernels/decode_gemv.py)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous(), scale   # _scaled_mm: row-major


def quantize_weight_blocks(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] fp8, scale [..., ceil(N/block), ceil(K/block)] float32).
    Float32 math; edge blocks cover what is left."""
    *lead, n, k = w.shape
    nb, kb = triton.cdiv(n, block), triton.cdiv(k, block)
    padded = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # [..., nb, B, kb, B]
    scale = scale_from_amax(blocks.abs().amax(dim=(-3, -1)))                     # [..., nb, kb]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def quantize_weight_per_matrix(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per [N, K] matrix, returned as a stride-0 view with the block grid's shape
    [..., ceil(N/block), ceil(K/block)] (its storage is [..., 1, 1])."""
    *lead, n, k = w.shape
    scale = scale_from_amax(w.float().abs().amax(dim=(-2, -1), keepdim=True))
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.expand(*lead, triton.cdiv(n, block), triton.cdiv(k, block))


def quantize_weight_channels(w: torch.Tensor, reduce_dims: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales: amax over ``reduce_dims`` (the K dim, -1, always among them).
    w_gate_up [M, E, 2I, H] -> scale [M, E, 2I]; w_down [M, E, H, I] with reduce_dims
    (0, -1) -> scale [E, H], one per output channel over all of its micros."""
    if -1 not in reduce_dims and w.dim() - 1 not in reduce_dims:
        raise ValueError(f"per-channel scales reduce over the last (K) dim; got reduce_dims {reduce_dims}")
    amax = w.float().abs().amax(dim=reduce_dims, keepdim=True)
    scale = scale_from_amax(amax)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.squeeze(reduce_dims).contiguous()


FP8_RECIPES = ("channels", "blocks", "tensor")


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, recipe: str = "channels"):
    """Micro-packed experts (w_gate_up [M, E, 2I, H], w_down [M, E, H, I]) in the model's
    FP8 layout -> (gate_up q, its scales, down q, its scales). "channels": gate/up per row
    [M, E, 2I], down per output channel over all micros [E, H]; "blocks": 128 x 128 blocks
    of each micro's matrices; "tensor": one scale per expert matrix (all its micros), laid
    out as channel scales (every row holds it), so it runs the channel kernels.
    (The loader makes the same from a checkpoint, shard by shard.)"""
    if recipe == "blocks":
        return (*quantize_weight_blocks(w_gate_up), *quantize_weight_blocks(w_down))
    if recipe == "tensor":
        return (*quantize_weight_per_expert(w_gate_up, scale_shape=w_gate_up.shape[:3]),
                *quantize_weight_per_expert(w_down, scale_shape=(w_down.shape[1], w_down.shape[2])))
    if recipe != "channels":
        raise ValueError(f"FP8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    return (*quantize_weight_channels(w_gate_up), *quantize_weight_channels(w_down, reduce_dims=(0, -1)))


def expert_amax(w: torch.Tensor) -> torch.Tensor:
    """w [M, E, rows, cols] -> [E] float32: max |w| per expert over its micros, rows and
    columns, with temporaries of one micro at a time (a full-width |w| would double it)."""
    return torch.stack([w[m].abs().amax(dim=(1, 2)) for m in range(w.shape[0])]).amax(0).float()


def quantize_weight_per_expert(w: torch.Tensor, scale_shape: tuple[int, ...],
                               amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, E, rows, cols] -> (q, scale): one scale per expert (amax over its micros, rows
    and columns, or the given [E] amax), broadcast to the channel-scale shape `scale_shape`
    ([M, E, rows] or [E, rows]). Float32 temporaries of one micro at a time."""
    if amax is None:
        amax = expert_amax(w)
    scale = scale_from_amax(amax)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    for m in range(w.shape[0]):
        q[m] = (w[m].float() / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    per_expert = scale.view(*([1] * (len(scale_shape) - 2)), -1, 1)
    return q, per_expert.expand(scale_shape).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int = GROUP) -> torch.Tensor:
    """float32 ``q * scale``, each scale spread over its block_rows x block_cols block
    (weights: 128 x 128; activation rows: 1 x 128)."""
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(block_rows, dim=-2)[..., :n, :].repeat_interleave(block_cols, dim=-1)[..., :k]
    return q.float() * full


def quantize_row_groups_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] fp8, scale [T, ceil(K/group)] float32), float32 math."""
    t, k = x.shape
    groups = triton.cdiv(k, group)
    padded = torch.zeros(t, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = scale_from_amax(padded.view(t, groups, group).abs().amax(-1))
    q = (padded.view(t, groups, group) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.flatten(1)[:, :k].to(FP8_DTYPE), scale


@triton.jit
def to_fp8(v, dtype: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Cast float32 values in [-448, 448] to e4m3. ROUND_FIRST: round to the e4m3 grid
    (nearest, ties to even) in float32 first, so that the cast itself is exact. Triton's
    interpreter needs it: its cast rounds ties away from zero and drops the carry into the
    exponent (126.7 -> 64, not 128; seen with triton 3.9). The GPU cast is right as it is."""
    if ROUND_FIRST:
        exponent = tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625)))  # 2^-6: subnormals share one spacing
        spacing = tl.exp2(exponent - 3.0)                                # 3 mantissa bits
        v = ((v / spacing + 12582912.0) - 12582912.0) * spacing          # 1.5 * 2^23: float32 round-to-even
    return v.to(dtype)


@triton.jit
def _quantize_row_groups_kernel(x_ptr, q_ptr, scale_ptr, k_dim, num_groups, stride_x, stride_q, stride_s,
                                GROUP_K: tl.constexpr, GROUPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program per (row, GROUPS groups): a [GROUPS, GROUP_K] tile, amax per group."""
    row = tl.cast(tl.program_id(0), tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    ok = cols < k_dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = to_fp8(tl.clamp(x / scale[:, None], -448.0, 448.0), q_ptr.dtype.element_ty, ROUND_FIRST)
    tl.store(q_ptr + row * stride_q + cols, q, mask=ok)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


def quantize_row_groups(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16/fp16/fp32, unit stride along K) -> (q fp8, scale [T, ceil(K/group)])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_row_groups needs a [T, K] tensor with unit stride along K, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    t, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    # One group per row (group >= K): the whole row in one tile.
    group_tile = triton.next_power_of_2(k) if groups == 1 else group
    per_program = min(8, triton.next_power_of_2(groups))  # 8 x 128 columns: 2 KiB of bf16 a program
    if t:
        _quantize_row_groups_kernel[(t, triton.cdiv(groups, per_program))](
            x, q, scale, k, groups, x.stride(0), q.stride(0), scale.stride(0),
            GROUP_K=group_tile, GROUPS=per_program, ROUND_FIRST=INTERPRETED)
    return q, scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, k_dim, stride_x, stride_q,
                          ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """ROWS rows a program: their maxima in one pass over K, the scaled cast in a second
    (which reads them again, mostly from L2)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows64 = tl.cast(rows, tl.int64)
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < k_dim)
        v = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < k_dim)
        v = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        q = to_fp8(tl.clamp(v / scale[:, None], -448.0, 448.0), q_ptr.dtype.element_ty, ROUND_FIRST)
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit stride along K) -> (q fp8, scale [T]): one scale per row."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows needs a [T, K] tensor with unit stride along K, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    per_program = 4
    if rows:
        _quantize_rows_kernel[(triton.cdiv(rows, per_program),)](
            x, q, scale, rows, k, x.stride(0), q.stride(0),
            ROWS=per_program, BLOCK_K=min(1024, triton.next_power_of_2(k)), ROUND_FIRST=INTERPRETED)
    return q, scale


@triton.jit
def _quantize_rows_by_amax_kernel(act_ptr, amax_ptr, q_ptr, scale_ptr, num_parts, inter, num_slots,
                                  stride_act_micro, stride_act_row, stride_amax_row, stride_q_micro, stride_q_row,
                                  NUM_MICROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr,
                                  BLOCK_I: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """ROWS slots a program: their scales from the amax partials, then every micro's rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_slots
    rows64 = tl.cast(rows, tl.int64)
    parts = tl.arange(0, BLOCK_P)
    partials = tl.load(amax_ptr + rows64[:, None] * stride_amax_row + parts[None, :],
                       mask=row_ok[:, None] & (parts[None, :] < num_parts), other=0.0)
    amax = tl.max(partials, axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for m in tl.static_range(NUM_MICROS):
        for i0 in range(0, inter, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            ok = row_ok[:, None] & (cols[None, :] < inter)
            v = tl.load(act_ptr + m * stride_act_micro + rows64[:, None] * stride_act_row + cols[None, :],
                        mask=ok, other=0.0)
            q = to_fp8(tl.clamp(v.to(tl.float32) / scale[:, None], -448.0, 448.0), q_ptr.dtype.element_ty,
                       ROUND_FIRST)
            tl.store(q_ptr + m * stride_q_micro + rows64[:, None] * stride_q_row + cols[None, :], q, mask=ok)


def quantize_rows_by_amax(act: torch.Tensor, amax_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act [M, S, I] (bf16) and amax_parts [S, P] (per-tile |act| maxima, from the GEMM that
    wrote act) -> (q [M, S, I] fp8, scale [S]): one scale per slot over all micros."""
    micros, slots, inter = act.shape
    q = torch.empty(act.shape, dtype=FP8_DTYPE, device=act.device)
    scale = torch.empty((slots,), dtype=torch.float32, device=act.device)
    per_program = 8  # 8 slots x 2 micros x 768 per program at the denoise shapes, not 1
    if slots:
        _quantize_rows_by_amax_kernel[(triton.cdiv(slots, per_program),)](
            act, amax_parts, q, scale, amax_parts.shape[1], inter, slots,
            act.stride(0), act.stride(1), amax_parts.stride(0), q.stride(0), q.stride(1),
            NUM_MICROS=micros, ROWS=per_program, BLOCK_P=triton.next_power_of_2(amax_parts.shape[1]),
            BLOCK_I=min(512, triton.next_power_of_2(inter)), ROUND_FIRST=INTERPRETED)
    return q, scale


def quantize_rows_by_amax_reference(act: torch.Tensor, amax_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_from_amax(amax_parts.float().amax(dim=1))
    q = (act.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# The decorator picked the interpreter or the compiler when this module was imported.
INTERPRETED = not isinstance(_quantize_row_groups_kernel, JITFunction)
