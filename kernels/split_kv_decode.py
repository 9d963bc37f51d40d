"""Decode attention for a batch of requests of their own KV lengths, load-balanced split-KV.

    schedule = balanced_schedule(lengths, cache_len, num_programs)     # once per decode step
    out = split_kv_decode(q, k_cache, v_cache, lengths, schedule)      # every layer

q ``[B, Hq, D]`` (one query row per request), k_cache and v_cache ``[B, Hkv, L, D]`` (any
strides; request b's keys are row b, slots 0..lengths[b]-1), lengths ``[B]`` int -> out
``[B, Hq, D]`` in q's dtype, ``out[b, h] = softmax(scale * q[b, h] . k[b, h // G, :len_b]) @ v``
with G = Hq / Hkv (GQA) and ``scale`` 1/sqrt(D) by default. A request of length 0 gets 0.
Lengths are data (no host sync): past L they are clamped to L (the torch path raises when
they are on the CPU).

The schedule. Each request's keys are cut into uniform tiles of ``tile`` keys; the tiles of
all requests, laid end to end (request 0's, then request 1's, ...), are cut into
``num_programs`` contiguous ranges of equal size (+-1 tile), one per program of a fixed
grid ``[num_programs, Hkv]``. A program walks its range; where it crosses into another
request it writes the partial result (output, LSE) of the request it leaves and starts
afresh. A program touches requests r0..r1 and the partial of (program p, request r) goes to
row ``p + r`` of a ``[B + P - 1, Hq, D]`` buffer: unique, because the requests a program
touches start where the previous program's end. A second kernel merges each request's
partials by their LSEs (the formula of `kernels.lse_merge`, which takes a fixed number of
partials per row; here the count varies by request, so the merge walks each request's
program range itself). One long request next to short ones is then spread over every
program instead of sitting on a few.

The schedule is a handful of device tensors built from the lengths by torch ops
(cumsum, searchsorted): no host sync, fixed shapes for a fixed (B, P), so a CUDA graph
records it; every layer of a step reuses it. `static_schedule(lengths, cache_len, splits)`
is the baseline of the benchmark: a fixed number of splits per request (flash-decoding's
static split), each of ceil(tiles / splits) tiles, on a grid of B * splits programs.

CPU runs the torch reference (float32 math; float64 in, float64 out); CUDA runs the Triton
kernels; ``impl="triton"`` forces Triton (on CPU only under TRITON_INTERPRET=1).
Registered as ``dtgen::split_kv_decode``: one node under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

IMPLS = ("auto", "reference", "triton")
DEFAULT_TILE = 64   # keys per tile: the balancing unit and the kernel's inner block
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shape_is(t: torch.Tensor, *dims) -> bool:
    """t's shape equals dims, dim by dim (symbolic sizes under torch.compile compare too;
    tuple equality does not match a symbolic size against a static one)."""
    return t.dim() == len(dims) and all(a == b for a, b in zip(t.shape, dims))


class DecodeSchedule(NamedTuple):
    """Which tiles each program of the split kernel reads (module docstring). int32 tensors."""

    prog_begin: torch.Tensor   # [P + 1]: first tile (in the end-to-end tile list) of each program; last = total
    prog_req: torch.Tensor     # [P]: the request holding tile prog_begin[p] (B when the program is empty at the end)
    req_begin: torch.Tensor    # [B + 1]: first tile of each request; last = total
    req_first: torch.Tensor    # [B]: first program that may hold a tile of the request
    req_last: torch.Tensor     # [B]: last one (inclusive); the merge checks each for overlap
    tile: int                  # keys per tile (static)

    @property
    def num_programs(self) -> int:
        return self.prog_begin.shape[0] - 1


# ------------------------------------------------------------------------------ schedules


def _request_tiles(lengths: torch.Tensor, cache_len: int,
                   tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles [B], req_begin [B + 1], req_end [B]). req_end is the cumsum itself, not a slice of
    req_begin: inductor (torch 2.11) cannot lower a searchsorted whose sorted sequence is a
    slice view of a computed buffer (NotImplementedError: SliceView)."""
    if lengths.dim() != 1 or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"split_kv_decode: lengths must be int32/int64 [B], got {lengths.dtype} {tuple(lengths.shape)}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"split_kv_decode: tile must be a power of two >= 16, got {tile}")
    tiles = (lengths.long().clamp(0, cache_len) + tile - 1) // tile
    req_end = torch.cumsum(tiles, 0)
    return tiles, torch.cat([req_end.new_zeros(1), req_end]), req_end


