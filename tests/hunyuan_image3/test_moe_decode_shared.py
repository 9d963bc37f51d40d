"""The shared expert folded into the decode MoE: kernels/moe_decode_shared.py, its dispatch
(kernels/moe_dispatch.py) and `MoE.forward`.

CPU: the Triton kernels under TRITON_INTERPRET=1 (conftest sets it) at odd shapes against
the op's torch reference, and the reference against the unfused math (the experts' op plus
the model's GatedMLP); the finalize's shared rows; the dispatch's choices; one-line errors;
opcheck and one node under fullgraph torch.compile; a decoder layer with and without the
fold. GPU (marker `gpu`): the released shapes (H=4096, I=3072, E=64, K=8) at T=1 and 16 with
FP8 channel experts, against the reference and replayed as a CUDA graph.

Tolerances. float32 with the dot in x's dtype: the kernels do the reference's float32 math
in another summation order: rtol = atol = 1e-5 on O(1) outputs (a wrong expert, token, slot
or scale moves outputs by O(0.1)). e4m3 weights with the default FP8 tiles: stage 1's dot
takes x in float16 (~5e-4 rms relative): 2e-3. float16 (the interpreter; its bf16 dot is
broken, triton-lang/triton#11584, so bf16 runs on the GPU): the activation and the output
are rounded to 16 bits: 1e-2. The fold against the unfused path: in float32 the same math
(1e-5); in bf16 the unfused path rounds the routed sum, the shared output and their sum
(three roundings to 8 bits where the fold makes one): 1e-2 relative. An FP8 shared expert:
the fold is weight-only FP8, equal to a GatedMLP over the dequantized weights (1e-5 in
float32); against the GatedMLP's own FP8 path (x and the activation rounded to e4m3 per row
too, ~2.6% rms each on the shared part) within 5e-2 relative.
"""
import math
from dataclasses import replace
from functools import partial

import pytest
import torch

from kernels import moe_dispatch
from kernels.fp8_quant import FP8_DTYPE, quantize_experts, quantize_weight_channels
from kernels.moe_decode import decode_config_for, moe_decode_fp8_reference, moe_decode_triton
from kernels.moe_decode_shared import moe_decode_shared, moe_decode_shared_reference, shared_mlp_reference
from kernels.moe_multi_micro import moe_finalize, moe_multi_micro_reference
from models.hunyuan_image3.transformer import GatedMLP
from tests.support.triton import needs_triton

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def rel(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def make_case(tokens, hidden, inter, experts, top_k, micros, experts_kind="float", shared_kind="float",
              dtype=torch.float32, device="cpu", seed=0):
    """x, routing, experts (weights in x's dtype or e4m3 channels/blocks with scales) and a
    shared GatedMLP's tensors (in x's dtype or e4m3 with per-channel scales), as the op's
    positional arguments; plus the shared expert's unquantized weights (x's dtype)."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    gu = torch.randn(micros, experts, 2 * inter, hidden, generator=g, device=device) / math.sqrt(hidden)
    dn = torch.randn(micros, experts, hidden, inter, generator=g, device=device) / math.sqrt(inter)
    sgu = torch.randn(micros, 2 * inter, hidden, generator=g, device=device) / math.sqrt(hidden)
    sdn = torch.randn(hidden, micros * inter, generator=g, device=device) / math.sqrt(micros * inter)
    if experts_kind == "float":
        routed = (gu.to(dtype), None, dn.to(dtype), None)
    else:
        q_gu, s_gu, q_dn, s_dn = quantize_experts(gu, dn, experts_kind)
        routed = (q_gu, s_gu, q_dn, s_dn)
    if shared_kind == "float":
        shared = (sgu.to(dtype), None, sdn.to(dtype), None)
    else:
        (q_sgu, s_sgu), (q_sdn, s_sdn) = quantize_weight_channels(sgu), quantize_weight_channels(sdn)
        shared = (q_sgu, s_sgu, q_sdn, s_sdn)
    return (x.to(dtype), ids, weights, *routed, *shared), (sgu.to(dtype), sdn.to(dtype))


def gated_mlp(shared_args, dequantize=False):
    """The model's GatedMLP holding these tensors (FP8: its own fp8_linear path, or with
    `dequantize` a float GatedMLP over the dequantized weights: weight-only FP8)."""
    sgu, sgu_s, sdn, sdn_s = shared_args
    mlp = GatedMLP(sgu.shape[2], sgu.shape[1] // 2)
    if dequantize:  # float32 weights (dequantized where e4m3)
        sgu, sdn = sgu.float(), sdn.float()
        if sgu_s is not None:
            sgu, sdn = sgu * sgu_s[..., None], sdn * sdn_s[:, None]
        sgu_s = sdn_s = None
    if sgu_s is not None:
        mlp.use_fp8()
        mlp.gate_and_up_scale = torch.nn.Parameter(sgu_s, requires_grad=False)
        mlp.down_scale = torch.nn.Parameter(sdn_s, requires_grad=False)
    mlp.gate_and_up_proj = torch.nn.Parameter(sgu, requires_grad=False)
    mlp.down_proj = torch.nn.Parameter(sdn, requires_grad=False)
    return mlp


def unfused(args, dequantize_shared=False):
    """The separate path: the experts' op reference plus the model's GatedMLP, added in x's dtype."""
    x, ids, weights, gu, gu_s, dn, dn_s = args[:7]
    if gu_s is None:
        routed = moe_multi_micro_reference(x, ids, weights, gu, dn)
    else:
        routed = moe_decode_fp8_reference(x, ids, weights, gu, gu_s, dn, dn_s)
    mlp = gated_mlp(args[7:], dequantize_shared)
    return routed + mlp(x.float() if dequantize_shared else x).to(x.dtype)


