"""The Gluon FP8 attention kernel's trace option and its probe's arithmetic, on the CPU.

kernels.fp8_attention_gluon: the public op keeps its signature (the trace goes through
`launch_fp8_attention_gluon(..., trace=)`), the trace buffer's shape and the one-line refusals of a
bad one. bench.bench_fp8_attention_trace: its phases, overlap shares, timeline and table on
synthetic stamps laid out as the kernel writes them, and its argument errors (before any GPU).
"""
import inspect
import re

import pytest
import torch

from bench import bench_fp8_attention_trace as probe
from kernels import fp8_attention as fa
from kernels import fp8_attention_gluon as fg

# One key block's phases in cycles, in order (SEGMENTS); a block takes 1000.
DURATIONS = {"k_wait": 10, "turn_wait": 0, "issue": 100, "qk_wait": 200, "softmax": 500, "pv_wait": 50,
             "pack_rescale": 140}
BLOCK = sum(DURATIONS.values())


def _stamps(t0):
    """TRACE_POINTS of a block starting at t0 (issue: Q K^T 40, the V wait 20, P V 40; the K slot's
    release 20 of the softmax, the V slot's 30 of the pack)."""
    top = t0
    k_ready = top + 10
    turn_held = k_ready
    qk_issued, v_ready, turn_passed = turn_held + 40, turn_held + 60, turn_held + 100
    logits = turn_passed + 200
    k_released = logits + 20
    softmax_done = logits + 500
    pv_done = softmax_done + 50
    v_released = pv_done + 30
    end = pv_done + 140
    return [top, k_ready, turn_held, qk_issued, v_ready, turn_passed, logits, k_released, softmax_done, pv_done,
            v_released, end]


def _trace(programs, iters, wg1_offset):
    """Stamps as the kernel lays them out: WG0's blocks back to back from 10000 (+ 100000 a program),
    WG1's `wg1_offset` cycles later; the producer waits 5 cycles on each slot; meta: smid, start, finish."""
    trace = torch.zeros(programs, fg.TRACE_ROLES, iters + 1, fg.TRACE_SLOTS, dtype=torch.int64)
    for p in range(programs):
        base = 10_000 + 100_000 * p
        for role, offset in ((0, 0), (1, wg1_offset)):
            for j in range(iters):
                trace[p, role, j] = torch.tensor(_stamps(base + offset + j * BLOCK))
            trace[p, role, iters, :3] = torch.tensor([p, base + offset - 50, base + offset + iters * BLOCK])
        for j in range(iters):
            t = base - 500 + 100 * j
            trace[p, 2, j, :4] = torch.tensor([t, t + 5, t + 10, t + 15])
        trace[p, 2, iters, :3] = torch.tensor([p, base - 600, base])
    return trace.tolist()


def test_the_public_op_keeps_its_signature_and_the_trace_is_a_launch_option():
    assert list(inspect.signature(fg.fp8_attention_gluon).parameters) == [
        "q8", "q_scale", "k8", "k_scale", "vt8", "v_scale", "sq", "sk", "heads", "dtype", "tiles"]
    launch = inspect.signature(fg.launch_fp8_attention_gluon).parameters
    assert "trace" in launch and launch["trace"].default is None


def test_the_kernel_stamps_its_points_in_order():
    # The slots the kernel names are TRACE_POINTS' (and the producer's, the meta row's), and the loop
    # of `_consumer` stamps every point once, in that order.
    for names in (fg.TRACE_POINTS, fg.PRODUCER_POINTS, fg.TRACE_META):
        assert [getattr(fg, f"_AT_{n.upper()}").value for n in names] == list(range(len(names)))
    source = inspect.getsource(fg._consumer.fn)
    loop = source[source.index("for j in range(1, n_blocks):"):source.index("last = (n_blocks - 1)")]
    assert [n.lower() for n in re.findall(r"_stamp\(at \+ _AT_(\w+), on, 4\)", loop)] == list(
        fg.TRACE_POINTS)
    producer = inspect.getsource(fg._producer.fn)
    assert [n.lower() for n in re.findall(r"_stamp\(at \+ _AT_(\w+), on, 1\)", producer)] == list(fg.PRODUCER_POINTS)


