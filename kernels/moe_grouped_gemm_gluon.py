"""An FP8 grouped GEMM in Gluon for Hopper (sm90): persistent, TMA-fed, warp-specialized.

The routed experts' two GEMMs with torch._scaled_grouped_mm's contract
(`kernels.moe_scaled_grouped_mm` defines the pipeline around them and hands over the same views):
- a [rows, K] e4m3, unit stride along K, one float32 scale per row (scale_a [rows]);
- b [G, N, K] e4m3, unit stride along K (the resident layout, read in place: its G and N dims
  must merge, as they do for ``w_gate_up[m]`` and ``w_down.view(M*E, H, I)``), one float32
  scale per (group, N) row: scale_b [P, N] with unit stride along N, row ``g % P`` for group g
  (P = G, or the E experts' scales shared by the M micros of the down GEMM without a repeat);
- group_ends [G] int32: group g holds rows ``group_ends[g-1] .. group_ends[g]`` (any count, none
  included);
- out [rows, N] bf16 = ``(a @ b[g].T) * scale_a[row] * scale_b[g % P, n]``.

The kernel (`_grouped_gemm_fp8_kernel`): one program per SM loops over the work items (group,
row tile, column tile), numbered group by group and, in a group, column tile by column tile with
the group's row tiles consecutive, so the programs running side by side read the same B tiles
(hot in L2) and each group's rows stay in L2 over its column tiles. The items' table is the
cumulated count per group (`work_ends`, computed on the device from group_ends: no host sync,
CUDA-graph safe); each program walks it forward. The partitions (`GluonTiles`):
- a producer (1 warp, 24 registers): TMA loads of A [block_m, 128] and B [block_n, 128] tiles into a
  `stages`-deep shared ring, each stage's "ready" mbarrier expecting the bytes, waiting on its "empty" one;
- the consumers: async wgmma on each ready stage, one MMA in flight (`warpgroup_mma_wait(1)`), the stage
  before it released to the producer; the scales load under the last MMA; then the epilogue (both
  scales, bf16, stores masked to the group's rows and to N) while the producer already fills the ring
  with the next items' operands. A row tile that runs past its group's end reads the next group's rows
  (or TMA's zero fill past the tensor) and masks them at the store. Either one consumer of two
  warpgroups sharing a 128 x 256 accumulator (`DEFAULT_TILES`), or ping-pong (`PINGPONG_TILES`): two
  consumer warpgroups of 128 x 128 taking the program's items in turn, so that one's epilogue runs
  under the other's MMAs (the ring hands out the stages in item order).

The accumulator is the tensor cores' FP8 one without promotion (torch's ``use_fast_accum``, the
default of Triton's FP8 dots on Hopper).

Gluon kernels compile for the GPU only (no TRITON_INTERPRET): `gluon_problem` names why it cannot
run on a device; elsewhere the Triton kernels (`kernels.moe_grouped_gemm`) and the torch library
path stay. Nothing compiles at import; on a triton without Gluon's Hopper API the module imports and
`gluon_problem` says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

try:  # Gluon's Hopper API: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _IMPORT_PROBLEM = None
except ImportError as err:  # pragma: no cover - depends on the installed triton
    _IMPORT_PROBLEM = f"triton {triton.__version__} has no Gluon Hopper API ({err})"

# K steps of 128 e4m3: 128-byte rows, the widest swizzle, 4 wgmma k32 instructions a stage.
BLOCK_K = 128
PRODUCER_REGS = 24
# K and N in whole 16-byte TMA rows.
ALIGN_ELEMENTS = 16
SHARED_BYTES = 227 * 1024  # an H100's / H200's shared memory per block


@dataclass(frozen=True)
class GluonTiles:
    """A tile and its ring: block_m x block_n accumulated by `warps` consumer warps (warpgroups of 4
    stacked along M, each 64 rows at a time), `stages` shared stages of A [block_m, 128] and B [block_n, 128].
    consumers 2 (ping-pong): two consumer warpgroups (warps 4), each on every other work item, so one's
    epilogue overlaps the other's MMAs. specialized False: the simple kernel (one software pipeline, no
    producer warp), the specialized one's reference."""
    block_m: int = 128
    block_n: int = 256
    stages: int = 4
    warps: int = 8
    consumers: int = 1
    specialized: bool = True

    def problem(self) -> str | None:
        """Why this tile cannot compile, in one line, or None."""
        stage_bytes = (self.block_m + self.block_n) * BLOCK_K
        if self.warps not in (4, 8) or self.block_m % (16 * self.warps) or self.block_n not in (64, 128, 256):
            return f"{self}: block_m a multiple of 16 x warps (4 or 8), block_n 64, 128 or 256"
        if self.consumers not in (1, 2) or (self.consumers == 2 and (self.warps != 4 or not self.specialized)):
            return f"{self}: one consumer, or two (ping-pong, specialized) of one warpgroup (warps 4) each"
        if self.block_m * self.block_n // (32 * self.warps) > 128:
            return f"{self}: over 128 accumulator registers a thread"
        if not 2 <= self.stages or self.stages * stage_bytes + 1024 > SHARED_BYTES:
            return (f"{self}: {self.stages} stages of {stage_bytes} bytes do not fit {SHARED_BYTES} bytes of "
                    f"shared memory")
        return None

    @property
    def max_regs(self) -> int:
        """Registers per thread at launch: the consumer warps and the producer's warpgroup share the SM's 64 Ki
        (warp specialization then moves the producer's unused share to the consumers with setmaxnreg)."""
        return min(256, 65536 // ((self.warps * self.consumers + 4) * 32) // 8 * 8)

    @property
    def consumer_regs(self) -> int:
        """The ping-pong's second consumer warpgroup: what the producer's 24 leave, halved, in steps of 8."""
        return min(256, (65536 // 128 - PRODUCER_REGS) // 2 // 8 * 8)


# The default: a 128 x 256 accumulator over two warpgroups (128 float32 registers a thread); a stage
# holds A 16 KiB + B 32 KiB, four stages 192 KiB.
DEFAULT_TILES = GluonTiles()
# Ping-pong: 128 x 128 per consumer warpgroup, six stages of 32 KiB.
PINGPONG_TILES = GluonTiles(128, 128, 6, 4, consumers=2)
# The simple kernel at the default tile (the specialized kernels' reference).
SIMPLE_TILES = GluonTiles(specialized=False)


def gluon_problem(device: torch.device) -> str | None:
    """Why the Gluon grouped GEMM cannot run on `device`, in one line, or None."""
    if _IMPORT_PROBLEM:
        return _IMPORT_PROBLEM
    if device.type != "cuda":
        return f"the Gluon FP8 grouped GEMM runs on CUDA (compute capability 9.0), not on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (f"the Gluon FP8 grouped GEMM is written for sm90's wgmma (compute capability 9.0: H100, H200); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


def shape_problem(hidden: int, inter: int) -> str | None:
    """Why these expert sizes do not fit the kernel's TMA rows, in one line, or None."""
    for name, size in (("hidden size H", hidden), ("intermediate size I", inter)):
        if size % ALIGN_ELEMENTS:
            return f"the Gluon FP8 grouped GEMM needs the {name} to be a multiple of {ALIGN_ELEMENTS}, got {size}"
    return None


def check_operands(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   group_ends: torch.Tensor) -> None:
    """The contract (module docstring), each breach in one line naming the tensor. No sync."""
    def fail(message: str):
        raise ValueError(f"Gluon FP8 grouped GEMM: {message}")

    if a.dim() != 2 or a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1:
        fail(f"a must be [rows, K] float8_e4m3fn with unit stride along K, got {a.dtype} {tuple(a.shape)} "
             f"strides {a.stride()}")
    if b.dim() != 3 or b.dtype != torch.float8_e4m3fn or b.stride(-1) != 1 or b.shape[2] != a.shape[1]:
        fail(f"b must be [G, N, K = {a.shape[1]}] float8_e4m3fn with unit stride along K, got {b.dtype} "
             f"{tuple(b.shape)} strides {b.stride()}")
    groups, n_out, k_dim = b.shape
    if b.stride(0) != n_out * b.stride(1):
        fail(f"b's group and N dims must merge without a copy (stride(0) = N * stride(1)), got strides {b.stride()}")
    if k_dim == 0 or n_out == 0:  # no TMA descriptor of an empty dim; a K loop of no step releases no stage
        fail(f"K and N must be positive, got K {k_dim}, N {n_out}")
    if k_dim % ALIGN_ELEMENTS or n_out % ALIGN_ELEMENTS or b.stride(1) % ALIGN_ELEMENTS or \
            a.stride(0) % ALIGN_ELEMENTS:
        fail(f"K, N and the row strides must be multiples of {ALIGN_ELEMENTS} (TMA rows), got K {k_dim}, N {n_out}, "
             f"strides a {a.stride()} b {b.stride()}")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            fail(f"{name} must be 16-byte aligned, got address {t.data_ptr():#x}")
    if scale_a.shape != (a.shape[0],) or scale_a.dtype != torch.float32:
        fail(f"scale_a must be float32 [{a.shape[0]}] (one per row of a), got {scale_a.dtype} {tuple(scale_a.shape)}")
    if scale_b.dim() != 2 or scale_b.shape[1] != n_out or scale_b.dtype != torch.float32 or \
            scale_b.stride(1) != 1 or groups % max(scale_b.shape[0], 1):
        fail(f"scale_b must be float32 [P, N = {n_out}] with unit stride along N and P dividing G = {groups}, got "
             f"{scale_b.dtype} {tuple(scale_b.shape)} strides {scale_b.stride()}")
    if group_ends.shape != (groups,) or group_ends.dtype != torch.int32:
        fail(f"group_ends must be int32 [G = {groups}], got {group_ends.dtype} {tuple(group_ends.shape)}")
    devices = {t.device for t in (a, b, scale_a, scale_b, group_ends)}
    if len(devices) != 1:
        fail(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def work_ends_of(group_ends: torch.Tensor, column_tiles: int, block_m: int) -> torch.Tensor:
    """int32 [G]: the work items (row tile, column tile) of groups 0..g, cumulated; on the device."""
    counts = torch.diff(group_ends, prepend=group_ends.new_zeros(1))
    return (torch.div(counts + (block_m - 1), block_m, rounding_mode="floor") * column_tiles).cumsum(0).to(torch.int32)


# ----------------------------------------------------------------------------- kernel

if _IMPORT_PROBLEM is None:

    @gluon.jit
    def _work_item(t, g, group_ends_ptr, work_ends_ptr, BLOCK_M: gl.constexpr):
        """Work item t -> (its group g, first row, the group's end row, column tile). g only moves
        forward: a program's items come in increasing order."""
        while t >= gl.load(work_ends_ptr + g):
            g += 1
        row_start = gl.load(group_ends_ptr + g - 1, mask=g > 0, other=0)
        row_end = gl.load(group_ends_ptr + g)
        work_start = gl.load(work_ends_ptr + g - 1, mask=g > 0, other=0)
        row_tiles = gl.cdiv(row_end - row_start, BLOCK_M)
        local = t - work_start
        return g, row_start + (local % row_tiles) * BLOCK_M, row_end, local // row_tiles

    @gluon.jit
    def _tile_scales(rows_in_tile, cols_in_tile, g, row0, row_end, col_tile, n_out, scale_a_ptr, scale_b_ptr,
                     stride_scale_b, scale_b_rows, BLOCK_N: gl.constexpr):
        """The tile's rows and columns and their scales (0 outside the group's rows and N)."""
        rows = row0 + rows_in_tile
        cols = col_tile * BLOCK_N + cols_in_tile
        scale_a = gl.load(scale_a_ptr + rows, mask=rows < row_end, other=0.0)
        scale_b = gl.load(scale_b_ptr + (g % scale_b_rows).to(gl.int64) * stride_scale_b + cols, mask=cols < n_out,
                          other=0.0)
        return rows, cols, scale_a, scale_b

    @gluon.jit
    def _store_tile(acc, rows, cols, row_end, n_out, scale_a, scale_b, out_ptr, stride_out):
        """The epilogue: both scales, bf16, stores masked to the group's rows and to N."""
        out = (acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)).to(gl.bfloat16)
        offsets = gl.expand_dims(rows.to(gl.int64) * stride_out, 1) + gl.expand_dims(cols, 0)
        gl.store(out_ptr + offsets, out, mask=gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < n_out, 0))

    @gluon.jit
    def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_ends_ptr, work_ends_ptr, num_groups,
                        n_out, k_dim):
        """The producer: for each work item, its K steps' A and B tiles into the ring."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        total = gl.load(work_ends_ptr + num_groups - 1)
        g = gl.program_id(0) * 0
        it = gl.program_id(0) * 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            g, row0, row_end, col_tile = _work_item(t, g, group_ends_ptr, work_ends_ptr, BLOCK_M)
            b_row = g * n_out + col_tile * BLOCK_N
            for k in range(0, k_dim, BLOCK_K):
                s = it % STAGES
                # A stage's first use waits on the phase before its barrier's first (complete at init).
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), STAGE_BYTES)
                tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [b_row, k], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, ready, empty, order, out_ptr, scale_a_ptr, scale_b_ptr, group_ends_ptr,
                       work_ends_ptr, num_groups, n_out, k_dim, stride_out, stride_scale_b, scale_b_rows,
                       BLOCK_N: gl.constexpr, WARPS: gl.constexpr, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr):
        """A consumer: async wgmma over the ring, then the epilogue, for every CONSUMERS-th work item of the
        program from its CONSUMER-th (the ring hands the items' stages out in order, so with two consumers
        one's epilogue runs while the other's MMAs do).

        Two consumers take turns at the ring through `order` (CUTLASS's ping-pong order barrier): consumer c
        starts an item's K loop once the other has issued its previous item's (order[c] arrived), so only one
        walks the ring at a time and in item order. Without it the second consumer would wait on stages a
        whole item (more than the ring) ahead, where a barrier's phase parity cannot tell this round's
        completion from an earlier one's."""
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows_in_tile = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols_in_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        total = gl.load(work_ends_ptr + num_groups - 1)
        k_steps = gl.cdiv(k_dim, BLOCK_K)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        g = pid * 0
        turn = pid * 0
        for t in range(pid + CONSUMER * programs, total, CONSUMERS * programs):
            g, row0, row_end, col_tile = _work_item(t, g, group_ends_ptr, work_ends_ptr, BLOCK_M)
            it = (t - pid) // programs * k_steps  # the ring's count of stages before this item's
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            if CONSUMERS == 2:
                # The first consumer's first turn passes (the phase before a fresh barrier's first counts as
                # complete); after that each waits for the other's latest turn.
                mbarrier.wait(order.index(CONSUMER), (turn & 1) ^ (1 - CONSUMER))
            for k in range(0, k_dim, BLOCK_K):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a_buf = a_bufs.index(s)
                b_buf = b_bufs.index(s)
                acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, is_async=True)
                # One MMA stays in flight: the one before it has read its stage, which goes back.
                acc, a_buf, b_buf = warpgroup_mma_wait(1, deps=(acc, a_buf, b_buf))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
                it += 1
            if CONSUMERS == 2:
                mbarrier.arrive(order.index(1 - CONSUMER))  # the other consumer's turn at the ring
                turn += 1
            # The scales load while the last MMA runs.
            rows, cols, scale_a, scale_b = _tile_scales(rows_in_tile, cols_in_tile, g, row0, row_end, col_tile,
                                                        n_out, scale_a_ptr, scale_b_ptr, stride_scale_b,
                                                        scale_b_rows, BLOCK_N)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            # The epilogue runs while the producer already loads the next items.
            _store_tile(acc, rows, cols, row_end, n_out, scale_a, scale_b, out_ptr, stride_out)

    @gluon.jit
    def _grouped_gemm_fp8_kernel(a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, group_ends_ptr, work_ends_ptr,
                                 num_groups, n_out, k_dim, stride_out, stride_scale_b, scale_b_rows,
                                 STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(order.index(i), count=1)
        # (Constexprs go in by name: a tuple built here would turn them into tensors.)
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, ready, empty, order, out_ptr, scale_a_ptr, scale_b_ptr,
                                  group_ends_ptr, work_ends_ptr, num_groups, n_out, k_dim, stride_out, stride_scale_b,
                                  scale_b_rows, BLOCK_N, num_warps, 0, 1)),
                (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_ends_ptr, work_ends_ptr,
                                   num_groups, n_out, k_dim)),
            ], [1], [PRODUCER_REGS])
        else:  # ping-pong: the second consumer warpgroup in a worker partition
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, ready, empty, order, out_ptr, scale_a_ptr, scale_b_ptr,
                                  group_ends_ptr, work_ends_ptr, num_groups, n_out, k_dim, stride_out, stride_scale_b,
                                  scale_b_rows, BLOCK_N, num_warps, 0, 2)),
                (_mma_partition, (a_bufs, b_bufs, ready, empty, order, out_ptr, scale_a_ptr, scale_b_ptr,
                                  group_ends_ptr, work_ends_ptr, num_groups, n_out, k_dim, stride_out, stride_scale_b,
                                  scale_b_rows, BLOCK_N, num_warps, 1, 2)),
                (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_ends_ptr, work_ends_ptr,
                                   num_groups, n_out, k_dim)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


    @gluon.jit
    def _grouped_gemm_fp8_simple_kernel(a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, group_ends_ptr,
                                        work_ends_ptr, num_groups, n_out, k_dim, stride_out, stride_scale_b,
                                        scale_b_rows, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """The same work without warp specialization: one software pipeline over the program's (item, K step)
        sequence, loads issued STAGES - 1 steps ahead into the ring, async wgmma with one in flight. The
        reference of the specialized kernel (`GluonTiles.specialized`)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        rows_in_tile = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols_in_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        total = gl.load(work_ends_ptr + num_groups - 1)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        k_steps = gl.cdiv(k_dim, BLOCK_K)
        items = gl.cdiv(gl.maximum(total - pid, 0), programs)
        steps = items * k_steps
        g_load = pid * 0
        for p in range(0, STAGES - 1):  # the prologue: the first STAGES - 1 steps' loads
            if p < steps:
                g_load = _load_step(p, g_load, pid, programs, k_steps, a_desc, b_desc, a_bufs, b_bufs, ready,
                                    group_ends_ptr, work_ends_ptr, n_out, STAGE_BYTES, BLOCK_M, BLOCK_N, BLOCK_K,
                                    STAGES)
        g = pid * 0
        c = pid * 0
        # An item's K loop nested in the items' loop, its accumulator fresh each item and waited for after
        # it (one flat loop with the epilogue under a branch makes ptxas wait for every MMA: C7517).
        for j in range(0, items):
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for kk in range(0, k_steps):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                a_buf = a_bufs.index(s)
                b_buf = b_bufs.index(s)
                acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, is_async=True)
                acc, a_buf, b_buf = warpgroup_mma_wait(1, deps=(acc, a_buf, b_buf))
                # Step c - 1's MMA is done: its stage takes step c + STAGES - 1's loads.
                if c + STAGES - 1 < steps:
                    g_load = _load_step(c + STAGES - 1, g_load, pid, programs, k_steps, a_desc, b_desc, a_bufs,
                                        b_bufs, ready, group_ends_ptr, work_ends_ptr, n_out, STAGE_BYTES, BLOCK_M,
                                        BLOCK_N, BLOCK_K, STAGES)
                c += 1
            g, row0, row_end, col_tile = _work_item(pid + j * programs, g, group_ends_ptr, work_ends_ptr, BLOCK_M)
            rows, cols, scale_a, scale_b = _tile_scales(rows_in_tile, cols_in_tile, g, row0, row_end, col_tile,
                                                        n_out, scale_a_ptr, scale_b_ptr, stride_scale_b,
                                                        scale_b_rows, BLOCK_N)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _store_tile(acc, rows, cols, row_end, n_out, scale_a, scale_b, out_ptr, stride_out)

    @gluon.jit
    def _load_step(p, g, pid, programs, k_steps, a_desc, b_desc, a_bufs, b_bufs, ready, group_ends_ptr,
                   work_ends_ptr, n_out, STAGE_BYTES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """Step p's A and B tiles into its stage (the simple kernel's loads); returns the group tracker."""
        g, row0, row_end, col_tile = _work_item(pid + (p // k_steps) * programs, g, group_ends_ptr, work_ends_ptr,
                                                BLOCK_M)
        k = (p % k_steps) * BLOCK_K
        s = p % STAGES
        mbarrier.expect(ready.index(s), STAGE_BYTES)
        tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [g * n_out + col_tile * BLOCK_N, k], ready.index(s), b_bufs.index(s))
        return g


# ---------------------------------------------------------------------------- launcher


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def descriptors(a: torch.Tensor, b: torch.Tensor, tiles: GluonTiles) -> tuple:
    """TMA descriptors of a [rows, K] and of b as [G*N, K] (its group and N dims merged, in place)."""
    groups, n_out, k_dim = b.shape
    a_block, b_block = [tiles.block_m, BLOCK_K], [tiles.block_n, BLOCK_K]
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], a_block,
                              gl.NVMMASharedLayout.get_default_for(a_block, gl.float8e4nv))
    b_desc = TensorDescriptor(b, [groups * n_out, k_dim], [b.stride(1), 1], b_block,
                              gl.NVMMASharedLayout.get_default_for(b_block, gl.float8e4nv))
    return a_desc, b_desc


def grouped_gemm_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     group_ends: torch.Tensor, out: torch.Tensor | None = None,
                     tiles: GluonTiles = DEFAULT_TILES) -> torch.Tensor:
    """out [rows, N] bf16 = (a @ b[g].T) * scale_a[row] * scale_b[g % P] on each group's rows
    (module docstring: the contract). out: an optional [rows, N] bf16 tensor with unit stride along N."""
    check_operands(a, b, scale_a, scale_b, group_ends)
    if tiles.problem():
        raise ValueError(f"Gluon FP8 grouped GEMM tiles {tiles.problem()}")
    problem = gluon_problem(a.device)
    if problem:
        raise RuntimeError(problem)
    rows = a.shape[0]
    groups, n_out, k_dim = b.shape
    if out is None:
        out = torch.empty((rows, n_out), dtype=torch.bfloat16, device=a.device)
    elif out.shape != (rows, n_out) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"Gluon FP8 grouped GEMM: out must be bf16 [{rows}, {n_out}] with unit stride along N, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if rows == 0 or groups == 0:  # nothing to compute (TMA descriptors take no empty tensor)
        return out
    column_tiles = triton.cdiv(n_out, tiles.block_n)
    work_ends = work_ends_of(group_ends, column_tiles, tiles.block_m)
    a_desc, b_desc = descriptors(a, b, tiles)
    # One program per SM, never more than the work items can feed (bounded on the host without a sync).
    most_items = (triton.cdiv(rows, tiles.block_m) + groups) * column_tiles
    grid = (min(_num_sms(a.device), most_items),)
    args = (a_desc, b_desc, out, scale_a, scale_b, group_ends, work_ends, groups, n_out, k_dim, out.stride(0),
            scale_b.stride(0), scale_b.shape[0])
    if tiles.specialized:
        _grouped_gemm_fp8_kernel[grid](*args, STAGES=tiles.stages, CONSUMERS=tiles.consumers,
                                       PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=tiles.consumer_regs,
                                       num_warps=tiles.warps, maxnreg=tiles.max_regs)
    else:
        _grouped_gemm_fp8_simple_kernel[grid](*args, STAGES=tiles.stages, num_warps=tiles.warps)
    return out


def grouped_gemm_fp8_reference(a, b, scale_a, scale_b, group_ends) -> torch.Tensor:
    """`grouped_gemm_fp8` in torch: float32 products of the dequantized operands, bf16 out (one host
    sync: the group bounds)."""
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    bounds = [0] + group_ends.tolist()
    periods = scale_b.shape[0]
    for g in range(b.shape[0]):
        start, end = bounds[g], bounds[g + 1]
        if start < end:
            out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ \
                (b[g].float() * scale_b[g % periods][:, None]).T
    return out.to(torch.bfloat16)
