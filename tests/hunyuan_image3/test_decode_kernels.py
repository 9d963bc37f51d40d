"""Batched-decode kernels: kernels.split_kv_decode and kernels.qk_norm_rope_kv.

CPU: the torch references against float64 math and against the model's own modules; the
Triton kernels under TRITON_INTERPRET=1 (conftest sets it) at small odd shapes against the
references; the schedules' invariants; opcheck; one node under fullgraph torch.compile.
GPU (marker `gpu`): the released model's shapes (32 q / 8 kv heads, head_dim 128) in bf16,
and a CUDA-graph replay at new lengths.

Tolerances. split_kv_decode in float32 against float64: 1e-5 absolute (softmax of at most a
few hundred O(1) scores; a wrong key, head or request is off by O(0.1)). 16-bit: the output
is rounded once to 16 bits and probabilities go to 16 bits before the PV product (as in
flash attention): 2e-2 absolute on O(1) outputs (bf16 keeps 8 bits). The prologue in
float32: within 4 ulp of the separate ops (rtol 1e-6: the kernel sums the squares of a head
in another order and uses the hardware rsqrt); float16 under the interpreter: bit-equal
(every rounding the model makes is made at the same point). bf16 on the interpreter
converts by truncation, not round-to-nearest (measured: 509 of 1024 random floats differ),
so the prologue's bf16 runs on the GPU only (1 ulp, rtol 2^-7, on at most 1% of elements);
the split kernel's bf16 runs under the interpreter too (its dots in float32 there: the
interpreter's tl.dot multiplies bf16 raw bits, triton-lang/triton#11584), at 2e-2.
"""
import math

import pytest
import torch

from kernels import split_kv_decode as skv
from kernels import qk_norm_rope_kv as pro
from kernels.qk_norm_rope_kv import qk_norm_rope_kv, qk_norm_rope_kv_reference
from kernels.split_kv_decode import (
    balanced_schedule,
    split_kv_decode,
    split_kv_decode_reference,
    static_schedule,
)
from tests.support.triton import needs_triton


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _decode_case(B, Hq, Hkv, D, L, lengths, dtype=torch.float32, seed=0, device="cpu"):
    q = _randn(B, Hq, D, seed=seed, dtype=dtype, device=device)
    k = _randn(B, Hkv, L, D, seed=seed + 1, dtype=dtype, device=device)
    v = _randn(B, Hkv, L, D, seed=seed + 2, dtype=dtype, device=device)
    return q, k, v, torch.tensor(lengths, device=device)


