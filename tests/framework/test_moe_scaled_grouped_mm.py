"""kernels.moe_scaled_grouped_mm: the FP8 experts' GEMMs in torch._scaled_grouped_mm, and its dispatch.

CPU: the activation kernel under TRITON_INTERPRET=1 against its reference; the library calls
on meta tensors, which run torch's own checks of shapes, strides and scales (the meta kernel
mirrors _scaled_grouped_mm_cuda's) on the views the op passes; the whole op with the library
call emulated in torch (its checks on meta, then its math per group) against the op's
reference; and every refusal of the dispatch, in one line.
GPU (marker `gpu`, sm90): groups of 0, 1 and 17 rows at the real K/N and small ones, the op at
the denoise shapes against its emulation and the float experts, and a CUDA-graph replay.
"""
import math

import pytest
import torch

from kernels import fp8_quant as fq
from kernels import moe_scaled_grouped_mm as sg
from kernels.moe_multi_micro import moe_finalize_reference, moe_multi_micro_fp8, moe_multi_micro_reference
from kernels.moe_routing import moe_route
from tests.framework.test_moe_grouped_gemm import make_inputs
from tests.support.triton import needs_triton

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="torch._scaled_grouped_mm's rowwise FP8 kernel needs sm90")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def op_reference(x, ids, weights, gu_q, gu_s, dn_q, dn_s):
    """The scaled_grouped_mm op in torch: x per token, `experts_partials_reference`, the finalize."""
    routing = moe_route(x, ids, gu_q.shape[1], gather=False)
    x_q, x_s = fq.quantize_row_groups_reference(x, group=x.shape[1])
    partials = sg.experts_partials_reference(x_q, x_s[:, 0], routing.pair_of_slot // ids.shape[1], gu_q, gu_s,
                                             dn_q, dn_s, routing.expert_ends)
    return moe_finalize_reference(partials, routing.slot_of_pair, weights, x.dtype)


def ends_of(counts, device="cpu"):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


