"""Decode GEMV (kernels/decode_gemv.py) and the FP8 linear's dispatch to it.

CPU: the Triton kernels under TRITON_INTERPRET=1 (conftest sets it) at odd shapes against
the torch reference, every code path (CUDA-core sums / tensor cores, x quantized in the
GEMV / in a first kernel, split-K) forced by a config; the e4m3 rounding bit-exact with
torch's cast; opcheck; one node under fullgraph torch.compile; one-line errors. GPU (marker
`gpu`): the HunyuanImage-3 decode shapes at M = 1 and 8, a CUDA-graph replay, the FP8
linear's dispatch.

Tolerances. e4m3 weights with float32 x: the kernel does the reference's arithmetic (same
quantized x, same e4m3 products, float32 sums) in another summation order: rtol = atol =
1e-5 on O(1) outputs; one x element rounded to the wrong e4m3 neighbour moves an output by
~1e-3, and a wrong row, scale or channel by O(1). 16-bit outputs: one rounding of the float32
result, 2^-8 relative on the GPU; the interpreter truncates float32 -> bf16/fp16 instead of
rounding (so up to 2^-7), hence rtol 2^-7 and atol 1e-4 x max|y| (sums near 0).
"""
import pytest
import torch

from kernels import decode_gemv as dg
from kernels.decode_gemv import (
    GemvConfig,
    config_for,
    decode_gemv,
    decode_gemv_reference,
    decode_gemv_triton,
    quantize_rows_triton,
    split_count,
)
from kernels.decode_gemv_tma import layout_split
from kernels.fp8_linear import fp8_gemv_suits, fp8_linear, fp8_linear_reference, quantize_activation_rows
from kernels.fp8_quant import FP8_DTYPE, quantize_weight_channels
from tests.support.triton import needs_triton

KINDS = ("bf16", "fp16", "fp8-f32", "fp8-bf16")   # weight dtype - x dtype


def operands(lead, n, k, kind, bias=False, seed=0, device="cpu"):
    """x [*lead, k], weight [n, k] (e4m3 with scales for fp8 kinds), bias [n] or None; drawn
    on `device` (the lm_head's 545 M values would take seconds on the host)."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(*lead, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) / k ** 0.5
    b = torch.randn(n, generator=g, device=device) if bias else None
    if kind.startswith("fp8"):
        xdtype = torch.float32 if kind == "fp8-f32" else torch.bfloat16
        q, s = quantize_weight_channels(w)
        return (x.to(device, xdtype), q.to(device), s.to(device),
                None if b is None else b.to(device, xdtype))
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    return x.to(device, dtype), w.to(device, dtype), None, None if b is None else b.to(device, dtype)


def assert_matches(y, ref):
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-4 * ref.float().abs().max().item())


# ---------------------------------------------------------------------- x quantization


@needs_triton
def test_e4m3_rounding_is_the_cast_bit_for_bit():
    """Every e4m3 value, every midpoint between neighbours (ties to even) and its float32
    neighbours, the subnormal range, random values: one row with amax 448 (scale exactly 1, so
    x / scale = x), and rows of very different size, one all zero (scale 1, q 0)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = codes[torch.isfinite(codes)].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    g = torch.Generator().manual_seed(0)
    extra = torch.cat([torch.rand(3000, generator=g) * 448, torch.rand(1000, generator=g) * 2 ** -5,
                       -torch.rand(1000, generator=g) * 448])
    row = torch.cat([values, mids, up, down, -mids, extra, torch.tensor([448.0])])
    row = row[torch.randperm(row.numel(), generator=g)].view(1, -1)
    rows = torch.randn(4, 3001, generator=g) * torch.logspace(-4, 4, 4)[:, None]
    rows[1] = 0
    for x in (row, rows, rows.bfloat16()):
        q, s = quantize_rows_triton(x)
        q_ref, s_ref = quantize_activation_rows(x)
        assert torch.equal(s, s_ref.flatten())
        assert torch.equal(q.view(torch.uint8) & 0x7F, q_ref.view(torch.uint8) & 0x7F)   # -0 and 0 alike
        assert torch.equal(q.float(), q_ref.float())


# -------------------------------------------------------------------- kernel vs reference