def _naive(q, k, v, lengths):
    """float64, one request and head at a time."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            if n == 0:
                continue
            s = k[b, h // G, :n].double() @ q[b, h].double() / math.sqrt(D)
            out[b, h] = torch.softmax(s, 0) @ v[b, h // G, :n].double()
    return out


# ------------------------------------------------------------------------------ schedules


def _tiles_of_programs(sch):
    """{program: [(request, tile within request), ...]} as the split kernel walks them."""
    begin, req_begin = sch.prog_begin.tolist(), sch.req_begin.tolist()
    out = {}
    for p in range(sch.num_programs):
        for t in range(begin[p], begin[p + 1]):
            r = max(i for i in range(len(req_begin) - 1) if req_begin[i] <= t < req_begin[i + 1])
            out.setdefault(p, []).append((r, t - req_begin[r]))
    return out


@pytest.mark.parametrize("lengths,programs", [([1], 4), ([16000, 1000, 1000, 1000, 1000, 1000, 1000, 1000], 33),
                                              ([0, 5, 0, 130, 64, 0], 7), ([3, 3], 40), ([0, 0], 3)])
def test_balanced_schedule_covers_every_tile_once_evenly(lengths, programs):
    lens = torch.tensor(lengths)
    sch = balanced_schedule(lens, max(lengths) or 1, programs, tile=64)
    walked = _tiles_of_programs(sch)
    tiles = [(r, j) for r, n in enumerate(lengths) for j in range(-(-n // 64))]
    assert sorted(x for v in walked.values() for x in v) == tiles
    sizes = [len(walked.get(p, [])) for p in range(programs)]
    assert max(sizes) - min(sizes) <= 1                       # equal work, +-1 tile
    # the merge's program range of each request holds every program that touched it
    for p, items in walked.items():
        for r in {r for r, _ in items}:
            assert sch.req_first[r] <= p <= sch.req_last[r]
            assert sch.prog_req[p] <= r                       # the walk starts at or before it
    # the partial rows p + r are unique
    rows = [p + r for p, items in walked.items() for r in {r for r, _ in items}]
    assert len(rows) == len(set(rows)) and max(rows, default=0) < len(lengths) + programs - 1


def test_static_schedule_splits_each_request_alone():
    lengths = [16000, 1000, 1, 0]
    sch = static_schedule(torch.tensor(lengths), 16000, splits=4, tile=64)
    walked = _tiles_of_programs(sch)
    for p, items in walked.items():
        assert {r for r, _ in items} == {p // 4}               # no program crosses requests
    assert max(len(v) for v in walked.values()) == 63          # ceil(250 tiles / 4): the long one dominates


def test_schedule_bad_arguments():
    with pytest.raises(ValueError, match="tile"):
        balanced_schedule(torch.tensor([3]), 8, 4, tile=24)
    with pytest.raises(ValueError, match="num_programs"):
        balanced_schedule(torch.tensor([3]), 8, 0)
    with pytest.raises(ValueError, match="lengths"):
        balanced_schedule(torch.tensor([3.0]), 8, 2)


# ------------------------------------------------------------------------ split-KV decode


def test_reference_matches_naive():
    q, k, v, lengths = _decode_case(4, 6, 2, 16, 37, [1, 37, 0, 20], dtype=torch.float64)
    torch.testing.assert_close(split_kv_decode_reference(q, k, v, lengths), _naive(q, k, v, lengths),
                               atol=1e-12, rtol=0)
    out = split_kv_decode_reference(q.float(), k.float(), v.float(), lengths)
    assert out.dtype == torch.float32 and out[2].abs().max() == 0    # an empty request gives 0


def test_bad_inputs_name_the_problem():
    q, k, v, lengths = _decode_case(2, 4, 2, 16, 9, [3, 9])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        split_kv_decode(q[:, :3], k, v, lengths)
    with pytest.raises(ValueError, match="lengths must lie in"):
        split_kv_decode(q, k, v, torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="v_cache"):
        split_kv_decode(q, k, v[:, :, :5], lengths)
    with pytest.raises(ValueError, match="schedule is for 3 requests"):
        split_kv_decode(q, k, v, lengths, balanced_schedule(torch.tensor([1, 2, 3]), 9, 2))
    with pytest.raises(ValueError, match="impl"):
        split_kv_decode(q, k, v, lengths, impl="cuda")


CASES = [  # B, Hq, Hkv, D, L, lengths
    (1, 4, 1, 64, 1, [1]),                                  # length 1, batch 1
    (1, 8, 2, 128, 200, [200]),                              # batch 1, lengths not multiple of the tile
    (8, 8, 2, 64, 130, [130, 1, 5, 16, 17, 0, 33, 64]),     # batch 8, an empty row, odd lengths
    (5, 6, 3, 64, 400, [400, 2, 3, 1, 9]),                   # one huge + many small
]


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(case, dtype):
    B, Hq, Hkv, D, L, lens = case
    q, k, v, lengths = _decode_case(B, Hq, Hkv, D, L, lens, dtype=dtype, device=_device())
    expected = _naive(q.cpu(), k.cpu(), v.cpu(), lengths.cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # 45 programs of 16-key tiles: the 400-key request spans more than the merge's 32-program
    # chunk (two chunks, the second partly empty).
    for sch in (balanced_schedule(lengths, L, 5, tile=32), balanced_schedule(lengths, L, 1, tile=64),
                static_schedule(lengths, L, 3, tile=16), balanced_schedule(lengths, L, 45, tile=16)):
        out = split_kv_decode(q, k, v, lengths, sch, impl="triton")
        assert out.dtype == dtype and out.shape == (B, Hq, D)
        torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=0)


@needs_triton
def test_triton_more_programs_than_tiles_and_strided_cache():
    """40 programs over 3 tiles (most programs empty); the cache a strided view (a wider buffer)."""
    q, k, v, lengths = _decode_case(2, 4, 2, 64, 40, [3, 40])
    wide_k = torch.zeros(2, 2, 64, 64)
    wide_k[:, :, :40] = k
    wide_v = torch.zeros(2, 2, 64, 64)
    wide_v[:, :, :40] = v
    dev = _device()
    out = split_kv_decode(q.to(dev), wide_k[:, :, :40].to(dev), wide_v[:, :, :40].to(dev), lengths.to(dev),
                          balanced_schedule(lengths.to(dev), 40, 40, tile=16), impl="triton")
    torch.testing.assert_close(out.cpu().double(), _naive(q, k, v, lengths), atol=1e-5, rtol=0)


def test_opcheck_and_one_compiled_node():
    q, k, v, lengths = _decode_case(3, 4, 2, 16, 20, [20, 1, 7])
    sch = balanced_schedule(lengths, 20, 3, tile=16)
    args = (q, k, v, lengths, *sch[:5], sch.tile, None, "reference")
    torch.library.opcheck(torch.ops.dtgen.split_kv_decode.default, args)
    compiled = torch.compile(lambda *a: split_kv_decode(*a, sch, impl="reference"), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, lengths), split_kv_decode_reference(q, k, v, lengths))


# ------------------------------------------------------------------------ fused prologue


def _prologue_case(B, S, Hkv, G, D, L, dtype, per_row, norm=True, seed=0, per_row_rope=None):
    """per_row: slots [B, S] (else [S]); per_row_rope: cos/sin [B, S, D] (else [S, D]), as per_row unless given."""
    from models.hunyuan_image3.rope import rope_cos_sin

    per_row_rope = per_row if per_row_rope is None else per_row_rope
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, S, Hkv * (G + 2) * D, generator=gen).to(dtype)
    pos = torch.randint(0, 4000, (B, S, 2) if per_row_rope else (S, 2), generator=gen)   # 2-D (y, x) positions
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    qw = (torch.rand(D, generator=gen) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(D, generator=gen) + 0.5).to(dtype) if norm else None
    slots = (torch.stack([torch.randperm(L, generator=gen)[:S] for _ in range(B)]) if per_row
             else torch.randperm(L, generator=gen)[:S])
    cache = lambda: torch.zeros(B, Hkv, L, D, dtype=dtype)  # noqa: E731
    return qkv, cos, sin, qw, kw, cache, slots


def test_prologue_reference_is_the_models_order():
    """The reference against HunyuanImage-3's own Attention ops (split, apply_rope, then its
    RMSNorm modules) and the cache's own write, in bf16: bit for bit."""
    from dtgen.attention import LayerKVCache
    from dtgen.layers.norms import RMSNorm
    from dtgen.layers.rope import apply_rope

    B, S, Hkv, G, D, L = 2, 5, 2, 3, 16, 11
    qkv, cos, sin, qw, kw, cache, slots = _prologue_case(B, S, Hkv, G, D, L, torch.bfloat16, per_row=False)
    qn, kn = RMSNorm(D, 1e-5), RMSNorm(D, 1e-5)
    qn.weight.data, kn.weight.data = qw, kw
    grouped = qkv.view(B, S, Hkv, G + 2, D)
    q = qn(apply_rope(grouped[:, :, :, :G].reshape(B, S, -1, D), cos, sin))
    k = kn(apply_rope(grouped[:, :, :, G], cos, sin))
    layer = LayerKVCache(cache(), cache())
    layer.write(slots, k, grouped[:, :, :, G + 1])
    kc, vc = cache(), cache()
    out = qk_norm_rope_kv_reference(qkv, cos, sin, qw, kw, 1e-5, kc, vc, slots, G)
    assert torch.equal(out, q) and torch.equal(kc, layer.k) and torch.equal(vc, layer.v)


