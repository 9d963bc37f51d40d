"""The MoE's grouped GEMMs on the denoise shapes: torch._grouped_mm, inductor, and the fused kernels.

One TP2 rank of HunyuanImage-3's denoise (64 experts, top-8, hidden 4096, two micros of 768), random
routing. Two layouts of the same weights: micro-major ([M, E, 2I, H]: a gate/up GEMM per micro, one down
GEMM over M*E groups) and expert-major ([E, M*2I, H]: one of each, the micro sum inside), in TFLOP/s
against 694 (`--autotune`: also inductor's templates). Then `kernels.moe_grouped_gemm`'s fused kernels
(gate/up reading x through the routing, the activation in its epilogue; down with the micro sum in its K
loop) against the CUTLASS path doing the same work, bf16 and on e4m3 experts (channel scales), each
checked against CUTLASS's result. `--sweep`: more tiles; `--flatten`: each persistent tile's loops flattened.
Beside the fused FP8 kernels (channel scales), torch._scaled_grouped_mm (CUTLASS's rowwise FP8 grouped GEMM,
sm90; `kernels.moe_scaled_grouped_mm`) on the same e4m3 inputs: its GEMMs alone, the gate/up stage as the op
runs it (gather of x's e4m3 rows, the GEMMs, the activation quantized), and both experts ops whole (x to the
output: quantization, routing, finalize), each with its error against the float reference. `--only
scaled-grouped-mm`: only these FP8 rows (no bf16 rows). On the same pipeline, our Gluon kernel for sm90
(`kernels.moe_grouped_gemm_gluon`, MoE impl "gluon"): its GEMMs alone per tile (the default, ping-pong and the
simple kernel without warp specialization; `--sweep`: more tiles), in
TFLOP/s of useful FLOPs and of whole row tiles (the rows each group's last tile pads to), with the median,
fastest and slowest of the timed runs; the gate/up stage as the op runs it; and the "gluon" experts op whole.

Every kernel row (the fused, library and Gluon GEMMs, their tiles, the experts ops) is timed as the replay
of a CUDA graph recorded from it, L2 flushed between replays (do_bench): device time, without the host's
launch work, which differs between the paths (a descriptor and a work table built per Gluon call, several
torch ops around the library's) and which the model's CUDA-graphed steps do not pay either.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from kernels import moe_grouped_gemm_gluon as gluon_gemm
from kernels import moe_scaled_grouped_mm as sgmm
from kernels.fp8_quant import quantize_experts, quantize_rows, quantize_rows_by_amax
from kernels.moe_grouped_gemm import DEFAULT_FUSED_CONFIG, FP8_CHANNELS_CONFIG, GemmTiles, down_sum, gate_up_act
from kernels.moe_multi_micro import moe_multi_micro_fp8, moe_multi_micro_reference
from kernels.moe_routing import moe_route

from bench.harness import Bench, median_ms, need_cuda, rel_err

H, E, TOPK, MICROS, INTER = 4096, 64, 8, 2, 768
TARGET_TFLOPS, TARGET_FP8_TFLOPS = 620.0, 1100.0

T = dict(weights_tma=True)
TT = dict(weights_tma=True, rows_tma=True)
GATE_UP_SWEEP = [
    GemmTiles(128, 128, 64, 8, 3), GemmTiles(128, 128, 64, 8, 4, **T), GemmTiles(128, 128, 64, 8, 3, **T),
    GemmTiles(128, 128, 64, 8, 4, **TT), GemmTiles(128, 128, 64, 8, 3, **TT),
    GemmTiles(128, 128, 64, 8, 4, persistent=False, **T),
    GemmTiles(128, 64, 64, 4, 4, **TT), GemmTiles(64, 128, 64, 4, 4, **TT), GemmTiles(64, 256, 64, 8, 3, **TT),
]
DOWN_SWEEP = [
    GemmTiles(128, 256, 64, 8, 3), GemmTiles(128, 256, 64, 8, 3, **T), GemmTiles(128, 256, 64, 8, 4, **T),
    GemmTiles(128, 256, 64, 8, 3, **TT), GemmTiles(128, 256, 64, 8, 4, **TT),
    GemmTiles(128, 256, 64, 8, 3, persistent=False, **TT),
    GemmTiles(128, 128, 64, 4, 4, **TT), GemmTiles(128, 128, 64, 8, 4, **TT), GemmTiles(64, 256, 64, 4, 4, **TT),
]
FP8_CHANNELS_GATE_UP_SWEEP = [
    GemmTiles(128, 128, 128, 8, 3, **T), GemmTiles(128, 128, 64, 8, 4, **T), GemmTiles(128, 128, 128, 8, 4, **TT),
    GemmTiles(64, 256, 128, 8, 3, **TT), GemmTiles(128, 128, 128, 8, 4, persistent=False, **T),
    GemmTiles(64, 256, 128, 8, 2, **TT), GemmTiles(64, 128, 128, 4, 4, **TT), GemmTiles(128, 128, 64, 8, 3, **TT),
]
FP8_CHANNELS_DOWN_SWEEP = [
    GemmTiles(128, 256, 128, 8, 4, **TT), GemmTiles(128, 256, 64, 8, 4, **TT), GemmTiles(128, 256, 128, 8, 3, **T),
    GemmTiles(128, 128, 128, 8, 4, **TT), GemmTiles(64, 256, 128, 8, 4, **TT), GemmTiles(128, 256, 128, 8, 3, **TT),
]


MODULE = "bench.bench_grouped_gemm"


def _us(fn) -> float:
    return median_ms(fn) * 1e3


def _graph_us(fn) -> float:
    """Median microseconds of fn's CUDA-graph replay (module docstring: why every kernel row is timed so)."""
    return median_ms(fn, graph=True) * 1e3


