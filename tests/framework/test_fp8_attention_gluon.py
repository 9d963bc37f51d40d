"""kernels.fp8_attention_gluon: the FP8 attention op in Gluon (sm90), and how fp8_attention dispatches to it.

CPU: the module imports without a GPU (nothing compiles at import); the one-line refusals of
impl="gluon" and of its tiles; "auto" keeps the Triton kernel unless AUTO_PICKS_GLUON; the K
descriptor's 5-D view puts each key where the P V operand expects it (checked against the wgmma
register layouts of the PTX ISA, on the same strides the kernel's TMA reads).
GPU (marker `gpu`, sm90): the kernel against `fp8_attention_reference` and against the Triton
kernel on the same operands at odd shapes (Sq, Sk not multiples of the tiles, one key, GQA 32/8,
head_dim 64 and 128, batch 2), each variant of its tiles against its default, and a CUDA-graph replay.

Bounds: against the reference as the Triton kernel's (they round P against running maxima, the
reference against the final one: 1-2%, bound 0.04); against exact attention 0.06 (random data,
FP8 P V); against the Triton kernel 5e-3 (the same 128-key blocks in the same order, the same P
rounding: only the order of the row sums' additions differs, and bf16's rounding of the outputs
that it moves); 64-key steps round P against other running maxima: 0.03.
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kernels import fp8_attention as fa
from kernels import fp8_attention_gluon as fg

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon FP8 attention kernel runs on sm90 (Hopper)")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _qkv(B, Hq, Hkv, Sq, Sk, D, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g) for _ in range(2))
    return q.to(device, dtype), (k + 3.0).to(device, dtype), v.to(device, dtype)


# ------------------------------------------------------------------------------ CPU


def test_impl_gluon_refuses_in_one_line_off_sm90():
    q, k, v = _qkv(1, 2, 2, 5, 7, 64)
    with pytest.raises(RuntimeError, match=r"^fp8_attention: impl='gluon' cannot run: the Gluon FP8 attention "
                                           r"kernel [^\n]*$"):
        fp8_attention_of(q, k, v, impl="gluon")
    with pytest.raises(RuntimeError, match=r"^fp8_attention_gluon: the Gluon FP8 attention kernel [^\n]*$"):
        fg.fp8_attention_gluon(*fa.quantize_qkv(q, k, v), 5, 7, 2, torch.float32)
    with pytest.raises(ValueError, match="impl must be one of .*'gluon'"):
        fp8_attention_of(q, k, v, impl="cutlass")


def fp8_attention_of(q, k, v, **kw):
    return fa.fp8_attention(q, k, v, **kw)


def test_the_module_defines_its_kernel_and_refuses_the_cpu():
    """This Triton has Gluon: the kernel is defined at import (compiled at its first launch), and the
    CPU is refused in one line."""
    assert fg.GLUON_IMPORT_PROBLEM is None
    problem = fg.gluon_problem(torch.device("cpu"))
    assert problem.startswith("the Gluon FP8 attention kernel ") and "\n" not in problem


@pytest.mark.parametrize("change,message", [
    (dict(consumers=3), "1 or 2 consumer warpgroups"),
    (dict(consumers=1), "pingpong needs 2 consumer warpgroups"),
    (dict(block_n=96), "block_n must be 64 or 128"),
    (dict(num_stages=1), "num_stages >= 2"),
    (dict(poly_exp2=3), "poly_exp2 is 0, 1"),
])
def test_tiles_refuse_in_one_line(change, message):
    assert message in fg.GluonTiles(**change).problem()
    assert fg.GLUON_TILES.problem() is None


def test_operands_it_does_not_take():
    q, k, v = _qkv(1, 2, 2, 5, 7, 64)
    q8, _, k8, _, vt16, _ = fa.quantize_qkv(q, k, v, pv="fp16")
    assert "pv='fp8'" in fg.operands_problem(q8, k8, vt16, fg.GLUON_TILES)
    q8, _, k8, _, vt8, _ = fa.quantize_qkv(q, k, v)
    # the GPU's scale blocks (128 x 128) hold the tiles; the interpreter's (16 x 16) do not
    expected = None if fa.SCALE_M == 128 else "must divide the scale blocks 16 x 16"
    problem = fg.operands_problem(q8, k8, vt8, fg.GLUON_TILES)
    assert problem == expected or expected in problem


def test_lengths_it_does_not_take():
    """The kernel trusts sq, sk and heads: no key would leave its consumers waiting for a first K tile
    forever (a hung GPU); longer lengths or other head counts would read other heads' rows."""
    q, k, v = _qkv(1, 4, 2, 5, 7, 64)
    q8, _, k8, _, vt8, _ = fa.quantize_qkv(q, k, v)
    assert fg.lengths_problem(q8, k8, vt8, 5, 7, 4) is None
    assert fg.lengths_problem(q8, k8, vt8, 0, 7, 4) is None          # no query: nothing launched
    for sq, sk, heads, field in [(5, 0, 4, "sk 0"), (5, k8.shape[2] + 1, 4, "1 <= sk"),
                                 (q8.shape[2] + 1, 7, 4, "sq"), (5, 7, 3, "heads (3)"), (5, 7, 8, "heads (8)")]:
        problem = fg.lengths_problem(q8, k8, vt8, sq, sk, heads)
        assert field in problem and "\n" not in problem
    assert "vt8 [B, Hkv, D, Sk_pad]" in fg.lengths_problem(q8, k8, vt8[:, :, :, :-1], 5, 7, 4)


