"""Attention kernels: kernels.ulysses_pack, kernels.lse_merge, kernels.attention_lse.

CPU: each torch reference against naive loop-by-loop math over odd shapes; the Triton
kernels (Ulysses pack and relayouts, LSE merge) under TRITON_INTERPRET=1 (conftest sets it
before triton is imported) against their references; opcheck on every op; each op is one
node of a fullgraph torch.compile. GPU (marker `gpu`): HunyuanImage-3 shapes per rank at
TP2 x SP2 (16 query heads, 4 KV heads, head_dim 128, 2674 local / 5347 total tokens) in bf16,
and opcheck on CUDA.

Tolerances. Pack and relayouts are pure copies: equal bit for bit, every dtype. float32
math against float64 naive loops: 1e-5 (sums of at most a few dozen O(1) terms; a wrong
weight, head or row is off by O(0.1)). float16 under the interpreter and bf16 on the GPU:
outputs are rounded once to 16 bits (bf16 keeps 8 bits: relative 2^-9 = 0.2% per element),
so the relative Frobenius error is held under 1e-2; LSEs stay float32 in every path and
are held to 1e-5 for the merge (same float32 formula) and 2e-2 absolute for attention
(bf16 inputs, float32 scores summed over 5347 keys in a different order and blocking).
"""
import warnings

import pytest
import torch

from dtgen.attention import structured_mask
from dtgen.sp import ulysses_kv_heads
from kernels import ulysses_pack as up
from kernels.attention_lse import (
    attention_lse,
    attention_lse_naive,
    attention_lse_reference,
    mask_to_bias,
)
from kernels.lse_merge import lse_merge, lse_merge_naive, lse_merge_reference
from kernels.ulysses_pack import (
    ulysses_pack,
    ulysses_pack_out,
    ulysses_relayout_reference,
    ulysses_unpack,
    ulysses_unpack_out,
)
from tests.support.triton import needs_triton

NEG_INF = float("-inf")