CASES = [  # tokens, hidden, inter, experts, top_k, micros
    (1, 48, 24, 9, 8, 1),      # one token, top-8
    (3, 80, 40, 7, 1, 2),      # top-1, two micros, H and I not multiples of any tile
    (16, 64, 48, 8, 8, 1),     # one full chunk, every expert picked by many tokens
    (17, 40, 24, 6, 2, 2),     # two chunks, the second with one token
]
KINDS = [("float", "float"), ("channels", "fp8"), ("channels", "float"), ("float", "fp8"), ("blocks", "fp8")]


@needs_triton
@pytest.mark.parametrize("kinds", KINDS, ids=["-".join(k) for k in KINDS])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_triton_matches_reference_float32(case, kinds):
    if kinds[0] == "blocks" and case[0] in (16, 17):
        pytest.skip("blocks: the odd shapes are enough (the interpreter is slow)")
    args, _ = make_case(*case, *kinds, seed=case[0])
    expected = moe_decode_shared_reference(*args)
    out = moe_decode_shared(*args, impl="triton")
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    if "fp8" in kinds or kinds[0] != "float":   # the default FP8 tiles: stage 1's dot in float16
        assert rel(out, expected) < 2e-3
        exact = replace(decode_config_for(args[4], torch.float32), fp8_dot_f16=False)
        x, ids, w, gu, gu_s, dn, dn_s, sgu, sgu_s, sdn, sdn_s = args
        out = moe_decode_triton(x, ids, w, gu, dn, config=exact, w_gate_up_scale=gu_s, w_down_scale=dn_s,
                                shared_gate_up=sgu, shared_down=sdn, shared_gate_up_scale=sgu_s,
                                shared_down_scale=sdn_s)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("kinds", [("float", "float"), ("channels", "fp8"), ("channels", "float")])
def test_triton_half_precision(kinds):
    args, _ = make_case(3, 80, 40, 7, 2, 2, *kinds, dtype=torch.float16)
    out = moe_decode_shared(*args, impl="triton")
    assert out.dtype == torch.float16
    assert rel(out, moe_decode_shared_reference(*args)) < 1e-2


@needs_triton
def test_shared_absent_is_the_decode_op():
    """Without a shared expert the kernels are the decode op's (no extra pair, no extra rows)."""
    args, _ = make_case(5, 48, 24, 6, 3, 2, "channels")
    x, ids, w, gu, gu_s, dn, dn_s = args[:7]
    out = moe_decode_triton(x, ids, w, gu, dn, w_gate_up_scale=gu_s, w_down_scale=dn_s)
    assert rel(out, moe_decode_fp8_reference(x, ids, w, gu, gu_s, dn, dn_s)) < 2e-3
    with_shared = moe_decode_shared(*args, impl="triton")
    assert rel(with_shared - out, shared_mlp_reference(x, *args[7:])) < 2e-3


@pytest.mark.parametrize("kinds", KINDS[:4], ids=["-".join(k) for k in KINDS[:4]])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_reference_is_the_unfused_math(case, kinds):
    """float32: the reference equals experts + GatedMLP (an FP8 shared expert: the GatedMLP
    over its dequantized weights, i.e. weight-only FP8); its own FP8 path (W8A8) stays near."""
    args, _ = make_case(*case, *kinds, seed=case[0] + 1)
    expected = moe_decode_shared_reference(*args)
    torch.testing.assert_close(unfused(args, dequantize_shared=True), expected, **FP32_TOL)
    if kinds[1] == "fp8":
        assert rel(unfused(args), expected) < 5e-2