PROLOGUE_CASES = [  # B, S, Hkv, G, D, L, per-row slots (decode), QK norm
    (1, 7, 2, 4, 64, 16, False, True),      # prefill shape
    (3, 1, 2, 4, 128, 40, True, True),      # batched decode: one row per request at its own slot
    (2, 5, 3, 1, 32, 9, False, False),      # no QK norm, G = 1
    (1, 3, 1, 3, 128, 8, True, True),       # odd group
]


@needs_triton
@pytest.mark.parametrize("case", PROLOGUE_CASES)
# bf16 on the GPU only: the interpreter converts to bf16 by truncation (module docstring).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_prologue_triton_matches_reference(case, dtype):
    B, S, Hkv, G, D, L, per_row, norm = case
    qkv, cos, sin, qw, kw, cache, slots = _prologue_case(B, S, Hkv, G, D, L, dtype, per_row, norm)
    dev = _device()
    qkv, cos, sin, slots = qkv.to(dev), cos.to(dev), sin.to(dev), slots.to(dev)
    qw, kw = (None if w is None else w.to(dev) for w in (qw, kw))
    kc1, vc1, kc2, vc2 = (cache().to(dev) for _ in range(4))
    expected = qk_norm_rope_kv_reference(qkv, cos, sin, qw, kw, 1e-5, kc1, vc1, slots, G)
    out = qk_norm_rope_kv(qkv, cos, sin, qw, kw, 1e-5, kc2, vc2, slots, G, impl="triton")
    assert out.dtype == dtype and out.shape == (B, S, Hkv * G, D)
    assert torch.equal(vc1, vc2)                                  # V is a copy
    if dtype == torch.float16:
        assert torch.equal(out, expected) and torch.equal(kc1, kc2)
    else:
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(out, expected, **tol)
        torch.testing.assert_close(kc2, kc1, **tol)
    untouched = torch.ones(B, L, dtype=torch.bool, device=dev)
    untouched[torch.arange(B, device=dev)[:, None].expand(B, S), slots.expand(B, S)] = False
    assert kc2.transpose(1, 2)[untouched].abs().max() == 0       # nothing written outside the slots