CASES = [  # M (leading dims), N, K, bias
    ((1,), 8, 64, False),
    ((3,), 100, 72, True),
    ((16,), 6144, 64, True),
    ((1,), 100, 4096, False),
    ((16,), 8, 4096, True),
    ((3,), 6144, 72, False),
    ((1,), 6144, 1000, True),    # K not a multiple of block_k (1000 = 512 + 488)
    ((2, 3), 40, 200, True),     # [B, S, K]
]


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead,n,k,bias", CASES)
def test_triton_matches_reference(lead, n, k, bias, kind):
    x, w, s, b = operands(lead, n, k, kind, bias, seed=n + k)
    y = decode_gemv(x, w, s, b, impl="triton")
    assert y.shape == (*lead, n)
    assert_matches(y, decode_gemv_reference(x, w, s, b))


PATHS = {  # every code path the configs select
    "sums": GemvConfig(block_n=16, block_k=128),
    "sums-split": GemvConfig(block_n=8, block_k=64, split_k=3),
    "sums-prequant": GemvConfig(block_n=32, block_k=256, prequant=True),
    "dot": GemvConfig(block_n=16, block_k=64, dot=True),
    "dot-prequant-split": GemvConfig(block_n=32, block_k=128, dot=True, prequant=True, split_k=2),
    "stream": GemvConfig(block_n=8, block_k=128, stream=True),
    "stream-wide": GemvConfig(block_n=16, block_k=64, num_warps=2, stream=True, programs_per_sm=1),
}


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("rows", [1, 5])
def test_every_path_matches_reference(path, kind, rows):
    x, w, s, b = operands((rows,), 50, 328, kind, bias=True, seed=rows)   # 328 = 2 * 128 + 72
    assert_matches(decode_gemv_triton(x, w, s, b, config=PATHS[path]), decode_gemv_reference(x, w, s, b))


@needs_triton
@pytest.mark.parametrize("kind", ["bf16", "fp8-bf16"])
@pytest.mark.parametrize("rows,n,k", [(1, 50, 328), (2, 37, 96), (7, 64, 256), (16, 9, 40)])
def test_stream_programs_own_several_tiles(monkeypatch, rows, n, k, kind):
    """Fewer programs than N tiles (2 "SMs"): each program's flat (tile, chunk) sequence crosses
    tile boundaries, its prefetch runs past its last chunk, the split is uneven (odd N, K)."""
    monkeypatch.setattr(dg, "_sm_count", lambda device: 2)
    x, w, s, b = operands((rows,), n, k, kind, bias=True, seed=rows + n)
    cfg = GemvConfig(block_n=8, block_k=32, stream=True, programs_per_sm=1)
    assert_matches(decode_gemv_triton(x, w, s, b, config=cfg), decode_gemv_reference(x, w, s, b))
    if kind.startswith("fp8"):   # x already e4m3, as fp8_linear passes it
        q, scale = quantize_activation_rows(x)
        got = decode_gemv_triton(q, w, s, b, config=cfg, x_scale=scale.view(-1), out_dtype=x.dtype)
        assert_matches(got, decode_gemv_reference(x, w, s, b))


@needs_triton
@pytest.mark.parametrize("path", ["sums", "dot-prequant-split", "stream"])
def test_fp8_all_zero_row_and_strided_x(path):
    x, w, s, b = operands((6,), 24, 96, "fp8-f32", bias=True, seed=3)
    x[2] = 0
    x = torch.cat([x, x], dim=1)[:, ::2]        # a non-contiguous view (K stride 2)
    assert not x.is_contiguous()
    y = decode_gemv_triton(x, w, s, b, config=PATHS[path])
    assert_matches(y, fp8_linear_reference(x, w, s, b))
    torch.testing.assert_close(y[2], b)         # 0 @ W + b, the scale 1 row


def test_split_count_fills_the_gpu_only_when_n_does_not():
    cpu = torch.device("cpu")                      # 132 SMs assumed off CUDA
    cfg = GemvConfig(block_n=16, block_k=512)
    assert split_count(4096, 4096, cfg, cpu) == (1, 4096)       # 256 programs: no split
    assert split_count(100, 4096, cfg, cpu) == (4, 1024)        # 7 programs: 4 splits of 2 chunks
    assert split_count(100, 512, cfg, cpu) == (1, 512)          # one chunk: nothing to split
    assert split_count(8, 1000, GemvConfig(block_k=128, split_k=3), cpu) == (3, 384)   # 8 chunks, 3 + 3 + 2
    assert split_count(8, 100, GemvConfig(block_k=64, split_k=5), cpu) == (2, 64)      # capped at the chunks