def _finish(prog_begin: torch.Tensor, req_begin: torch.Tensor, req_end: torch.Tensor, tile: int) -> DecodeSchedule:
    P = prog_begin.shape[0] - 1
    prog_req = torch.searchsorted(req_end, prog_begin[:-1], right=True)
    # The last program whose range starts at or before the request's first (last) tile.
    req_first = (torch.searchsorted(prog_begin, req_begin[:-1], right=True) - 1).clamp(0, P - 1)
    req_last = (torch.searchsorted(prog_begin, req_end - 1, right=True) - 1).clamp(0, P - 1)
    i32 = torch.int32
    return DecodeSchedule(prog_begin.to(i32), prog_req.to(i32), req_begin.to(i32), req_first.to(i32),
                          req_last.to(i32), tile)


def balanced_schedule(lengths: torch.Tensor, cache_len: int, num_programs: int,
                      tile: int = DEFAULT_TILE) -> DecodeSchedule:
    """Every program gets floor or ceil of (all tiles) / num_programs consecutive tiles."""
    if num_programs < 1:
        raise ValueError(f"split_kv_decode: num_programs must be >= 1, got {num_programs}")
    _, req_begin, req_end = _request_tiles(lengths, cache_len, tile)
    total = req_begin[-1]
    prog_begin = torch.arange(num_programs + 1, device=lengths.device) * total // num_programs
    return _finish(prog_begin, req_begin, req_end, tile)


def static_schedule(lengths: torch.Tensor, cache_len: int, splits: int, tile: int = DEFAULT_TILE) -> DecodeSchedule:
    """The baseline: `splits` programs per request, each ceil(its tiles / splits) tiles."""
    if splits < 1:
        raise ValueError(f"split_kv_decode: splits must be >= 1, got {splits}")
    tiles, req_begin, req_end = _request_tiles(lengths, cache_len, tile)
    chunk = (tiles + splits - 1) // splits                                           # [B]
    s = torch.arange(splits, device=lengths.device)
    begin = req_begin[:-1, None] + torch.minimum(s[None, :] * chunk[:, None], tiles[:, None])   # [B, splits]
    prog_begin = torch.cat([begin.flatten(), req_begin[-1:]])
    return _finish(prog_begin, req_begin, req_end, tile)


def default_num_programs(device: torch.device, kv_heads: int) -> int:
    """Programs per KV head for the balanced grid: about two resident programs per SM in all."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, (2 * sms) // max(1, kv_heads))


def heuristic_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """The static baseline's split count: enough programs to fill the SMs twice (the usual
    flash-decoding heuristic: splits grow until batch * heads * splits covers the GPU)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, -(-2 * sms // max(1, batch * kv_heads)))


# ------------------------------------------------------------------------------ checks


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor) -> None:
    """Raise ValueError naming the tensor and the shapes when the inputs do not fit."""
    if q.dim() != 3:
        raise ValueError(f"split_kv_decode: q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"split_kv_decode: k_cache must be [B={B}, Hkv, L, D={D}], got {tuple(k_cache.shape)}")
    if not _shape_is(v_cache, *k_cache.shape):
        raise ValueError(f"split_kv_decode: v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if k_cache.shape[1] == 0 or Hq % k_cache.shape[1]:
        raise ValueError(f"split_kv_decode: query heads ({Hq}) must be a multiple of KV heads ({k_cache.shape[1]})")
    if not _shape_is(lengths, B) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"split_kv_decode: lengths must be int32/int64 [B={B}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"split_kv_decode: dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, lengths)}) != 1:
        raise ValueError("split_kv_decode: q, k_cache, v_cache and lengths must be on one device")
    if lengths.device.type == "cpu" and lengths.numel() and not torch.compiler.is_compiling():
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > k_cache.shape[2]:
            raise ValueError(f"split_kv_decode: lengths must lie in [0, {k_cache.shape[2]}] (the cache length), "
                             f"got min {lo} max {hi}")


# ---------------------------------------------------------------------------- reference