ROWS_CASES = [  # B, S, Hkv, G, D, L, per-row slots, per-row cos/sin, QK norm, rows_per_program
    (3, 5, 2, 3, 48, 9, True, True, True, 4),       # 15 rows in blocks of 4 (tail of 3); D/2 = 24 masked to 32
    (2, 7, 2, 4, 64, 12, False, False, True, 8),    # shared slots [S], cos/sin [S, D]; 14 rows: 8 + 6
    (2, 7, 1, 2, 32, 12, False, True, True, 2),     # shared slots [S], cos/sin [B, S, D]; 7 blocks of 2
    (3, 3, 3, 1, 32, 8, True, False, False, 4),     # no QK norm, G = 1, per-row slots with cos/sin [S, D]; 4 + 4 + 1
    (2, 3, 2, 2, 16, 8, True, True, True, 1),       # rows_per_program = 1 given explicitly
    (2, 3, 2, 2, 16, 8, False, True, True, 32),     # one program for all 6 rows (26 masked)
]


@needs_triton
@pytest.mark.parametrize("case", ROWS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prologue_rows_per_program(case, dtype):
    """Several rows a program: each row's own b, s, slot and cos/sin row, the ragged tail masked.
    float16 bit-equal to the reference; float32 bit-equal to one row a program (a row's math does
    not depend on the tiling) and within the reference's tolerance above (bit-equal without norm)."""
    B, S, Hkv, G, D, L, per_row, per_row_rope, norm, rows = case
    qkv, cos, sin, qw, kw, cache, slots = _prologue_case(B, S, Hkv, G, D, L, dtype, per_row, norm, seed=3,
                                                         per_row_rope=per_row_rope)
    assert slots.dim() == (2 if per_row else 1) and cos.dim() == (3 if per_row_rope else 2)
    dev = _device()
    qkv, cos, sin, slots = qkv.to(dev), cos.to(dev), sin.to(dev), slots.to(dev)
    qw, kw = (None if w is None else w.to(dev) for w in (qw, kw))
    kc1, vc1, kc2, vc2 = (cache().to(dev) for _ in range(4))
    expected = qk_norm_rope_kv_reference(qkv, cos, sin, qw, kw, 1e-5, kc1, vc1, slots, G)
    out = pro.qk_norm_rope_kv_triton(qkv, cos, sin, qw, kw, 1e-5, kc2, vc2, slots, G, rows_per_program=rows)
    assert out.dtype == dtype and out.shape == (B, S, Hkv * G, D)
    assert torch.equal(vc1, vc2)
    if dtype == torch.float16 or not norm:
        assert torch.equal(out, expected) and torch.equal(kc1, kc2)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kc2, kc1, rtol=1e-6, atol=1e-6)
    if dtype == torch.float32 and rows != 1:
        kc3, vc3 = cache().to(dev), cache().to(dev)
        one = pro.qk_norm_rope_kv_triton(qkv, cos, sin, qw, kw, 1e-5, kc3, vc3, slots, G, rows_per_program=1)
        assert torch.equal(out, one) and torch.equal(kc2, kc3) and torch.equal(vc2, vc3)
    untouched = torch.ones(B, L, dtype=torch.bool, device=dev)
    untouched[torch.arange(B, device=dev)[:, None].expand(B, S), slots.expand(B, S)] = False
    assert kc2.transpose(1, 2)[untouched].abs().max() == 0 and vc2.transpose(1, 2)[untouched].abs().max() == 0


