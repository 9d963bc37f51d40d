"""The fused MoE router: kernels.moe_router (logits, softmax, top-k, normalisation).

CPU: the Triton kernels under TRITON_INTERPRET=1 (conftest sets it) at odd shapes (T 1, 3,
16, 20; E 64, 7, 100; K 1, 2, 8 and K = E; hidden 4096, 72, 200; normalised and scaled; x
bf16, fp16 and fp32, a bf16 weight, a strided x) against the reference torch ops; other
tilings; ties, NaN, batch invariance; the kernels compiled for sm_90 (no GPU: the
interpreter never lowers them); opcheck and one node under fullgraph torch.compile; the
one-line errors; MoE.route's CPU path is the torch ops of before. GPU (marker `gpu`): the
released shapes (T 1 and 8, E 64, K 8, H 4096, x bf16, fp32 weight) against the reference,
through MoE.route, under torch.compile, and in a CUDA-graph replay on new inputs.

Tolerances. ids: equal. The kernels sum the float32 logits in another order than the CPU's
GEMM (or cuBLAS): the logits agree to ~1e-6, so ids can only differ where two probabilities
are that close; every case checks first that its reference top-(K+1) probabilities are
apart by > 1e-4 relative, so its ids (and their order) are well defined. weights: rtol 1e-5,
atol 1e-8: the logits' ~1e-6 (O(1) logits here), exp and the sums of the softmax and the
normalisation in other orders (measured under the interpreter: at most 1.5e-6 relative).
A softmax over the masked lanes (as logit 0) would move the scaled cases' weights by >= 12%,
a missing renormalisation by the factor 1 / (sum of the top K).
"""
import operator

import pytest
import torch

from kernels import moe_router as mr
from kernels.moe_router import (
    RouterConfig,
    moe_route_topk,
    moe_route_topk_reference,
    moe_route_topk_triton,
    route_from_logits,
)
from tests.support.triton import TRITON_RUNS, needs_triton

RTOL, ATOL = 1e-5, 1e-8


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(T, E, H, x_dtype=torch.bfloat16, w_dtype=torch.float32, seed=0, device="cpu"):
    """x ~ N(0, 1) and weight ~ N(0, 1/H): O(1) logits, as a trained router's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device, x_dtype)
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device, w_dtype)
    return x, w


def _assert_separated(x, w, K):
    """The case's top-(K+1) reference probabilities differ pairwise by > 1e-4 relative."""
    probs = torch.softmax(x.float().cpu() @ w.float().cpu().T, dim=-1)
    top = torch.topk(probs, min(K + 1, probs.shape[1]), dim=-1).values
    gaps = (top[:, :-1] - top[:, 1:]) / top[:, :-1]
    assert gaps.numel() == 0 or gaps.min() > 1e-4, "test case with a near-tie: choose another seed"


def _assert_route(got, want):
    ids, weights = got
    ref_ids, ref_weights = want
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == ref_ids.shape and ids.is_contiguous() and weights.is_contiguous()
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_weights.cpu(), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------- Triton vs reference

CASES = [
    # T, E, K, H, normalize, x dtype
    (1, 64, 8, 4096, True, torch.bfloat16),    # the released decode shape
    (3, 64, 8, 72, True, torch.float32),
    (16, 64, 8, 4096, True, torch.bfloat16),
    (3, 7, 2, 72, True, torch.bfloat16),       # E not a power of two, smaller than a block
    (16, 7, 1, 72, True, torch.float32),       # K = 1: scaled even with normalize
    (1, 100, 8, 72, False, torch.float32),     # E = 100: 7 expert blocks, the last one partial
    (16, 100, 2, 72, False, torch.bfloat16),
    (3, 100, 1, 4096, False, torch.bfloat16),
    (20, 64, 8, 200, True, torch.float16),     # two token chunks, H not a multiple of the block
    (1, 7, 7, 72, True, torch.float32),        # K = E
]


@needs_triton
@pytest.mark.parametrize("T,E,K,H,normalize,x_dtype", CASES)
def test_triton_matches_reference(T, E, K, H, normalize, x_dtype):
    x, w = _case(T, E, H, x_dtype, seed=T * 1000 + E + K)
    _assert_separated(x, w, K)
    want = moe_route_topk_reference(x, w, K, normalize, 2.5)
    _assert_route(moe_route_topk(x, w, K, normalize, 2.5, impl="triton"), want)


@needs_triton
def test_triton_bf16_weight_and_strided_x():
    """A bf16 weight is upcast (the reference's weight.float()); x a row-strided view."""
    x, w = _case(5, 64, 72, torch.float32, torch.bfloat16, seed=3)
    wide = torch.randn(5, 2 * 72, generator=torch.Generator().manual_seed(4))
    wide[:, :72] = x
    x = wide[:, :72]
    assert not x.is_contiguous()
    _assert_separated(x, w, 8)
    _assert_route(moe_route_topk(x, w, 8, impl="triton"), moe_route_topk_reference(x, w, 8))