def rel_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def _randn(*shape, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _heads(q_heads, kv_heads, parts):
    """Plain Ulysses' head lists: destination j gets query heads block j and its KV heads."""
    hq = q_heads // parts
    return [list(range(j * hq, (j + 1) * hq)) for j in range(parts)], ulysses_kv_heads(q_heads, kv_heads, parts)


def pack_reference(q, k, v, q_heads, kv_heads):
    return ulysses_pack(q, k, v, q_heads, kv_heads, impl="reference")


# ------------------------------------------------------------------------------- naive


def pack_naive(q, k, v, q_heads, kv_heads):
    P, hq, n = len(q_heads), len(q_heads[0]), len(kv_heads[0])
    B, S, _, D = q.shape
    out = torch.empty(P, B, S, hq + 2 * n, D, dtype=q.dtype)
    for j in range(P):
        for i, h in enumerate(q_heads[j]):
            out[j, :, :, i] = q[:, :, h]
        for i, h in enumerate(kv_heads[j]):
            out[j, :, :, hq + i] = k[:, :, h]
            out[j, :, :, hq + n + i] = v[:, :, h]
    return out


def relayout_naive(x, layout, parts):
    if layout == "unpack":          # out[b, j*S + s] = x[j, b, s]
        P, B, S, H, D = x.shape
        out = torch.empty(B, P * S, H, D, dtype=x.dtype)
        for j in range(P):
            out[:, j * S:(j + 1) * S] = x[j]
    elif layout == "pack_out":      # out[j, b, s] = x[b, j*S + s]
        B, PS, h, D = x.shape
        S = PS // parts
        out = torch.empty(parts, B, S, h, D, dtype=x.dtype)
        for j in range(parts):
            out[j] = x[:, j * S:(j + 1) * S]
    else:                           # out[b, s, j*h + i] = x[j, b, s, i]
        P, B, S, h, D = x.shape
        out = torch.empty(B, S, P * h, D, dtype=x.dtype)
        for j in range(P):
            out[:, :, j * h:(j + 1) * h] = x[j]
    return out


def _merge_inputs(N, rows, D, seed=0, dtype=torch.float32):
    """Partials with the awkward cases: a row dead in one partial (its output NaN), a row
    dead in every partial, LSEs far apart."""
    outs = _randn(N, *rows, D, seed=seed).to(dtype)
    lses = 4 * _randn(N, *rows, seed=seed + 1)
    flat_o, flat_l = outs.view(N, -1, D), lses.view(N, -1)
    flat_l[0, 0] = NEG_INF
    flat_o[0, 0] = float("nan")
    if flat_l.shape[1] > 1:
        flat_l[:, 1] = NEG_INF
    if flat_l.shape[1] > 2 and N > 1:
        flat_l[1, 2] = 60.0   # dominates its row
    return outs, lses


def _slot_case(Sq, Sk, seed=0):
    """A mask from slots with an image block, and query rows that see nothing (padding-like)."""
    gen = torch.Generator().manual_seed(seed)
    k_slots = torch.randperm(Sk + 4, generator=gen)[:Sk]
    q_slots = torch.randint(0, Sk + 4, (Sq,), generator=gen)
    q_slots[0] = -1   # before every key: an empty row
    return structured_mask(q_slots, k_slots, ((3, 3 + Sk // 2),))


# ------------------------------------------------------------------- references vs naive


@pytest.mark.parametrize("N,rows,D", [(1, (5,), 4), (2, (3, 4), 5), (3, (2, 3, 7), 16), (5, (1, 9, 2), 3)])
def test_lse_merge_reference_matches_naive(N, rows, D):
    outs, lses = _merge_inputs(N, rows, D)
    out, lse = lse_merge_reference(outs, lses)
    want_out, want_lse = lse_merge_naive(outs, lses)
    assert not out.isnan().any()
    assert torch.allclose(out.double(), want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    dead = want_lse.isneginf()
    assert dead.any() and torch.all(out[dead] == 0)


def test_lse_merge_of_split_keys_is_full_attention():
    """Attention over disjoint key blocks merged by LSE equals attention over all keys."""
    q, k, v = _randn(1, 4, 6, 8, seed=1), _randn(1, 2, 11, 8, seed=2), _randn(1, 2, 11, 8, seed=3)
    mask = _slot_case(6, 11, seed=4)
    full_out, full_lse = attention_lse_reference(q, k, v, mask)
    parts = [attention_lse_reference(q, k[:, :, a:b], v[:, :, a:b], mask[:, a:b]) for a, b in ((0, 4), (4, 5), (5, 11))]
    out, lse = lse_merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert torch.allclose(out, full_out, atol=1e-6) and torch.allclose(lse, full_lse, atol=1e-6)


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [(1, 1, 1, 1, 1, 4), (1, 4, 4, 7, 9, 8), (2, 6, 2, 5, 13, 6),
                                              (1, 8, 1, 3, 17, 16), (2, 4, 2, 9, 3, 5)])
def test_attention_lse_reference_matches_naive(B, Hq, Hkv, Sq, Sk, D):
    q, k, v = _randn(B, Hq, Sq, D, seed=1), _randn(B, Hkv, Sk, D, seed=2), _randn(B, Hkv, Sk, D, seed=3)
    mask = _slot_case(Sq, Sk, seed=Sq)
    out, lse = attention_lse_reference(q, k, v, mask)
    want_out, want_lse = attention_lse_naive(q, k, v, mask)
    assert out.shape == (B, Hq, Sq, D) and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous()   # the op's layout: [B, Hq, Sq, D] stored [B, Sq, Hq, D]
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.equal(lse.isneginf(), want_lse.isneginf()) and lse[..., 0].isneginf().all()
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)
    assert torch.all(out[..., 0, :] == 0)


def test_attention_lse_reference_scale_and_half_inputs():
    q, k, v = _randn(1, 2, 5, 8, seed=5), _randn(1, 1, 7, 8, seed=6), _randn(1, 1, 7, 8, seed=7)
    mask = torch.ones(5, 7, dtype=torch.bool)
    out, lse = attention_lse_reference(q, k, v, mask, scale=0.3)
    want_out, want_lse = attention_lse_naive(q, k, v, mask, scale=0.3)
    assert torch.allclose(out.double(), want_out, atol=1e-5) and torch.allclose(lse.double(), want_lse, atol=1e-5)
    half = [t.half() for t in (q, k, v)]
    out_h, lse_h = attention_lse_reference(*half, mask)
    want_h, want_lse_h = attention_lse_naive(*half, mask)
    assert out_h.dtype == torch.float16 and rel_error(out_h, want_h) < 1e-2
    assert torch.allclose(lse_h.double(), want_lse_h, atol=1e-5)   # float32 scores of the same half inputs


@pytest.mark.parametrize("B,S,Hq,Hkv,D,P", [(1, 5, 8, 4, 6, 4), (2, 3, 8, 2, 4, 4), (1, 7, 16, 4, 8, 2),
                                            (2, 1, 4, 1, 3, 2)])
def test_ulysses_pack_reference_matches_naive(B, S, Hq, Hkv, D, P):
    q, k, v = _randn(B, S, Hq, D, seed=1), _randn(B, S, Hkv, D, seed=2), _randn(B, S, Hkv, D, seed=3)
    q_heads, kv_heads = _heads(Hq, Hkv, P)
    assert torch.equal(pack_reference(q, k, v, q_heads, kv_heads), pack_naive(q, k, v, q_heads, kv_heads))


@pytest.mark.parametrize("layout", up.LAYOUTS)
def test_ulysses_relayout_reference_matches_naive(layout):
    x = _randn(3, 2, 5, 4, 6) if layout != "pack_out" else _randn(2, 15, 4, 6)
    assert torch.equal(ulysses_relayout_reference(x, layout, 3), relayout_naive(x, layout, 3))


def test_ulysses_roundtrip_and_batch_one_views():
    """unpack_out(pack_out(.)) undoes a head split; with B == 1 the free layouts are views."""
    P, S, h, D = 4, 3, 2, 5
    recv = _randn(P, 1, S, 6, D)
    unpacked = ulysses_unpack(recv)
    assert unpacked.data_ptr() == recv.data_ptr() and torch.equal(unpacked, relayout_naive(recv, "unpack", P))
    out = _randn(1, P * S, h, D)
    assert ulysses_pack_out(out, P).data_ptr() == out.data_ptr()
    full = _randn(2, S, P * h, D)   # [B, S, Hq, D]: split into head blocks, then back
    blocks = full.view(2, S, P, h, D).permute(2, 0, 1, 3, 4).contiguous()
    assert torch.equal(ulysses_unpack_out(blocks), full)


# ---------------------------------------------------------------- Triton (interpreter on CPU)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,P", [(1, 5, 8, 4, 6, 4), (2, 3, 8, 2, 4, 4), (1, 7, 16, 4, 16, 2),
                                            (2, 9, 4, 1, 3, 2)])
def test_triton_pack_matches_reference(B, S, Hq, Hkv, D, P, dtype):
    dev = _device()
    # q as a transposed view of [B, H, S, D] memory: the kernel reads any strides.
    q = _randn(B, Hq, S, D, seed=1, dtype=dtype, device=dev).transpose(1, 2)
    k, v = _randn(B, S, Hkv, D, seed=2, dtype=dtype, device=dev), _randn(B, S, Hkv, D, seed=3, dtype=dtype, device=dev)
    q_heads, kv_heads = _heads(Hq, Hkv, P)
    got = ulysses_pack(q, k, v, q_heads, kv_heads, impl="triton")
    assert torch.equal(got, pack_reference(q, k, v, q_heads, kv_heads))
    # A head group of pipelined Ulysses: every other query head, the first KV head of each rank.
    sub_q, sub_kv = [row[::2] for row in q_heads], [row[:1] for row in kv_heads]
    assert torch.equal(ulysses_pack(q, k, v, sub_q, sub_kv, impl="triton"), pack_reference(q, k, v, sub_q, sub_kv))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", up.LAYOUTS)
def test_triton_relayout_matches_reference(layout, dtype):
    dev = _device()
    for B, S, H, D, P in ((1, 5, 3, 6, 4), (2, 3, 4, 16, 2), (2, 1, 1, 3, 3)):
        if layout == "pack_out":   # the attention output: a [B, H, S, D] buffer seen as [B, S, H, D]
            x = _randn(B, H, P * S, D, dtype=dtype, device=dev).transpose(1, 2)
            got = ulysses_pack_out(x, P, impl="triton")
        else:
            x = _randn(P, B, S, H, D, dtype=dtype, device=dev)
            got = (ulysses_unpack if layout == "unpack" else ulysses_unpack_out)(x, impl="triton")
        assert torch.equal(got, ulysses_relayout_reference(x, layout, P)), (layout, B, S, H, D, P)


@needs_triton
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.float16, None),
                                             (torch.float16, torch.float32)])