def test_config_table_overrides_the_defaults(monkeypatch):
    assert config_for(4096, 4096, "fp8", 1) == dg.GEMV_CONFIGS[(4096, 4096, "fp8", "m1")]   # swept
    assert config_for(1000, 4096, "fp8", 1) == dg.DEFAULT_CONFIGS[("fp8", "m1")]            # not in the table
    assert config_for(4096, 4096, "16bit", 8) == dg.DEFAULT_CONFIGS[("16bit", "m16")]
    mine = GemvConfig(block_n=8, block_k=256, num_warps=2)
    monkeypatch.setitem(dg.GEMV_CONFIGS, (4096, 4096, "fp8", "m1"), mine)
    assert config_for(4096, 4096, "fp8", 1) == mine
    assert config_for(4096, 4096, "fp8", 2) == dg.DEFAULT_CONFIGS[("fp8", "m16")]


@needs_triton
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("rows,xkind", [(1, "fp8-bf16"), (5, "fp8-f32")])
def test_quantized_x_matches_the_fp8_linear_reference(path, rows, xkind):
    """x already in e4m3 with its row scales (what fp8_linear passes: torch's quantization,
    fused into x's producer under torch.compile): the GEMV gives fp8_linear_reference's result
    in `out_dtype`, on every path; the reference takes it bit for bit."""
    x, w, s, b = operands((rows,), 50, 328, xkind, bias=True, seed=rows + 7)
    q, sx = quantize_activation_rows(x)
    expected = fp8_linear_reference(x, w, s, b)
    assert torch.equal(decode_gemv(q, w, s, b, x_scale=sx.view(-1), out_dtype=x.dtype), expected)
    y = decode_gemv_triton(q, w, s, b, config=PATHS[path], x_scale=sx.view(-1), out_dtype=x.dtype)
    assert_matches(y, expected)


# ------------------------------------------------------------------------ op and compile


@needs_triton
@pytest.mark.parametrize("kind", ["bf16", "fp8-f32"])
def test_opcheck_and_one_compiled_node(kind):
    x, w, s, b = operands((1, 2), 24, 40, kind, bias=True)
    # test_schema compares the inputs before and after with ops CPU torch lacks for e4m3
    skip_schema = {"test_utils": ("test_faketensor", "test_aot_dispatch_dynamic")} if s is not None else {}
    torch.library.opcheck(torch.ops.dtgen.decode_gemv.default, (x, w, s, b, "reference"), **skip_schema)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: decode_gemv(*a, impl="triton"), fullgraph=True, backend=backend)
    assert_matches(compiled(x, w, s, b), decode_gemv_reference(x, w, s, b))
    calls = [nd for gm in graphs for nd in gm.graph.nodes if nd.op == "call_function"]
    assert [nd.target for nd in calls] == [torch.ops.dtgen.decode_gemv]


def test_cpu_defaults_are_the_reference():
    """CPU "auto": decode_gemv is the reference (any rows) and fp8_linear never takes the GEMV,
    so every CPU result (the golden tests) is what it was."""
    x, w, s, b = operands((20,), 24, 40, "fp8-f32", bias=True)
    assert not fp8_gemv_suits(x[:1], w)
    assert torch.equal(fp8_linear(x[:1], w, s, b), fp8_linear_reference(x[:1], w, s, b))
    for xx, bb in ((x, b), (x.bfloat16().view(4, 5, 40), b.bfloat16())):   # the same arithmetic, bit for bit
        assert torch.equal(decode_gemv(xx, w, s, bb), fp8_linear_reference(xx, w, s, bb))
    xb, wb, _, bb = operands((3,), 24, 40, "bf16", bias=True)
    assert torch.equal(dg.decode_linear(xb, wb, bb), torch.nn.functional.linear(xb, wb, bb))


# ------------------------------------------------------------------------------ errors