@needs_triton
@pytest.mark.parametrize("config", [RouterConfig(block_e=8, block_h=32, topk_warps=1),
                                    RouterConfig(block_e=64, block_h=16, logits_warps=2, topk_warps=4)])
def test_triton_other_tilings(config):
    """Other tile sizes (many H-blocks: the top-k kernel's partial tiles loop) give the route too."""
    x, w = _case(4, 100, 200, seed=5)
    _assert_separated(x, w, 8)
    _assert_route(moe_route_topk_triton(x, w, 8, config=config), moe_route_topk_reference(x, w, 8))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")   # the interpreter's numpy on NaN
def test_triton_ties_lowest_index_first_and_nan_stays_in_range():
    E, K, H = 100, 8, 72
    _, w = _case(1, E, H)
    x = torch.zeros(2, H)
    x[1, 0] = float("nan")
    ids, weights = moe_route_topk(x, w, K, impl="triton")
    # x = 0: every probability 1/E, a tie: the lowest experts, in order (torch.topk on the
    # CPU picks others); the weights are the reference's.
    assert ids[0].tolist() == list(range(K))
    torch.testing.assert_close(weights[0], moe_route_topk_reference(x[:1], w, K)[1][0], rtol=RTOL, atol=ATOL)
    # NaN logits: NaN weights, but ids still valid experts (the expert kernels index by them).
    assert ((ids[1] >= 0) & (ids[1] < E)).all() and ids[1].unique().numel() == K
    assert weights[1].isnan().all()


@needs_triton
def test_triton_token_result_independent_of_batch():
    """Each token's route is bit-identical alone and inside a batch (per-token tiling)."""
    x, w = _case(12, 64, 200, seed=6)
    ids, weights = moe_route_topk(x, w, 8, impl="triton")
    for t in (0, 5, 11):
        one_ids, one_weights = moe_route_topk(x[t:t + 1], w, 8, impl="triton")
        assert torch.equal(one_ids[0], ids[t]) and torch.equal(one_weights[0], weights[t])


def test_empty_batch():
    x, w = _case(0, 64, 72)
    for impl in ("reference",) + (("triton",) if TRITON_RUNS else ()):
        ids, weights = moe_route_topk(x.to(_device()) if impl == "triton" else x, w.to(x.device), 8, impl=impl)
        assert ids.shape == (0, 8) and weights.shape == (0, 8)


# ----------------------------------------------------------------------- op and compile


def test_reference_is_moe_route_math():
    """The reference is the torch ops MoE.route runs (bit-equal), both branches."""
    x, w = _case(6, 64, 72, seed=7)
    logits = torch.nn.functional.linear(x.float(), w)
    probs = torch.softmax(logits, dim=-1)
    top, ids = torch.topk(probs, 8, dim=-1)
    ids_n, w_n = moe_route_topk_reference(x, w, 8, True, 3.0)
    assert torch.equal(ids_n, ids) and torch.equal(w_n, top / top.sum(-1, keepdim=True))
    ids_s, w_s = moe_route_topk_reference(x, w, 8, False, 3.0)
    assert torch.equal(ids_s, ids) and torch.equal(w_s, top * 3.0)
    one_ids, one_w = moe_route_topk_reference(x, w, 1, True, 3.0)   # K = 1 scales even with normalize
    assert torch.equal(one_ids, ids[:, :1]) and torch.equal(one_w, top[:, :1] * 3.0)


def test_opcheck_and_one_compiled_node():
    x, w = _case(3, 7, 72, seed=8)
    torch.library.opcheck(torch.ops.dtgen.moe_route_topk.default, (x, w, 2, True, 1.0, "reference"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda a, b: moe_route_topk(a, b, 2, True, 1.0), fullgraph=True, backend=backend)
    got = compiled(x, w)
    want = moe_route_topk_reference(x, w, 2, True, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    calls = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    ops = [c for c in calls if c is not operator.getitem]   # the tuple's two outputs
    assert len(ops) == 1 and ops[0] in (torch.ops.dtgen.moe_route_topk, torch.ops.dtgen.moe_route_topk.default), calls


def test_moe_route_cpu_path_is_the_torch_ops():
    """MoE.route on the CPU: the torch ops of before (golden parity unchanged)."""
    from models.hunyuan_image3.transformer import MoE

    class Cfg:
        moe_topk = [8]
        norm_topk_prob = True
        routed_scaling_factor = 1.0
        num_experts = 64
        hidden_size = 72
        moe_intermediate_size = [16]
        use_mixed_mlp_moe = False

    moe = MoE(Cfg(), 0)
    x, w = _case(5, 64, 72, seed=9)
    moe.gate.wg.weight.data.copy_(w)
    ids, weights = moe.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x.float(), w), dim=-1)
    top, ref_ids = torch.topk(probs, 8, dim=-1)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))


