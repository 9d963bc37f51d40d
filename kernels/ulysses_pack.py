"""Ulysses all-to-all buffers: pack q/k/v into one send buffer, and lay out what comes back.

Ulysses turns sequence-sharded q/k/v into head-sharded ones with ONE all-to-all over P ranks
and back with another. Around the two exchanges sit four pure data movements:

    pack         q [B, S, Hq, D], k/v [B, S, Hkv, D]  ->  send [P, B, S, hq + 2n, D]
                 send[j, b, s] = q heads q_heads[j] (hq of them), then k heads kv_heads[j],
                 then v heads kv_heads[j] (n each). With fewer KV heads than ranks one KV
                 head is selected for several j (see ``dtgen.attention.ulysses_kv_heads``).
                 The head lists are Python ints (constants under torch.compile: no guards,
                 no host-to-device copy per call); the op keeps their device tables.
    unpack       recv [P, B, S, H, D]  ->  [B, P*S, H, D]      (source j's rows are chunk j)
    pack_out     out [B, P*S, h, D]    ->  [P, B, S, h, D]     (chunk j goes back to rank j)
    unpack_out   recv [P, B, S, h, D]  ->  [B, S, P*h, D]      (rank j's heads are block j)

The Triton path is one strided row-copy kernel (each row is D contiguous elements; a row
index decomposes into 4 dims with source and destination strides, and pack reads the
source head from an index table). Torch's path for pack is index_select + cat + reshape,
two extra copies of the buffer. With B == 1 `unpack` is a free view, and `pack_out` of a
contiguous output is too: the public functions then return views and launch nothing.

CPU runs the torch references, CUDA the Triton kernel; ``impl="triton"`` forces it (on the
CPU only under TRITON_INTERPRET=1). Registered as ``dtgen::ulysses_pack`` and
``dtgen::ulysses_relayout``: one node each under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

IMPLS = ("auto", "reference", "triton")
LAYOUTS = ("unpack", "pack_out", "unpack_out")


# ------------------------------------------------------------------------------ checks


def check_pack_inputs(q, k, v, q_heads: list[int], kv_heads: list[int], parts: int) -> None:
    """q_heads / kv_heads: the flattened [P][hq] / [P][n] head lists."""
    if q.dim() != 4:
        raise ValueError(f"ulysses_pack: q must be [B, S, Hq, D], got shape {tuple(q.shape)}")
    B, S, Hq, D = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (B, S, D):
        raise ValueError(f"ulysses_pack: k must be [B={B}, S={S}, Hkv, D={D}] to match q, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"ulysses_pack: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    for name, heads, limit in (("q_heads", q_heads, Hq), ("kv_heads", kv_heads, k.shape[2])):
        if parts < 1 or not heads or len(heads) % parts:
            raise ValueError(f"ulysses_pack: {name} must list the same number (>= 1) of heads for each of the "
                             f"{parts} ranks, got {len(heads)} in all")
        if not all(0 <= h < limit for h in heads):
            raise ValueError(f"ulysses_pack: {name} {list(heads)} must lie in [0, {limit})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ulysses_pack: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("ulysses_pack: q, k and v need a contiguous last (head_dim) dimension")


def check_relayout_input(x: torch.Tensor, layout: str, parts: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"ulysses relayout: layout must be one of {LAYOUTS}, got {layout!r}")
    if x.dim() != 5 and layout != "pack_out":
        raise ValueError(f"ulysses {layout}: input must be [P, B, S, heads, D], got shape {tuple(x.shape)}")
    if layout == "pack_out":
        if x.dim() != 4 or parts < 1 or x.shape[1] % parts:
            raise ValueError(f"ulysses pack_out: output must be [B, P*S, heads, D] with rows divisible by "
                             f"P = {parts}, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"ulysses {layout}: input needs a contiguous last (head_dim) dimension")


# --------------------------------------------------------------------------- references


_TABLES: dict[tuple, torch.Tensor] = {}


def head_table(heads: list[int], parts: int, device: torch.device) -> torch.Tensor:
    """The int64 [P, heads per rank] table on `device`, built once per (heads, device)."""
    key = (tuple(heads), parts, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(heads, dtype=torch.int64, device=device).view(parts, -1)
    return _TABLES[key]


def ulysses_pack_reference(q, k, v, q_heads: list[int], kv_heads: list[int], parts: int) -> torch.Tensor:
    check_pack_inputs(q, k, v, q_heads, kv_heads, parts)
    q_index, kv_index = head_table(q_heads, parts, q.device), head_table(kv_heads, parts, q.device)
    B, S, _, D = q.shape
    P, hq, n = parts, q_index.shape[1], kv_index.shape[1]
    packed = torch.cat([
        q.index_select(2, q_index.flatten()).view(B, S, P, hq, D),
        k.index_select(2, kv_index.flatten()).view(B, S, P, n, D),
        v.index_select(2, kv_index.flatten()).view(B, S, P, n, D),
    ], dim=3)                                                     # [B, S, P, hq + 2n, D]
    return packed.permute(2, 0, 1, 3, 4).contiguous()


def ulysses_relayout_reference(x: torch.Tensor, layout: str, parts: int) -> torch.Tensor:
    """One copy into a new buffer (never a view of x: an op's output must not alias its input)."""
    check_relayout_input(x, layout, parts)
    if layout == "unpack":
        P, B, S, H, D = x.shape
        out = torch.empty(B, P * S, H, D, dtype=x.dtype, device=x.device)
        out.view(B, P, S, H, D).copy_(x.permute(1, 0, 2, 3, 4))
    elif layout == "pack_out":
        B, PS, h, D = x.shape
        out = torch.empty(parts, B, PS // parts, h, D, dtype=x.dtype, device=x.device)
        out.copy_(x.unflatten(1, (parts, PS // parts)).permute(1, 0, 2, 3, 4))
    else:
        P, B, S, h, D = x.shape
        out = torch.empty(B, S, P * h, D, dtype=x.dtype, device=x.device)
        out.view(B, S, P, h, D).copy_(x.permute(1, 2, 0, 3, 4))
    return out


# ------------------------------------------------------------------------------ Triton


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, table_ptr,
    num_rows, n1, n2, n3, head_dim, table_cols,
    s0, s1, s2, s3, s_d,
    d0, d1, d2, d3, d_d,
    USE_TABLE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dst[i0, i1, i2, i3, :] = src[i0, i1, i2, h, :] over rows (i0, i1, i2, i3) of [n0, n1, n2, n3].

    h = i3, or with USE_TABLE h = table[i0, i3] (then src's i0 stride is unused: the table
    names the head for each destination block). Strides are in elements, per index dim.
    """
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    i3 = rows % n3
    i2 = (rows // n3) % n2
    i1 = (rows // (n3 * n2)) % n1
    i0 = rows // (n3 * n2 * n1)
    if USE_TABLE:
        head = tl.load(table_ptr + i0 * table_cols + i3, mask=row_ok, other=0)
        src_rows = i1 * s1 + i2 * s2 + head * s3
    else:
        src_rows = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
    dst_rows = i0 * d0 + i1 * d1 + i2 * d2 + i3 * d3
    ok = row_ok[:, None] & (cols[None, :] < head_dim)
    x = tl.load(src_ptr + src_rows[:, None] + cols[None, :] * s_d, mask=ok)
    tl.store(dst_ptr + dst_rows[:, None] + cols[None, :] * d_d, x, mask=ok)


TRITON_INTERPRETED = not isinstance(_copy_rows_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"the Triton Ulysses kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                           f"set before triton is first imported; got a tensor on {x.device}")


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, sizes, src_strides, dst_strides, head_dim: int,
               table: torch.Tensor | None = None) -> None:
    """Launch the row copy: 4 index dims of `sizes`, then head_dim contiguous-ish elements."""
    n0, n1, n2, n3 = sizes
    num_rows = n0 * n1 * n2 * n3
    if num_rows == 0 or head_dim == 0:
        return
    block_d = min(triton.next_power_of_2(head_dim), 256)
    block_r = max(1, 8192 // block_d)  # 64 rows of 128: 16 KiB of bf16 per program
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(head_dim, block_d))
    use_table = table is not None
    _copy_rows_kernel[grid](
        src, dst, table if use_table else dst, num_rows, n1, n2, n3, head_dim,
        table.shape[1] if use_table else 0,
        *src_strides, src.stride(-1), *dst_strides, dst.stride(-1),
        USE_TABLE=use_table, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)


def ulysses_pack_triton(q, k, v, q_heads: list[int], kv_heads: list[int], parts: int) -> torch.Tensor:
    check_pack_inputs(q, k, v, q_heads, kv_heads, parts)
    require_triton_device(q)
    q_index, kv_index = head_table(q_heads, parts, q.device), head_table(kv_heads, parts, q.device)
    B, S, _, D = q.shape
    P, hq, n = parts, q_index.shape[1], kv_index.shape[1]
    send = torch.empty(P, B, S, hq + 2 * n, D, dtype=q.dtype, device=q.device)
    # Three launches, each filling its own head range of every destination block j.
    for src, index, first in ((q, q_index, 0), (k, kv_index, hq), (v, kv_index, hq + n)):
        heads = index.shape[1]
        dst = send[:, :, :, first:first + heads]
        _copy_rows(src, dst, (P, B, S, heads), (0, src.stride(0), src.stride(1), src.stride(2)),
                   dst.stride()[:4], D, table=index)
    return send


def ulysses_relayout_triton(x: torch.Tensor, layout: str, parts: int) -> torch.Tensor:
    check_relayout_input(x, layout, parts)
    require_triton_device(x)
    if layout == "unpack":
        P, B, S, H, D = x.shape
        out = torch.empty(B, P * S, H, D, dtype=x.dtype, device=x.device)
        o = out.stride()
        _copy_rows(x, out, (P, B, S, H), x.stride()[:4], (S * o[1], o[0], o[1], o[2]), D)
    elif layout == "pack_out":
        B, PS, h, D = x.shape
        P, S = parts, PS // parts
        out = torch.empty(P, B, S, h, D, dtype=x.dtype, device=x.device)
        s = x.stride()
        _copy_rows(x, out, (P, B, S, h), (S * s[1], s[0], s[1], s[2]), out.stride()[:4], D)
    else:
        P, B, S, h, D = x.shape
        out = torch.empty(B, S, P * h, D, dtype=x.dtype, device=x.device)
        o = out.stride()
        _copy_rows(x, out, (P, B, S, h), x.stride()[:4], (h * o[2], o[0], o[1], o[2]), D)
    return out


# ----------------------------------------------------------------------- ops and public API


@torch.library.custom_op("dtgen::ulysses_pack", mutates_args=())
def _ulysses_pack_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_heads: list[int],
                     kv_heads: list[int], parts: int, impl: str) -> torch.Tensor:
    # Measured on an H200 at HunyuanImage-3 TP2 x SP2 shapes (bench/results/h200-2026-11-29):
    # at B=1 the torch gather-copy takes 0.10 ms and this Triton kernel 0.27 ms; at B=2 the
    # kernel wins (0.14 vs 0.19 ms). "auto" takes the faster one until the kernel is tuned.
    if impl == "reference" or (impl == "auto" and (not q.is_cuda or q.shape[0] == 1)):
        return ulysses_pack_reference(q, k, v, q_heads, kv_heads, parts)
    return ulysses_pack_triton(q, k, v, q_heads, kv_heads, parts)


@_ulysses_pack_op.register_fake
def _(q, k, v, q_heads, kv_heads, parts, impl):
    B, S, _, D = q.shape
    return q.new_empty(parts, B, S, (len(q_heads) + 2 * len(kv_heads)) // parts, D)


@torch.library.custom_op("dtgen::ulysses_relayout", mutates_args=())
def _ulysses_relayout_op(x: torch.Tensor, layout: str, parts: int, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return ulysses_relayout_reference(x, layout, parts)
    return ulysses_relayout_triton(x, layout, parts)


@_ulysses_relayout_op.register_fake
def _(x, layout, parts, impl):
    if layout == "unpack":
        P, B, S, H, D = x.shape
        return x.new_empty(B, P * S, H, D)
    if layout == "pack_out":
        B, PS, h, D = x.shape
        return x.new_empty(parts, B, PS // parts, h, D)
    P, B, S, h, D = x.shape
    return x.new_empty(B, S, P * h, D)


def _check_impl(impl: str, x: torch.Tensor) -> None:
    if impl not in IMPLS:
        raise ValueError(f"ulysses kernels: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "triton":
        require_triton_device(x)


def _flatten(heads, name: str) -> list[int]:
    rows = [list(r) for r in heads]
    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError(f"ulysses_pack: {name} must give each rank the same number of heads, got {rows}")
    return [int(h) for r in rows for h in r]


def ulysses_pack(q, k, v, q_heads, kv_heads, impl: str = "auto") -> torch.Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> send buffer [P, B, S, hq + 2n, D].

    q_heads [P][hq] and kv_heads [P][n] (Python ints) name the heads destination j gets.
    impl: "auto" (CPU: reference, CUDA: Triton), "reference", "triton".
    """
    _check_impl(impl, q)
    flat_q, flat_kv, parts = _flatten(q_heads, "q_heads"), _flatten(kv_heads, "kv_heads"), len(q_heads)
    check_pack_inputs(q, k, v, flat_q, flat_kv, parts)
    if len(kv_heads) != parts:
        raise ValueError(f"ulysses_pack: q_heads has {parts} ranks, kv_heads {len(kv_heads)}")
    return torch.ops.dtgen.ulysses_pack(q, k, v, flat_q, flat_kv, parts, impl)


def ulysses_unpack(recv: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """recv [P, B, S, H, D] -> [B, P*S, H, D] (a view when B == 1)."""
    _check_impl(impl, recv)
    check_relayout_input(recv, "unpack", recv.shape[0] if recv.dim() == 5 else 1)
    P, B, S, H, D = recv.shape
    if B == 1 and impl == "auto":
        return recv.view(1, P * S, H, D) if recv.is_contiguous() else recv.reshape(1, P * S, H, D)
    return torch.ops.dtgen.ulysses_relayout(recv, "unpack", P, impl)


def ulysses_pack_out(out: torch.Tensor, parts: int, impl: str = "auto") -> torch.Tensor:
    """out [B, P*S, h, D] -> send buffer [P, B, S, h, D] (a view when B == 1 and out is contiguous)."""
    _check_impl(impl, out)
    check_relayout_input(out, "pack_out", parts)
    B, PS, h, D = out.shape
    if B == 1 and impl == "auto" and out.is_contiguous():
        return out.view(parts, 1, PS // parts, h, D)
    return torch.ops.dtgen.ulysses_relayout(out, "pack_out", parts, impl)


def ulysses_unpack_out(recv: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """recv [P, B, S, h, D] (block j from rank j) -> [B, S, P*h, D]."""
    _check_impl(impl, recv)
    check_relayout_input(recv, "unpack_out", recv.shape[0] if recv.dim() == 5 else 1)
    return torch.ops.dtgen.ulysses_relayout(recv, "unpack_out", recv.shape[0], impl)