@pytest.mark.parametrize("kinds", KINDS[:4], ids=["-".join(k) for k in KINDS[:4]])
def test_reference_bf16_rounds_once(kinds):
    args, _ = make_case(7, 64, 32, 8, 8, 2, *kinds, dtype=torch.bfloat16)
    out = moe_decode_shared(*args)                       # CPU "auto": the reference
    assert out.dtype == torch.bfloat16
    exact = moe_decode_shared_reference(*[t.float() if t is not None and t.dtype == torch.bfloat16 else t
                                          for t in args])
    assert rel(out, exact) < 5e-3                        # one rounding to bf16 (2^-9 rms)
    assert rel(unfused(args, dequantize_shared=True), exact) < 1e-2


@needs_triton
def test_finalize_adds_the_shared_rows_with_weight_one():
    g = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 3, 2, 40
    partials = torch.randn(1, tokens * top_k + tokens, hidden, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    out = moe_finalize(partials, None, weights, torch.float32, shared_row0=tokens * top_k)
    pairs = partials[0, :tokens * top_k].view(tokens, top_k, hidden)
    expected = (weights[..., None] * pairs).sum(1) + partials[0, tokens * top_k:]
    torch.testing.assert_close(out, expected, **FP32_TOL)


def test_dispatch_folds_only_decode_rows_and_shared_experts_it_takes():
    args, _ = make_case(3, 48, 24, 6, 2, 2)
    op = moe_dispatch.shared_fold_impl("auto")
    torch.testing.assert_close(op(*args), moe_decode_shared_reference(*args), rtol=0, atol=0)
    assert moe_dispatch.shared_fold_impl("eager") is None and moe_dispatch.shared_fold_impl("fused") is None
    big, _ = make_case(moe_dispatch.DECODE_MOE_MAX_TOKENS + 1, 48, 24, 6, 2, 2)
    assert op(*big) is None                                          # prefill rows: apart
    wider, _ = make_case(3, 48, 32, 6, 2, 2)                         # a shared expert of another I
    assert op(*args[:7], *wider[7:]) is None
    assert op(*args[:7], wider[7].new_zeros(1, 48, 48), None, args[9], None) is None   # another M
    assert op(*args[:7], args[7].bfloat16(), None, args[9].bfloat16(), None) is None   # not x's dtype
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        moe_dispatch.shared_fold_impl("nope")


@pytest.mark.parametrize("change,match", [
    (dict(shared_down=lambda a: a[9][:, :-1]), r"shared_down must be \(48, 48\)"),
    (dict(shared_gate_up=lambda a: a[7][:, :-2]), r"shared_gate_up must be \(2, 48, 48\)"),
    (dict(shared_gate_up=lambda a: a[7].double()), "must both be torch.float32"),
    (dict(shared_gate_up_scale=lambda a: torch.ones(2, 48)), "must be given together"),
])
def test_bad_inputs_name_the_problem(change, match):
    args, _ = make_case(3, 48, 24, 6, 2, 2)
    names = ["shared_gate_up", "shared_gate_up_scale", "shared_down", "shared_down_scale"]
    args = list(args)
    for name, fn in change.items():
        args[7 + names.index(name)] = fn(args)
    with pytest.raises(ValueError, match=match):
        moe_decode_shared(*args)


def test_bad_scales_and_impl_name_the_problem():
    args, _ = make_case(3, 48, 24, 6, 2, 2, "channels", "fp8")
    bad = list(args)
    bad[8] = args[8][:, :-1]
    with pytest.raises(ValueError, match=r"shared_gate_up_scale must be float32 \(2, 48\)"):
        moe_decode_shared(*bad)
    with pytest.raises(ValueError, match="impl must be one of"):
        moe_decode_shared(*args, impl="cuda")


def test_opcheck_and_one_compiled_node():
    # opcheck's schema test multiplies every tensor, which torch has no e4m3 kernel for.
    args, _ = make_case(3, 48, 24, 6, 2, 2)
    torch.library.opcheck(torch.ops.dtgen.moe_decode_shared.default, (*args, "auto"))
    args, _ = make_case(3, 48, 24, 6, 2, 2, "channels", "fp8")
    torch._dynamo.reset()
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda *a: moe_decode_shared(*a), fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(*args), moe_decode_shared(*args), rtol=0, atol=0)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["dtgen.moe_decode_shared"]


