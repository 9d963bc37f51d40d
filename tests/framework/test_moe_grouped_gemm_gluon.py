"""kernels.moe_grouped_gemm_gluon: the FP8 grouped GEMM in Gluon (sm90) and MoE impl "gluon".

CPU: the contract's checks and the tiles' limits, each in one line; the work table; the whole op
with the kernel emulated in torch (its operand checks run on the very views the pipeline hands it,
then its math) against the op's reference; every refusal of the dispatch.
GPU (marker `gpu`, sm90): the kernel against its reference on groups of 0, 1 and 17 rows at the
denoise K/N and small ones, and over many items a program (the ring's phases wrapping), for each tile
the benchmark times; shared down scales (P < G); the denoise routing against torch._scaled_grouped_mm;
the op at the denoise shapes and a CUDA-graph replay.
"""
import math
import re
from functools import partial

import pytest
import torch

from kernels import fp8_quant as fq
from kernels import moe_grouped_gemm_gluon as gg
from kernels import moe_scaled_grouped_mm as sg
from kernels.moe_multi_micro import moe_multi_micro_fp8, moe_multi_micro_reference
from tests.framework.test_moe_grouped_gemm import make_inputs
from tests.framework.test_moe_scaled_grouped_mm import ends_of, op_reference, rel
from tests.support.triton import needs_triton

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon FP8 grouped GEMM is written for sm90")
TILES = [gg.DEFAULT_TILES, gg.PINGPONG_TILES, gg.SIMPLE_TILES, gg.GluonTiles(128, 128, 4, 8),
         gg.GluonTiles(64, 256, 4, 4)]