def test_prologue_launch_config():
    """Decode-sized launches keep one row a program (and the one-row warps); the prefill shape
    (4096 rows, 8 KV heads, group 4, head dim 128) takes 8 rows at 4 warps (the H200 sweep's
    fastest); few rows shrink the block to keep 1024 programs; an override is taken as given,
    a non-power of two refused."""
    cfg = pro.prologue_launch_config
    assert cfg(8, 8, 4, 128) == (1, 4) and cfg(1, 8, 4, 128) == (1, 4) and cfg(8, 2, 1, 64) == (1, 1)
    assert cfg(4096, 8, 4, 128) == (8, 4)
    assert cfg(512, 8, 4, 128) == (4, 4)                     # 512 / 4 * 8 = 1024 programs
    assert cfg(65536, 8, 8, 128) == (4, 4)                   # the tile cap: 4 rows x 8 heads x 128
    assert cfg(8, 8, 4, 128, rows_per_program=32) == (32, 4)
    assert cfg(4096, 8, 4, 128, rows_per_program=1, num_warps=2) == (1, 2)
    with pytest.raises(ValueError, match="power of two"):
        cfg(4096, 8, 4, 128, rows_per_program=12)


def test_prologue_bad_inputs_name_the_problem():
    qkv, cos, sin, qw, kw, cache, slots = _prologue_case(1, 3, 2, 2, 16, 8, torch.float32, per_row=False)
    with pytest.raises(ValueError, match="qkv's last dim"):
        qk_norm_rope_kv(qkv, cos, sin, qw, kw, 1e-5, cache(), cache(), slots, 3)
    with pytest.raises(ValueError, match="slots must be int64"):
        qk_norm_rope_kv(qkv, cos, sin, qw, kw, 1e-5, cache(), cache(), slots.int(), 2)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        qk_norm_rope_kv(qkv, cos, sin, qw, None, 1e-5, cache(), cache(), slots, 2)
    with pytest.raises(ValueError, match="cos must be float32"):
        qk_norm_rope_kv(qkv, cos[:2], sin, qw, kw, 1e-5, cache(), cache(), slots, 2)