# --------------------------------------------------------------------------- the model


def _layer_moe(shared_fp8: bool, experts_fp8: bool, dtype=torch.float32):
    from models.hunyuan_image3.config import HunyuanImage3Config
    from models.hunyuan_image3.model import set_moe_impl
    from models.hunyuan_image3.tiny import tiny_config
    from models.hunyuan_image3.transformer import MoE

    cfg = HunyuanImage3Config.from_dict(tiny_config(1))
    moe = MoE(cfg, 0)
    g = torch.Generator().manual_seed(0)
    for name, p in moe.named_parameters():
        p.requires_grad_(False)
        p.data = (torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).to(
            torch.float32 if ".wg." in name else dtype)
    if experts_fp8:
        e = moe.experts
        e.use_fp8()
        q_gu, s_gu, q_dn, s_dn = quantize_experts(e.gate_and_up_proj.data.float(), e.down_proj.data.float(),
                                                  "channels")
        for attr, t in (("gate_and_up_proj", q_gu), ("gate_and_up_scale", s_gu), ("down_proj", q_dn),
                        ("down_scale", s_dn)):
            setattr(e, attr, torch.nn.Parameter(t, requires_grad=False))
    if shared_fp8:
        s = moe.shared_mlp
        (q_gu, s_gu), (q_dn, s_dn) = quantize_weight_channels(s.gate_and_up_proj.data.float()), \
            quantize_weight_channels(s.down_proj.data.float())
        s.use_fp8()
        for attr, t in (("gate_and_up_proj", q_gu), ("gate_and_up_scale", s_gu), ("down_proj", q_dn),
                        ("down_scale", s_dn)):
            setattr(s, attr, torch.nn.Parameter(t, requires_grad=False))
    set_moe_impl(moe, "auto")
    return moe


@pytest.mark.parametrize("experts_fp8,shared_fp8", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_decode_output_with_the_fold_equals_the_unfused_path(experts_fp8, shared_fp8, dtype):
    moe = _layer_moe(shared_fp8, experts_fp8, dtype)
    assert moe.shared_fold is not None
    x = torch.randn(1, 5, moe.gate.wg.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = []
    fold = moe.shared_fold
    moe.shared_fold = lambda *a: calls.append(1) or fold(*a)
    folded = moe(x)
    assert calls and folded.dtype == dtype and folded.shape == x.shape
    moe.shared_fold = None
    apart = moe(x)
    if shared_fp8:      # weight-only FP8 against the GatedMLP's W8A8
        assert rel(folded, apart) < 5e-2
    elif dtype == torch.float32:
        torch.testing.assert_close(folded, apart, **FP32_TOL)
    else:
        assert rel(folded, apart) < 1e-2
    # prefill rows keep the separate path
    moe.shared_fold = partial(moe_dispatch.experts_shared_op, impl="auto")
    long = torch.randn(1, moe_dispatch.DECODE_MOE_MAX_TOKENS + 1, x.shape[-1]).to(dtype)
    out = moe(long)
    moe.shared_fold = None
    torch.testing.assert_close(out, moe(long), rtol=0, atol=0)


# ------------------------------------------------------------------------------- GPU

RELEASED = dict(hidden=4096, inter=3072, experts=64, top_k=8, micros=1)


@pytest.mark.gpu
@pytest.mark.parametrize("shared_kind", ["fp8", "float"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_released_shapes_fp8_channels_and_cuda_graph(tokens, shared_kind):
    """One H200's AR decode MoE (FP8 channel experts; the shared expert in FP8 as with
    --dense-dtype fp8, or bf16 as with the default dense dtype) against the reference, and
    replayed as a CUDA graph on new inputs."""
    args, _ = make_case(tokens, **RELEASED, experts_kind="channels", shared_kind=shared_kind,
                        dtype=torch.bfloat16, device="cuda", seed=tokens)
    out = moe_decode_shared(*args)
    expected = moe_decode_shared_reference(*[t.float() if t is not None and t.dtype == torch.bfloat16 else t
                                             for t in args])
    assert rel(out, expected) < 1e-2
    x = args[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_decode_shared(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode_shared(*args)
    x.copy_(x.flip(0) * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, moe_decode_shared(*args), rtol=0, atol=0)   # same kernels, same order
    assert not torch.equal(captured, out)                       # the replay read the new x
    assert captured.dtype == torch.bfloat16 and args[7].dtype == (FP8_DTYPE if shared_kind == "fp8" else x.dtype)