@pytest.mark.parametrize("N,rows,D", [(1, (5,), 4), (2, (3, 4), 5), (3, (2, 3, 7), 16), (4, (1, 9, 2), 128)])
def test_triton_lse_merge_matches_reference(N, rows, D, dtype, out_dtype):
    outs, lses = _merge_inputs(N, rows, D, dtype=dtype)
    outs, lses = outs.to(_device()), lses.to(_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the interpreter's numpy warns on log(0) = -inf
        out, lse = lse_merge(outs, lses, out_dtype, impl="triton")
    want_out, want_lse = lse_merge_reference(outs, lses, out_dtype)
    assert out.dtype == (out_dtype or dtype) and not out.isnan().any()
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2
    assert rel_error(out, want_out) < tol
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_lse_merge_reads_a_packed_receive_buffer():
    """Attention2D's receive buffer [R, B, S, H, D + 2] (fp16 out, the fp32 lse in two lanes):
    strided views in, no unpacking copy."""
    R, B, S, H, D = 3, 1, 4, 2, 16
    outs, lses = _merge_inputs(R, (B, S, H), D, dtype=torch.float16)
    buf = torch.cat([outs, lses.unsqueeze(-1).view(torch.float16)], dim=-1).to(_device())
    o_view, l_view = buf[..., :D], buf[..., D:].view(torch.float32).squeeze(-1)
    assert o_view.data_ptr() == buf.data_ptr() and not o_view.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = lse_merge(o_view, l_view, torch.float32, impl="triton")
    want_out, want_lse = lse_merge_reference(outs, lses, torch.float32)
    assert rel_error(out.cpu(), want_out) < 1e-5 and torch.allclose(lse.cpu(), want_lse, atol=1e-5)


# ------------------------------------------------------------------ op registration


def _opcheck_cases(device="cpu", impl="reference"):
    q, k, v = _randn(1, 2, 4, 4, device=device), _randn(1, 2, 2, 4, device=device), _randn(1, 2, 2, 4, device=device)
    q_heads, kv_heads = _heads(4, 2, 2)
    flat_q, flat_kv = [h for r in q_heads for h in r], [h for r in kv_heads for h in r]
    outs, lses = _randn(2, 1, 3, 2, 4, device=device), _randn(2, 1, 3, 2, seed=1, device=device)
    aq, ak, av = _randn(1, 4, 3, 8, device=device), _randn(1, 2, 5, 8, device=device), _randn(1, 2, 5, 8, device=device)
    mask = _slot_case(3, 5).to(device)
    attn_impl = "reference" if impl == "reference" else "efficient"
    return {
        "ulysses_pack": (torch.ops.dtgen.ulysses_pack.default, (q, k, v, flat_q, flat_kv, 2, impl)),
        "relayout_unpack": (torch.ops.dtgen.ulysses_relayout.default, (_randn(2, 1, 3, 2, 4, device=device),
                                                                      "unpack", 2, impl)),
        "relayout_pack_out": (torch.ops.dtgen.ulysses_relayout.default, (_randn(1, 6, 2, 4, device=device),
                                                                        "pack_out", 2, impl)),
        "relayout_unpack_out": (torch.ops.dtgen.ulysses_relayout.default, (_randn(2, 2, 3, 2, 4, device=device),
                                                                          "unpack_out", 2, impl)),
        "lse_merge": (torch.ops.dtgen.lse_merge.default, (outs, lses, None, impl)),
        "lse_merge_f32_out": (torch.ops.dtgen.lse_merge.default, (outs.half(), lses, torch.float32, impl)),
        "attention_lse": (torch.ops.dtgen.attention_lse.default, (aq, ak, av, mask, None, attn_impl)),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_cpu(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def _all_ops(q, k, v, q_heads, kv_heads, outs, lses, aq, ak, av, mask):
    send = ulysses_pack(q, k, v, q_heads, kv_heads)
    full = ulysses_unpack(send)   # B = 2: the op, not a view
    back = ulysses_unpack_out(ulysses_pack_out(full[:, :, :2], 2))
    merged, lse = lse_merge(outs, lses)
    att, att_lse = attention_lse(aq, ak, av, mask)
    return back, merged, lse, att, att_lse


def test_compile_fullgraph_keeps_each_op_one_node():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "dtgen" in str(n.target))
        return gm.forward

    q, k, v = _randn(2, 3, 4, 4), _randn(2, 3, 2, 4), _randn(2, 3, 2, 4)
    q_heads, kv_heads = _heads(4, 2, 2)
    args = (q, k, v, q_heads, kv_heads, _randn(3, 2, 3, 2, 4), _randn(3, 2, 3, 2),
            _randn(1, 4, 3, 8), _randn(1, 2, 5, 8), _randn(1, 2, 5, 8), _slot_case(3, 5))
    compiled = torch.compile(_all_ops, fullgraph=True, backend=backend)
    for got, want in zip(compiled(*args), _all_ops(*args)):
        assert torch.equal(got, want)
    assert sorted(seen) == sorted(["dtgen.ulysses_pack", "dtgen.ulysses_relayout", "dtgen.ulysses_relayout",
                                   "dtgen.ulysses_relayout", "dtgen.lse_merge", "dtgen.attention_lse"])


@pytest.mark.parametrize("call,message", [
    (lambda: ulysses_pack(_randn(1, 2, 4, 8), _randn(1, 3, 2, 8), _randn(1, 3, 2, 8), *_heads(4, 2, 2)),
     r"k must be \[B=1, S=2, Hkv, D=8\] to match q, got \(1, 3, 2, 8\)"),
    (lambda: ulysses_pack(_randn(1, 2, 4, 8), _randn(1, 2, 2, 8), _randn(1, 2, 2, 8), [[0, 1], [2, 4]], [[0], [1]]),
     r"q_heads \[0, 1, 2, 4\] must lie in \[0, 4\)"),
    (lambda: ulysses_pack(_randn(1, 2, 4, 8), _randn(1, 2, 2, 8), _randn(1, 2, 2, 8), [[0, 1], [2]], [[0], [1]]),
     "q_heads must give each rank the same number of heads"),
    (lambda: ulysses_pack_out(_randn(1, 7, 2, 8), 2), r"rows divisible by P = 2, got shape \(1, 7, 2, 8\)"),
    (lambda: lse_merge(_randn(2, 3, 4), _randn(2, 4)), r"lses must be outs' shape without the last dim, \(2, 3\)"),
    (lambda: lse_merge(_randn(2, 3, 4), _randn(2, 3).half()), "lses must be float32"),
    (lambda: attention_lse(_randn(1, 3, 2, 8), _randn(1, 2, 4, 8), _randn(1, 2, 4, 8), torch.ones(2, 4).bool()),
     r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    (lambda: attention_lse(_randn(1, 2, 2, 8), _randn(1, 2, 4, 8), _randn(1, 2, 4, 8), torch.ones(2, 5).bool()),
     r"mask must be bool \[Sq, Sk\] = \(2, 4\)"),
    (lambda: lse_merge(_randn(2, 3, 4), _randn(2, 3), impl="fast"), "impl must be one of"),
])
def test_bad_inputs_raise_with_names_and_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_mask_to_bias_rows_are_aligned():
    mask = _slot_case(5, 21)
    bias = mask_to_bias(mask, torch.float32)
    assert bias.shape == (5, 21) and bias.stride(0) % 16 == 0 and bias.stride(1) == 1
    assert torch.equal(bias == 0, mask) and torch.all(bias[~mask] == NEG_INF)


# ------------------------------------------------------------------------------- GPU

# Per rank at TP2 x SP2 (HunyuanImage-3: 32 query / 8 KV heads, head_dim 128; a 1024x1024 image
# and its prompt make 5347 tokens, 2674 per SP rank after padding).
HQ, HKV, D, S_LOCAL, S_TOTAL, SP = 16, 4, 128, 2674, 5347, 2


@pytest.mark.gpu
def test_gpu_ulysses_pack_and_relayouts_real_shapes():
    dev = "cuda"
    q = _randn(1, S_LOCAL, HQ, D, dtype=torch.bfloat16, device=dev)
    k, v = (_randn(1, S_LOCAL, HKV, D, seed=s, dtype=torch.bfloat16, device=dev) for s in (1, 2))
    q_heads, kv_heads = _heads(HQ, HKV, SP)
    send = ulysses_pack(q, k, v, q_heads, kv_heads)                       # CUDA auto: Triton
    assert send.shape == (SP, 1, S_LOCAL, HQ // SP + 2 * (HKV // SP), D)
    assert torch.equal(send, pack_reference(q, k, v, q_heads, kv_heads))
    recv = _randn(SP, 2, S_LOCAL, 12, D, dtype=torch.bfloat16, device=dev)  # CFG batch 2: a real copy
    assert torch.equal(ulysses_unpack(recv), ulysses_relayout_reference(recv, "unpack", SP))
    out = _randn(2, HQ // SP, SP * S_LOCAL, D, dtype=torch.bfloat16, device=dev).transpose(1, 2)
    assert torch.equal(ulysses_pack_out(out, SP), ulysses_relayout_reference(out, "pack_out", SP))
    back = _randn(SP, 2, S_LOCAL, HQ // SP, D, dtype=torch.bfloat16, device=dev)
    assert torch.equal(ulysses_unpack_out(back), ulysses_relayout_reference(back, "unpack_out", SP))


@pytest.mark.gpu
def test_gpu_lse_merge_real_shapes():
    for N in (2, 3):
        outs, lses = _merge_inputs(N, (1, S_LOCAL, HQ), D, dtype=torch.bfloat16)
        outs, lses = outs.cuda(), lses.cuda()
        out, lse = lse_merge(outs, lses)                                  # CUDA auto: Triton, bf16 out
        want_out, want_lse = lse_merge_reference(outs.float(), lses)     # float32 math on the same inputs
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        assert rel_error(out, want_out) < 1e-2
        assert torch.equal(lse.isneginf(), want_lse.isneginf())
        assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_attention_lse_real_shapes():
    dev = "cuda"
    q = _randn(1, HQ, S_LOCAL, D, dtype=torch.bfloat16, device=dev)
    k, v = (_randn(1, HKV, S_TOTAL, D, seed=s, dtype=torch.bfloat16, device=dev) for s in (1, 2))
    # Rank 1's rows of the denoise sequence: text, then a 4096-token image block; the last row
    # is padding at a spare slot. Plus one row that sees nothing (slot -1) for the -inf case.
    q_slots = torch.arange(S_LOCAL, 2 * S_LOCAL, device=dev)
    q_slots[0] = -1
    mask = structured_mask(q_slots, torch.arange(S_TOTAL, device=dev), ((1248, 1248 + 4096),))
    out, lse = attention_lse(q, k, v, mask)                               # CUDA auto: efficient attention
    want_out, want_lse = attention_lse_reference(q, k, v, mask)
    assert out.shape == (1, HQ, S_LOCAL, D) and out.dtype == torch.bfloat16
    assert rel_error(out, want_out) < 1e-2
    assert torch.all(out[:, :, 0] == 0) and lse[:, :, 0].isneginf().all()
    assert float((lse[:, :, 1:] - want_lse[:, :, 1:]).abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_cuda(name):
    op, args = _opcheck_cases("cuda", "triton")[name]
    torch.library.opcheck(op, args)