def fp8_operands(rows, groups, n_out, k_dim, device="cpu", scale_rows=None, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    a, scale_a = fq.quantize_activation_rows(torch.randn(rows, k_dim, device=device, generator=gen))
    w = torch.randn(groups, n_out, k_dim, device=device, generator=gen) / math.sqrt(k_dim)
    b, scale_b = fq.quantize_weight_channels(w)
    if scale_rows is not None:
        scale_b = scale_b[:scale_rows].contiguous()
    return a, scale_a.reshape(-1).contiguous(), b, scale_b


# ------------------------------------------------------------------------------ CPU


def test_operands_outside_the_contract_are_named_in_one_line():
    a, scale_a, b, scale_b = fp8_operands(20, 3, 32, 64)
    ends = ends_of([0, 17, 3])
    gg.check_operands(a, b, scale_a, scale_b, ends)
    cases = [
        ((a.float(), b, scale_a, scale_b, ends), "a must be [rows, K] float8_e4m3fn"),
        ((a, b[:, :, :32], scale_a, scale_b, ends), "b must be [G, N, K = 64] float8_e4m3fn"),
        ((a, b.transpose(0, 1), scale_a, scale_b[:, :3].contiguous(), ends), "b's group and N dims must merge"),
        ((a, b, scale_a[:5], scale_b, ends), "scale_a must be float32 [20]"),
        ((a, b, scale_a, scale_b[:2], ends), "scale_b must be float32 [P, N = 32] with unit stride along N and P "
                                             "dividing G = 3"),
        ((a, b, scale_a, scale_b, ends.long()), "group_ends must be int32 [G = 3]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match="^" + re.escape(f"Gluon FP8 grouped GEMM: {message}")):
            gg.check_operands(*args)
    a0, b0 = torch.zeros(4, 0, dtype=torch.float8_e4m3fn), torch.zeros(1, 32, 0, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^Gluon FP8 grouped GEMM: K and N must be positive, got K 0, N 32$"):
        gg.check_operands(a0, b0, torch.ones(4), torch.ones(1, 32), ends_of([4]))
    a40, _, b40, _ = fp8_operands(4, 1, 32, 40)
    with pytest.raises(ValueError, match="K, N and the row strides must be multiples of 16"):
        gg.check_operands(a40, b40, torch.ones(4), torch.ones(1, 32), ends_of([4]))


def test_tiles_that_cannot_compile_are_refused():
    assert all(t.problem() is None for t in TILES)
    assert gg.DEFAULT_TILES.max_regs == 168 and gg.GluonTiles(64, 256, 4, 4).max_regs == 256
    assert gg.PINGPONG_TILES.max_regs == 168 and gg.PINGPONG_TILES.consumer_regs == 244 // 8 * 8
    assert "two (ping-pong, specialized) of one warpgroup" in gg.GluonTiles(128, 256, 4, 8, consumers=2).problem()
    assert "two (ping-pong, specialized)" in gg.GluonTiles(128, 128, 4, 4, consumers=2, specialized=False).problem()
    assert "over 128 accumulator registers" in gg.GluonTiles(128, 256, 3, 4).problem()
    assert "do not fit" in gg.GluonTiles(128, 256, 5, 8).problem()
    assert "block_m a multiple of 16 x warps" in gg.GluonTiles(64, 256, 4, 8).problem()
    a, scale_a, b, scale_b = fp8_operands(4, 1, 32, 64)
    with pytest.raises(ValueError, match="tiles GluonTiles.*do not fit"):
        gg.grouped_gemm_fp8(a, b, scale_a, scale_b, ends_of([4]), tiles=gg.GluonTiles(128, 256, 5, 8))


def test_work_table_counts_row_tiles_per_group_times_column_tiles():
    ends = ends_of([0, 1, 128, 129, 0, 300])
    assert gg.work_ends_of(ends, column_tiles=3, block_m=128).tolist() == [0, 3, 6, 12, 12, 21]
    assert gg.work_ends_of(ends, column_tiles=3, block_m=128).dtype == torch.int32


def test_the_kernel_says_why_it_cannot_run_here(monkeypatch):
    assert gg.gluon_problem(torch.device("cpu")) == \
        "the Gluon FP8 grouped GEMM runs on CUDA (compute capability 9.0), not on cpu"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    for capability in ((8, 9), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert gg.gluon_problem(cuda) == (
            "the Gluon FP8 grouped GEMM is written for sm90's wgmma (compute capability 9.0: H100, H200); "
            f"a test GPU has {capability[0]}.{capability[1]}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gg.gluon_problem(cuda) is None
    assert gg.shape_problem(4096, 768) is None
    assert gg.shape_problem(4096, 24) == \
        "the Gluon FP8 grouped GEMM needs the intermediate size I to be a multiple of 16, got 24"


def emulated_gemm(calls, resident):
    """grouped_gemm_fp8 in torch: its operand checks on the views it is handed, then its reference.
    Records whether b is a view of a resident weight (never a copy) and scale_b's rows."""
    def run(a, b, scale_a, scale_b, group_ends):
        gg.check_operands(a, b, scale_a, scale_b, group_ends)
        calls.append((any(b.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for w in resident),
                      scale_b.shape[0]))
        return gg.grouped_gemm_fp8_reference(a, b, scale_a, scale_b, group_ends)
    return run


@needs_triton
@pytest.mark.parametrize("recipe", ["channels", "tensor"])
def test_op_with_the_kernel_emulated_matches_its_reference(monkeypatch, recipe):
    """The "gluon" op's plumbing on the CPU (the scaled_grouped_mm pipeline with our GEMM: per-micro
    gate/up, the down over M*E groups with the E experts' scales shared, not repeated): 9 tokens, top-2
    of 6 experts, expert 0 empty, two micros, H = 32 and I = 16."""
    import kernels.moe_multi_micro as mm
    x, ids, weights, w_gate_up, w_down = make_inputs(9, 32, 16, 6, 2, 2, seed=3)
    gu_q, gu_s, dn_q, dn_s = fq.quantize_experts(w_gate_up, w_down, recipe)
    calls = []
    monkeypatch.setitem(mm._PIPELINE_GEMMS, "gluon", emulated_gemm(calls, (gu_q, dn_q)))
    monkeypatch.setattr(mm, "gluon_problem", lambda device: None)
    out = moe_multi_micro_fp8(x, ids, weights, gu_q, gu_s, dn_q, dn_s, impl="gluon")
    assert calls == [(True, 6), (True, 6), (True, 6)]  # two gate/up micros, one down over 12 groups with 6 scale rows
    expected = op_reference(x, ids, weights, gu_q, gu_s, dn_q, dn_s)
    assert rel(out, expected) < 1e-2
    assert rel(out, moe_multi_micro_reference(x, ids, weights, w_gate_up, w_down)) < 0.08


def test_dispatch_refuses_where_the_kernel_cannot_run(monkeypatch):
    from kernels.moe_dispatch import MOE_IMPLS, experts_impl, moe_impl_device_problem, moe_impl_problem

    assert "gluon" in MOE_IMPLS
    assert moe_impl_problem("gluon", None) == "MoE implementation 'gluon' runs FP8 experts only (--moe-dtype fp8)"
    assert moe_impl_problem("gluon", "blocks") == (
        "MoE implementation 'gluon' takes one scale per weight row (--fp8-scales channels or tensor), not 'blocks'")
    assert moe_impl_problem("gluon", "channels") is None and moe_impl_problem("gluon", "tensor") is None
    with pytest.raises(ValueError, match="runs FP8 experts only"):
        experts_impl("gluon", eager=lambda *a: None)
    assert moe_impl_device_problem("gluon", torch.device("cpu")) == (
        "MoE implementation 'gluon': the Gluon FP8 grouped GEMM runs on CUDA (compute capability 9.0), not on cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert moe_impl_device_problem("gluon", torch.device("cuda", 0)) == (
        "MoE implementation 'gluon': the Gluon FP8 grouped GEMM is written for sm90's wgmma (compute capability "
        "9.0: H100, H200); a test GPU has 10.0")


def test_op_refuses_block_scales_and_the_cpu_in_one_line():
    x, ids, weights, w_gate_up, w_down = make_inputs(3, 32, 16, 4, 2, 1)
    with pytest.raises(ValueError, match=r"impl 'gluon' takes one scale per weight row \(FP8 recipe 'channels' or "
                                         r"'tensor'\), got 'blocks' scales"):
        moe_multi_micro_fp8(x, ids, weights, *fq.quantize_experts(w_gate_up, w_down, "blocks"), impl="gluon")
    with pytest.raises(RuntimeError, match="the Gluon FP8 grouped GEMM runs on CUDA"):
        moe_multi_micro_fp8(x, ids, weights, *fq.quantize_experts(w_gate_up, w_down), impl="gluon")


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.block_m}x{t.block_n}s{t.stages}w{t.warps}c{t.consumers}"
                         + ("" if t.specialized else "simple"))
@pytest.mark.parametrize("n_out,k_dim", [(1536, 4096), (4096, 768), (32, 64), (48, 160)],
                         ids=["gate_up", "down", "small", "partial_k_and_n"])
def test_gpu_kernel_on_groups_of_0_1_and_17_rows(tiles, n_out, k_dim):
    """Groups of 0, 1, 17, 0, 5, 33 and 130 rows (a row tile past its group's end, a group over two
    row tiles, empty groups first and inside), against the float32 reference rounded to bf16."""
    counts = [0, 1, 17, 0, 5, 33, 130]
    a, scale_a, b, scale_b = fp8_operands(sum(counts), len(counts), n_out, k_dim, "cuda")
    ends = ends_of(counts, "cuda")
    out = gg.grouped_gemm_fp8(a, b, scale_a, scale_b, ends, tiles=tiles)
    expected = gg.grouped_gemm_fp8_reference(a, b, scale_a, scale_b, ends)
    assert out.shape == (sum(counts), n_out) and out.dtype == torch.bfloat16
    assert rel(out, expected) < 1e-2
    atol = 2e-2 * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=atol)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.block_m}x{t.block_n}s{t.stages}w{t.warps}c{t.consumers}"
                         + ("" if t.specialized else "simple"))
def test_gpu_kernel_ring_wraps_across_many_items_a_program(tiles):
    """The ring's phases over many items a program: 5 K steps an item (not a multiple of 3, 4 or 6
    stages, so each item starts at another stage and parity), ~900 items of 128 x 256 (~7 a program on
    132 SMs, so each ping-pong consumer takes several turns), a group ending inside a row tile."""
    counts = [1000, 3, 1500, 0, 777]
    a, scale_a, b, scale_b = fp8_operands(sum(counts), len(counts), 8192, 640, "cuda", seed=1)
    ends = ends_of(counts, "cuda")
    out = gg.grouped_gemm_fp8(a, b, scale_a, scale_b, ends, tiles=tiles)
    assert rel(out, gg.grouped_gemm_fp8_reference(a, b, scale_a, scale_b, ends)) < 1e-2


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tiles", [gg.DEFAULT_TILES, gg.PINGPONG_TILES, gg.SIMPLE_TILES],
                         ids=["default", "pingpong", "simple"])