def split_kv_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """The attention in torch: float32 math (float64 inputs stay float64), keys past each
    request's length masked, GQA by viewing query heads as [Hkv, G]."""
    B, Hq, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    math_dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(math_dtype).reshape(B, Hkv, Hq // Hkv, D)
    scores = scale * torch.einsum("bhgd,bhsd->bhgs", qg, k_cache.to(math_dtype))          # [B, Hkv, G, L]
    valid = torch.arange(L, device=q.device)[None, :] < lengths.clamp(0, L)[:, None]       # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    live = valid.any(dim=1)[:, None, None, None]
    probs = torch.softmax(torch.where(live, scores, torch.zeros_like(scores)), dim=-1)
    probs = torch.where(live & valid[:, None, None, :], probs, torch.zeros_like(probs))    # empty request: 0
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v_cache.to(math_dtype))
    return out.reshape(B, Hq, D).to(q.dtype)


# ------------------------------------------------------------------------------ Triton

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, prog_begin_ptr, prog_req_ptr, req_begin_ptr, part_o_ptr, part_lse_ptr,
    cache_len, scale_log2,
    s_qb, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_pn, s_ph, s_ln,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Program (p, kv head h): the tiles [prog_begin[p], prog_begin[p+1]) for the G query
    heads of h, one partial (normalised output, natural-log LSE) per request it touches."""
    p = tl.program_id(0)
    kv_head = tl.program_id(1)
    t = tl.load(prog_begin_ptr + p)
    t_end = tl.load(prog_begin_ptr + p + 1)
    r = tl.load(prog_req_ptr + p)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    n_base = tl.arange(0, BLOCK_N)
    while t < t_end:
        r_begin = tl.load(req_begin_ptr + r)
        seg_end = tl.minimum(t_end, tl.load(req_begin_ptr + r + 1))
        if seg_end > t:
            length = tl.minimum(tl.load(len_ptr + r).to(tl.int32), cache_len)
            r64 = r.to(tl.int64)
            q = tl.load(q_ptr + r64 * s_qb + heads[:, None] * s_qh + d[None, :],
                        mask=g_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            k_rows = k_ptr + r64 * s_kb + kv_head.to(tl.int64) * s_kh
            v_rows = v_ptr + r64 * s_vb + kv_head.to(tl.int64) * s_vh
            m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            l = tl.zeros((BLOCK_G,), tl.float32)
            acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
            for tt in range(t, seg_end):
                n = (tt - r_begin) * BLOCK_N + n_base
                n_ok = n < length
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(k_rows + n[:, None].to(tl.int64) * s_ks + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_rows + n[:, None].to(tl.int64) * s_vs + d[None, :], mask=kv_mask, other=0.0)
                if DOT_F32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2     # [G, N], log2 units
                s = tl.where(n_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))          # finite: every tile holds a valid key
                alpha = tl.exp2(m - m_new)
                prob = tl.exp2(s - m_new[:, None])
                l = l * alpha + tl.sum(prob, axis=1)
                acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
                m = m_new
            row = (p + r).to(tl.int64)
            tl.store(part_o_ptr + row * s_pn + heads[:, None] * s_ph + d[None, :], acc / l[:, None],
                     mask=g_ok[:, None] & d_ok[None, :])
            tl.store(part_lse_ptr + row * s_ln + heads, (m + tl.log2(l)) * 0.6931471805599453, mask=g_ok)
        t = seg_end
        r += 1


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, prog_begin_ptr, req_begin_ptr, req_first_ptr, req_last_ptr,
    s_pn, s_ph, s_ln, s_ob, s_oh,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (request b, query head h): the LSE merge of b's partials for h.

    The partials are read BLOCK_P programs at a time (one vector load of their LSEs, one tile
    load of their outputs), each chunk folded into a running max: a request spread over
    every program of the grid costs a couple of chunks, not one dependent load per program."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pp = tl.arange(0, BLOCK_P)
    r_begin = tl.load(req_begin_ptr + b)
    r_end = tl.load(req_begin_ptr + b + 1)
    p_lo = tl.load(req_first_ptr + b)
    p_hi = tl.load(req_last_ptr + b)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for p0 in range(p_lo, p_hi + 1, BLOCK_P):
        p = p0 + pp
        in_range = p <= p_hi
        begin = tl.load(prog_begin_ptr + p, mask=in_range, other=0)
        end = tl.load(prog_begin_ptr + p + 1, mask=in_range, other=0)
        ok = in_range & (tl.minimum(end, r_end) - tl.maximum(begin, r_begin) > 0)   # p wrote row p + b
        row = (p + b).to(tl.int64)
        lse = tl.load(part_lse_ptr + row * s_ln + head, mask=ok, other=float("-inf"))
        o = tl.load(part_o_ptr + row[:, None] * s_pn + head * s_ph + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a chunk with no partial of b
        alpha = tl.exp(m - m_safe)
        w = tl.where(ok, tl.exp(lse - m_safe), 0.0)
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)   # no keys: 0
    tl.store(out_ptr + b.to(tl.int64) * s_ob + head * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


TRITON_INTERPRETED = not isinstance(_split_kv_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"split_kv_decode: the Triton kernels need CUDA tensors, or CPU tensors with "
                           f"TRITON_INTERPRET=1 set before triton is first imported; got a tensor on {x.device}")


def split_kv_decode_triton(q, k_cache, v_cache, lengths, prog_begin, prog_req, req_begin, req_first, req_last,
                           tile: int, scale: float | None = None) -> torch.Tensor:
    """The two kernels (inputs assumed checked). Graph-capturable: no host sync."""
    require_triton_device(q)
    B, Hq, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    P = prog_begin.shape[0] - 1
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("split_kv_decode: the caches' last dim must be contiguous")
    part_o = torch.empty((B + P - 1, Hq, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B + P - 1, Hq), dtype=torch.float32, device=q.device)
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_g = max(16, triton.next_power_of_2(group))   # tl.dot's smallest edge
    block_d = triton.next_power_of_2(D)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The interpreter's tl.dot multiplies the raw bits of bfloat16 operands
    # (triton-lang/triton#11584): there, bf16 tiles go to float32 for the dots.
    dot_f32 = TRITON_INTERPRETED and q.dtype == torch.bfloat16
    _split_kv_kernel[(P, Hkv)](
        q, k_cache, v_cache, lengths, prog_begin, prog_req, req_begin, part_o, part_lse, L, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), part_o.stride(0), part_o.stride(1),
        part_lse.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_G=block_g, BLOCK_N=tile, BLOCK_D=block_d, DOT_PRECISION=precision,
        DOT_F32=dot_f32, num_warps=4, num_stages=2)
    _merge_kernel[(B, Hq)](
        part_o, part_lse, out, prog_begin, req_begin, req_first, req_last,
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_P=min(32, triton.next_power_of_2(P)), BLOCK_D=block_d, num_warps=2)
    return out


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::split_kv_decode", mutates_args=())
def _split_kv_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                        prog_begin: torch.Tensor, prog_req: torch.Tensor, req_begin: torch.Tensor,
                        req_first: torch.Tensor, req_last: torch.Tensor, tile: int, scale: float | None,
                        impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not q.is_cuda):
        return split_kv_decode_reference(q, k_cache, v_cache, lengths, scale)
    return split_kv_decode_triton(q, k_cache, v_cache, lengths, prog_begin, prog_req, req_begin, req_first,
                                  req_last, tile, scale)


@_split_kv_decode_op.register_fake
def _(q, k_cache, v_cache, lengths, prog_begin, prog_req, req_begin, req_first, req_last, tile, scale, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                    schedule: DecodeSchedule | None = None, scale: float | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """Batched decode attention (module docstring) -> [B, Hq, D].

    schedule: from `balanced_schedule` / `static_schedule` for these lengths and this cache
    length (build it once per step; None builds a balanced one here). impl: "auto" (CPU:
    reference, CUDA: Triton), "reference", "triton".
    """
    if impl not in IMPLS:
        raise ValueError(f"split_kv_decode: impl must be one of {IMPLS}, got {impl!r}")
    check_decode_inputs(q, k_cache, v_cache, lengths)
    if q.dtype not in _FLOAT_DTYPES and impl != "reference" and (q.is_cuda or impl == "triton"):
        raise ValueError(f"split_kv_decode: the Triton kernels take {_FLOAT_DTYPES}, got {q.dtype}")
    if impl == "triton":
        require_triton_device(q)
    if schedule is None and (impl == "reference" or (impl == "auto" and not q.is_cuda)):
        return split_kv_decode_reference(q, k_cache, v_cache, lengths, scale)   # no schedule to build
    if schedule is None:
        schedule = balanced_schedule(lengths, k_cache.shape[2], default_num_programs(q.device, k_cache.shape[1]))
    if schedule.req_begin.shape[0] != q.shape[0] + 1:
        raise ValueError(f"split_kv_decode: the schedule is for {schedule.req_begin.shape[0] - 1} requests, "
                         f"q holds {q.shape[0]}")
    return torch.ops.dtgen.split_kv_decode(q, k_cache, v_cache, lengths, schedule.prog_begin, schedule.prog_req,
                                           schedule.req_begin, schedule.req_first, schedule.req_last, schedule.tile,
                                           scale, impl)
