"""MoE expert ops: kernels.moe_routing, kernels.moe_multi_micro, kernels.moe_decode.

CPU: the reference against the per-token formula, the Triton kernels under
TRITON_INTERPRET=1 (conftest sets it before triton is imported), torch.compile and
opcheck. GPU (marker `gpu`): HunyuanImage-3 shapes in bf16.

Tolerances. float32 on CPU, rtol = atol = 1e-5: every implementation does the same
float32 math on O(1) values and differs only in summation order over at most a few
hundred terms (error ~1e-6), while a wrong expert, micro, slot or weight changes outputs
by O(0.1). bf16 (GPU) and float16 (interpreter): relative Frobenius error < 1e-2; bf16 keeps 8
bits (relative rounding 2^-9 = 0.2%) and the fast path rounds u, the activation and the
micro partials to 16 bits once each, so about 0.3-0.5% is expected.
"""
import importlib.util
import itertools
import math
import re

import pytest
import torch

from kernels import moe_multi_micro as mm
from kernels.moe_decode import moe_decode
from kernels.moe_multi_micro import (
    concat_micros,
    moe_multi_micro,
    moe_multi_micro_reference,
    moe_naive,
    moe_two_dispatch,
)
from kernels.moe_routing import moe_route
from tests.support.triton import needs_triton

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def make_moe(tokens, hidden, inter, experts, top_k, micros, dtype=torch.float32, device="cpu", seed=0):
    """Random MoE inputs. Routing is top-k of a softmax over random logits, renormalised;
    one expert (chosen by seed) is never picked, so an expert with no token always exists
    (needs top_k < experts)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, seed % experts] = -math.inf
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    # At HunyuanImage-3 shapes the weights are 1.2 G values: on a GPU they are drawn there
    # (drawing them on the host took ~8 s a test); on the CPU the draws are as they were.
    wgen = gen if torch.device(device).type == "cpu" else torch.Generator(device).manual_seed(seed)
    w_gate_up = torch.randn(micros, experts, 2 * inter, hidden, generator=wgen, device=device) / math.sqrt(hidden)
    w_down = torch.randn(micros, experts, hidden, inter, generator=wgen, device=device) / math.sqrt(inter)
    return (x.to(device, dtype), ids.to(device), weights.to(device),
            w_gate_up.to(device, dtype), w_down.to(device, dtype))


def rel_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _fp32_reference(args):
    """The reference on float32 copies of the same (rounded) inputs."""
    return moe_multi_micro_reference(*[t.float() if t.is_floating_point() else t for t in args])


# ---------------------------------------------------------------------------- routing


def test_routing_sorts_pairs_by_expert():
    x, ids, _, _, _ = make_moe(tokens=9, hidden=4, inter=2, experts=5, top_k=2, micros=1, seed=3)
    routing = moe_route(x, ids, num_experts=5)
    flat = ids.reshape(-1)
    sorted_ids = flat[routing.pair_of_slot]
    assert torch.all(sorted_ids[1:] >= sorted_ids[:-1])
    counts = torch.bincount(flat, minlength=5)
    assert routing.expert_ends.dtype == torch.int32
    assert routing.expert_ends.tolist() == torch.cumsum(counts, 0).tolist()
    assert counts[3] == 0  # seed 3: expert 3 is idle, and its run is empty
    assert torch.equal(routing.slot_of_pair[routing.pair_of_slot], torch.arange(flat.numel()))
    assert torch.equal(routing.x_sorted, x[routing.pair_of_slot // 2])


def test_routing_compiles_fullgraph():
    x, ids, _, _, _ = make_moe(tokens=7, hidden=4, inter=2, experts=4, top_k=2, micros=1)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(moe_route)(x, ids, 4)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(moe_route, fullgraph=True, backend="aot_eager")(x, ids, 4)
    for got, want in zip(compiled, moe_route(x, ids, 4)):
        assert torch.equal(got, want)


# -------------------------------------------------------------------------- reference

# Every (T, K, M); (H, I, E) cycles through all 8 of its combinations along the way.
_HIE = list(itertools.product((16, 48), (8, 24), (4, 7)))
_REFERENCE_CASES = [
    (tokens, hidden, inter, experts, top_k, micros)
    for n, (tokens, top_k, micros) in enumerate(itertools.product((1, 3, 17, 33), (1, 2, 3), (1, 2, 3)))
    for hidden, inter, experts in [_HIE[n % len(_HIE)]]
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,micros", _REFERENCE_CASES)
def test_reference_matches_naive(tokens, hidden, inter, experts, top_k, micros):
    args = make_moe(tokens, hidden, inter, experts, top_k, micros, seed=tokens + micros)
    torch.testing.assert_close(moe_multi_micro_reference(*args), moe_naive(*args), **FP32_TOL)


def test_reference_accepts_int32_ids_and_any_token_order():
    x, ids, w, wgu, wd = make_moe(tokens=11, hidden=16, inter=8, experts=7, top_k=3, micros=2)
    expected = moe_naive(x, ids, w, wgu, wd)
    torch.testing.assert_close(moe_multi_micro_reference(x, ids.int(), w, wgu, wd), expected, **FP32_TOL)
    # Permuting the k columns permutes nothing in the result.
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(moe_multi_micro_reference(x, ids[:, perm], w[:, perm], wgu, wd), expected, **FP32_TOL)


def test_one_dispatch_over_concatenated_weights_matches():
    x, ids, w, wgu, wd = make_moe(tokens=13, hidden=16, inter=8, experts=4, top_k=2, micros=3)
    gate_up, down = concat_micros(wgu, wd)
    assert gate_up.shape == (1, 4, 2 * 3 * 8, 16) and down.shape == (1, 4, 16, 3 * 8)
    torch.testing.assert_close(moe_multi_micro_reference(x, ids, w, gate_up, down),
                               moe_naive(x, ids, w, wgu, wd), **FP32_TOL)


# ------------------------------------------------------------------ Triton (interpreted)

_TRITON_CASES = [  # tokens, hidden, inter, experts, top_k, micros
    (1, 16, 8, 4, 1, 1),
    (3, 48, 24, 7, 3, 2),
    (17, 16, 24, 4, 2, 3),
    (33, 48, 8, 7, 3, 2),  # 99 pair rows: one GEMM row tile spanning every expert's run
]


@needs_triton
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,micros", _TRITON_CASES)
def test_triton_multi_micro_matches_reference(tokens, hidden, inter, experts, top_k, micros):
    args = make_moe(tokens, hidden, inter, experts, top_k, micros, seed=tokens)
    torch.testing.assert_close(moe_multi_micro(*args, impl="triton"), moe_multi_micro_reference(*args), **FP32_TOL)


@needs_triton
def test_grouped_gemm_kernel_runs_straddle_tiles_and_skip_empty_experts():
    rows, k_dim, n_out = 300, 16, 24  # three 128-row tiles, each meeting two or three runs
    ends = torch.tensor([0, 140, 140, 280, 300], dtype=torch.int32)  # experts 0 and 2: no rows
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, rows, k_dim, generator=gen)
    b = torch.randn(2, 5, n_out, k_dim, generator=gen)
    out = torch.full((2, rows, n_out), float("nan"))
    mm._grouped_gemm(a, b, ends, out)
    starts = [0] + ends[:-1].tolist()
    expected = torch.cat([a[:, s:e] @ b[:, g].transpose(-2, -1) for g, (s, e) in enumerate(zip(starts, ends.tolist()))], 1)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@needs_triton
def test_finalize_kernel_weights_each_pair_once_after_micro_sum():
    tokens, top_k, micros, hidden = 5, 3, 2, 40
    gen = torch.Generator().manual_seed(2)
    partials = torch.randn(micros, tokens * top_k, hidden, generator=gen)
    slot_of_pair = torch.randperm(tokens * top_k, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = mm.moe_finalize(partials, slot_of_pair, weights, torch.float32)
    per_pair = partials.sum(0)[slot_of_pair].view(tokens, top_k, hidden)
    torch.testing.assert_close(out, (weights.unsqueeze(-1) * per_pair).sum(1), **FP32_TOL)


# 16-bit inputs under the interpreter are float16: its tl.dot multiplies the raw bits of
# bfloat16 operands (triton-lang/triton#11584). bf16 is covered by the GPU tests.
@needs_triton
def test_triton_multi_micro_half_precision():
    args = make_moe(tokens=9, hidden=32, inter=16, experts=5, top_k=2, micros=2, dtype=torch.float16)
    out = moe_multi_micro(*args, impl="triton")
    assert out.dtype == torch.float16
    assert rel_error(out, _fp32_reference(args)) < 1e-2


@needs_triton
@pytest.mark.parametrize("micros", [1, 2, 3])
def test_two_dispatch_matches_multi_micro(micros):
    args = make_moe(tokens=7, hidden=16, inter=8, experts=5, top_k=2, micros=micros, seed=micros)
    torch.testing.assert_close(moe_two_dispatch(*args), moe_multi_micro(*args, impl="triton"), **FP32_TOL)
    torch.testing.assert_close(moe_multi_micro(*args, impl="two_dispatch"), moe_multi_micro_reference(*args), **FP32_TOL)


_DECODE_CASES = [  # tokens, hidden, inter, experts, top_k, micros
    (1, 48, 24, 7, 3, 1),
    (2, 16, 8, 4, 2, 2),
    (16, 32, 16, 7, 3, 1),  # one full chunk, experts shared by many tokens
    (17, 16, 8, 4, 1, 2),  # two chunks, the second with one token
]


@needs_triton
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,micros", _DECODE_CASES)
def test_triton_decode_matches_reference(tokens, hidden, inter, experts, top_k, micros):
    x, ids, w, wgu, wd = make_moe(tokens, hidden, inter, experts, top_k, micros, seed=tokens)
    out = moe_decode(x, ids.int(), w, wgu, wd, impl="triton")
    torch.testing.assert_close(out, moe_multi_micro_reference(x, ids, w, wgu, wd), **FP32_TOL)


@needs_triton
def test_triton_decode_half_precision():
    args = make_moe(tokens=3, hidden=32, inter=16, experts=5, top_k=2, micros=2, dtype=torch.float16)
    out = moe_decode(*args, impl="triton")
    assert out.dtype == torch.float16
    assert rel_error(out, _fp32_reference(args)) < 1e-2


def test_grouped_mm_calling_convention_on_cpu():
    """The _grouped_mm path (offsets, transposed weight views, one down GEMM over M*E
    groups) on torch's CPU kernel, where this torch has one, through the real finalize."""
    x, ids, w, wgu, wd = make_moe(tokens=9, hidden=32, inter=16, experts=5, top_k=2, micros=2, dtype=torch.bfloat16)
    try:
        torch._grouped_mm(x[:8], wgu[0].transpose(-2, -1), offs=torch.tensor([4, 4, 6, 8, 8], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._grouped_mm has no CPU bf16 kernel here: {err}")
    if not mm.TRITON_INTERPRETED:
        pytest.skip("the finalize kernel needs TRITON_INTERPRET=1 on CPU")
    routing = moe_route(x, ids, 5)
    partials = mm._expert_mlp_grouped_mm(routing, wgu, wd)
    out = mm.moe_finalize(partials, routing.slot_of_pair, w, x.dtype)
    assert rel_error(out, _fp32_reference((x, ids, w, wgu, wd))) < 1e-2


def _grouped_mm_on_cpu(dtype) -> bool:
    try:
        x = torch.zeros(4, 16, dtype=dtype)
        torch._grouped_mm(x, torch.zeros(2, 16, 8, dtype=dtype), offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,micros",
                         [(1, 16, 8, 4, 1, 1), (17, 24, 12, 7, 3, 2), (33, 48, 8, 5, 2, 3)])
def test_traceable_fast_path_matches_reference(tokens, hidden, inter, experts, top_k, micros):
    """moe_multi_micro_graph (the torch-level fast path inductor compiles) on torch's CPU
    grouped GEMM: odd shapes, an expert with no token, any number of micros."""
    if not _grouped_mm_on_cpu(torch.float32):
        pytest.skip("torch._grouped_mm has no CPU float32 kernel in this torch")
    args = make_moe(tokens, hidden, inter, experts, top_k, micros, seed=tokens)
    torch.testing.assert_close(mm.moe_multi_micro_graph(*args), moe_multi_micro_reference(*args), **FP32_TOL)


def test_traceable_fast_path_compiles_without_breaks():
    # bf16: the dtype torch._grouped_mm's shape function accepts (the fast path's dtype).
    if not _grouped_mm_on_cpu(torch.bfloat16):
        pytest.skip("torch._grouped_mm has no CPU bf16 kernel in this torch")
    args = make_moe(tokens=9, hidden=16, inter=8, experts=5, top_k=2, micros=2, dtype=torch.bfloat16)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(mm.moe_multi_micro_graph)(*args)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(mm.moe_multi_micro_graph, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    torch.testing.assert_close(out, mm.moe_multi_micro_graph(*args), rtol=0, atol=0)
    assert rel_error(out, _fp32_reference(args)) < 1e-2


# --------------------------------------------------------------- compile and opcheck


def _both_ops(x, ids, w, wgu, wd):
    return moe_multi_micro(x, ids, w, wgu, wd) + moe_decode(x, ids, w, wgu, wd)


def test_compile_fullgraph_keeps_each_op_one_node():
    args = make_moe(tokens=5, hidden=16, inter=8, experts=4, top_k=2, micros=2)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_both_ops)(*args)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    targets = [node.target for node in explanation.graphs[0].graph.nodes if node.op == "call_function"]
    for packet in (torch.ops.dtgen.moe_multi_micro, torch.ops.dtgen.moe_decode):
        assert sum(target in (packet, packet.default) for target in targets) == 1
    torch._dynamo.reset()
    compiled = torch.compile(_both_ops, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), 2 * moe_multi_micro_reference(*args), **FP32_TOL)


@pytest.mark.parametrize("op_name", ["moe_multi_micro", "moe_decode"])
def test_opcheck_cpu(op_name):
    args = make_moe(tokens=3, hidden=16, inter=8, experts=4, top_k=2, micros=2)
    torch.library.opcheck(getattr(torch.ops.dtgen, op_name).default, (*args, "auto"))


# ------------------------------------------------------------------------ bad input


def _bad_inputs():
    x, ids, w, wgu, wd = make_moe(tokens=4, hidden=16, inter=8, experts=4, top_k=2, micros=2)
    return {
        "x must be [T, H]": (x[None], ids, w, wgu, wd),
        "topk_ids must be [T, K]": (x, ids[:3], w, wgu, wd),
        "topk_weights must have": (x, ids, w[:, :1], wgu, wd),
        "w_gate_up must be [M, E, 2*I, H]": (x, ids, w, wgu[..., :8], wd),
        "w_down must be [M, E, H, I]": (x, ids, w, wgu, wd[:1]),
        "top-k K = 5 must be between 1 and the number of experts E = 4":
            (x, torch.zeros(4, 5, dtype=torch.int64), torch.ones(4, 5), wgu, wd),
        "dtype mismatch": (x, ids, w, wgu.double(), wd),
        "topk_ids dtype": (x, ids.float(), w, wgu, wd),
        "topk_weights dtype": (x, ids, w.double(), wgu, wd),
    }


@pytest.mark.parametrize("message", list(_bad_inputs()))
@pytest.mark.parametrize("op", [moe_multi_micro, moe_decode])
def test_bad_inputs_raise_before_any_kernel(op, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        op(*_bad_inputs()[message])


def test_unknown_impl_and_missing_triton_device(monkeypatch):
    args = make_moe(tokens=2, hidden=16, inter=8, experts=4, top_k=2, micros=1)
    with pytest.raises(ValueError, match="impl must be one of"):
        moe_multi_micro(*args, impl="cutlass")
    with pytest.raises(ValueError, match="impl must be one of"):
        moe_decode(*args, impl="two_dispatch")
    monkeypatch.setattr(mm, "TRITON_INTERPRETED", False)
    for call in (lambda: moe_multi_micro(*args, impl="triton"), lambda: moe_decode(*args, impl="triton")):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            call()


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_flashinfer_missing_names_the_extra():
    args = make_moe(tokens=2, hidden=16, inter=8, experts=4, top_k=2, micros=1)
    with pytest.raises(ImportError, match=r"pip install dtgen\[flashinfer\]"):
        moe_multi_micro(*args, impl="flashinfer")


# ------------------------------------------------------------------------------ GPU
# HunyuanImage-3 per-rank shapes: H=4096, E=64, top-8, one micro of I=768 (AR, TP4);
# two micros for denoise (TP2 storage as two TP4 micros).

HUNYUAN = dict(hidden=4096, inter=768, experts=64, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "fused", "grouped_mm", "triton", "two_dispatch"])
def test_gpu_multi_micro_hunyuan_shapes(impl):
    args = make_moe(tokens=256, micros=2, dtype=torch.bfloat16, device="cuda", **HUNYUAN)
    out = moe_multi_micro(*args, impl=impl)
    assert out.dtype == torch.bfloat16 and out.shape == (256, 4096)
    assert rel_error(out, _fp32_reference(args)) < 1e-2


@pytest.mark.gpu
def test_gpu_traceable_fast_path_compiled():
    """What the compiled prefill/denoise steps run with MoE impl "graph": the torch-level fast
    path traced by inductor (fullgraph) at HunyuanImage-3 shapes, against the fp32 reference
    and the op. With inductor's grouped-GEMM autotuning (`--compile-autotune`) the same graph
    compiles ~100 Triton templates per GEMM shape (126 s here): too long for this suite; the grouped
    GEMMs it tunes are measured against inductor's templates by `python -m bench kernels grouped-gemm
    --autotune`."""
    args = make_moe(tokens=300, micros=2, dtype=torch.bfloat16, device="cuda", **HUNYUAN)
    torch._dynamo.reset()
    compiled = torch.compile(mm.moe_multi_micro_graph, fullgraph=True)
    out = compiled(*args)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, _fp32_reference(args)) < 1e-2
    assert rel_error(out, moe_multi_micro(*args)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
def test_gpu_decode_hunyuan_shapes(tokens):
    args = make_moe(tokens=tokens, micros=1, dtype=torch.bfloat16, device="cuda", seed=tokens, **HUNYUAN)
    assert rel_error(moe_decode(*args), _fp32_reference(args)) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_two_micros_and_cuda_graph_replay():
    args = make_moe(tokens=4, micros=2, dtype=torch.bfloat16, device="cuda", **HUNYUAN)
    eager = moe_decode(*args)
    assert rel_error(eager, _fp32_reference(args)) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)  # same kernels, same order


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["moe_multi_micro", "moe_decode"])
def test_gpu_opcheck(op_name):
    args = make_moe(tokens=5, hidden=64, inter=32, experts=8, top_k=2, micros=2, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(getattr(torch.ops.dtgen, op_name).default, (*args, "auto"))


def test_model_dispatch_to_the_traceable_path_compiles_in_a_layer(monkeypatch):
    """The compiled denoise/prefill layers on GPU take moe_multi_micro_graph; on CPU force
    that branch (bf16, torch's CPU grouped GEMM) so its tracing is checked here too: the
    usability checks themselves must trace (no data_ptr at trace time)."""
    if not _grouped_mm_on_cpu(torch.bfloat16):
        pytest.skip("torch._grouped_mm has no CPU bf16 kernel in this torch")
    import kernels.moe_dispatch as dispatch
    from dtgen.attention import AttentionMeta
    from models.hunyuan_image3.rope import rope_cos_sin
    from models.hunyuan_image3.config import HunyuanImage3Config
    from models.hunyuan_image3.model import set_moe_impl
    from models.hunyuan_image3.tiny import tiny_config
    from models.hunyuan_image3.transformer import DecoderLayer

    cfg = HunyuanImage3Config.from_dict(tiny_config(1))
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    for name, p in layer.named_parameters():
        p.requires_grad_(False)
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).to(p.dtype if ".wg." in name else torch.bfloat16)
    set_moe_impl(layer, "auto")
    calls = []

    def usable_on_cpu(x, w_gate_up, w_down):  # the real checks, minus "is CUDA"
        calls.append(1)
        return mm._aligned_16(w_gate_up) and mm._aligned_16(w_down) and x.dtype == torch.bfloat16

    monkeypatch.setattr(dispatch, "graph_path_usable", usable_on_cpu)
    set_moe_impl(layer, "graph")
    S = 40
    x = torch.randn(1, S, cfg.hidden_size, dtype=torch.bfloat16)
    slots = torch.arange(S)
    cos, sin = rope_cos_sin(slots.unsqueeze(-1).repeat(1, 2), cfg.head_dim, cfg.rope_theta)
    meta = AttentionMeta(slots, ((10, 30),), slot_runs=((0, S),))
    torch._dynamo.reset()
    compiled = torch.compile(lambda: layer(x, cos, sin, meta, None), fullgraph=True, backend="aot_eager")
    out = compiled()
    assert calls, "the compiled layer did not reach the traceable-path dispatch"
    ref = layer(x, cos, sin, meta, None)     # eager: the op (its float32 reference on CPU)
    assert rel_error(out, ref) < 1e-2


def test_finalize_op_matches_its_reference_and_passes_opcheck():
    g = torch.Generator().manual_seed(0)
    partials = torch.randn(2, 12, 16, generator=g)
    slot_of_pair = torch.randperm(12, generator=g)
    weights = torch.rand(4, 3, generator=g)
    expected = mm.moe_finalize_reference(partials, slot_of_pair, weights, torch.float32)
    manual = torch.stack([sum(weights[t, k] * partials[:, slot_of_pair[t * 3 + k]].sum(0) for k in range(3))
                          for t in range(4)])
    torch.testing.assert_close(expected, manual, **FP32_TOL)
    torch.testing.assert_close(torch.ops.dtgen.moe_finalize(partials, slot_of_pair, weights, torch.float32),
                               expected, **FP32_TOL)
    torch.library.opcheck(torch.ops.dtgen.moe_finalize.default, (partials, slot_of_pair, weights, torch.float32))