def test_auto_keeps_the_triton_kernel_until_switched(monkeypatch):
    """"auto" runs the Gluon kernel only where AUTO_PICKS_GLUON is set, the PV is e4m3 and the device can."""
    assert fa.AUTO_PICKS_GLUON is False
    assert not fa._auto_gluon(torch.device("cpu"), fa.FP8_DTYPE)
    monkeypatch.setattr(fa, "AUTO_PICKS_GLUON", True)
    monkeypatch.setattr(fa, "gluon_problem", lambda device: None)
    assert fa._auto_gluon(torch.device("cpu"), fa.FP8_DTYPE)
    assert not fa._auto_gluon(torch.device("cpu"), torch.float16)


# The wgmma register layouts (PTX ISA, "Register fragments" of wgmma .m64nNk32 with 8-bit A): within each
# 16 columns, lane l of a warp holds accumulator (D) columns {2c, 2c+1, 8+2c, 9+2c} and A operand columns
# {4c, 4c+1, 4c+2, 4c+3}, in that register order, c = l % 4 (rows l / 4 and l / 4 + 8 alike).
def _accumulator_columns(c):
    return [2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c]


def _operand_columns(c):
    return [4 * c + i for i in range(4)]


@pytest.mark.parametrize("D,block_n", [(64, 128), (128, 128), (128, 64)])
def test_permuted_k_puts_each_key_where_the_pv_operand_reads_it(D, block_n):
    """K's 5-D TMA view (the kernel's descriptor: shape and strides) read in box order gives the
    shared-memory rows of a key block; the logit in accumulator column n is then that row's key. The
    P V operand relabels a thread's accumulator registers as its operand registers, in order, and V^T
    is read in natural key order: so accumulator column n must hold the key of the operand column it
    becomes. The mask's `_key_of_column` map must say the same."""
    tiles = replace(fg.GLUON_TILES, block_n=block_n)
    rows = 2 * 256
    k_rows = torch.zeros(rows, D, dtype=torch.int8)     # a row holds its key: key // 64, key % 64
    k_rows[:, 0], k_rows[:, 1] = torch.arange(rows) // 64, torch.arange(rows) % 64
    k8 = k_rows.view(1, 1, rows, D)
    vt8 = torch.zeros(1, 1, D, 256, dtype=fa.FP8_DTYPE)
    _, k_desc, _ = fg._descriptors(torch.zeros(1, 1, 128, D, dtype=torch.int8), k8, vt8, tiles)
    assert k_desc.block_shape == [block_n // 16, 2, 4, 2, D]
    view = torch.as_strided(k_rows, k_desc.shape, k_desc.strides)
    for start in (0, block_n, rows - block_n):
        box = view[start // 16:start // 16 + block_n // 16].reshape(block_n, D)   # the slot's rows, in order
        key_of_column = (box[:, 0].long() * 64 + box[:, 1].long() - start).tolist()
        assert sorted(key_of_column) == list(range(block_n))
        for group in range(block_n // 16):
            for c in range(4):
                held = [key_of_column[16 * group + n] for n in _accumulator_columns(c)]
                assert held == [16 * group + n for n in _operand_columns(c)]
        n = torch.arange(block_n)
        mask_map = (n & ~15) + ((n >> 1) & 3) * 4 + ((n >> 3) & 1) * 2 + (n & 1)   # `_key_of_column`
        assert mask_map.tolist() == key_of_column


# ------------------------------------------------------------------------------ GPU (sm90)


def _gpu_case(B, Hq, Hkv, Sq, Sk, D, seed=0):
    q, _, _ = _qkv(B, Hq, Hkv, Sq, Sk, D, seed=seed, device="cuda", dtype=torch.bfloat16)
    _, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, seed=seed + 1, device="cuda", dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [
    (2, 4, 4, 1000, 777, 128),      # neither length a multiple of the tiles; batch 2
    (1, 32, 8, 300, 1031, 128),     # GQA 32 / 8
    (2, 8, 2, 129, 256, 64),        # head_dim 64; one query row past a 128-row tile; whole key blocks
    (1, 2, 1, 64, 1, 128),          # one key
    (1, 2, 2, 77, 100, 64),         # fewer keys than one block
])
def test_gpu_matches_reference_and_triton_kernel(B, Hq, Hkv, Sq, Sk, D):
    q, k, v = _gpu_case(B, Hq, Hkv, Sq, Sk, D)
    out = fa.fp8_attention(q, k, v, impl="gluon")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    g = Hq // Hkv
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                           v.double().repeat_interleave(g, 1))
    assert rel(out, fa.fp8_attention_reference(q, k, v)) < 0.04
    assert rel(out, exact) < 0.06
    assert rel(out, fa.fp8_attention(q, k, v, impl="triton")) < 5e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_natural_k_order_matches_reference_on_its_own(D):
    """K in natural order (2-D TMA, P moved between lanes by a layout conversion) against the reference
    and the Triton kernel, independently of the permuted 5-D K view the default uses."""
    q, k, v = _gpu_case(2, 8, 2, 1000, 777, D, seed=11)
    operands = fa.quantize_qkv(q, k, v)
    tiles = replace(fg.GLUON_TILES, permuted_k=False)
    out = fg.fp8_attention_gluon(*operands, 1000, 777, 8, torch.bfloat16, tiles).transpose(1, 2)[..., :D]
    assert rel(out, fa.fp8_attention_reference(q, k, v)) < 0.04
    assert rel(out, fa.fp8_attention(q, k, v, impl="triton")) < 5e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("change,bound", [
    (dict(num_stages=2), 1e-6), (dict(pingpong=False), 1e-6), (dict(permuted_k=False), 1e-4),
    (dict(consumers=1, pingpong=False, maxnreg=128), 1e-6), (dict(block_n=64), 0.03),
    (dict(poly_exp2=1), 0.03), (dict(poly_exp2=2), 0.03)],
    ids=["stages2", "no-pingpong", "natural-k", "one-warpgroup", "n64", "poly-exp2-quarter", "poly-exp2-half"])
def test_gpu_tile_variants_match_the_default(change, bound):
    """Ring depth, ping-pong and warpgroups a program change only the order of independent work (the
    same result); natural K order adds the row sums in another order (the same P, the same MMAs: a
    float32 rounding of the sums, which flips a few bf16 outputs by one unit); 64-key steps round P
    against other running maxima; P's exp2 by polynomial (1.7e-3 from MUFU's) moves some of P's e4m3
    roundings."""
    q, k, v = _gpu_case(1, 4, 2, 1000, 1500, 128, seed=3)
    operands = fa.quantize_qkv(q, k, v)
    base = fg.fp8_attention_gluon(*operands, 1000, 1500, 4, torch.bfloat16)
    other = fg.fp8_attention_gluon(*operands, 1000, 1500, 4, torch.bfloat16, replace(fg.GLUON_TILES, **change))
    assert rel(other, base) <= bound


@pytest.mark.gpu
@needs_sm90
def test_gpu_cuda_graph_replay_matches_eager():
    """Captured once, replayed on new inputs copied into the captured ones: as the eager call."""
    q, k, v = _gpu_case(1, 8, 2, 500, 700, 128, seed=5)
    static = [t.clone() for t in (q, k, v)]
    fa.fp8_attention(*static, impl="gluon")                  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.fp8_attention(*static, impl="gluon")
    q2, k2, v2 = _gpu_case(1, 8, 2, 500, 700, 128, seed=7)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fa.fp8_attention(q2, k2, v2, impl="gluon"), rtol=0, atol=0)


@pytest.mark.gpu
@needs_sm90
def test_gpu_auto_runs_the_gluon_kernel_once_switched(monkeypatch):
    """AUTO_PICKS_GLUON is the one switch: "auto" then runs the Gluon kernel (the same output as
    impl="gluon"); FP16 PV stays on the Triton kernel under "auto" and is refused by impl="gluon"."""
    q, k, v = _gpu_case(1, 4, 4, 300, 400, 128, seed=9)
    monkeypatch.setattr(fa, "AUTO_PICKS_GLUON", True)
    torch.testing.assert_close(fa.fp8_attention(q, k, v), fa.fp8_attention(q, k, v, impl="gluon"), rtol=0, atol=0)
    torch.testing.assert_close(fa.fp8_attention(q, k, v, pv="fp16"), fa.fp8_attention(q, k, v, impl="triton",
                                                                                      pv="fp16"), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"^fp8_attention: impl='gluon' cannot run: it runs P V in e4m3"):
        fa.fp8_attention(q, k, v, impl="gluon", pv="fp16")
