"""FP8 attention on Hopper in Gluon: kernels/fp8_attention.py's op, its softmax overlapped with its MMAs.

    out = fp8_attention_gluon(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype)   # [B, Sq, Hq, D]

The operands are `quantize_qkv`'s (INT8 Q and smoothed K with per-block scales, V^T in e4m3 with
a scale per channel); the math is the Triton kernel's: Q K^T on the INT8 tensor cores (int32,
the accumulator starting at MAGIC_BITS so that the logits read as float32 with one FFMA), the
online softmax in exp2 with P made as P * 448, P V on the e4m3 tensor cores (float32
accumulation). Only the order of the work differs, as FlashAttention-3 arranges it on sm90:

- A producer partition (one warp, few registers) loads K and V^T tiles with TMA into a ring of
  NUM_STAGES shared-memory slots, each with a "ready" mbarrier (expect-tx: the TMA bytes
  complete it) and an "empty" one (both consumers arrive when their MMAs have read it); it
  loads each consumer's 64 query rows once.
- Two consumer warpgroups (the default partition and a 4-warp worker) each own 64 of the
  program's 128 query rows. Inside each, the next key block's Q K^T is issued asynchronously
  before this block's P V, and the softmax of the new logits runs while the P V MMA does.
- Ping-pong: the consumers take turns issuing their MMAs (a pair of mbarriers passes the turn),
  so that one warpgroup's softmax (exp2, conversions: the units that bound an 8-bit attention
  kernel) runs while the other's MMAs keep the tensor cores busy.
- P goes from the Q K^T accumulator to the P V operand without leaving its registers: K's rows
  are loaded in a permuted order (a 5-D TMA view) that puts in each thread's accumulator columns
  the keys its operand columns need (`_pack_p`), and P is carried as packed e4m3 words.
- Registers are moved to the consumers (`setmaxnreg` through `gl.warp_specialize`): one program
  an SM, 12 warps (the producer's warpgroup holds 3 idle warps).

A traced launch (`launch_fp8_attention_gluon(..., trace=trace_buffer(...))`, the TRACE constexpr)
records `%clock64` at the phase boundaries of each warpgroup's first key blocks in the first
programs (`TRACE_POINTS`, `PRODUCER_POINTS`), to see where each warpgroup waits; untraced, the
kernel's code is the same as without the option.

The kernel is written for Triton 3.6's Gluon (the GPU stack) and compiles for sm90 only; the
Triton kernel stays the path everywhere else (and the interpreter's). Nothing is compiled at
import, and the module imports without Gluon: `gluon_problem` says in one line why it cannot run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:    # Gluon is experimental: its module paths move between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    GLUON_IMPORT_PROBLEM = None
except Exception as e:   # noqa: BLE001 - any failure means the same: no Gluon kernel here
    GLUON_IMPORT_PROBLEM = f"{type(e).__name__}: {e}".splitlines()[0]

from .fp8_attention_constants import HEAD_DIMS, LOG2_FP8_MAX_C, MAGIC_BITS, MAGIC_FLOAT, SCALE_M, SCALE_N
from .fp8_quant import FP8_DTYPE, INTERPRETED

WARPGROUP_ROWS = 64          # query rows a consumer warpgroup owns (a wgmma's M)
# A masked key's logit bits: the lowest logit the magic offset reads (as the Triton kernel masks).
MASKED_BITS = tl.constexpr(MAGIC_BITS.value - (1 << 22))


@dataclass(frozen=True)
class GluonTiles:
    """Launch parameters: `consumers` warpgroups of 64 query rows a program (2: ping-pong between
    them when `pingpong`), `block_n` keys a step, `num_stages` K/V slots in the ring; `permuted_k`:
    K's rows loaded in the order that makes P the P V operand in place (`_pack_p`; else P moves
    between lanes through a layout conversion); registers a thread for the consumer and producer
    warpgroups (`setmaxnreg`) and the kernel's cap (`maxnreg`, which sets what the default
    partition keeps: 3 warpgroups x 168 - 240 - 24 = 240)."""

    consumers: int = 2
    block_n: int = 128
    num_stages: int = 3          # one program an SM: shared memory is there for a deeper ring
    pingpong: bool = True
    permuted_k: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168
    poly_exp2: int = 0           # P's exp2 on the FMA units for 1 in 4 (1) or 1 in 2 (2) logits, not MUFU

    @property
    def block_m(self) -> int:
        return self.consumers * WARPGROUP_ROWS

    def problem(self) -> str | None:
        if self.consumers not in (1, 2):
            return f"Gluon FP8 attention runs 1 or 2 consumer warpgroups, got {self.consumers}"
        if self.pingpong and self.consumers != 2:
            return "Gluon FP8 attention: pingpong needs 2 consumer warpgroups"
        if self.block_n not in (64, 128):
            return f"Gluon FP8 attention: block_n must be 64 or 128, got {self.block_n}"
        if self.num_stages < 2:
            return f"Gluon FP8 attention needs num_stages >= 2, got {self.num_stages}"
        if self.poly_exp2 not in (0, 1, 2):
            return f"Gluon FP8 attention: poly_exp2 is 0, 1 (a quarter of P) or 2 (half), got {self.poly_exp2}"
        return None


GLUON_TILES = GluonTiles()

# A traced launch's buffer: int64 [programs, TRACE_ROLES, iterations + 1, TRACE_SLOTS]. Roles: the two
# consumer warpgroups, then the producer. Row `iteration` j of a consumer holds `%clock64` at each of
# TRACE_POINTS of key block j (row 0: block 0, whose logits and softmax come before the loop: no V, no
# P V); of the producer, at PRODUCER_POINTS of loading block j. The last row holds TRACE_META.
TRACE_ROLES = 3
TRACE_POINTS = ("top", "k_ready", "turn_held", "qk_issued", "v_ready", "turn_passed", "logits_ready",
                "k_released", "softmax_done", "pv_done", "v_released", "end")
PRODUCER_POINTS = ("k_empty_wait", "k_empty_done", "v_empty_wait", "v_empty_done")
TRACE_META = ("smid", "start", "finish")
TRACE_SLOTS = len(TRACE_POINTS)
_SLOTS = tl.constexpr(TRACE_SLOTS)
_ROLES = tl.constexpr(TRACE_ROLES)
# The slots as the kernel names them (constexpr: the kernel reads them)
(_AT_TOP, _AT_K_READY, _AT_TURN_HELD, _AT_QK_ISSUED, _AT_V_READY, _AT_TURN_PASSED, _AT_LOGITS_READY, _AT_K_RELEASED,
 _AT_SOFTMAX_DONE, _AT_PV_DONE, _AT_V_RELEASED, _AT_END) = (tl.constexpr(i) for i in range(TRACE_SLOTS))
_AT_K_EMPTY_WAIT, _AT_K_EMPTY_DONE, _AT_V_EMPTY_WAIT, _AT_V_EMPTY_DONE = (tl.constexpr(i) for i in range(4))
_AT_SMID, _AT_START, _AT_FINISH = (tl.constexpr(i) for i in range(3))


def trace_buffer(programs: int, iterations: int, device) -> torch.Tensor:
    """A zeroed trace buffer for `programs` programs (linear index pid0 * programs_y + pid1) and the
    first `iterations` key blocks of each."""
    if programs < 1 or iterations < 1:
        raise ValueError(f"trace_buffer: programs and iterations must be >= 1, got {programs}, {iterations}")
    return torch.zeros(programs, TRACE_ROLES, iterations + 1, TRACE_SLOTS, dtype=torch.int64, device=device)


def trace_problem(trace: torch.Tensor) -> str | None:
    """Why `trace` is not a trace buffer (`trace_buffer`'s), in one line, or None."""
    if (trace.dtype != torch.int64 or trace.dim() != 4 or trace.shape[1] != TRACE_ROLES
            or trace.shape[3] != TRACE_SLOTS or trace.shape[0] < 1 or trace.shape[2] < 2 or not trace.is_contiguous()):
        return (f"trace must be a contiguous int64 [programs, {TRACE_ROLES}, iterations + 1, {TRACE_SLOTS}] tensor "
                f"(trace_buffer), got {trace.dtype} {tuple(trace.shape)}")
    return None


def gluon_problem(device: torch.device) -> str | None:
    """Why the Gluon kernel cannot run on `device`, in one line, or None."""
    if GLUON_IMPORT_PROBLEM is not None:
        return f"the Gluon FP8 attention kernel needs triton.experimental.gluon ({GLUON_IMPORT_PROBLEM})"
    if INTERPRETED:
        return "the Gluon FP8 attention kernel does not run under TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"the Gluon FP8 attention kernel runs on CUDA sm90 (Hopper), not on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (f"the Gluon FP8 attention kernel runs on sm90 (Hopper); {torch.cuda.get_device_name(device)} "
                f"is sm{capability[0]}{capability[1]}")
    return None


if GLUON_IMPORT_PROBLEM is None:

    @gluon.jit
    def _producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                  q_row0, kv_row0, vt_row0, n_blocks, trace_ptr, trace_row,
                  CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  PERMUTED_K: gl.constexpr, TRACE: gl.constexpr, TRACED_PROGRAMS: gl.constexpr,
                  TRACE_ITERS: gl.constexpr):
        """The TMA loads: each consumer's Q once, then K and V^T of every key block through the ring
        (a slot is refilled once both consumers have released it)."""
        if TRACE:
            traced = trace_row < TRACED_PROGRAMS
            trace_base = (trace_row * _ROLES + 2) * (TRACE_ITERS + 1) * _SLOTS
            _stamp_meta(trace_ptr + trace_base + TRACE_ITERS * _SLOTS, traced, 1)
        for w in gl.static_range(CONSUMERS):
            mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row0 + w * 64, 0], q_bars.index(w), q_smem.index(w))
        for j in range(n_blocks):
            stage = j % NUM_STAGES
            empty_phase = ((j // NUM_STAGES) & 1) ^ 1      # a fresh mbarrier's "previous" phase is complete
            if TRACE:
                on = traced & (j < TRACE_ITERS)
                at = trace_ptr + (trace_base + j * _SLOTS)
                _stamp(at + _AT_K_EMPTY_WAIT, on, 1)
            mbarrier.wait(k_empty.index(stage), empty_phase)
            if TRACE:
                _stamp(at + _AT_K_EMPTY_DONE, on, 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            if PERMUTED_K:
                tma.async_copy_global_to_shared(k_desc, [(kv_row0 + j * BLOCK_N) // 16, 0, 0, 0, 0],
                                                k_ready.index(stage), k_smem.index(stage))
            else:
                tma.async_copy_global_to_shared(k_desc, [kv_row0 + j * BLOCK_N, 0], k_ready.index(stage),
                                                k_smem.index(stage))
            if TRACE:
                _stamp(at + _AT_V_EMPTY_WAIT, on, 1)
            mbarrier.wait(v_empty.index(stage), empty_phase)
            if TRACE:
                _stamp(at + _AT_V_EMPTY_DONE, on, 1)
            mbarrier.expect(v_ready.index(stage), vt_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(vt_desc, [vt_row0, j * BLOCK_N], v_ready.index(stage),
                                            v_smem.index(stage))
        if TRACE:
            _stamp(trace_ptr + trace_base + TRACE_ITERS * _SLOTS + _AT_FINISH, traced, 1)

    @gluon.jit
    def _stamp(at, on, WARPS: gl.constexpr, SMID: gl.constexpr = False):
        """Record `%clock64` (or with SMID, `%smid`) at the trace pointer `at` from the partition's first
        thread when `on`. The register is read in every thread (one value a thread: a [32 WARPS] tensor); the
        read is not pure, so that it is neither merged with nor moved across other reads. A block's stamps
        take `at` as one row pointer plus a constant: the store's immediate offset, no address arithmetic."""
        lane = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        if SMID:
            value = gl.inline_asm_elementwise("{ .reg .u32 sm;\n mov.u32 sm, %smid;\n cvt.u64.u32 $0, sm; }",
                                              "=l,r", [lane], dtype=gl.int64, is_pure=False, pack=1)
        else:
            value = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [lane], dtype=gl.int64,
                                              is_pure=False, pack=1)
        gl.store(at + lane * 0, value, mask=(lane == 0) & on)

    @gluon.jit
    def _stamp_meta(row, on, WARPS: gl.constexpr):
        """TRACE_META's smid and start clock into the trace row `row` (the program's and role's last)."""
        _stamp(row + _AT_SMID, on, WARPS, True)
        _stamp(row + _AT_START, on, WARPS)

    @gluon.jit
    def _take_turn(turns, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait until this warpgroup may issue its MMAs (its t-th turn; warpgroup 0 goes first)."""
        if PINGPONG:
            mbarrier.wait(turns.index(WG), (t + 1 - WG) & 1)

    @gluon.jit
    def _pass_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - WG))

    @gluon.jit
    def _release(bar):
        """Free a ring slot: every warp of the warpgroup has waited on the MMAs that read it."""
        gl.thread_barrier()
        mbarrier.arrive(bar)

    @gluon.jit
    def _key_of_column(BLOCK_N: gl.constexpr, s_layout: gl.constexpr, PERMUTED_K: gl.constexpr):
        """The key (within the block) of each logit column: with PERMUTED_K, column 16 g + 8 h + 2 c + e
        holds key 16 g + 4 c + 2 h + e (K's rows are loaded in that order, see `_pack_p`)."""
        n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if PERMUTED_K:
            n = (n & ~15) + ((n >> 1) & 3) * 4 + ((n >> 3) & 1) * 2 + (n & 1)
        return n

    @gluon.jit
    def _pack_p(p, BLOCK_N: gl.constexpr, p_layout: gl.constexpr, PERMUTED_K: gl.constexpr):
        """P (float32, the Q K^T accumulator's layout) -> the e4m3 A operand of P V as int32 words, four
        keys a word, computed in the registers P is in. A thread holds accumulator columns
        {2c, 2c+1, 8+2c, 9+2c} of each 16 (c: its lane mod 4) and A operand columns {4c .. 4c+3}:
        K's rows are loaded permuted so that those accumulator columns are keys 4c .. 4c+3, which
        makes the operand a relabelling of the registers (no shuffles; without PERMUTED_K the layout
        conversion moves P between lanes). The words are what the loop carries (a tensor of bytes
        would be carried as one byte a register and packed again before each MMA)."""
        if PERMUTED_K:
            p = gl.reshape(p, [64, BLOCK_N // 16, 2, 4, 2])                     # [row, g, h, c, e]
            p = gl.reshape(gl.permute(p, (0, 1, 3, 2, 4)), [64, BLOCK_N])       # [row, g, c, h, e]
            p = gl.convert_layout(p, p_layout, assert_trivial=True)
        else:
            p = gl.convert_layout(p, p_layout)
        lo, hi = gl.split(gl.reshape(p, [64, BLOCK_N // 4, 2, 2]))               # keys 4i + {0, 2}, 4i + {1, 3}
        k0, k2 = gl.split(lo)
        k1, k3 = gl.split(hi)
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            " mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [k0, k1, k2, k3], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pv_operand(words, BLOCK_N: gl.constexpr, p_layout: gl.constexpr):
        """`_pack_p`'s words as the [64, BLOCK_N] e4m3 operand tensor (each word's four bytes in place)."""
        w = gl.join(words, words)
        w = gl.reshape(gl.join(w, w), [64, BLOCK_N])
        w = gl.convert_layout(w, p_layout, assert_trivial=True)
        p8 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w], dtype=gl.int8, is_pure=True, pack=4)
        return p8.to(gl.float8e4nv, bitcast=True)

    @gluon.jit
    def _k_tile(k_smem, stage, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PERMUTED_K: gl.constexpr):
        """K^T of a ring slot as the MMA's B operand ([D, BLOCK_N], K-major as 8-bit wgmma needs). A
        permuted slot is 5-D as TMA wrote it; its bytes are the 2-D tile's (the same swizzle of D-byte rows)."""
        tile = k_smem.index(stage)
        if PERMUTED_K:
            tile = tile._reinterpret(gl.int8, [BLOCK_N, HEAD_DIM],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.int8))
        return tile.permute((1, 0))

    @gluon.jit
    def _exp2_fma(x):
        """2^x on the FMA and integer units: 2^j by the exponent bits, 2^f (|f| <= 1/2) by a degree-2
        polynomial (relative error 1.7e-3, far under e4m3's rounding of P: 2^-4). x >= -126: smaller
        values are P's zeros in e4m3 anyway."""
        x = gl.maximum(x, -126.0)
        t = x + 12582912.0                      # 1.5 * 2^23: x rounded to an integer j in t's low bits
        f = x - (t - 12582912.0)
        p = (0.23842697 * f + 0.70344532) * f + 1.0004431
        return (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _exp2_split(x, BLOCK_N: gl.constexpr, POLY_EXP2: gl.constexpr):
        """2^x with POLY_EXP2 (1: a quarter, 2: half) of the columns on the FMA units, the rest on MUFU:
        the exp2 unit (16 results a clock an SM) bounds an 8-bit attention kernel; the FMA units idle."""
        if POLY_EXP2 == 0:
            return gl.exp2(x)
        if POLY_EXP2 == 2:
            x0, x1 = gl.split(gl.reshape(x, [64, BLOCK_N // 2, 2]))
            y = gl.join(gl.exp2(x0), _exp2_fma(x1))
        else:   # the columns a thread holds differ in bits 0 and 3 (`_pack_p`): split on both
            x0, x1 = gl.split(gl.reshape(x, [64, BLOCK_N // 16, 2, 4, 2]))     # [row, g, bit 3, c, bit 0]
            x00, x01 = gl.split(gl.permute(x0, (0, 1, 3, 2)))
            y0 = gl.permute(gl.join(gl.exp2(x00), _exp2_fma(x01)), (0, 1, 3, 2))
            y1 = gl.exp2(x1)
            y = gl.join(gl.convert_layout(y0, y1.type.layout, assert_trivial=True), y1)
        return gl.convert_layout(gl.reshape(y, [64, BLOCK_N]), x.type.layout, assert_trivial=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, scale, n0, sk, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 PERMUTED_K: gl.constexpr, POLY_EXP2: gl.constexpr):
        """One online-softmax step on the int32 logits `s` (offset by the magic bits) of keys
        [n0, n0 + BLOCK_N): -> (P * 448 as float32, the new row max, row sums, the rescale alpha).
        Keys >= sk (the last block only) are masked."""
        masked = n0 + BLOCK_N > sk
        if masked:
            s = gl.where((_key_of_column(BLOCK_N, s_layout, PERMUTED_K) < sk - n0)[None, :], s, MASKED_BITS)
        m_new = gl.maximum(m_i, (gl.max(s, axis=1) - MAGIC_BITS).to(gl.float32) * scale)
        shift = MAGIC_FLOAT * scale + (m_new - LOG2_FP8_MAX_C)
        p = _exp2_split(s.to(gl.float32, bitcast=True) * scale - shift[:, None], BLOCK_N, POLY_EXP2)
        if masked:
            p = gl.where((_key_of_column(BLOCK_N, s_layout, PERMUTED_K) < sk - n0)[None, :], p, 0.0)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turns,
                  qs_ptr, ks_ptr, vs_ptr, o_ptr, n_blocks, sk, m0, sq, kv_bh, b, h,
                  stride_qs_bh, bh, stride_ks_bh, stride_ob, stride_oh, stride_os, trace_ptr, trace_row,
                  WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  SCALE_M: gl.constexpr, SCALE_N: gl.constexpr, PINGPONG: gl.constexpr,
                  PERMUTED_K: gl.constexpr, POLY_EXP2: gl.constexpr, TRACE: gl.constexpr,
                  TRACED_PROGRAMS: gl.constexpr, TRACE_ITERS: gl.constexpr):
        """64 query rows (m0 + 64 WG ...) against every key: S_{j+1} = Q K_{j+1}^T issued before
        O += P_j V_j, the softmax of S_{j+1} while that P V runs. Traced: TRACE_POINTS of key blocks
        < TRACE_ITERS into trace row (trace_row, WG, j)."""
        if TRACE:
            traced = trace_row < TRACED_PROGRAMS
            trace_base = (trace_row * _ROLES + WG) * (TRACE_ITERS + 1) * _SLOTS
            _stamp_meta(trace_ptr + trace_base + TRACE_ITERS * _SLOTS, traced, 4)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row0 = m0 + WG * 64
        q_scale = gl.load(qs_ptr + bh * stride_qs_bh + row0 // SCALE_M)
        ks_ptr = ks_ptr + kv_bh * stride_ks_bh
        q = q_smem.index(WG)
        magic = gl.full([64, BLOCK_N], MAGIC_BITS, gl.int32, layout=s_layout)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)

        # key block 0: its logits and softmax
        if TRACE:     # block 0's row: Q K^T alone (qk_issued, v_ready, pv_done, v_released stay 0)
            _stamp(trace_ptr + trace_base + _AT_TOP, traced, 4)
        mbarrier.wait(q_bars.index(WG), 0)
        mbarrier.wait(k_ready.index(0), 0)
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_K_READY, traced, 4)
        _take_turn(turns, 0, WG, PINGPONG)
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_TURN_HELD, traced, 4)
        s = warpgroup_mma(q, _k_tile(k_smem, 0, BLOCK_N, HEAD_DIM, PERMUTED_K), magic, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_TURN_PASSED, traced, 4)
        s = warpgroup_mma_wait(0, deps=[s])
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_LOGITS_READY, traced, 4)
        _release(k_empty.index(0))
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_K_RELEASED, traced, 4)
        scale = q_scale * gl.load(ks_ptr)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, scale, 0, sk, s_layout, BLOCK_N, PERMUTED_K, POLY_EXP2)
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_SOFTMAX_DONE, traced, 4)
        p8 = _pack_p(p, BLOCK_N, p_layout, PERMUTED_K)
        if TRACE:
            _stamp(trace_ptr + trace_base + _AT_END, traced, 4)

        for j in range(1, n_blocks):
            stage = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            if TRACE:
                on = traced & (j < TRACE_ITERS)
                at = trace_ptr + (trace_base + j * _SLOTS)
                _stamp(at + _AT_TOP, on, 4)
            p_op = _pv_operand(p8, BLOCK_N, p_layout)
            mbarrier.wait(k_ready.index(stage), (j // NUM_STAGES) & 1)
            if TRACE:
                _stamp(at + _AT_K_READY, on, 4)
            _take_turn(turns, j, WG, PINGPONG)
            if TRACE:
                _stamp(at + _AT_TURN_HELD, on, 4)
            s_next = warpgroup_mma(q, _k_tile(k_smem, stage, BLOCK_N, HEAD_DIM, PERMUTED_K), magic, is_async=True)
            if TRACE:
                _stamp(at + _AT_QK_ISSUED, on, 4)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
            if TRACE:
                _stamp(at + _AT_V_READY, on, 4)
            acc = warpgroup_mma(p_op, v_smem.index(prev).permute((1, 0)), acc, is_async=True)
            _pass_turn(turns, WG, PINGPONG)
            if TRACE:
                _stamp(at + _AT_TURN_PASSED, on, 4)
            s = warpgroup_mma_wait(1, deps=[s_next])          # this block's logits; P V still runs
            if TRACE:
                _stamp(at + _AT_LOGITS_READY, on, 4)
            _release(k_empty.index(stage))
            if TRACE:
                _stamp(at + _AT_K_RELEASED, on, 4)
            scale = q_scale * gl.load(ks_ptr + (j * BLOCK_N) // SCALE_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, scale, j * BLOCK_N, sk, s_layout, BLOCK_N, PERMUTED_K,
                                             POLY_EXP2)
            if TRACE:
                _stamp(at + _AT_SOFTMAX_DONE, on, 4)
            acc = warpgroup_mma_wait(0, deps=[acc])
            if TRACE:
                _stamp(at + _AT_PV_DONE, on, 4)
            _release(v_empty.index(prev))
            if TRACE:
                _stamp(at + _AT_V_RELEASED, on, 4)
            # packed once the P V that reads the previous words is done: ptxas serializes every wgmma
            # where a register one reads is written while it may still run
            p8 = _pack_p(p, BLOCK_N, p_layout, PERMUTED_K)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            if TRACE:
                _stamp(at + _AT_END, on, 4)

        last = (n_blocks - 1) % NUM_STAGES
        p_op = _pv_operand(p8, BLOCK_N, p_layout)
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // NUM_STAGES) & 1)
        _take_turn(turns, n_blocks, WG, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(last).permute((1, 0)), acc, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _release(v_empty.index(last))

        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        v_scale = gl.load(vs_ptr + kv_bh * HEAD_DIM + dims)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / l_o[:, None] * v_scale[None, :]     # P's 448 is in both acc and l_i
        ptrs = o_ptr + b * stride_ob + h * stride_oh + rows.to(gl.int64)[:, None] * stride_os + dims[None, :]
        gl.store(ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows < sq)[:, None])
        if TRACE:
            _stamp(trace_ptr + trace_base + TRACE_ITERS * _SLOTS + _AT_FINISH, traced, 4)

    @gluon.jit
    def _fp8_attention_gluon_kernel(q_desc, k_desc, vt_desc, qs_ptr, ks_ptr, vs_ptr, o_ptr,
                                    heads, kv_heads, sq, sq_pad, sk, sk_pad, stride_qs_bh, stride_ks_bh,
                                    stride_ob, stride_oh, stride_os, trace_ptr,
                                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                                    CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, SCALE_M: gl.constexpr,
                                    SCALE_N: gl.constexpr, PERMUTED_K: gl.constexpr,
                                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                    POLY_EXP2: gl.constexpr = 0, TRACE: gl.constexpr = False,
                                    TRACED_PROGRAMS: gl.constexpr = 0, TRACE_ITERS: gl.constexpr = 0):
        """One program: 64 CONSUMERS query rows of one (batch, query head) against every key of its
        KV head. Q, K, V^T are 2-D [rows, D] / [D rows, keys] matrices padded to whole scale blocks.
        TRACE: `trace_ptr` is a `trace_buffer` of TRACED_PROGRAMS programs and TRACE_ITERS key blocks
        (else unused)."""
        trace_row = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1) if TRACE else 0
        m0 = gl.program_id(0) * (64 * CONSUMERS)
        bh = gl.program_id(1)
        b = (bh // heads).to(gl.int64)
        h = bh % heads
        kv_bh = (bh // heads) * kv_heads + h // (heads // kv_heads)
        n_blocks = gl.cdiv(sk, BLOCK_N)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(vt_desc.dtype, [NUM_STAGES] + vt_desc.block_type.shape, vt_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(w), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        for w in gl.static_range(2):
            mbarrier.init(turns.index(w), count=1)
        fence_async_shared()   # the initialized barriers, before TMA (the async proxy) signals them

        q_row0 = bh * sq_pad + m0
        kv_row0 = kv_bh * sk_pad
        vt_row0 = kv_bh * HEAD_DIM
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turns, qs_ptr, ks_ptr,
                             vs_ptr, o_ptr, n_blocks, sk, m0, sq, kv_bh, b, h, stride_qs_bh, bh, stride_ks_bh,
                             stride_ob, stride_oh, stride_os, trace_ptr, trace_row, 0, HEAD_DIM, BLOCK_N, NUM_STAGES,
                             SCALE_M, SCALE_N, PINGPONG, PERMUTED_K, POLY_EXP2, TRACE, TRACED_PROGRAMS, TRACE_ITERS)),
                (_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turns, qs_ptr, ks_ptr,
                             vs_ptr, o_ptr, n_blocks, sk, m0, sq, kv_bh, b, h, stride_qs_bh, bh, stride_ks_bh,
                             stride_ob, stride_oh, stride_os, trace_ptr, trace_row, 1, HEAD_DIM, BLOCK_N, NUM_STAGES,
                             SCALE_M, SCALE_N, PINGPONG, PERMUTED_K, POLY_EXP2, TRACE, TRACED_PROGRAMS, TRACE_ITERS)),
                (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                             v_empty, q_row0, kv_row0, vt_row0, n_blocks, trace_ptr, trace_row, CONSUMERS, BLOCK_N,
                             NUM_STAGES, PERMUTED_K, TRACE, TRACED_PROGRAMS, TRACE_ITERS)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turns, qs_ptr, ks_ptr,
                             vs_ptr, o_ptr, n_blocks, sk, m0, sq, kv_bh, b, h, stride_qs_bh, bh, stride_ks_bh,
                             stride_ob, stride_oh, stride_os, trace_ptr, trace_row, 0, HEAD_DIM, BLOCK_N, NUM_STAGES,
                             SCALE_M, SCALE_N, False, PERMUTED_K, POLY_EXP2, TRACE, TRACED_PROGRAMS, TRACE_ITERS)),
                (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                             v_empty, q_row0, kv_row0, vt_row0, n_blocks, trace_ptr, trace_row, CONSUMERS, BLOCK_N,
                             NUM_STAGES, PERMUTED_K, TRACE, TRACED_PROGRAMS, TRACE_ITERS)),
            ], [1], [PRODUCER_REGS])


def _descriptors(q8, k8, vt8, tiles: GluonTiles):
    """TMA descriptors: Q [rows, D] in 64-row blocks; V^T [D rows, keys]; K [rows, D], or with
    `permuted_k` 5-D [rows / 16, h, c, e, D] over the same memory (strides 16 D, 2 D, 4 D, D, 1), so
    that a block lands in shared memory with key 16 g + 4 c + 2 h + e at row 16 g + 8 h + 2 c + e."""
    D = q8.shape[3]
    q2, k2, vt2 = q8.reshape(-1, D), k8.reshape(-1, D), vt8.reshape(-1, vt8.shape[3])   # contiguous: views
    q_block, vt_block = [WARPGROUP_ROWS, D], [D, tiles.block_n]
    if tiles.permuted_k:
        k_shape, k_strides = [k2.shape[0] // 16, 2, 4, 2, D], [16 * D, 2 * D, 4 * D, D, 1]
        k_block = [tiles.block_n // 16, 2, 4, 2, D]
    else:
        k_shape, k_strides, k_block = list(k2.shape), list(k2.stride()), [tiles.block_n, D]
    return (GluonTensorDescriptor(q2, list(q2.shape), list(q2.stride()), q_block,
                                  gl.NVMMASharedLayout.get_default_for(q_block, gl.int8)),
            GluonTensorDescriptor(k2, k_shape, k_strides, k_block,
                                  gl.NVMMASharedLayout.get_default_for(k_block, gl.int8)),
            GluonTensorDescriptor(vt2, list(vt2.shape), list(vt2.stride()), vt_block,
                                  gl.NVMMASharedLayout.get_default_for(vt_block, gl.float8e4nv)))


def operands_problem(q8, k8, vt8, tiles: GluonTiles) -> str | None:
    """Why the Gluon kernel does not take these `quantize_qkv` operands, in one line, or None."""
    problem = tiles.problem()
    if problem:
        return problem
    if vt8.dtype != FP8_DTYPE:
        return f"the Gluon FP8 attention kernel runs P V in e4m3 (pv='fp8'), got V^T in {vt8.dtype}"
    if q8.shape[3] not in HEAD_DIMS:
        return f"the Gluon FP8 attention kernel takes head_dim {HEAD_DIMS}, got {q8.shape[3]}"
    if SCALE_M % tiles.block_m or SCALE_N % tiles.block_n:
        return (f"the Gluon FP8 attention tiles {tiles.block_m} x {tiles.block_n} must divide the scale blocks "
                f"{SCALE_M} x {SCALE_N}")
    return None


def lengths_problem(q8, k8, vt8, sq: int, sk: int, heads: int) -> str | None:
    """Why `sq`, `sk`, `heads` do not describe these operands, in one line, or None. The kernel trusts
    them: with no key its consumers would wait forever for a first K tile; lengths past the padded
    ones, or query heads that are not a whole multiple of the KV heads, would read other heads' rows."""
    B, q_heads, sq_pad, D = q8.shape
    kv_heads, sk_pad = k8.shape[1], k8.shape[2]
    if heads != q_heads or kv_heads < 1 or heads % kv_heads:
        return (f"the Gluon FP8 attention kernel needs heads ({heads}) = q8's heads ({q_heads}), a multiple of "
                f"k8's KV heads ({kv_heads})")
    if not 1 <= sk <= sk_pad or not 0 <= sq <= sq_pad:
        return (f"the Gluon FP8 attention kernel needs 1 <= sk <= {sk_pad} and 0 <= sq <= {sq_pad} (the operands' "
                f"padded lengths), got sk {sk}, sq {sq}")
    if tuple(vt8.shape) != (B, kv_heads, D, sk_pad) or k8.shape[0] != B or k8.shape[3] != D:
        return (f"the Gluon FP8 attention kernel takes k8 [B, Hkv, Sk_pad, D] and vt8 [B, Hkv, D, Sk_pad] for q8 "
                f"{tuple(q8.shape)}, got k8 {tuple(k8.shape)}, vt8 {tuple(vt8.shape)}")
    return None


def fp8_attention_gluon(q8, q_scale, k8, k_scale, vt8, v_scale, sq: int, sk: int, heads: int,
                        dtype: torch.dtype, tiles: GluonTiles | None = None) -> torch.Tensor:
    """The Gluon kernel over `quantize_qkv`'s operands -> out [B, Sq, Hq, D] (as `_fp8_attention_triton`)."""
    return launch_fp8_attention_gluon(q8, q_scale, k8, k_scale, vt8, v_scale, sq, sk, heads, dtype, tiles)[0]


def launch_fp8_attention_gluon(q8, q_scale, k8, k_scale, vt8, v_scale, sq: int, sk: int, heads: int,
                               dtype: torch.dtype, tiles: GluonTiles | None = None, trace: torch.Tensor | None = None):
    """`fp8_attention_gluon`, and the compiled kernel it ran (a benchmark reads its registers). With
    `trace` (a `trace_buffer`), the traced kernel writes its clocks there (see TRACE_POINTS)."""
    tiles = tiles or GLUON_TILES
    problem = (gluon_problem(q8.device) or operands_problem(q8, k8, vt8, tiles)
               or lengths_problem(q8, k8, vt8, sq, sk, heads) or (trace_problem(trace) if trace is not None else None))
    if problem is None and trace is not None and trace.device != q8.device:
        problem = f"the trace buffer is on {trace.device}, the operands on {q8.device}"
    if problem:
        raise RuntimeError(f"fp8_attention_gluon: {problem}")
    B, _, sq_pad, D = q8.shape
    kv_heads, sk_pad = k8.shape[1], k8.shape[2]
    out = torch.empty(B, sq, heads, D, dtype=dtype, device=q8.device)
    if out.numel() == 0:       # no query: nothing to launch (TMA cannot describe an empty Q)
        return out, None
    q_desc, k_desc, vt_desc = _descriptors(q8, k8, vt8, tiles)
    grid = (triton.cdiv(sq, tiles.block_m), B * heads)
    traced = {} if trace is None else dict(TRACE=True, TRACED_PROGRAMS=trace.shape[0], TRACE_ITERS=trace.shape[2] - 1)
    compiled = _fp8_attention_gluon_kernel[grid](
        q_desc, k_desc, vt_desc, q_scale, k_scale, v_scale, out,
        heads, kv_heads, sq, sq_pad, sk, sk_pad, q_scale.stride(1), k_scale.stride(1),
        out.stride(0), out.stride(2), out.stride(1),
        trace if trace is not None else torch.empty(1, dtype=torch.int64, device=q8.device),
        HEAD_DIM=D, BLOCK_N=tiles.block_n, NUM_STAGES=tiles.num_stages, CONSUMERS=tiles.consumers,
        PINGPONG=tiles.pingpong, SCALE_M=SCALE_M, SCALE_N=SCALE_N, PERMUTED_K=tiles.permuted_k,
        CONSUMER_REGS=tiles.consumer_regs, PRODUCER_REGS=tiles.producer_regs, POLY_EXP2=tiles.poly_exp2, num_warps=4,
        maxnreg=tiles.maxnreg, **traced)
    return out, compiled
