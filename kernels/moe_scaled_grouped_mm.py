"""The routed experts' two FP8 grouped GEMMs through torch._scaled_grouped_mm (CUTLASS on sm90).

The library kernel beside our fused Triton one (`kernels.moe_grouped_gemm` with channel
scales), on the same inputs: x [T, H] quantized per token, the T*K slots sorted by expert
(`kernels.moe_routing`: ``expert_ends`` is exactly the ``offs`` it takes), e4m3 experts
``w_gate_up [M, E, 2I, H]`` with one scale per row ``[M, E, 2I]`` and ``w_down [M, E, H, I]``
with one scale per output channel over all micros ``[E, H]`` (the "channels" and "tensor"
recipes of `kernels.fp8_quant`; "blocks" scales change along K, which a rowwise kernel cannot take).

What torch._scaled_grouped_mm takes (2-D x 3-D, rowwise scales) and how the resident tensors
are handed to it without a copy of any weight:
- mat_a [rows, K] e4m3, row-major, with one float32 scale per row (1-D, contiguous);
- mat_b [G, K, N] e4m3, column-major per group, i.e. the transpose of a contiguous
  [G, N, K]: our weights are stored [.., N, K], so ``w[m].transpose(-2, -1)`` is that view
  (strides (N*K, 1, K)), and ``w_down.view(M*E, H, I)`` merges the micros into the groups;
- scale_b [G, N] float32 with unit stride along N (the kernel steps its rows by stride(0));
- offs: int32 group ends; bf16 out (the only output dtype), rows padded to 16 bytes.
torch checks: compute capability 9.0 (10.0 passes its check, but its rowwise grouped kernel
is sm90 CUTLASS and torch's own tests expect it to fail there), K and N multiples of 16, every
data pointer 16-byte aligned, fewer than 1024 groups. Groups may hold any number of rows,
none included (its tests run an empty group).

What our data lacks, done here and counted in the benchmark's timings:
- it cannot gather rows: the e4m3 rows of x and their scales are gathered into slot order
  (S x H bytes, one pass; the Triton gate/up GEMM gathers the same way when it reads rows
  through TMA);
- it has no epilogue of ours: gate/up writes u [S, 2I] in bf16 per micro, and one kernel
  here applies ``x1 * silu(x2)`` and quantizes each (micro, slot) row with its own scale
  (the down GEMM runs over M*E groups of M*S rows, so each row can have one; the Triton
  down GEMM sums the micros in its K loop and takes one scale per slot over all of them);
- its scale_b holds one row per group, and the down scales are shared by the micros: with
  M > 1 they are repeated to [M*E, H] per call (M*E*H*4 bytes: 2 MiB at the denoise shapes;
  `library_gemm` does it);
- its down output is one bf16 partial per (micro, slot): the finalize sums the micros in
  float32 (`kernels.moe_multi_micro.moe_finalize`).

The two GEMM calls go through one contract (`library_gemm`): the same pipeline runs them in
the Gluon kernel of `kernels.moe_grouped_gemm_gluon` (its ``gemm`` argument; MoE impl "gluon").

``fast_accum`` (default on): the tensor cores' FP8 accumulator is not promoted to float32
every few K steps, as in Triton's FP8 dots on Hopper (its default); off: CUTLASS promotes
(slower, more exact).

References: `gate_up_act_quant_reference`, `down_partials_reference` and
`act_quantize_rows_reference` (torch, float32 math, the same roundings: u and the partials
to bf16, the activation to e4m3).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, INTERPRETED, scale_from_amax, to_fp8

# torch's rowwise FP8 grouped GEMM: TMA rows of 16 bytes, and its argument buffers sized for
# fewer than 1024 groups (ScaledGroupMM.cu).
ALIGN_ELEMENTS = 16
MAX_GROUPS = 1023


def scaled_grouped_mm_problem(device: torch.device) -> str | None:
    """Why torch._scaled_grouped_mm cannot run the experts on `device`, in one line, or None."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm (it came with torch 2.8)"
    if device.type != "cuda":
        return f"torch._scaled_grouped_mm runs on CUDA (compute capability 9.0), not on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (f"torch._scaled_grouped_mm's rowwise FP8 kernel is sm90 CUTLASS (compute capability 9.0: H100, "
                f"H200); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