def test_gpu_kernel_shares_scale_rows_over_groups_and_takes_no_rows(tiles):
    """scale_b with P = 3 rows for G = 6 groups (group g takes row g % 3: the down GEMM's micros);
    a = 0 rows gives an empty out without a launch; all groups empty gives zero work items. More work
    items than programs (6 row tiles x 32 column tiles of 256 against at most 132 SMs): some programs run
    two, so both ping-pong consumers get one."""
    counts = [3, 0, 200, 7, 1, 40]
    a, scale_a, b, scale_b = fp8_operands(sum(counts), 6, 8192, 256, "cuda", scale_rows=3)
    ends = ends_of(counts, "cuda")
    out = gg.grouped_gemm_fp8(a, b, scale_a, scale_b, ends, tiles=tiles)
    assert rel(out, gg.grouped_gemm_fp8_reference(a, b, scale_a, scale_b, ends)) < 1e-2
    assert gg.grouped_gemm_fp8(a[:0], b, scale_a[:0], scale_b, ends_of([0] * 6, "cuda")).shape == (0, 8192)
    out = torch.full((4, 8192), 7.0, dtype=torch.bfloat16, device="cuda")
    gg.grouped_gemm_fp8(a[:4], b, scale_a[:4], scale_b, ends_of([0] * 6, "cuda"), out=out)
    assert (out == 7).all()  # no group holds a row: nothing written


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tiles", [gg.DEFAULT_TILES, gg.PINGPONG_TILES], ids=["default", "pingpong"])
def test_gpu_kernel_matches_the_library_at_the_denoise_routing(tiles):
    """One TP2 rank's denoise routing (2674 tokens, top-8 of 64 experts): both GEMMs of a micro against
    torch._scaled_grouped_mm on the same operands (the same rounding to bf16; different summation order)."""
    gemm = partial(gg.grouped_gemm_fp8, tiles=tiles)
    x, ids, _, w_gate_up, w_down = make_inputs(2674, 4096, 768, 64, 8, 2, dtype=torch.bfloat16, device="cuda",
                                               empty_experts=())
    gu_q, gu_s, dn_q, dn_s = fq.quantize_experts(w_gate_up, w_down, "channels")
    from kernels.moe_routing import moe_route
    routing = moe_route(x, ids, 64, gather=False)
    x_q, x_s = fq.quantize_rows(x)
    token_of_slot = routing.pair_of_slot // ids.shape[1]
    x_sorted_q, x_sorted_s = x_q.index_select(0, token_of_slot), x_s.index_select(0, token_of_slot)
    ours = sg.gate_up_u(x_sorted_q, x_sorted_s, gu_q, gu_s, routing.expert_ends, 1, gemm=gemm)
    library = sg.gate_up_u(x_sorted_q, x_sorted_s, gu_q, gu_s, routing.expert_ends, 1)
    assert rel(ours, library) < 1e-2
    act_q, act_s = sg.gate_up_act_quant(x_sorted_q, x_sorted_s, gu_q, gu_s, routing.expert_ends)
    ours = sg.down_partials(act_q, act_s, dn_q, dn_s, routing.expert_ends, gemm=gemm)
    library = sg.down_partials(act_q, act_s, dn_q, dn_s, routing.expert_ends)
    assert rel(ours, library) < 1e-2


@pytest.mark.gpu
@needs_sm90
def test_gpu_op_at_denoise_shapes_and_under_a_cuda_graph():
    """The "gluon" op at the denoise shapes: against its emulation, the float experts and the
    scaled_grouped_mm op (the same pipeline); replayed as a CUDA graph."""
    args = make_inputs(2674, 4096, 768, 64, 8, 2, dtype=torch.bfloat16, device="cuda", empty_experts=())
    x, ids, weights, w_gate_up, w_down = args
    fp8_args = (x, ids, weights, *fq.quantize_experts(w_gate_up, w_down, "channels"))
    out = moe_multi_micro_fp8(*fp8_args, impl="gluon")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel(out, op_reference(*fp8_args)) < 3e-2
    exact = moe_multi_micro_reference(*[t.float() if t.is_floating_point() else t for t in args])
    assert rel(out, exact) < 0.08
    # The same pipeline: u differs by bf16 roundings, which may move an activation across an e4m3 tie.
    assert rel(out, moe_multi_micro_fp8(*fp8_args, impl="scaled_grouped_mm")) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_multi_micro_fp8(*fp8_args, impl="gluon")
    graph.replay()
    torch.testing.assert_close(replayed, out, rtol=0, atol=0)