def _fp8():
    return operands((2,), 8, 16, "fp8-f32", bias=True)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, s, b: decode_gemv(torch.zeros(17, 16), w, s, impl="triton"), "at most 16 rows.*has 17"),
    (lambda x, w, s, b: decode_gemv(torch.zeros(3, 6, 16), w, s, impl="triton"), "at most 16 rows.*has 18"),
    (lambda x, w, s, b: decode_gemv(x[:, :5], w, s), "x has 5 features"),
    (lambda x, w, s, b: decode_gemv(x, w, None), "needs weight_scale"),
    (lambda x, w, s, b: decode_gemv(x, w, s[:3]), r"weight_scale must be float32 \[8\]"),
    (lambda x, w, s, b: decode_gemv(x, w, s.double()), "weight_scale must be float32"),
    (lambda x, w, s, b: decode_gemv(x.double(), w, s), "with an e4m3 weight x must be one of"),
    (lambda x, w, s, b: decode_gemv(x.bfloat16(), w.bfloat16(), s), "takes no weight_scale"),
    (lambda x, w, s, b: decode_gemv(x, w.float().bfloat16()), "x is torch.float32 but the weight is torch.bfloat16"),
    (lambda x, w, s, b: decode_gemv(x, w.float()), "weight dtype must be"),
    (lambda x, w, s, b: decode_gemv(x, w[0], s), "weight must be 2-D"),
    (lambda x, w, s, b: decode_gemv(x, w, s, b[:4]), r"bias must be a float \[8\]"),
    (lambda x, w, s, b: decode_gemv(x, w, s, impl="cublas"), "impl must be one of"),
    (lambda x, w, s, b: decode_gemv_triton(x, w, s, config=GemvConfig(block_n=8, dot=True)), "block_n >= 16"),
    (lambda x, w, s, b: decode_gemv_triton(x, w, s, config=GemvConfig(block_n=16, dot=True, stream=True)),
     "at most one of stream, tma"),
    (lambda x, w, s, b: decode_gemv_triton(x, w, s, config=GemvConfig(stream=True, programs_per_sm=0)),
     "programs_per_sm must be >= 1"),
    (lambda x, w, s, b: decode_gemv(x.to(FP8_DTYPE), w, s, out_dtype=torch.float32), r"needs x_scale float32 \[2\]"),
    (lambda x, w, s, b: decode_gemv(x.to(FP8_DTYPE), w, s, x_scale=torch.ones(3), out_dtype=torch.float32),
     r"needs x_scale float32 \[2\]"),
    (lambda x, w, s, b: decode_gemv(x.to(FP8_DTYPE), w, s, x_scale=torch.ones(2)), "needs out_dtype"),
    (lambda x, w, s, b: decode_gemv(x, w, s, x_scale=torch.ones(2)), "go with an e4m3 x only"),
    (lambda x, w, s, b: decode_gemv(x.to(FP8_DTYPE), w.float().bfloat16(), None, x_scale=torch.ones(2),
                                    out_dtype=torch.float32), "an e4m3 x .* needs an e4m3 weight"),
])
def test_bad_input_is_one_line_naming_the_problem(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call(*_fp8())
    assert "\n" not in str(err.value)


def test_the_tma_kernel_is_refused_off_hopper_in_one_line():
    x, w, s, _ = operands((1,), 64, 256, "fp8-bf16")
    with pytest.raises(RuntimeError, match=r"Hopper \(sm90\) only, x is on cpu") as err:
        decode_gemv_triton(x, w, s, config=GemvConfig(block_n=8, block_k=512, tma=True))
    assert "\n" not in str(err.value)
    assert layout_split(8, 1024, 1, 4) == (16, 4)       # 16-byte vectors of e4m3, the 4 warps along N
    assert layout_split(8, 512, 2, 8) == (8, 8)
    with pytest.raises(ValueError, match=r"tile \[8, 256\] is smaller than its 4 warps cover"):
        layout_split(8, 256, 1, 4)


@needs_triton
@pytest.mark.parametrize("kind", ["bf16", "fp8-bf16"])
def test_a_table_tma_entry_runs_the_stream_schedule_off_hopper(monkeypatch, kind):
    x, w, s, b = operands((1,), 50, 328, kind, bias=True)
    wkind = "fp8" if kind.startswith("fp8") else "16bit"
    monkeypatch.setitem(dg.GEMV_CONFIGS, (50, 328, wkind, "m1"), GemvConfig(block_n=8, block_k=128, num_stages=6,
                                                                            tma=True))
    real, launched = dg._launch_stream, []

    def spy(*args):
        launched.append(args[-1])   # the config it ran
        return real(*args)
    monkeypatch.setattr(dg, "_launch_stream", spy)
    assert_matches(decode_gemv_triton(x, w, s, b), decode_gemv_reference(x, w, s, b))
    assert [(c.stream, c.tma) for c in launched] == [(True, False)]


def test_reference_takes_any_rows():
    x, w, s, b = operands((40,), 8, 16, "fp8-f32", bias=True)
    assert decode_gemv(x, w, s, b, impl="reference").shape == (40, 8)


# ------------------------------------------------------------------------------------ GPU

# The HunyuanImage-3 decode step's dense linears: per layer QKV, O, the shared expert's
# gate_up and down; the lm_head once.
RELEASED = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (6144, 4096), "down": (4096, 3072),
            "lm_head": (133120, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("name", sorted(RELEASED))
def test_gpu_released_shapes_match_reference(name, rows, kind):
    n, k = RELEASED[name]
    x, w, s, b = operands((rows,), n, k, kind, device="cuda", seed=rows)
    assert_matches(decode_gemv(x, w, s, b), decode_gemv_reference(x, w, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-f32"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_gpu_every_path_compiles_and_matches(path, kind):
    x, w, s, b = operands((5,), 4096, 3072, kind, bias=True, device="cuda")
    assert_matches(decode_gemv_triton(x, w, s, b, config=PATHS[path]), decode_gemv_reference(x, w, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-bf16"])
@pytest.mark.parametrize("rows,nk", [(r, RELEASED[name]) for name in sorted(RELEASED) for r in (1, 8)]
                         + [(8, (100, 4096))])   # the last splits K
def test_gpu_cuda_graph_replay(rows, nk, kind):
    x, w, s, b = operands((rows,), *nk, kind, bias=True, device="cuda")
    eager = decode_gemv(x, w, s, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_gemv(x, w, s, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_gemv(x, w, s, b)
    x.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, decode_gemv(x, w, s, b), rtol=0, atol=0)   # same kernels, same order
    assert_matches(captured, decode_gemv_reference(x, w, s, b))
    assert rows == 1 or not torch.equal(captured, eager)      # the replay read the new x


def stream_config(kind: str, block_n: int = 8, tma: bool = False) -> GemvConfig:
    """The stream kernel (tma: its TMA-ring form, 4 blocks in flight) with 8 KB chunks (a sweep
    candidate): 1024 e4m3 or 512 16-bit columns."""
    return GemvConfig(block_n=block_n, block_k=1024 if kind.startswith("fp8") else 512, num_warps=4,
                      num_stages=4, stream=not tma, tma=tma)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["stream", "tma"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-bf16"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 3072), (1000, 1008), (37, 4112)])
def test_gpu_stream_matches_reference(nk, rows, kind, tma):
    """The persistent kernels at the decode shapes and odd ones (N, K not multiples of the
    blocks, K a multiple of 16 for TMA; 37 rows: fewer tiles than programs), one row, a few,
    the most, both weight kinds (one compile per kernel, rows and K class: ~24 in all)."""
    x, w, s, b = operands((rows,), *nk, kind, bias=True, device="cuda", seed=rows)
    got = decode_gemv_triton(x, w, s, b, config=stream_config(kind, tma=tma))
    assert_matches(got, decode_gemv_reference(x, w, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["stream", "tma"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-bf16"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_stream_cuda_graph_replay(rows, kind, tma):
    x, w, s, b = operands((rows,), 6144, 4096, kind, bias=True, device="cuda")
    cfg = stream_config(kind, tma=tma)
    extra = {}
    if kind.startswith("fp8"):   # as fp8_linear calls it: x in e4m3 with its scales
        q, scale = quantize_activation_rows(x)
        x, extra = q, {"x_scale": scale.view(-1), "out_dtype": torch.bfloat16}
    call = lambda: decode_gemv_triton(x, w, s, b, config=cfg, **extra)   # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    before = captured.clone()
    x.copy_((-x.float()).to(x.dtype))     # exact in e4m3 and bf16: the outputs change, not the arithmetic
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, call(), rtol=0, atol=0)   # same kernel, same order
    assert not torch.equal(captured, before)                        # the replay read the new x


@pytest.mark.gpu
def test_gpu_fp8_linear_dispatches_decode_rows_to_the_gemv():
    x, w, s, b = operands((17,), 4096, 4096, "fp8-bf16", bias=True, device="cuda")
    assert fp8_gemv_suits(x[:16], w) and not fp8_gemv_suits(x, w)
    for rows in (1, 8, 16):
        # fp8_linear quantizes x with torch ops, then the GEMV streams the e4m3 weight: the
        # same kernel as an explicit prequantized call, bit for bit. (The GEMV quantizing x
        # itself takes another config, so another summation order: 1 ulp apart on ~5%.)
        q, scale = quantize_activation_rows(x[:rows])
        got = fp8_linear(x[:rows], w, s, b)
        torch.testing.assert_close(got, decode_gemv_triton(q, w, s, b, x_scale=scale.view(-1), out_dtype=x.dtype),
                                   rtol=0, atol=0)
        assert_matches(got, fp8_linear_reference(x[:rows], w, s, b))
    torch.testing.assert_close(fp8_linear(x, w, s, b), fp8_linear(x, w, s, b, impl="scaled_mm"), rtol=0, atol=0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: fp8_linear(a, w, s, b), fullgraph=True)
    # inductor fuses the quantization of x into one kernel of its own arithmetic: an element
    # may round to the other e4m3 neighbour (~1e-3 of an output), within the GEMV's bound
    assert_matches(compiled(x[:1]), fp8_linear(x[:1], w, s, b))