# ------------------------------------------------------------------------------ CPU


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quantize_rows_matches_reference(dtype):
    """13 rows (a partial last program), I = 40 (not a power of two), an all-zero row."""
    u = (torch.randn(13, 80, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    u[4] = 0
    q = torch.empty(13, 40, dtype=fq.FP8_DTYPE)
    scale = torch.empty(13)
    sg.act_quantize_rows(u, q, scale)
    q_ref, scale_ref = sg.act_quantize_rows_reference(u)
    assert scale[4] == 1.0 and (q[4].float() == 0).all()
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # x1 * x2 * sigmoid(x2) against x1 * silu(x2): a value within float32 rounding of an e4m3 tie may round
    # the other way; nothing else differs.
    assert (q.float() != q_ref.float()).float().mean() < 0.01


def test_library_calls_pass_torchs_checks_on_the_resident_layouts():
    """The views the op hands torch._scaled_grouped_mm, on meta: its meta kernel runs the CUDA op's
    checks (mat_a row-major, mat_b column-major, 16-byte strides, scale shapes and strides, int32
    offs) and gives the output's shape. The weights are [.., N, K] contiguous as resident."""
    micros, experts, hidden, inter, slots = 2, 8, 256, 64, 40
    meta = dict(device="meta")
    w_gate_up = torch.empty(micros, experts, 2 * inter, hidden, dtype=fq.FP8_DTYPE, **meta)
    w_gate_up_scale = torch.empty(micros, experts, 2 * inter, **meta)
    w_down = torch.empty(micros, experts, hidden, inter, dtype=fq.FP8_DTYPE, **meta)
    w_down_scale = torch.empty(experts, hidden, **meta)
    ends = torch.empty(experts, dtype=torch.int32, **meta)
    x_q = torch.empty(slots, hidden, dtype=fq.FP8_DTYPE, **meta)
    u = sg.gate_up_u(x_q, torch.empty(slots, **meta), w_gate_up, w_gate_up_scale, ends, micro=1)
    assert u.shape == (slots, 2 * inter) and u.dtype == torch.bfloat16
    act_q = torch.empty(micros, slots, inter, dtype=fq.FP8_DTYPE, **meta)
    partials = sg.down_partials(act_q, torch.empty(micros * slots, **meta), w_down, w_down_scale, ends)
    assert partials.shape == (micros, slots, hidden) and partials.dtype == torch.bfloat16
    # What the checks refuse: the weights handed over untransposed (row-major mat_b).
    with pytest.raises(RuntimeError, match="column major"):
        torch._scaled_grouped_mm(x_q, w_gate_up[0].transpose(-2, -1).contiguous(), torch.empty(slots, **meta),
                                 w_gate_up_scale[0], offs=ends, out_dtype=torch.bfloat16)


def emulated_scaled_grouped_mm(calls, resident):
    """torch._scaled_grouped_mm in torch (2-D x 3-D): its checks on meta copies (strides kept), then
    ``out[rows of g] = (a * scale_a) @ (b[g] * scale_b[g])`` in float32, rounded to bf16. Records
    whether each mat_b is a view of a resident weight (never a copy)."""
    check = torch._scaled_grouped_mm

    def run(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        to_meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
        check(to_meta(mat_a), to_meta(mat_b), to_meta(scale_a), to_meta(scale_b), offs=to_meta(offs),
              out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        calls.append(any(mat_b.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for w in resident))
        a = mat_a.float() * scale_a[:, None]
        out = torch.zeros(mat_a.shape[0], mat_b.shape[2])
        bounds = [0] + offs.tolist()
        for g in range(mat_b.shape[0]):
            out[bounds[g]:bounds[g + 1]] = a[bounds[g]:bounds[g + 1]] @ (mat_b[g].float() * scale_b[g][None, :])
        return out.to(torch.bfloat16)
    return run


@needs_triton
@pytest.mark.parametrize("recipe", ["channels", "tensor"])
def test_op_with_the_library_emulated_matches_its_reference(monkeypatch, recipe):
    """The op's plumbing on the CPU (routing, gather, per-micro gate/up, the activation kernel,
    the M*E-group down with shifted ends and repeated scales, the finalize): 9 tokens, top-2 of 6
    experts, expert 0 empty, two micros, H = 32 and I = 16 (multiples of 16)."""
    import kernels.moe_multi_micro as mm
    x, ids, weights, w_gate_up, w_down = make_inputs(9, 32, 16, 6, 2, 2, seed=3)
    gu_q, gu_s, dn_q, dn_s = fq.quantize_experts(w_gate_up, w_down, recipe)
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm(calls, (gu_q, dn_q)))
    monkeypatch.setattr(mm, "scaled_grouped_mm_problem", lambda device: None)
    out = moe_multi_micro_fp8(x, ids, weights, gu_q, gu_s, dn_q, dn_s, impl="scaled_grouped_mm")
    assert calls == [True, True, True]  # two gate/up micros and one down, each on a view of the weights
    expected = op_reference(x, ids, weights, gu_q, gu_s, dn_q, dn_s)
    # The kernel's activation against the reference's: an e4m3 tie may round the other way.
    assert rel(out, expected) < 1e-2
    assert rel(out, moe_multi_micro_reference(x, ids, weights, w_gate_up, w_down)) < 0.08


# ------------------------------------------------------------------------- refusals


def test_dispatch_refuses_where_the_library_cannot_run(monkeypatch):
    from kernels.moe_dispatch import experts_impl, moe_impl_device_problem, moe_impl_problem

    assert moe_impl_problem("scaled_grouped_mm", None) == \
        "MoE implementation 'scaled_grouped_mm' runs FP8 experts only (--moe-dtype fp8)"
    assert moe_impl_problem("scaled_grouped_mm", "blocks") == (
        "MoE implementation 'scaled_grouped_mm' takes one scale per weight row (--fp8-scales channels or tensor), "
        "not 'blocks'")
    assert moe_impl_problem("scaled_grouped_mm", "channels") is None
    assert moe_impl_problem("scaled_grouped_mm", "tensor") is None
    assert moe_impl_problem("auto", None) is None and moe_impl_device_problem("auto", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="runs FP8 experts only"):
        experts_impl("scaled_grouped_mm", eager=lambda *a: None)
    assert moe_impl_device_problem("scaled_grouped_mm", torch.device("cpu")) == (
        "MoE implementation 'scaled_grouped_mm': torch._scaled_grouped_mm runs on CUDA (compute capability 9.0), "
        "not on cpu")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    for capability in ((8, 9), (10, 0), (12, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert sg.scaled_grouped_mm_problem(cuda) == (
            "torch._scaled_grouped_mm's rowwise FP8 kernel is sm90 CUTLASS (compute capability 9.0: H100, H200); "
            f"a test GPU has {capability[0]}.{capability[1]}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sg.scaled_grouped_mm_problem(cuda) is None
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert sg.scaled_grouped_mm_problem(cuda).endswith("has no torch._scaled_grouped_mm (it came with torch 2.8)")


def test_shapes_the_library_cannot_take_are_named():
    assert sg.shape_problem(2, 64, 4096, 768) is None
    assert sg.shape_problem(1, 8, 40, 16) == \
        "torch._scaled_grouped_mm needs the hidden size H to be a multiple of 16, got 40"
    assert sg.shape_problem(1, 8, 32, 24) == \
        "torch._scaled_grouped_mm needs the intermediate size I to be a multiple of 16, got 24"
    assert sg.shape_problem(4, 256, 32, 32) == \
        "torch._scaled_grouped_mm takes at most 1023 groups; the down GEMM has micros x experts = 4 x 256"


def test_op_refuses_block_scales_and_the_cpu_in_one_line():
    x, ids, weights, w_gate_up, w_down = make_inputs(3, 32, 16, 4, 2, 1)
    with pytest.raises(ValueError, match=r"impl 'scaled_grouped_mm' takes one scale per weight row \(FP8 recipe "
                                         r"'channels' or 'tensor'\), got 'blocks' scales"):
        moe_multi_micro_fp8(x, ids, weights, *fq.quantize_experts(w_gate_up, w_down, "blocks"),
                            impl="scaled_grouped_mm")
    with pytest.raises(RuntimeError, match="torch._scaled_grouped_mm runs on CUDA"):
        moe_multi_micro_fp8(x, ids, weights, *fq.quantize_experts(w_gate_up, w_down), impl="scaled_grouped_mm")


@pytest.mark.parametrize("impl", ["scaled_grouped_mm", "gluon"])
def test_model_dtype_experts_refuse_the_fp8_only_impl(impl):
    """Each FP8-only impl (this file's and `kernels.moe_grouped_gemm_gluon`'s)."""
    from models.hunyuan_image3.model import set_moe_impl
    from models.hunyuan_image3.transformer import Experts

    experts = Experts(4, 32, 16)
    with pytest.raises(ValueError, match="runs FP8 experts only"):
        set_moe_impl(experts, impl)
    experts.use_fp8()
    set_moe_impl(experts, impl)
    assert experts.impl_fp8.keywords == {"impl": impl}


def test_load_refuses_before_reading_any_weight(tiny_checkpoint):
    from models.hunyuan_image3.loading import load
    from placements.hunyuan_image3 import get_plan

    with pytest.raises(ValueError, match="runs FP8 experts only"):
        load(tiny_checkpoint, get_plan("single"), moe_impl="scaled_grouped_mm")
    with pytest.raises(ValueError, match="not 'blocks'"):
        load(tiny_checkpoint, get_plan("single"), moe_impl="scaled_grouped_mm", moe_dtype="fp8", fp8_scales="blocks")
    with pytest.raises(RuntimeError, match="MoE implementation 'scaled_grouped_mm': torch._scaled_grouped_mm runs "
                                           "on CUDA"):
        load(tiny_checkpoint, get_plan("single"), moe_impl="scaled_grouped_mm", moe_dtype="fp8")


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("hidden,inter", [(4096, 768), (64, 32)], ids=["denoise", "small"])
def test_gpu_gemms_on_groups_of_0_1_and_17_rows(hidden, inter):
    """Each GEMM against its reference on the same inputs, groups of 0, 1, 17, 0, 5 and 33 rows
    (two micros): the gate/up GEMM with the activation quantized, then the down GEMM.

    Row by row with CUTLASS's promoted accumulation (fast_accum off: float32-grade sums, so u, each
    row's scale and its e4m3 roundings are the reference's up to summation order). With the default fast
    accumulation (the tensor cores' FP8 accumulator, about 14 bits kept, never promoted) the sums over
    K = 4096 drift by up to ~1-2 %, every row's scale moves a little and its e4m3 roundings become
    independent of the reference's (~2.6 % rms each, as the op's test says): the same checks over all
    rows, at those bounds."""
    counts = [0, 1, 17, 0, 5, 33]
    micros, experts, slots = 2, len(counts), sum(counts)
    ends = ends_of(counts, "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    w_gate_up = torch.randn(micros, experts, 2 * inter, hidden, device="cuda", generator=gen) / math.sqrt(hidden)
    w_down = torch.randn(micros, experts, hidden, inter, device="cuda", generator=gen) / math.sqrt(inter)
    gu_q, gu_s, dn_q, dn_s = fq.quantize_experts(w_gate_up, w_down, "channels")
    x_q, x_s = fq.quantize_rows(torch.randn(slots, hidden, device="cuda", generator=gen))
    ref_q, ref_s = sg.gate_up_act_quant_reference(x_q, x_s, gu_q, gu_s, ends)
    ref_f = ref_q.float() * ref_s.view(micros, slots, 1)
    for fast_accum, scale_rtol, act_bound in ((False, 1e-2, 3e-2), (True, 3e-2, 6e-2)):
        act_q, act_s = sg.gate_up_act_quant(x_q, x_s, gu_q, gu_s, ends, fast_accum=fast_accum)
        assert act_q.shape == (micros, slots, inter) and act_s.shape == (micros * slots,)
        torch.testing.assert_close(act_s, ref_s, rtol=scale_rtol, atol=0)
        assert rel(act_q.float() * act_s.view(micros, slots, 1), ref_f) < act_bound
        partials = sg.down_partials(act_q, act_s, dn_q, dn_s, ends, fast_accum=fast_accum)
        assert rel(partials, sg.down_partials_reference(act_q, act_s, dn_q, dn_s, ends)) < 1e-2


@pytest.mark.gpu
@needs_sm90
def test_gpu_op_at_denoise_shapes_and_under_a_cuda_graph():
    """One TP2 rank's denoise MoE (T = 2674, H 4096, 64 experts, top-8, two micros of 768): against
    its emulation, the float experts, and the fused Triton kernels; replayed as a CUDA graph."""
    args = make_inputs(2674, 4096, 768, 64, 8, 2, dtype=torch.bfloat16, device="cuda", empty_experts=())
    x, ids, weights, w_gate_up, w_down = args
    fp8_args = (x, ids, weights, *fq.quantize_experts(w_gate_up, w_down, "channels"))
    out = moe_multi_micro_fp8(*fp8_args, impl="scaled_grouped_mm")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel(out, op_reference(*fp8_args)) < 3e-2
    exact = moe_multi_micro_reference(*[t.float() if t.is_floating_point() else t for t in args])
    assert rel(out, exact) < 0.08  # three e4m3 roundings, as the Triton path: 0.065 there
    # The fused kernels quantize the activation per slot over both micros, this path per (micro, slot) row:
    # where the scales differ the e4m3 roundings are independent (~2.6% rms relative each).
    assert rel(out, moe_multi_micro_fp8(*fp8_args, impl="fused")) < 0.06
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_multi_micro_fp8(*fp8_args, impl="scaled_grouped_mm")
    graph.replay()
    torch.testing.assert_close(replayed, out, rtol=0, atol=0)
