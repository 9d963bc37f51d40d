"""Decode GEMV on Hopper through a TMA ring (Gluon): `kernels.decode_gemv`'s op with its stream
kernel's schedule, the weight copied by TMA into a shared-memory ring instead of loaded into registers.

Each persistent program owns an even split of the N tiles ([BLOCK_N, K] weight rows) and reads them as
one flat sequence of (tile, K chunk) blocks; `STAGES` blocks are in flight at once (TMA copies, each
completing an mbarrier), so the bytes in flight per SM are programs x STAGES x the block, independent of
the registers, and no thread issues an address per 16 bytes. The consumer (every warp of the program)
waits for a block, reads it from shared memory into registers, and, once every warp has read it
(a CTA barrier), refills that slot with the block STAGES ahead. Rows past N and columns past K come as
zeros from TMA. The arithmetic is the stream kernel's: one row of x (its chunks read one ahead)
accumulates the products elementwise and reduces once a tile; more rows sum per chunk and row; e4m3
weights take x already in e4m3 with its per-row scales and multiply by scale_w[n] * scale_x[m] in the
epilogue, then the bias, one cast. So the results are `decode_gemv_reference`'s up to the float32
summation order.

sm90 only (TMA, Gluon): `require_tma` refuses anything else in one line. Gluon does not run under
TRITON_INTERPRET=1: the CPU tests check the refusals and the shape checks; its numerics are checked on
the GPU (tests/framework/test_decode_gemv.py, marker `gpu`). This module imports on any triton (without
Gluon's Hopper TMA the kernel is refused); the kernel is compiled on its first call, never at import.
"""
from __future__ import annotations

import functools

import torch
import triton

from .fp8_quant import FP8_DTYPE

try:   # Gluon and its Hopper TMA: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_PROBLEM = None
except ImportError as err:   # an older triton: the kernel is refused, the module still imports
    gluon = None
    GLUON_PROBLEM = f"triton {triton.__version__} has no Gluon Hopper TMA ({err})"

