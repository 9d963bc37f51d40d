"""LSE merge: combine partial attention results over disjoint key sets.

Partial ``i`` attended to a key set ``K_i`` and returned its output ``o_i`` (softmax-normalised
over ``K_i`` only) and ``lse_i = log sum_{k in K_i} exp(s_k)`` (natural log, scores already
scaled). Over the union of the key sets:

    lse = log sum_i exp(lse_i)          o = sum_i exp(lse_i - lse) * o_i

computed in float32 with the max subtracted first. A partial whose query row saw no key at
all has ``lse_i = -inf``: its weight is exactly 0 whatever ``o_i`` holds (even NaN). When every
partial of a row is -inf the row's result is ``o = 0, lse = -inf``. Ring attention and
Attention2D both use this to combine per-block results.

Shapes: ``outs [N, *rows, D]`` and ``lses [N, *rows]`` (at most 3 row dims; any strides, so a
strided view of a receive buffer needs no copy) -> ``out [*rows, D]`` (contiguous, dtype
``out_dtype`` or ``outs.dtype``) and ``lse [*rows]`` float32.

CPU runs the torch reference; CUDA runs the Triton kernel; ``impl="triton"`` forces Triton
(on CPU only under TRITON_INTERPRET=1). Registered as ``dtgen::lse_merge``: one node under
``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

IMPLS = ("auto", "reference", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------ checks


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """Raise ValueError naming the tensor and the shapes when the inputs do not fit."""
    if outs.dim() < 2 or outs.shape[0] == 0:
        raise ValueError(f"lse_merge: outs must be [N, *rows, D] with N >= 1, got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lse_merge: lses must be outs' shape without the last dim, {tuple(outs.shape[:-1])}, "
                         f"got {tuple(lses.shape)}")
    if outs.dim() - 2 > 3:
        raise ValueError(f"lse_merge: at most 3 row dims between N and D, got outs shape {tuple(outs.shape)}")
    if outs.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"lse_merge: outs dtype must be one of {_FLOAT_DTYPES}, got {outs.dtype}")
    if lses.dtype != torch.float32:
        raise ValueError(f"lse_merge: lses must be float32, got {lses.dtype}")
    if outs.device != lses.device:
        raise ValueError(f"lse_merge: outs on {outs.device} but lses on {lses.device}")


# ---------------------------------------------------------------------------- reference


def lse_merge_naive(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth for tests: the formula row by row in float64, -inf partials skipped."""
    N, D = outs.shape[0], outs.shape[-1]
    o = outs.double().reshape(N, -1, D)
    l_all = lses.double().reshape(N, -1)
    out = torch.zeros(o.shape[1:], dtype=torch.float64)
    lse = torch.full((o.shape[1],), float("-inf"), dtype=torch.float64)
    for r in range(o.shape[1]):
        live = [i for i in range(N) if l_all[i, r] != float("-inf")]
        if not live:
            continue
        lse[r] = torch.logsumexp(l_all[live, r], 0)
        for i in live:
            out[r] += torch.exp(l_all[i, r] - lse[r]) * o[i, r]
    return out.reshape(outs.shape[1:]), lse.reshape(lses.shape[1:])