def shape_problem(micros: int, experts: int, hidden: int, inter: int) -> str | None:
    """Why these expert shapes do not fit the library kernel, in one line, or None."""
    for name, size in (("hidden size H", hidden), ("intermediate size I", inter)):
        if size % ALIGN_ELEMENTS:
            return f"torch._scaled_grouped_mm needs the {name} to be a multiple of {ALIGN_ELEMENTS}, got {size}"
    if micros * experts > MAX_GROUPS:
        return (f"torch._scaled_grouped_mm takes at most {MAX_GROUPS} groups; the down GEMM has micros x experts = "
                f"{micros} x {experts}")
    return None


def _check_operand(name: str, t: torch.Tensor) -> None:
    """What the library checks on the device too, said here in one line naming the tensor."""
    if t.data_ptr() % 16:
        raise ValueError(f"torch._scaled_grouped_mm needs {name} 16-byte aligned, got address {t.data_ptr():#x}")
    if t.stride(-1) != 1:
        raise ValueError(f"torch._scaled_grouped_mm needs {name} with unit stride along its last dim, "
                         f"got strides {t.stride()}")


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _act_quantize_rows_kernel(u_ptr, q_ptr, scale_ptr, num_rows, inter, stride_u_row, stride_q_row,
                              ROWS: tl.constexpr, BLOCK_I: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """ROWS rows a program: act = x1 * silu(x2) on u's halves in float32, their maxima in one
    pass over I, the scaled e4m3 cast in a second (which reads u again, mostly from L2)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    u_rows = u_ptr + tl.cast(rows, tl.int64)[:, None] * stride_u_row
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for i0 in range(0, inter, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        ok = row_ok[:, None] & (cols[None, :] < inter)
        x1 = tl.load(u_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(u_rows + inter + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x1 * x2 * tl.sigmoid(x2)), axis=1))
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    q_rows = q_ptr + tl.cast(rows, tl.int64)[:, None] * stride_q_row
    for i0 in range(0, inter, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        ok = row_ok[:, None] & (cols[None, :] < inter)
        x1 = tl.load(u_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(u_rows + inter + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        act = x1 * x2 * tl.sigmoid(x2)
        q = to_fp8(tl.clamp(act / scale[:, None], -448.0, 448.0), q_ptr.dtype.element_ty, ROUND_FIRST)
        tl.store(q_rows + cols[None, :], q, mask=ok)


def act_quantize_rows(u: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """u [S, 2I] (``[x1; x2]`` per row, unit stride along 2I) -> q [S, I] e4m3 (unit stride
    along I) and scale [S] float32: ``x1 * silu(x2)`` quantized with one scale per row, written
    into q and scale (views of the [M, S, I] activation and its [M*S] scales)."""
    rows, inter = q.shape
    per_program = 4
    if rows:
        _act_quantize_rows_kernel[(triton.cdiv(rows, per_program),)](
            u, q, scale, rows, inter, u.stride(0), q.stride(0),
            ROWS=per_program, BLOCK_I=min(1024, triton.next_power_of_2(inter)), ROUND_FIRST=INTERPRETED)


# --------------------------------------------------------------------------- the GEMMs


def library_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 group_ends: torch.Tensor, fast_accum: bool = True) -> torch.Tensor:
    """out [rows, N] bf16 = (a @ b[g].T) * scale_a[row] * scale_b[g % P] per group, in torch._scaled_grouped_mm.
    The GEMM contract the pipeline calls (`kernels.moe_grouped_gemm_gluon.grouped_gemm_fp8` has the same):
    a [rows, K] e4m3, b [G, N, K] e4m3 (resident, K contiguous: handed over as its transposed view),
    scale_a [rows], scale_b [P, N] with P dividing G (repeated to [G, N] here: one row per group is what
    the library takes), group_ends [G] int32."""
    groups, periods = b.shape[0], scale_b.shape[0]
    scale_rows = scale_b if periods == groups else scale_b.repeat(groups // periods, 1)
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, scale_rows, offs=group_ends,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def _gemm_or_library(gemm: Callable | None, fast_accum: bool) -> Callable:
    return gemm if gemm is not None else partial(library_gemm, fast_accum=fast_accum)


def gate_up_u(x_sorted_q: torch.Tensor, x_sorted_scale: torch.Tensor, w_gate_up: torch.Tensor,
              w_gate_up_scale: torch.Tensor, expert_ends: torch.Tensor, micro: int,
              fast_accum: bool = True, gemm: Callable | None = None) -> torch.Tensor:
    """u [S, 2I] bf16 of one micro: ``u[s] = (x[s] * x_scale[s]) @ (w_gate_up[micro, e(s)] * its row scales).T``.
    x_sorted_q [S, H] e4m3 in slot order, x_sorted_scale [S]; w_gate_up [M, E, 2I, H] e4m3,
    w_gate_up_scale [M, E, 2I]; expert_ends [E] int32. gemm: the grouped GEMM (`library_gemm`'s
    contract); None: `library_gemm` with fast_accum."""
    return _gemm_or_library(gemm, fast_accum)(x_sorted_q, w_gate_up[micro], x_sorted_scale, w_gate_up_scale[micro],
                                              expert_ends)


def down_partials(act_q: torch.Tensor, act_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                  expert_ends: torch.Tensor, fast_accum: bool = True, gemm: Callable | None = None) -> torch.Tensor:
    """partials [M, S, H] bf16:
    ``partials[m, s] = (act[m, s] * act_scale[m*S + s]) @ (w_down[m, e(s)] * w_down_scale[e(s)]).T``.
    act_q [M, S, I] e4m3 (contiguous), act_scale [M*S]; w_down [M, E, H, I] e4m3 whose (M, E)
    dims merge as a view, w_down_scale [E, H] (group m*E + e takes row e). One GEMM over M*E groups:
    group (m, e) is act[m]'s run of expert e, so its ends are expert_ends shifted by m*S."""
    micros, experts, hidden, inter = w_down.shape
    slots = act_q.shape[1]
    if w_down.stride(0) != experts * w_down.stride(1):
        raise ValueError(f"the grouped down GEMM needs w_down's micro and expert dims to merge without a "
                         f"copy, got strides {w_down.stride()}")
    shift = torch.arange(micros, device=act_q.device, dtype=torch.int32).unsqueeze(1) * slots
    ends = (expert_ends.unsqueeze(0) + shift).reshape(-1)
    out = _gemm_or_library(gemm, fast_accum)(act_q.view(micros * slots, inter),
                                             w_down.view(micros * experts, hidden, inter), act_scale, w_down_scale,
                                             ends)
    return out.view(micros, slots, hidden)


def gate_up_act_quant(x_sorted_q: torch.Tensor, x_sorted_scale: torch.Tensor, w_gate_up: torch.Tensor,
                      w_gate_up_scale: torch.Tensor, expert_ends: torch.Tensor, fast_accum: bool = True,
                      gemm: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_q [M, S, I] e4m3, act_scale [M*S] float32): each micro's u (`gate_up_u`), then
    ``x1 * silu(x2)`` quantized per (micro, slot) row (`act_quantize_rows`)."""
    micros, _, two_inter, _ = w_gate_up.shape
    slots = x_sorted_q.shape[0]
    act_q = torch.empty((micros, slots, two_inter // 2), dtype=FP8_DTYPE, device=x_sorted_q.device)
    act_scale = torch.empty((micros * slots,), dtype=torch.float32, device=x_sorted_q.device)
    for m in range(micros):
        u = gate_up_u(x_sorted_q, x_sorted_scale, w_gate_up, w_gate_up_scale, expert_ends, m, fast_accum, gemm)
        act_quantize_rows(u, act_q[m], act_scale[m * slots:(m + 1) * slots])
    return act_q, act_scale


def experts_partials(x_q: torch.Tensor, x_scale: torch.Tensor, token_of_slot: torch.Tensor, w_gate_up: torch.Tensor,
                     w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                     expert_ends: torch.Tensor, fast_accum: bool = True, gemm: Callable | None = None) -> torch.Tensor:
    """Both GEMMs: partials [M, S, H] bf16 (one per micro and slot, summed by the finalize).
    x_q [T, H] e4m3 and x_scale [T] (one per token, `kernels.fp8_quant.quantize_rows`);
    token_of_slot [S]; the experts and their channel scales as in the module docstring.
    gemm: the grouped GEMM both stages call (`library_gemm`'s contract; None: `library_gemm`)."""
    for name, t in (("x_q", x_q), ("w_gate_up", w_gate_up), ("w_down", w_down), ("w_gate_up_scale", w_gate_up_scale),
                    ("w_down_scale", w_down_scale)):
        _check_operand(name, t)
    x_sorted_q = x_q.index_select(0, token_of_slot)
    x_sorted_scale = x_scale.index_select(0, token_of_slot)
    act_q, act_scale = gate_up_act_quant(x_sorted_q, x_sorted_scale, w_gate_up, w_gate_up_scale, expert_ends,
                                         fast_accum, gemm)
    return down_partials(act_q, act_scale, w_down, w_down_scale, expert_ends, fast_accum, gemm)


# -------------------------------------------------------------------------- references


def _grouped_reference(a: torch.Tensor, w: torch.Tensor, expert_ends: torch.Tensor) -> torch.Tensor:
    """float32 [S, N]: a [S, K] float32 (slot order) times w [E, N, K] float32 per expert's run."""
    out = torch.zeros((a.shape[0], w.shape[1]), dtype=torch.float32, device=a.device)
    bounds = [0] + expert_ends.tolist()
    for e in range(w.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if start < end:
            out[start:end] = a[start:end] @ w[e].T
    return out


def act_quantize_rows_reference(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`act_quantize_rows` in torch: u [S, 2I] -> (q [S, I] e4m3, scale [S])."""
    x1, x2 = u.float().chunk(2, dim=-1)
    act = x1 * F.silu(x2)
    scale = scale_from_amax(act.abs().amax(dim=-1))
    return (act / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def gate_up_act_quant_reference(x_sorted_q, x_sorted_scale, w_gate_up, w_gate_up_scale, expert_ends):
    """`gate_up_act_quant` in torch: float32 products of the dequantized operands, u rounded to
    bf16 (the library's output), then the activation quantized per (micro, slot) row."""
    a = x_sorted_q.float() * x_sorted_scale[:, None]
    quantized = [act_quantize_rows_reference(_grouped_reference(a, w_gate_up[m].float() * w_gate_up_scale[m, ..., None],
                                                                expert_ends).to(torch.bfloat16))
                 for m in range(w_gate_up.shape[0])]
    return torch.stack([q for q, _ in quantized]), torch.cat([s for _, s in quantized])


def down_partials_reference(act_q, act_scale, w_down, w_down_scale, expert_ends):
    """`down_partials` in torch: float32 products of the dequantized operands, rounded to bf16."""
    micros, slots = act_q.shape[:2]
    act = act_q.float() * act_scale.view(micros, slots, 1)
    w = w_down.float() * w_down_scale[None, :, :, None]
    return torch.stack([_grouped_reference(act[m], w[m], expert_ends) for m in range(micros)]).to(torch.bfloat16)


def experts_partials_reference(x_q, x_scale, token_of_slot, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                               expert_ends):
    """`experts_partials` in torch (one host sync per GEMM: the run lengths)."""
    act_q, act_scale = gate_up_act_quant_reference(x_q[token_of_slot.long()], x_scale[token_of_slot.long()],
                                                   w_gate_up, w_gate_up_scale, expert_ends)
    return down_partials_reference(act_q, act_scale, w_down, w_down_scale, expert_ends)