def test_prologue_opcheck_and_one_compiled_node():
    qkv, cos, sin, qw, kw, cache, slots = _prologue_case(2, 1, 2, 2, 16, 8, torch.float32, per_row=True)
    torch.library.opcheck(torch.ops.dtgen.qk_norm_rope_kv.default,
                          (qkv, cos, sin, qw, kw, 1e-5, cache(), cache(), slots, 2, "reference"))
    kc, vc = cache(), cache()
    compiled = torch.compile(lambda *a: qk_norm_rope_kv(*a, impl="reference"), fullgraph=True, backend="eager")
    out = compiled(qkv, cos, sin, qw, kw, 1e-5, kc, vc, slots, 2)
    kr, vr = cache(), cache()
    torch.testing.assert_close(out, qk_norm_rope_kv_reference(qkv, cos, sin, qw, kw, 1e-5, kr, vr, slots, 2))
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_released_shapes_bf16_and_cuda_graph():
    dev = torch.device("cuda")
    lens = [16000, 1000, 1000, 1000, 1000, 1000, 1000, 1000]
    q, k, v, lengths = _decode_case(8, 32, 8, 128, 16384, lens, dtype=torch.bfloat16, device=dev)
    expected = split_kv_decode_reference(q, k, v, lengths).float()
    for sch in (balanced_schedule(lengths, 16384, skv.default_num_programs(dev, 8)),
                static_schedule(lengths, 16384, skv.heuristic_splits(8, 8, dev))):
        torch.testing.assert_close(split_kv_decode(q, k, v, lengths, sch).float(), expected, atol=2e-2, rtol=0)
    # a CUDA graph recorded at one set of lengths replays at others (schedule inside the graph)
    static_len = lengths.clone()
    graph = torch.cuda.CUDAGraph()
    split_kv_decode(q, k, v, static_len)
    with torch.cuda.graph(graph):
        out = split_kv_decode(q, k, v, static_len)
    static_len.copy_(torch.tensor([1, 2, 3, 4, 5, 6, 7, 16384], device=dev))
    graph.replay()
    torch.testing.assert_close(out.float(), split_kv_decode_reference(q, k, v, static_len).float(), atol=2e-2, rtol=0)
    # the prologue at decode and prefill shapes, bf16: at most 1% of elements differ, by 2 ulp
    # at most (measured on an H200: 4 of 4.2M prefill elements 2 ulp apart). The kernel rounds
    # where the model rounds, but its float32 steps are not torch's bit for bit (FMA contraction,
    # Triton's rsqrt), and one float32 ulp can move a bf16 rounding, which the norm can double.
    for B, S, per_row in ((8, 1, True), (1, 1024, False)):
        qkv, cos, sin, qw, kw, cache, slots = _prologue_case(B, S, 8, 4, 128, 2048, torch.bfloat16, per_row)
        moved = [t.to(dev) if t is not None else None for t in (qkv, cos, sin, qw, kw, slots)]
        kc1, vc1 = cache().to(dev), cache().to(dev)
        kc2, vc2 = cache().to(dev), cache().to(dev)
        expected = qk_norm_rope_kv_reference(*moved[:5], 1e-5, kc1, vc1, moved[5], 4)
        out = qk_norm_rope_kv(*moved[:5], 1e-5, kc2, vc2, moved[5], 4)
        assert (out != expected).float().mean() < 0.01 and (kc1 != kc2).float().mean() < 0.01
        torch.testing.assert_close(out, expected, rtol=2 ** -6, atol=1e-5)
        assert torch.equal(vc1, vc2)