def _case(name: str, fn, flop: float) -> dict:
    us = _us(fn)
    print(f"{name:<44}{us:>9.1f} us {flop / us / 1e6:>7.1f} TFLOP/s")
    return {"us": round(us, 1), "tflops": round(flop / us / 1e6, 1)}


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--tokens", type=int, default=2674)
    p.add_argument("--autotune", action="store_true", help="also inductor max-autotune (Triton templates)")
    p.add_argument("--sweep", action="store_true", help="time the fused kernels' tile sweep, not only the default")
    p.add_argument("--flatten", action="store_true",
                   help="also each timed tile with its work-item loop and K loop pipelined as one (tl.range flatten)")
    p.add_argument("--only", choices=("scaled-grouped-mm",), default=None,
                   help="only the FP8 rows: the fused kernels (channel scales) beside torch._scaled_grouped_mm "
                        "and the Gluon kernel")
    args = b.parse("outputs/bench_grouped_gemm.json")
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return need_cuda(MODULE + " (and torch._grouped_mm)")
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = args.tokens * TOPK
    ids = torch.rand(args.tokens, E, device=dev, generator=g).topk(TOPK, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(rows, H, device=dev, dtype=bf, generator=g)
    gu_micro = torch.randn(MICROS, E, 2 * INTER, H, device=dev, dtype=bf, generator=g) * 0.02
    dn_micro = torch.randn(MICROS, E, H, INTER, device=dev, dtype=bf, generator=g) * 0.02
    gu_expert = torch.randn(E, MICROS * 2 * INTER, H, device=dev, dtype=bf, generator=g) * 0.02
    dn_expert = torch.randn(E, H, MICROS * INTER, device=dev, dtype=bf, generator=g) * 0.02
    act_micro = torch.randn(MICROS, rows, INTER, device=dev, dtype=bf, generator=g)
    act_expert = torch.randn(rows, MICROS * INTER, device=dev, dtype=bf, generator=g)
    shift = torch.arange(MICROS, device=dev, dtype=torch.int32).unsqueeze(1) * rows
    down_ends = (ends.unsqueeze(0) + shift).reshape(-1)

    # Each returns its result: a compiled function would drop unused work.
    def micro_gate_up():
        return [torch._grouped_mm(x, gu_micro[m].transpose(-2, -1), offs=ends) for m in range(MICROS)]

    def micro_down():
        return torch._grouped_mm(act_micro.flatten(0, 1), dn_micro.flatten(0, 1).transpose(-2, -1), offs=down_ends)

    def expert_gate_up():
        return torch._grouped_mm(x, gu_expert.transpose(-2, -1), offs=ends)

    def expert_down():
        return torch._grouped_mm(act_expert, dn_expert.transpose(-2, -1), offs=ends)

    dense_a = torch.randn(rows, H, device=dev, dtype=bf, generator=g)
    dense_b = torch.randn(H, MICROS * 2 * INTER, device=dev, dtype=bf, generator=g)

    def dense():
        return torch.mm(dense_a, dense_b)

    gate_up_flop = 2 * rows * H * MICROS * 2 * INTER
    down_flop = 2 * rows * MICROS * INTER * H
    result = {"tokens": args.tokens,
              "max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min())}
    if args.only == "scaled-grouped-mm":
        result["fused_fp8"] = _bench_fused_fp8(args, g, ids, gu_micro, dn_micro, act_micro)
        b.write(result)
        return 0
    cases = [("micro_major_gate_up", micro_gate_up, gate_up_flop),
             ("expert_major_gate_up", expert_gate_up, gate_up_flop),
             ("micro_major_down", micro_down, down_flop),
             ("expert_major_down", expert_down, down_flop),
             ("dense_same_flops_as_gate_up", dense, gate_up_flop)]
    if args.autotune:
        # inductor's grouped-GEMM Triton templates, tuned against the ATen (CUTLASS) kernel.
        for name, fn, flop in list(cases[:4]):
            tuned = torch.compile(fn, mode="max-autotune-no-cudagraphs", fullgraph=True)
            tuned()
            cases.append((f"{name}_max_autotune", tuned, flop))
    result.update({name: _case(name, fn, flop) for name, fn, flop in cases})
    result["fused"] = _bench_fused(args, g, ids, gu_micro, dn_micro, act_micro, gate_up_flop, down_flop)
    result["fused_fp8"] = _bench_fused_fp8(args, g, ids, gu_micro, dn_micro, act_micro)
    b.write(result)
    return 0


def _tiles_to_time(args, default: GemmTiles, sweep: list[GemmTiles]) -> list[GemmTiles]:
    """The default tiles, the sweep's (--sweep), and each flattened (--flatten)."""
    tiles = [default] + (sweep if args.sweep else [])
    if args.flatten:
        tiles += [dataclasses.replace(t, flatten=True) for t in tiles if t.persistent]
    return list(dict.fromkeys(tiles))


def _label(kind: str, tiles: GemmTiles) -> str:
    return (f"{kind} {tiles.block_r}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"
            + "".join(tag for on, tag in ((tiles.persistent, " persistent"), (tiles.programs_per_sm > 1,
                                                                               f" x{tiles.programs_per_sm}"),
                                          (tiles.weights_tma, " tmaW"), (tiles.rows_tma, " tmaA"),
                                          (tiles.flatten, " flat")) if on))


def _time_row(fn, expected, flop, as_float=lambda out: out) -> dict:
    """Check fn's result (through as_float) against expected, then time fn alone."""
    row = {}
    try:
        row["rel_err"] = rel_err(as_float(fn()), expected)
        us = _graph_us(fn)
        row.update(us=round(us, 1), tflops=round(flop / us / 1e6, 1))
    except Exception as err:  # a tile that does not fit must not hide the others
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


def _tile_rows(args, kind: str, default: GemmTiles, sweep: list[GemmTiles], fn_of, expected, flop,
               as_float=lambda out: out) -> list[dict]:
    """Each tile's row (`_tiles_to_time`): fn_of(tiles) checked against expected, then timed."""
    rows = []
    for tiles in _tiles_to_time(args, default, sweep):
        row = _time_row(lambda: fn_of(tiles), expected, flop, as_float)
        rows.append({"tiles": vars(tiles), **row})
        label = _label(kind, tiles)
        print(f"{label:<60}{row['us']:>9.1f} us {row['tflops']:>7.1f} TFLOP/s  err {row['rel_err']:.1e}"
              if "us" in row else f"{label:<60} failed: {row['error']}")
    return rows


def _bench_fused_fp8(args, g, ids, gu_micro, dn_micro, act_micro) -> dict:
    """The fused GEMMs on e4m3 experts and activations, with one scale per weight row and per activation
    row (the channels recipe). Errors are against the bf16 results (CUTLASS), so they hold FP8's rounding."""
    x_tok = torch.randn(ids.shape[0], H, device="cuda", dtype=torch.bfloat16, generator=g)
    routing = moe_route(x_tok, ids, E, gather=False)
    ends = routing.expert_ends
    token_of_slot = (routing.pair_of_slot // TOPK).to(torch.int32)
    act_expected, _ = gate_up_act(x_tok, token_of_slot, gu_micro, ends, DEFAULT_FUSED_CONFIG.gate_up)
    y_expected = down_sum(act_micro, dn_micro, ends, DEFAULT_FUSED_CONFIG.down)
    rows = token_of_slot.shape[0]
    return {"target_tflops": TARGET_FP8_TFLOPS,
            "channels": _bench_fp8_channels(args, x_tok, token_of_slot, ends, gu_micro, dn_micro, act_micro,
                                            act_expected, y_expected, 2 * rows * H * MICROS * 2 * INTER,
                                            2 * rows * MICROS * INTER * H, ids, g)}


def _bench_fp8_channels(args, x_tok, token_of_slot, ends, gu_micro, dn_micro, act_micro, act_expected, y_expected,
                        gate_up_flop, down_flop, ids, g) -> dict:
    """The channel-scale recipe: one scale per weight row (per output channel over all
    micros for down) and per activation row, applied after the K loop. gate/up writes a bf16
    activation and its row maxima; a pass quantizes it; down reads e4m3."""
    gu_q, gu_s, dn_q, dn_s = quantize_experts(gu_micro, dn_micro, "channels")
    x_q, x_s = quantize_rows(x_tok)
    act_q, act_s = quantize_rows_by_amax(act_micro, act_micro.float().abs().amax(dim=(0, 2))[:, None].contiguous())
    report = {}
    _, amax = gate_up_act(x_q, token_of_slot, gu_q, ends, FP8_CHANNELS_CONFIG.gate_up, x_scale=x_s, w_scale=gu_s,
                          row_amax=True)
    act_bf16 = act_micro
    for name, fn in (("quantize x per row", lambda: quantize_rows(x_tok)),
                     ("quantize act per row from amax", lambda: quantize_rows_by_amax(act_bf16, amax))):
        us = _graph_us(fn)
        report[name.replace(" ", "_") + "_us"] = round(us, 1)
        print(f"{'fp8 channels ' + name:<60}{us:>9.1f} us")
    report["gate_up"] = _tile_rows(
        args, "fp8 channels gate_up", FP8_CHANNELS_CONFIG.gate_up, FP8_CHANNELS_GATE_UP_SWEEP,
        lambda t: gate_up_act(x_q, token_of_slot, gu_q, ends, t, x_scale=x_s, w_scale=gu_s, row_amax=True),
        act_expected, gate_up_flop, lambda out: out[0])
    report["down"] = _tile_rows(args, "fp8 channels down", FP8_CHANNELS_CONFIG.down, FP8_CHANNELS_DOWN_SWEEP,
                                lambda t: down_sum(act_q, dn_q, ends, t, act_scale=act_s, w_scale=dn_s),
                                y_expected, down_flop)
    report["gluon"] = _bench_gluon(args, x_q, x_s, token_of_slot, ends, (gu_q, gu_s, dn_q, dn_s), act_q, act_s,
                                   act_expected, y_expected, gate_up_flop, down_flop)
    report["scaled_grouped_mm"] = _bench_scaled_grouped_mm(x_q, x_s, token_of_slot, ends, (gu_q, gu_s, dn_q, dn_s),
                                                           act_q, act_s, act_expected, y_expected, gate_up_flop,
                                                           down_flop)
    report["experts_op"] = _bench_fp8_ops(x_tok, ids, g, gu_micro, dn_micro, (gu_q, gu_s, dn_q, dn_s),
                                          gate_up_flop + down_flop)
    _print_fp8_summary(report, torch.diff(ends, prepend=ends.new_zeros(1)).cpu())
    return report


def _print_fp8_summary(report: dict, counts: torch.Tensor) -> None:
    """The FP8 GEMM rows again, side by side, last: each kernel's gate/up and down, useful TFLOP/s (and of
    whole row tiles: the fused kernels' at their block_r, the Gluon ones' at theirs), median microseconds
    and error."""
    def with_whole(row: dict, block_m: int) -> dict:
        if "tflops" not in row:
            return row
        padded = float(((counts + block_m - 1) // block_m * block_m).sum()) / float(counts.sum())
        return {**row, "whole_tile_tflops": row["tflops"] * padded}

    rows = [("fused (Triton)", with_whole(report["gate_up"][0], report["gate_up"][0]["tiles"]["block_r"]),
             with_whole(report["down"][0], report["down"][0]["tiles"]["block_r"]))]
    sgmm_rows = report["scaled_grouped_mm"]
    if "skipped" not in sgmm_rows:
        rows.append(("scaled_grouped_mm", sgmm_rows["gate_up_gemms_fast_accum"], sgmm_rows["down_fast_accum"]))
    for tile_rows in report["gluon"].get("tiles", []):
        t = tile_rows["tiles"]
        name = (f"gluon {t['block_m']}x{t['block_n']} s{t['stages']} w{t['warps']}"
                + (" pingpong" if t["consumers"] == 2 else "") + ("" if t["specialized"] else " simple"))
        rows.append((name, tile_rows["gate_up_gemms"], tile_rows["down"]))

    def cell(row: dict) -> str:
        if "us" not in row:
            return f"{'failed':>30}"
        whole = f"/{row['whole_tile_tflops']:.0f}" if "whole_tile_tflops" in row else ""
        return f"{row['tflops']:>6.0f}{whole:<6}{row['us']:>8.1f}us {row['rel_err']:>7.1e}"

    print(f"\n{'FP8 GEMMs (TFLOP/s useful/whole, us, err)':<36}{'gate_up':>30}{'down':>30}")
    for name, gate_up, down in rows:
        print(f"{name:<36}{cell(gate_up):>30}{cell(down):>30}")


def _row(name: str, fn, expected, flop, as_float=lambda out: out) -> dict:
    row = _time_row(fn, expected, flop, as_float)
    print(f"{name:<60}{row['us']:>9.1f} us {row['tflops']:>7.1f} TFLOP/s  err {row['rel_err']:.1e}"
          if "us" in row else f"{name:<60} failed: {row['error']}")
    return row


def _bench_scaled_grouped_mm(x_q, x_s, token_of_slot, ends, experts_fp8, act_q, act_s, act_expected, y_expected,
                             gate_up_flop, down_flop) -> dict:
    """torch._scaled_grouped_mm on the fused kernels' e4m3 inputs (x per token, the activation per slot:
    its scale repeated for each micro's row). Errors against the same bf16 results as the fused rows."""
    problem = sgmm.scaled_grouped_mm_problem(x_q.device)
    if problem:
        print(f"scaled_grouped_mm: {problem}")
        return {"skipped": problem}
    gu_q, gu_s, dn_q, dn_s = experts_fp8
    micros, inter = gu_q.shape[0], gu_q.shape[2] // 2
    x_sorted_q, x_sorted_s = x_q.index_select(0, token_of_slot), x_s.index_select(0, token_of_slot)
    act_s_rows = act_s.repeat(micros)  # one scale per (micro, slot) row: the slot's, as the fused kernel used

    def act_of_u(us):  # x1 * silu(x2) in float32 from each micro's u
        return torch.stack([u[:, :inter].float() * torch.nn.functional.silu(u[:, inter:].float()) for u in us])

    def dequantized_act(out):
        q, scale = out
        return q.float() * scale.view(micros, -1, 1)

    report = {}
    for accum, fast in (("", True), (" precise accum", False)):
        key = "fast_accum" if fast else "precise_accum"
        report[f"gate_up_gemms_{key}"] = _row(
            f"scaled_grouped_mm gate_up GEMMs{accum}",
            lambda fast=fast: [sgmm.gate_up_u(x_sorted_q, x_sorted_s, gu_q, gu_s, ends, m, fast)
                               for m in range(micros)],
            act_expected, gate_up_flop, act_of_u)
        report[f"down_{key}"] = _row(
            f"scaled_grouped_mm down (M*E groups){accum}",
            lambda fast=fast: sgmm.down_partials(act_q, act_s_rows, dn_q, dn_s, ends, fast),
            y_expected, down_flop, lambda out: out.float().sum(0))
    report["gate_up_with_gather_and_act_quant"] = _row(
        "scaled_grouped_mm gate_up + gather + act quant",
        lambda: sgmm.gate_up_act_quant(x_q.index_select(0, token_of_slot), x_s.index_select(0, token_of_slot),
                                       gu_q, gu_s, ends),
        act_expected, gate_up_flop, dequantized_act)
    return report


GLUON_SWEEP = [gluon_gemm.PINGPONG_TILES, gluon_gemm.SIMPLE_TILES, gluon_gemm.GluonTiles(128, 128, 4, 8),
               gluon_gemm.GluonTiles(128, 256, 3, 8),
               gluon_gemm.GluonTiles(64, 256, 4, 4, consumers=2), gluon_gemm.GluonTiles(128, 128, 6, 8),
               gluon_gemm.GluonTiles(64, 256, 4, 4)]


def _us_spread(fn) -> tuple[float, float, float]:
    """(median, fastest, slowest) microseconds of do_bench's timed replays of fn recorded as a CUDA graph (L2
    flushed between runs)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = sorted(triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="all"))
    return times[len(times) // 2] * 1e3, times[0] * 1e3, times[-1] * 1e3


def _whole_tile_flop(counts: torch.Tensor, block_m: int, flop_per_row: float) -> float:
    """The FLOPs of whole row tiles: each group's rows rounded up to block_m."""
    return float(((counts + block_m - 1) // block_m * block_m).sum()) * flop_per_row


def _gluon_row(name: str, fn, expected, flop: float, whole_flop: float, as_float=lambda out: out) -> dict:
    """Check fn's result against expected, then time it: useful and whole-tile TFLOP/s, the runs' spread."""
    row = {}
    try:
        row["rel_err"] = rel_err(as_float(fn()), expected)
        us, fastest, slowest = _us_spread(fn)
        row.update(us=round(us, 1), us_fastest=round(fastest, 1), us_slowest=round(slowest, 1),
                   tflops=round(flop / us / 1e6, 1), whole_tile_tflops=round(whole_flop / us / 1e6, 1))
        print(f"{name:<60}{us:>9.1f} us ({fastest:.1f}-{slowest:.1f}) {row['tflops']:>7.1f} TFLOP/s "
              f"({row['whole_tile_tflops']:.1f} whole tiles)  err {row['rel_err']:.1e}")
    except Exception as err:  # a tile that does not fit must not hide the others
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"{name:<60} failed: {row['error']}")
    return row


def _bench_gluon(args, x_q, x_s, token_of_slot, ends, experts_fp8, act_q, act_s, act_expected, y_expected,
                 gate_up_flop, down_flop) -> dict:
    """Our Gluon grouped GEMM (sm90) on the scaled_grouped_mm rows' inputs: each tile's gate/up GEMMs (both
    micros) and down GEMM (M*E groups, the down scales shared by the micros), then the gate/up stage as the
    op runs it. Errors against the same bf16 results as the fused rows."""
    problem = gluon_gemm.gluon_problem(x_q.device)
    if problem:
        print(f"gluon: {problem}")
        return {"skipped": problem}
    gu_q, gu_s, dn_q, dn_s = experts_fp8
    micros, inter = gu_q.shape[0], gu_q.shape[2] // 2
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).cpu()
    x_sorted_q, x_sorted_s = x_q.index_select(0, token_of_slot), x_s.index_select(0, token_of_slot)
    act_s_rows = act_s.repeat(micros)
    gate_up_per_row, down_per_row = gate_up_flop / counts.sum().item(), down_flop / counts.sum().item()

    def act_of_u(us):
        return torch.stack([u[:, :inter].float() * torch.nn.functional.silu(u[:, inter:].float()) for u in us])

    report = {"tiles": []}
    for tiles in [gluon_gemm.DEFAULT_TILES] + (GLUON_SWEEP if args.sweep else GLUON_SWEEP[:2]):
        gemm = lambda *operands, tiles=tiles: gluon_gemm.grouped_gemm_fp8(*operands, tiles=tiles)  # noqa: E731
        label = (f"gluon {tiles.block_m}x{tiles.block_n}x{gluon_gemm.BLOCK_K} w{tiles.warps} s{tiles.stages}"
                 + (" pingpong" if tiles.consumers == 2 else "") + ("" if tiles.specialized else " simple"))
        report["tiles"].append({
            "tiles": vars(tiles),
            "gate_up_gemms": _gluon_row(
                f"{label} gate_up GEMMs",
                lambda gemm=gemm: [sgmm.gate_up_u(x_sorted_q, x_sorted_s, gu_q, gu_s, ends, m, gemm=gemm)
                                   for m in range(micros)],
                act_expected, gate_up_flop, _whole_tile_flop(counts, tiles.block_m, gate_up_per_row), act_of_u),
            "down": _gluon_row(
                f"{label} down (M*E groups)",
                lambda gemm=gemm: sgmm.down_partials(act_q, act_s_rows, dn_q, dn_s, ends, gemm=gemm),
                y_expected, down_flop, _whole_tile_flop(counts, tiles.block_m, down_per_row),
                lambda out: out.float().sum(0))})

    def dequantized_act(out):
        q, scale = out
        return q.float() * scale.view(micros, -1, 1)

    report["gate_up_with_gather_and_act_quant"] = _row(
        "gluon gate_up + gather + act quant",
        lambda: sgmm.gate_up_act_quant(x_q.index_select(0, token_of_slot), x_s.index_select(0, token_of_slot),
                                       gu_q, gu_s, ends, gemm=gluon_gemm.grouped_gemm_fp8),
        act_expected, gate_up_flop, dequantized_act)
    return report


def _bench_fp8_ops(x_tok, ids, g, gu_micro, dn_micro, experts_fp8, flop) -> dict:
    """Both FP8 experts ops whole, from x to the output (x's quantization, routing, both GEMMs, the
    activation's quantization, the finalize): "fused" (Triton), "scaled_grouped_mm" and "gluon", against
    the float experts (bf16 weights in float32)."""
    weights = torch.softmax(torch.randn(ids.shape, device=ids.device, generator=g), dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    exact = moe_multi_micro_reference(x_tok.float(), ids, weights, gu_micro.float(), dn_micro.float())
    impls = ["fused"] + ([] if sgmm.scaled_grouped_mm_problem(x_tok.device) else ["scaled_grouped_mm"]) + \
        ([] if gluon_gemm.gluon_problem(x_tok.device) else ["gluon"])
    return {impl: _row(f"fp8 experts op {impl} (x to output)",
                       lambda impl=impl: moe_multi_micro_fp8(x_tok, ids, weights, *experts_fp8, impl=impl),
                       exact, flop) for impl in impls}


def _bench_fused(args, g, ids, gu_micro, dn_micro, act_micro, gate_up_flop, down_flop) -> dict:
    """Our fused gate/up (+gather +activation) and down (+micro sum) against CUTLASS doing
    the same work: gather, per-micro gate/up, activation; and the M*E-group down GEMM."""
    dev, bf = "cuda", torch.bfloat16
    tokens = ids.shape[0]
    x_tok = torch.randn(tokens, H, device=dev, dtype=bf, generator=g)
    routing = moe_route(x_tok, ids, E, gather=False)
    ends = routing.expert_ends
    token_of_slot = (routing.pair_of_slot // TOPK).to(torch.int32)
    rows = token_of_slot.shape[0]
    shift = torch.arange(MICROS, device=dev, dtype=torch.int32).unsqueeze(1) * rows
    down_ends = (ends.unsqueeze(0) + shift).reshape(-1)

    def cutlass_gate_up():  # what the op's CUTLASS path does for the same result
        x_sorted = x_tok.index_select(0, routing.pair_of_slot // TOPK)
        acts = []
        for m in range(MICROS):
            u = torch._grouped_mm(x_sorted, gu_micro[m].transpose(-2, -1), offs=ends).float()
            acts.append((u[:, :INTER] * torch.nn.functional.silu(u[:, INTER:])).to(bf))
        return torch.stack(acts)

    def cutlass_down():  # M partials per slot; the op sums them in its finalize
        out = torch._grouped_mm(act_micro.flatten(0, 1), dn_micro.flatten(0, 1).transpose(-2, -1), offs=down_ends)
        return out.unflatten(0, (MICROS, rows))

    act_expected = cutlass_gate_up()
    y_expected = cutlass_down().float().sum(0)
    report = {"target_tflops": TARGET_TFLOPS}
    report["cutlass_gate_up_with_gather_and_act"] = _case("cutlass gate/up + gather + act", cutlass_gate_up,
                                                          gate_up_flop)
    report["cutlass_down"] = _case("cutlass down (M*E groups)", cutlass_down, down_flop)
    report["gate_up"] = _tile_rows(args, "fused gate_up", DEFAULT_FUSED_CONFIG.gate_up, GATE_UP_SWEEP,
                                   lambda t: gate_up_act(x_tok, token_of_slot, gu_micro, ends, t)[0],
                                   act_expected, gate_up_flop)
    report["down"] = _tile_rows(args, "fused down", DEFAULT_FUSED_CONFIG.down, DOWN_SWEEP,
                                lambda t: down_sum(act_micro, dn_micro, ends, t), y_expected, down_flop)
    return report


if __name__ == "__main__":
    sys.exit(main())