def test_trace_buffer_and_its_one_line_refusals():
    buf = fg.trace_buffer(8, 16, "cpu")
    assert buf.shape == (8, fg.TRACE_ROLES, 17, fg.TRACE_SLOTS) and buf.dtype == torch.int64
    assert not buf.any() and fg.trace_problem(buf) is None
    assert fg.TRACE_SLOTS >= max(len(fg.PRODUCER_POINTS), len(fg.TRACE_META))
    for bad in (buf.float(), buf[:, :2], buf[..., :4], buf[:, :, :1], buf.transpose(0, 1)):
        problem = fg.trace_problem(bad)
        assert problem is not None and problem.startswith("trace must be") and "\n" not in problem
    with pytest.raises(ValueError, match=r"^trace_buffer: programs and iterations must be >= 1"):
        fg.trace_buffer(0, 16, "cpu")
    # Off sm90, a traced launch is refused as an untraced one is, in one line.
    q = torch.randn(1, 2, 5, 64)
    with pytest.raises(RuntimeError, match=r"^fp8_attention_gluon: [^\n]*$"):
        fg.launch_fp8_attention_gluon(*fa.quantize_qkv(q, q, q), 5, 5, 2, torch.float32, trace=buf)


def test_phase_medians_of_synthetic_stamps():
    trace = _trace(programs=2, iters=10, wg1_offset=500)
    med = probe.summarize(trace, 2)["median_cycles"]
    for wg in ("WG0", "WG1"):
        assert {k: med[wg][k] for k in DURATIONS} == DURATIONS
        assert (med[wg]["qk_issue"], med[wg]["v_wait"], med[wg]["pv_issue"]) == (40, 20, 40)
        assert (med[wg]["k_release"], med[wg]["softmax_math"], med[wg]["v_release"], med[wg]["pack_math"]) == (
            20, 480, 30, 110)
        assert med[wg]["iteration"] == BLOCK and med[wg]["period"] == BLOCK
    cycles = probe.phase_cycles(trace, 2)
    assert len(cycles["WG0"]["softmax"]) == 2 * 8          # blocks 2 .. 9 of each program
    assert len(cycles["WG0"]["period"]) == 2 * 7


def test_overlap_tells_serialized_softmaxes_from_alternating_ones():
    same = probe.summarize(_trace(2, 10, wg1_offset=0), 2)
    for wg in ("WG0", "WG1"):
        assert same["overlap"][wg]["softmax_while_other_softmax"] == 1.0
        assert same["overlap"][wg]["issue_while_other_softmax"] == 0.0
    # WG1 half a block behind: a softmax [310, 810) of its block meets the other's P V wait 50, pack 140,
    # K wait 10, issue 100 and Q K^T wait 200 (MMAs 350 of 500); each issue window lies inside the other's
    # softmax. Blocks 2 .. 9 are clipped to the span both cover, [2500, 10000) from the first block: WG0's
    # first softmax keeps [2500, 2810) (WG1's K wait 10, issue 100, Q K^T wait 200), WG1's last keeps
    # [9810, 10000) (WG0's P V wait 50, pack 140).
    shifted = probe.summarize(_trace(2, 10, wg1_offset=500), 2)
    expected_mma = {"WG0": (300 + 7 * 350) / (310 + 7 * 500), "WG1": (7 * 350 + 50) / (7 * 500 + 190)}
    for wg in ("WG0", "WG1"):
        o = shifted["overlap"][wg]
        assert o["softmax_while_other_softmax"] == 0.0
        assert o["issue_while_other_softmax"] == 1.0
        assert o["softmax_while_other_mma"] == pytest.approx(expected_mma[wg])
        assert o["softmax_while_other_mma"] + o["softmax_while_other_elsewhere"] == pytest.approx(1.0)
    assert shifted["program_cycles_median"] == 10 * BLOCK + 500 + 50
    assert shifted["smids"] == [0, 1] and shifted["blocks_out_of_order"] == 0
    assert shifted["producer_median_cycles"] == {"k_empty_wait": 5, "v_empty_wait": 5}


def test_timeline_and_table_render():
    trace = _trace(2, 10, wg1_offset=500)
    lines = probe.timeline(trace, 0)
    bars = [line for line in lines if line.startswith(("WG0", "WG1", "prod"))]
    assert len(bars) == 3 and len({len(b) for b in bars}) == 1
    assert "S" in bars[0] and "I" in bars[1] and "S" in bars[1]
    assert sum(line.split()[0].isdigit() for line in lines) == 2 * probe.TIMELINE_BLOCKS
    summary = probe.summarize(trace, 2)
    printed = probe.variant_lines("pingpong", "tiles", trace, summary)
    assert printed[1].startswith("WG0: k_wait 10, turn_wait 0, issue 100") and printed[-len(lines):] == lines
    assert any(line.startswith("WG1 softmax (") and "in softmax 0%" in line for line in printed)
    rows = probe.table({"pingpong": {"summary": summary, "untraced_ms": 7.8, "traced_ms": 8.1,
                                     "traced_output_equal": True}})
    assert len(rows) == 4 and "7.800 ms" in rows[-1] and rows[1].split()[:2] == ["pingpong", "WG0"]