def lse_merge_reference(outs: torch.Tensor, lses: torch.Tensor,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in torch, float32 math."""
    check_merge_inputs(outs, lses)
    neg_inf = float("-inf")
    peak = lses.amax(dim=0)
    peak = torch.where(peak == neg_inf, torch.zeros_like(peak), peak)   # all -inf: any finite shift
    total = torch.exp(lses - peak).sum(dim=0)                            # exp(-inf) = 0
    lse = peak + torch.log(total)                                        # log(0) = -inf
    dead = lses == neg_inf
    weights = torch.where(dead, torch.zeros_like(lses), torch.exp(lses - lse))
    # where(), not multiply: a dead partial's output may be NaN and 0 * NaN is NaN.
    terms = torch.where(dead.unsqueeze(-1), torch.zeros((), device=outs.device),
                        weights.unsqueeze(-1) * outs.float())
    # contiguous(): strided inputs (a receive buffer) must still give the op's dense outputs.
    return terms.sum(dim=0).to(out_dtype or outs.dtype).contiguous(), lse.contiguous()


# ------------------------------------------------------------------------------ Triton


@triton.jit
def _lse_merge_kernel(
    outs_ptr, lses_ptr, out_ptr, lse_ptr,
    num_parts, rows0, rows1, rows2, head_dim,
    so_n, so_0, so_1, so_2, so_d,
    sl_n, sl_0, sl_1, sl_2,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program merges BLOCK_R rows (all D columns). out/lse are contiguous [rows, D] / [rows]."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.cast(rows0, tl.int64) * rows1 * rows2
    r2 = rows % rows2
    r1 = (rows // rows2) % rows1
    r0 = rows // (rows2 * rows1)
    o_rows = outs_ptr + r0 * so_0 + r1 * so_1 + r2 * so_2
    l_rows = lses_ptr + r0 * sl_0 + r1 * sl_1 + r2 * sl_2
    cols = tl.arange(0, BLOCK_D)
    tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)

    # Pass 1 over the (small) LSEs: the max, then the normaliser. All -inf: shift by 0.
    peak = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for n in range(num_parts):
        peak = tl.maximum(peak, tl.load(l_rows + tl.cast(n, tl.int64) * sl_n, mask=row_ok, other=float("-inf")))
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for n in range(num_parts):
        total += tl.exp(tl.load(l_rows + tl.cast(n, tl.int64) * sl_n, mask=row_ok, other=float("-inf")) - peak)
    lse = peak + tl.log(total)

    # Pass 2 over the outputs, each read once; dead partials contribute exactly 0.
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for n in range(num_parts):
        part_lse = tl.load(l_rows + tl.cast(n, tl.int64) * sl_n, mask=row_ok, other=float("-inf"))
        live = part_lse != float("-inf")
        weight = tl.where(live, tl.exp(part_lse - lse), 0.0)
        o = tl.load(o_rows[:, None] + tl.cast(n, tl.int64) * so_n + cols[None, :] * so_d,
                    mask=tile_ok, other=0.0).to(tl.float32)
        acc += tl.where(live[:, None], weight[:, None] * o, 0.0)
    tl.store(out_ptr + rows[:, None] * head_dim + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


TRITON_INTERPRETED = not isinstance(_lse_merge_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"the Triton LSE merge needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                           f"set before triton is first imported; got a tensor on {x.device}")


def _three_row_dims(x: torch.Tensor, row_dims: int) -> torch.Tensor:
    """View with exactly 3 row dims after dim 0 (leading size-1 dims added; no copy)."""
    for _ in range(3 - row_dims):
        x = x.unsqueeze(1)
    return x


def lse_merge_triton(outs: torch.Tensor, lses: torch.Tensor,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_merge_inputs(outs, lses)
    require_triton_device(outs)
    row_shape, head_dim = outs.shape[1:-1], outs.shape[-1]
    out = torch.empty((*row_shape, head_dim), dtype=out_dtype or outs.dtype, device=outs.device)
    lse = torch.empty(row_shape, dtype=torch.float32, device=outs.device)
    if out.numel() == 0:
        return out, lse
    o4 = _three_row_dims(outs, len(row_shape))
    l4 = _three_row_dims(lses, len(row_shape))
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, min(64, 4096 // block_d))  # ~16 KiB of fp32 accumulator per program
    rows = out.numel() // head_dim
    _lse_merge_kernel[(triton.cdiv(rows, block_r),)](
        o4, l4, out, lse, outs.shape[0], o4.shape[1], o4.shape[2], o4.shape[3], head_dim,
        *o4.stride(), *l4.stride(), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out, lse


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::lse_merge", mutates_args=())
def _lse_merge_op(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None,
                  impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "reference" or (impl == "auto" and not outs.is_cuda):
        return lse_merge_reference(outs, lses, out_dtype)
    return lse_merge_triton(outs, lses, out_dtype)


@_lse_merge_op.register_fake
def _(outs, lses, out_dtype, impl):
    return (outs.new_empty(outs.shape[1:], dtype=out_dtype or outs.dtype),
            lses.new_empty(lses.shape[1:]))


def lse_merge(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None,
              impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention results by their LSEs (module docstring): -> (out, lse).

    impl: "auto" (CPU: reference, CUDA: Triton), "reference", "triton".
    """
    if impl not in IMPLS:
        raise ValueError(f"lse_merge: impl must be one of {IMPLS}, got {impl!r}")
    check_merge_inputs(outs, lses)
    if impl == "triton":
        require_triton_device(outs)
    return torch.ops.dtgen.lse_merge(outs, lses, out_dtype, impl)