_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import moe_router as mr

def build(fn, sig, constexprs, aligned, warps):
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})

cfg = mr.RouterConfig()
logits = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "tokens": "i32", "experts": "i32",
          "hidden": "i32", "num_splits": "i32", "s_xt": "i32", "s_we": "i32",
          "BLOCK_T": "constexpr", "BLOCK_E": "constexpr", "BLOCK_H": "constexpr"}
for block_t in (1, 8):
    build(mr._router_logits_kernel, logits, {"BLOCK_T": block_t, "BLOCK_E": cfg.block_e, "BLOCK_H": cfg.block_h},
          ["x_ptr", "w_ptr", "part_ptr", "experts", "hidden", "num_splits", "s_xt", "s_we"], cfg.logits_warps)
topk = {"part_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "experts": "i32", "num_splits": "i32",
        "scaling_factor": "fp32", "TOP_K": "constexpr", "NORMALIZE": "constexpr", "BLOCK_S": "constexpr",
        "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
k = build(mr._router_topk_kernel, topk, {"TOP_K": 8, "NORMALIZE": True, "BLOCK_S": 32, "BLOCK_E": 64, "BLOCK_K": 8},
          ["part_ptr", "ids_ptr", "wts_ptr", "experts", "num_splits"], cfg.topk_warps)
print("barriers", k.asm["ptx"].count("bar.sync"))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The kernels lower to sm_90 machine code (Triton's own ptxas, no device), which the
    interpreter never checks; the top-k kernel's reductions need no barrier (one warp)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not (Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "barriers 0" in done.stdout


# --------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make,match", [
    (lambda x, w: (x[0], w, 8), "x must be \\[tokens, hidden\\]"),
    (lambda x, w: (x, w[0], 8), "weight must be \\[experts, hidden\\]"),
    (lambda x, w: (x[:, :70], w, 8), "weight's hidden size 72 != x's 70"),
    (lambda x, w: (x, w, 65), "top_k must be an int in \\[1, 64\\]"),
    (lambda x, w: (x, w, 0), "top_k must be an int in \\[1, 64\\]"),
    (lambda x, w: (x.long(), w, 8), "x dtype must be one of"),
])
def test_bad_input_one_line_value_error(make, match):
    x, w = _case(3, 64, 72)
    for impl in ("auto", "reference"):
        with pytest.raises(ValueError, match=match) as err:
            moe_route_topk(*make(x, w), impl=impl)
        assert "\n" not in str(err.value)


def test_bad_impl():
    x, w = _case(3, 64, 72)
    with pytest.raises(ValueError, match="impl must be one of"):
        moe_route_topk(x, w, 8, impl="cuda")


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_gpu_released_shapes_and_cuda_graph(T):
    """E 64, K 8, H 4096, x bf16, fp32 weight: the Triton path ("auto" on CUDA), MoE.route,
    torch.compile (bit-equal to eager), and a CUDA graph replayed on new inputs."""
    from models.hunyuan_image3.transformer import MoE

    dev = torch.device("cuda")
    E, K, H = 64, 8, 4096
    x, w = _case(T, E, H, seed=10 + T, device=dev)
    _assert_separated(x, w, K)
    assert mr.triton_path_taken(x, w)
    want = moe_route_topk_reference(x.cpu(), w.cpu(), K)
    _assert_route(moe_route_topk(x, w, K), want)
    _assert_route(moe_route_topk(x, w, K, impl="triton"), want)

    class Cfg:
        moe_topk = [K]
        norm_topk_prob = True
        routed_scaling_factor = 1.0
        num_experts = E
        hidden_size = H
        moe_intermediate_size = [16]
        use_mixed_mlp_moe = False

    moe = MoE(Cfg(), 0).to(dev)
    moe.gate.wg.weight.data.copy_(w)
    _assert_route(moe.route(x), want)
    eager = moe_route_topk(x, w, K)
    compiled = torch.compile(lambda a: moe_route_topk(a, w, K), fullgraph=True)(x)   # inductor: one extern node
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])

    static_x = x.clone()
    moe_route_topk(static_x, w, K)   # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_route_topk(static_x, w, K)
    x2, _ = _case(T, E, H, seed=20 + T, device=dev)
    _assert_separated(x2, w, K)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    _assert_route(out, moe_route_topk_reference(x2.cpu(), w.cpu(), K))