@pytest.mark.parametrize("argv, flag", [(["--iters", "3"], "--iters"), (["--programs", "0"], "--programs"),
                                        (["--repeats", "0"], "--repeats")])
def test_probe_refuses_bad_arguments_in_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        probe.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


class _KernelCall:
    """Stands in for the compiled kernel: binds a launch's arguments to the kernel's parameters."""

    def __init__(self, kernel):
        self.signature = inspect.signature(kernel.fn)
        self.bound = None

    def __getitem__(self, grid):
        self.grid = grid
        return self

    def __call__(self, *args, num_warps, maxnreg, **constexprs):
        self.bound = self.signature.bind(*args, **constexprs)
        return None


@pytest.mark.parametrize("traced", [False, True])
def test_a_launch_binds_to_the_kernel_with_and_without_a_trace(traced, monkeypatch):
    # The launch as on sm90, the kernel replaced by a binder: every argument lands on a parameter,
    # the trace buffer (or a 1-element dummy) on trace_ptr and its sizes on the TRACE constexprs.
    monkeypatch.setattr(fg, "gluon_problem", lambda device: None)
    monkeypatch.setattr(fg, "operands_problem", lambda *a: None)    # the interpreter's small scale blocks
    call = _KernelCall(fg._fp8_attention_gluon_kernel)
    monkeypatch.setattr(fg, "_fp8_attention_gluon_kernel", call)
    q = torch.randn(1, 12, 300, 128)
    buf = fg.trace_buffer(8, 16, "cpu") if traced else None
    fg.launch_fp8_attention_gluon(*fa.quantize_qkv(q, q, q), 300, 300, 12, torch.bfloat16, trace=buf)
    args = call.bound.arguments
    assert call.grid == (3, 12)
    if traced:
        assert args["trace_ptr"] is buf
        assert (args["TRACE"], args["TRACED_PROGRAMS"], args["TRACE_ITERS"]) == (True, 8, 16)
    else:
        assert args["trace_ptr"].dtype == torch.int64 and args["trace_ptr"].numel() == 1
        assert not {"TRACE", "TRACED_PROGRAMS", "TRACE_ITERS"} & set(args)     # the defaults: untraced
        assert call.signature.parameters["TRACE"].default is False


ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Gluon FP8 attention kernel runs on sm90 (Hopper)")
@pytest.mark.parametrize("pingpong", [True, False])
def test_gpu_traced_launch_writes_ordered_stamps_and_the_same_output(pingpong):
    # 6 key blocks, 12 programs (6 query tiles x 2 heads), the first 4 traced over all 6 blocks: the
    # output equals the untraced kernel's bit for bit; each traced consumer block's stamps are set and in
    # TRACE_POINTS order, the producer's in PRODUCER_POINTS order; nothing lands past the traced programs.
    from dataclasses import replace
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6 * 128, 128, generator=g).cuda().bfloat16() for _ in range(3))
    operands = fa.quantize_qkv(q, k, v)
    tiles = replace(fg.GLUON_TILES, pingpong=pingpong)
    whole = torch.zeros(5, fg.TRACE_ROLES, 7, fg.TRACE_SLOTS, dtype=torch.int64, device="cuda")
    trace = whole[:4]
    traced = fg.launch_fp8_attention_gluon(*operands, 768, 768, 2, torch.bfloat16, tiles, trace=trace)[0]
    assert torch.equal(traced, fg.fp8_attention_gluon(*operands, 768, 768, 2, torch.bfloat16, tiles))
    assert not whole[4].any()
    stamps = trace.cpu()
    block0 = [fg.TRACE_POINTS.index(n) for n in ("top", "k_ready", "turn_held", "turn_passed", "logits_ready",
                                                  "k_released", "softmax_done", "end")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for p in range(4):
        for role in (0, 1):
            rows = stamps[p, role]
            assert (rows[1:6] > 0).all() and (rows[1:6].diff(dim=1) >= 0).all()
            assert (rows[0, block0] > 0).all() and (rows[0, block0].diff() >= 0).all()
            assert (rows[1:6, 0] >= rows[0:5, -1]).all()          # a block starts after the one before ends
            smid, start, finish = rows[6, :3].tolist()
            assert 0 <= smid < sms and 0 < start <= rows[0, 0] and finish >= rows[5, -1]
        assert stamps[p, 0, 6, 0] == stamps[p, 1, 6, 0] == stamps[p, 2, 6, 0]   # one SM a program
        producer = stamps[p, 2, :6, :len(fg.PRODUCER_POINTS)]
        assert (producer > 0).all() and (producer.diff(dim=1) >= 0).all()