THREADS_PER_WARP = 32


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def tma_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the TMA kernel cannot take these operands (None: it can)."""
    if GLUON_PROBLEM:
        return GLUON_PROBLEM
    if not x.is_cuda or _capability(x.device)[0] != 9:
        return f"the TMA decode GEMV runs on Hopper (sm90) only, x is on {x.device}"
    elem = weight.element_size()
    if weight.stride(1) != 1 or (weight.stride(0) * elem) % 16 or weight.data_ptr() % 16:
        return (f"the TMA decode GEMV needs a K-contiguous weight with 16-byte aligned rows, got strides "
                f"{tuple(weight.stride())} of {elem}-byte elements")
    return None


def require_tma(x: torch.Tensor, weight: torch.Tensor) -> None:
    problem = tma_problem(x, weight)
    if problem:
        raise RuntimeError(f"decode_gemv: {problem}")


def layout_split(block_n: int, block_k: int, elem_bytes: int, num_warps: int) -> tuple[int, int]:
    """(vector elements a thread loads, warps along N) of the register tile [block_n, block_k]: 16-byte
    vectors, warps along N as far as block_n goes, the rest along K; ValueError naming the config
    where the tile is smaller than one pass of the warps (it would hold duplicates)."""
    vec = 16 // elem_bytes
    warps_n = min(num_warps, block_n)
    warps_k = num_warps // warps_n
    if block_n % warps_n or block_k % (vec * THREADS_PER_WARP * warps_k):
        raise ValueError(f"decode_gemv: the TMA kernel's tile [{block_n}, {block_k}] is smaller than its {num_warps} "
                         f"warps cover ({warps_n} rows x {vec * THREADS_PER_WARP * warps_k} columns a pass); "
                         f"raise block_k or block_n, or lower num_warps")
    return vec, warps_n


if gluon is not None:
    @gluon.jit
    def _gemv_tma_kernel(
        x_ptr, w_desc, ws_ptr, xs_ptr, b_ptr, y_ptr,
        M, N, K, n_tiles, k_chunks,
        stride_xm, stride_ym,
        ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr, BLOCK_BYTES: gl.constexpr, VEC: gl.constexpr, WARPS_N: gl.constexpr,
        FP8: gl.constexpr, EVEN_K: gl.constexpr, HAS_BIAS: gl.constexpr,
    ):
        """Program p of P: tiles t_lo .. t_hi - 1, STAGES TMA blocks in flight (module docstring)."""
        nw: gl.constexpr = gl.num_warps()
        w_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [WARPS_N, nw // WARPS_N], [1, 0])
        k_layout: gl.constexpr = gl.SliceLayout(0, w_layout)
        acc_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_M], [32, 1], [nw, 1], [1, 0])
        accn_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        accm_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        t_lo = pid * n_tiles // nprog
        t_hi = (pid + 1) * n_tiles // nprog
        total = (t_hi - t_lo) * k_chunks

        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES):   # the first STAGES blocks (fewer where the program has fewer)
            pred = s < total
            mbarrier.expect(ready.index(s), BLOCK_BYTES, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [(t_lo + s // k_chunks) * BLOCK_N, (s % k_chunks) * BLOCK_K],
                                            ready.index(s), ring.index(s), pred=pred)

        ks = gl.arange(0, BLOCK_K, layout=k_layout)
        ms = gl.arange(0, BLOCK_M, layout=accm_layout)
        ms_safe = gl.minimum(ms, M - 1)
        if FP8:
            sx = gl.load(xs_ptr + ms_safe)
        if ROWS == 1:
            if EVEN_K:
                x_next = gl.load(x_ptr + ks)
            else:
                x_next = gl.load(x_ptr + ks, mask=ks < K, other=0.0)
        acc2 = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, w_layout)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
        for i in range(0, total):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            wf = ring.index(slot).load(w_layout).to(gl.float32)
            gl.thread_barrier()   # every warp has read the slot: refill it with the block STAGES ahead
            j = i + STAGES
            pred = j < total
            mbarrier.expect(ready.index(slot), BLOCK_BYTES, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [(t_lo + j // k_chunks) * BLOCK_N, (j % k_chunks) * BLOCK_K],
                                            ready.index(slot), ring.index(slot), pred=pred)
            kc = i % k_chunks
            kk = kc * BLOCK_K + ks
            if ROWS == 1:
                xr = x_next.to(gl.float32)
                k_next = ((i + 1) % k_chunks) * BLOCK_K + ks      # x's next chunk, one ahead (an L2 read)
                if EVEN_K:
                    x_next = gl.load(x_ptr + k_next)
                else:
                    x_next = gl.load(x_ptr + k_next, mask=k_next < K, other=0.0)
                acc2 += wf * xr[None, :]
            else:
                for r in gl.static_range(ROWS):
                    if EVEN_K:
                        xr = gl.load(x_ptr + r * stride_xm + kk).to(gl.float32)
                    else:
                        xr = gl.load(x_ptr + r * stride_xm + kk, mask=kk < K, other=0.0).to(gl.float32)
                    part = gl.convert_layout(gl.sum(wf * xr[None, :], axis=1), accn_layout)
                    acc += gl.where(ms[None, :] == r, part[:, None], 0.0)
            if kc == k_chunks - 1:
                if ROWS == 1:
                    acc = gl.convert_layout(gl.sum(acc2, axis=1), accn_layout)[:, None] + \
                        gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
                    acc2 = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, w_layout)
                ns = (t_lo + i // k_chunks) * BLOCK_N + gl.arange(0, BLOCK_N, layout=accn_layout)
                ns_safe = gl.minimum(ns, N - 1)
                if FP8:
                    acc = acc * gl.load(ws_ptr + ns_safe)[:, None] * sx[None, :]
                if HAS_BIAS:
                    acc += gl.load(b_ptr + ns_safe).to(gl.float32)[:, None]
                out_mask = (ns[:, None] < N) & (ms[None, :] < M)
                gl.store(y_ptr + ms[None, :] * stride_ym + ns[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
                acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))


def launch_tma(flat: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
               bias: torch.Tensor | None, x_scale: torch.Tensor | None, y: torch.Tensor, block_n: int, block_k: int,
               num_warps: int, stages: int, programs: int) -> None:
    """y [M, N] = flat [M, K] (e4m3 with x_scale [M] for an e4m3 weight; contiguous) W^T: `programs`
    persistent programs, `stages` blocks [block_n, block_k] in flight each."""
    require_tma(flat, weight)
    n, k = weight.shape
    m = flat.shape[0]
    fp8 = weight.dtype == FP8_DTYPE
    vec, warps_n = layout_split(block_n, block_k, weight.element_size(), num_warps)
    gl_dtype = gl.float8e4nv if fp8 else (gl.bfloat16 if weight.dtype == torch.bfloat16 else gl.float16)
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl_dtype)
    desc = TensorDescriptor.from_tensor(weight, [block_n, block_k], layout)
    n_tiles = triton.cdiv(n, block_n)
    _gemv_tma_kernel[(min(programs, n_tiles),)](
        flat, desc, weight_scale if fp8 else y, x_scale if fp8 else y, bias if bias is not None else y, y,
        m, n, k, n_tiles, triton.cdiv(k, block_k), flat.stride(0), y.stride(0),
        ROWS=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        BLOCK_BYTES=block_n * block_k * weight.element_size(), VEC=vec, WARPS_N=warps_n, FP8=fp8,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps)
