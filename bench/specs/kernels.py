"""The kernels suite's tables: MoE, grouped GEMM, attention, FP8 attention, split-KV, prologue, GEMV, layers."""
from __future__ import annotations

from bench.floors import HBM_TBPS, moe_decode_expert_bytes
from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value, Verdict
from bench.specs.runs import (ATTENTION_DEFAULT_TILES, ATTENTION_LAZY, ATTENTION_SASS, ATTENTION_SWEEP,
                              ATTENTION_SWEEP_FIRST, FP8_EXPERTS, GEMV_1202, GEMV_SWEEP, H1129, H1129_LAYERS,
                              H1202_DECODE_KERNELS, H1202_FP8_ATTENTION, MOE_1201, MOE_TARGETS, PROLOGUE_PREFILL,
                              PROLOGUE_SWEEP, X2_FP8_DECODE, X2_REGIONS_1130)
from bench.specs.common import ATTENTION_DEFAULT_RUN, fp8_run, goal, ms, rank0_gb, timed


def decode_row(file, variant, tokens):
    return f"decode[variant={variant},tokens={tokens}]"


def _entry(section, gemm, tiles: dict | None):
    """bench_grouped_gemm's fused kernels: the run's default tiles (the first entry: the bench
    times the default first), or the sweep entry with exactly these tile fields."""
    if tiles is None:
        return f"{section}.{gemm}[0]"
    return f"{section}.{gemm}[" + ",".join(f"tiles/{k}={v}" for k, v in tiles.items()) + "]"


def fused(file, section, gemm, fmt="{:.0f}", tiles=None):
    return Value(_entry(section, gemm, tiles) + ".tflops", fmt, file)


def fused_us(file, section, gemm, tiles=None):
    return Value(_entry(section, gemm, tiles) + ".us", "{:.0f} us", file)


def _tiles(r, n, k, warps, stages, weights_tma=True, rows_tma=False, flatten=None):
    t = dict(block_r=r, block_n=n, block_k=k, num_warps=warps, num_stages=stages, weights_tma=weights_tma,
             rows_tma=rows_tma)
    return t if flatten is None else {**t, "flatten": flatten}


# Sweep entries named in the text (the best FP8 tiles of 2026-12-01, which became the defaults; the
# flattened FP8-channels down GEMM, the default now):
FP8_BLOCKS_GATE_UP_TILES = _tiles(64, 128, 128, 8, 4)
FP8_BLOCKS_DOWN_TILES = _tiles(64, 256, 128, 8, 4, rows_tma=True)
FP8_CH_GATE_UP_TILES = _tiles(64, 256, 128, 8, 3, rows_tma=True)
FP8_CH_DOWN_TILES = _tiles(128, 256, 128, 8, 4, rows_tma=True)
FP8_CH_DOWN_FLAT_TILES = _tiles(128, 256, 128, 8, 3, rows_tma=True, flatten=True)
FP8_CH_DOWN_FLAT_S4_TILES = _tiles(128, 256, 128, 8, 4, rows_tma=True, flatten=True)


def recomputed_decode(file, variant, tokens, what: str, fmt):
    """bench_moe's decode floor or bandwidth recomputed from the stored us and distinct-expert
    count with the row's own bytes (`bench.floors.moe_decode_expert_bytes`)."""
    from bench.floors import decode_kind_of
    kind = decode_kind_of(variant)
    row = decode_row(file, variant, tokens)
    moved = Calc(lambda n: n * moe_decode_expert_bytes(kind, 4096, 768), [Value(f"{row}.distinct_experts", file=file)])
    if what == "floor_us":
        return Calc(lambda b: b / (HBM_TBPS * 1e12) * 1e6, [moved], fmt)
    if what == "tbps":
        return Calc(lambda b, us: b / (us * 1e-6) / 1e12, [moved, Value(f"{row}.us", file=file)], fmt)
    if what == "mb":
        return Calc(lambda b: b / 1e6, [moved], fmt)
    raise ValueError(what)


FP8_T1_RUNS = [(f"{MOE_TARGETS}/bench_moe.json", decode_row(None, "decode_triton_fp8_channels", 1) + ".us"),
               (f"{MOE_TARGETS}/decode_sweep_2.json", decode_row(None, "decode_triton_fp8_channels_best_config", 1) + ".us"),
               (f"{MOE_TARGETS}/bench_moe_decode_profile.json", decode_row(None, "decode_triton_fp8_channels", 1) + ".us"),
               (f"{MOE_TARGETS}/bench_moe_decode_profile_t1_rerun.json", decode_row(None, "decode_triton_fp8_channels", 1) + ".us")]
FP8_T16_RUNS = [(f"{MOE_TARGETS}/bench_moe.json", decode_row(None, "decode_triton_fp8_channels", 16) + ".us"),
                (f"{MOE_TARGETS}/bench_moe_decode_profile.json", decode_row(None, "decode_triton_fp8_channels", 16) + ".us")]


def prefill_runs(files, tokens, key, fmt, unit):
    """bench_moe's multi-micro op at T: `multi_micro` and `multi_micro_fused` are the same path
    since `auto` became `fused` (2026-12-01), so both timings of every file count."""
    return Runs([(f, f"prefill[variant={v},tokens={tokens}].{key}") for f in files
                 for v in ("multi_micro", "multi_micro_fused")], fmt, unit)

B6, F6 = f"{FP8_EXPERTS}/t2i_2layers_bf16.json", f"{FP8_EXPERTS}/t2i_2layers_fp8_channels.json"
L6, D6, G6 = f"{FP8_EXPERTS}/bench_layers.json", f"{FP8_EXPERTS}/bench_moe_decode.json", f"{FP8_EXPERTS}/bench_grouped_gemm.json"
M6 = f"{FP8_EXPERTS}/bench_moe.json"

MOE_TARGETS_MOE = f"{MOE_TARGETS}/bench_moe.json"
MOE_TARGETS_PROFILE, MOE_TARGETS_PROFILE_T1 = f"{MOE_TARGETS}/bench_moe_decode_profile.json", f"{MOE_TARGETS}/bench_moe_decode_profile_t1_rerun.json"
FLAT, SWEEP, BAL = (f"{MOE_TARGETS}/grouped_gemm_flatten.json", f"{MOE_TARGETS}/grouped_gemm_sweep_flatten.json",
                    f"{MOE_TARGETS}/grouped_gemm_flatten_balanced_3072.json")
L9D, L9A = f"{MOE_TARGETS}/bench_layers_denoise.json", f"{MOE_TARGETS}/bench_layers_ar_decode.json"
X2_MOE_DECODE = f"{X2_FP8_DECODE}/bench_moe_decode.json"


def both_gemms(entries, fmt="{:.0f}"):
    """gate/up / down TFLOP/s: each a Runs over (file, path) pairs."""
    return Join([Runs(entries[0], fmt), Runs(entries[1], fmt)])
OP, TR = f"{H1129_LAYERS}/bench_layers_op_path.json", f"{H1129_LAYERS}/bench_layers_traced_moe_inductor_finalize.json"
GG2 = f"{H1129_LAYERS}/bench_grouped_gemm.json"
K1, A1 = f"{H1129}/bench_moe.json", f"{H1129}/bench_attention.json"


def attn(op, variant, batch, key, fmt, note=None):
    sel = f"rows[op={op},variant={variant},B={batch}" + (f",note={note}" if note else "") + "]"
    return Value(f"{sel}.{key}", fmt, A1)


STATIC_SPLITS = (1, 2, 4, 5, 8, 16, 32, 64)   # the keys of the sweep in `kernel.static_us_by_splits`
BALANCED = Value("kernel.balanced_us.median")


FP8_ATTENTION_RUNS = (("sdpa-flash_attention", "SDPA bf16, flash"), ("sdpa-cudnn_attention", "SDPA bf16, cuDNN"),
                      ("sdpa-efficient_attention", "SDPA bf16, memory-efficient"),
                      ("fp8-pv-fp8", "FP8 attention: INT8 QK, FP8 PV (Q/K/V quantized by eager ops)"),
                      ("fp8-pv-fp16", "FP8 attention: INT8 QK, FP16 PV (eager quantization)"),
                      ("fp8-pv-fp8-cq", "**FP8 attention: INT8 QK, FP8 PV, the quantization compiled**"),
                      ("fp8-quantize-only", "the quantization alone, eager"),
                      ("fp8-quantize-compiled", "the quantization alone, compiled"))


def _fp8_attention_cells(shape, run):
    if run.startswith("fp8-quantize"):
        return [Value(fp8_run(shape, run, "ms"), "{:.2f} ms"), "-", "-", "-"]
    return [Value(fp8_run(shape, run, "ms"), "{:.2f} ms"), Value(fp8_run(shape, run, "tflops"), "{:.0f}"),
            Value(fp8_run(shape, run, "rel_l2_vs_fp32"), "{:.2%}"),
            Value(fp8_run(shape, run, "speedup_vs_best_sdpa"), "**{:.2f}x**" if run.endswith("-cq") else "{:.2f}x")
            if run.startswith("fp8") else "-"]


GEMV_SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
GEMV_VARIANTS = (("cublas_bf16", "cuBLAS bf16 (F.linear)"), ("gemv_bf16", "decode GEMV, bf16"),
                 ("scaled_mm_fp8", "FP8: x quantized (inductor) + _scaled_mm (the old path)"),
                 ("gemv_fp8", "FP8: decode GEMV, x quantized inside"))
GEMV_SWEEP_KEYS = (("QKV / gate_up 6144x4096", "qkv N=6144 K=4096"), ("O 4096x4096", "o N=4096 K=4096"),
                   ("down 4096x3072", "down N=4096 K=3072"), ("lm_head 133120x4096", "lm_head N=133120 K=4096"))


ATTENTION_SHAPES = ("1.3B", "14B", "hy-t2i", "hy-ti2i")


# the shapes each attention file holds
ATTENTION_FILE_SHAPES = {ATTENTION_SWEEP_FIRST: ATTENTION_SHAPES, ATTENTION_SWEEP: ATTENTION_SHAPES, ATTENTION_DEFAULT_TILES: ("1.3B", "hy-t2i", "hy-ti2i"),
                   H1202_FP8_ATTENTION: ("1.3B", "14B"), ATTENTION_LAZY: ("1.3B", "hy-t2i")}


def _att(file, run, key="ms", fmt="{:.2f} ms"):
    """One figure of each shape from one sweep file; '-' where the file has no such shape or run."""
    return [Value(fp8_run(shape, run, key), fmt, file=file) if shape in ATTENTION_FILE_SHAPES[file] else "-"
            for shape in ATTENTION_SHAPES]


def _att_runs(runs):
    """The default tiles' kernel over the calls that ran it: the median and the range, per shape."""
    return [Runs([(file, fp8_run(shape, run, "ms")) for file, run in runs if shape in ATTENTION_FILE_SHAPES[file]],
                 "{:.2f}", " ms")
            for shape in ATTENTION_SHAPES]


ATTENTION_DEFAULT_RUNS = ((ATTENTION_SWEEP, ATTENTION_DEFAULT_RUN), (ATTENTION_DEFAULT_TILES, "fp8-kernel"))
LAZY_SHAPES = ("1.3B", "hy-t2i")


def _lazy_att(run, key="ms", fmt="{:.2f} ms"):
    return [Value(fp8_run(shape, run, key), fmt, file=ATTENTION_LAZY) for shape in LAZY_SHAPES]


TABLES = [
    Table("moe-fused-gemm", ["one TP2 rank: T=2674, 64 experts, top-8, 2 micros of 768", "before (CUTLASS `grouped_mm`)",
                     "fused Triton kernels", "target"], [
        Row(["bf16 gate/up (+ gather + activation)",
             Join([Value("fused.cutlass_gate_up_with_gather_and_act.us", "{:.0f} us"),
                   Value("fused.cutlass_gate_up_with_gather_and_act.tflops", "{:.0f} TFLOP/s")], ", "),
             Join([fused_us(None, "fused", "gate_up"),
                   fused(None, "fused", "gate_up", "{:.0f} TFLOP/s")], ", "),
             goal(">= 620 TFLOP/s", fused(None, "fused", "gate_up"), 620.0, ">=")], file=f"{MOE_1201}/bench_grouped_gemm.json"),
        Row(["bf16 down (micro sum inside)",
             Join([Value("fused.cutlass_down.us", "{:.0f} us"), Value("fused.cutlass_down.tflops", "{:.0f} TFLOP/s")],
                  ", "),
             Join([fused_us(None, "fused", "down"),
                   fused(None, "fused", "down", "{:.0f} TFLOP/s")], ", "),
             goal(">= 620", fused(None, "fused", "down"), 620.0, ">=")], file=f"{MOE_1201}/bench_grouped_gemm.json"),
        Row(["FP8, 128x128 block scales, best of the sweep: gate/up / down", "-",
             Join([fused(None, "fused_fp8", "gate_up", tiles=FP8_BLOCKS_GATE_UP_TILES),
                   fused(None, "fused_fp8", "down", tiles=FP8_BLOCKS_DOWN_TILES)],
                  " / ", suffix=" TFLOP/s"),
             goal(">= 1100", fused(None, "fused_fp8", "down", tiles=FP8_BLOCKS_DOWN_TILES), 1100.0, ">=")],
            file=f"{MOE_1201}/bench_grouped_gemm.json"),
        Row(["FP8, channel scales, best of the sweep: gate/up / down", "-",
             Join([fused(None, "fused_fp8.channels", "gate_up", tiles=FP8_CH_GATE_UP_TILES),
                   fused(None, "fused_fp8.channels", "down", tiles=FP8_CH_DOWN_TILES)], " / ", suffix=" TFLOP/s"),
             goal(">= 1100", fused(None, "fused_fp8.channels", "gate_up", tiles=FP8_CH_GATE_UP_TILES), 1100.0, ">=")],
            file=f"{MOE_1201}/bench_grouped_gemm.json"),
        Row(["multi-micro op, T=4096, bf16 (`auto` = `fused`: two timings of one path)", "-",
             Join([prefill_runs([f"{MOE_1201}/bench_moe_prefill.json"], 4096, "ms", "{:.2f}", " ms"),
                   prefill_runs([f"{MOE_1201}/bench_moe_prefill.json"], 4096, "speedup_vs_two_dispatch", "{:.2f}", "x")],
                  "; ", suffix=" over two dispatches"),
             goal("<= 2.4 ms", prefill_runs([f"{MOE_1201}/bench_moe_prefill.json"], 4096, "ms", "{:.2f}", ""), 2.4)]),
        Row(["multi-micro op, T=4096, FP8 channel scales", "-",
             Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].ms", "{:.2f} ms", f"{MOE_1201}/bench_moe_prefill.json"),
             ""]),
        Row(["denoise layer, compiled + CUDA graph, bf16",
             Value("denoise_layer.cuda_graph_compiled_ms", "{:.2f} ms (then the default path)",
                   f"{MOE_1201}/bench_layers_denoise.json"),
             Value("denoise_layer.cuda_graph_compiled_fused_moe_ms", "**{:.2f} ms**", f"{MOE_1201}/bench_layers_denoise.json"),
             goal("<= 2.0 ms", Value("denoise_layer.cuda_graph_compiled_fused_moe_ms",
                                     file=f"{MOE_1201}/bench_layers_denoise.json"), 2.0)]),
    ], note="Session 5's defaults were set from these sweeps: the FP8 rows give the swept tiles that became the "
            "defaults (64x128x128 and 64x256x128 with block scales; 64x256x128 and 128x256x128 with channel scales)."),
    Table("fp8-experts", ["what (session 6)", "bf16 experts", "FP8 experts", "target"], [
        Row(["T2I, full width, 2 layers, 1024x1024, compiled: denoise step", ms("timings_ms.denoise_step", B6),
             Join([ms("timings_ms.denoise_step", F6, "**{:.1f} ms**"),
                   Calc(lambda a, b: a / b - 1, [Value("timings_ms.denoise_step", file=F6),
                                                 Value("timings_ms.denoise_step", file=B6)], "{:+.0%}")], " (", suffix=")"),
             ""]),
        Row(["same: AR prefill (1251 tokens) / decode per token",
             Join([ms("timings_ms.ar_prefill", B6, "{:.2f} ms"), ms("timings_ms.ar_decode_per_token", B6, "{:.2f} ms")]),
             Join([ms("timings_ms.ar_prefill", F6, "{:.2f} ms"), ms("timings_ms.ar_decode_per_token", F6, "{:.2f} ms")]),
             ""]),
        Row(["same: resident weights / peak memory",
             Join([rank0_gb("storage_bytes_per_rank", B6), rank0_gb("peak_memory_bytes_per_rank", B6)]),
             Join([rank0_gb("storage_bytes_per_rank", F6), rank0_gb("peak_memory_bytes_per_rank", F6)]), ""]),
        Row(["denoise layer, compiled + CUDA graph (one TP2 rank)",
             Runs([(L6, "denoise_layer.cuda_graph_compiled_ms"), (L6, "denoise_layer.cuda_graph_compiled_fused_moe_ms")],
                  "{:.2f}", " ms"),
             Join([Value("denoise_layer.cuda_graph_compiled_fp8_channels_ms", "**{:.2f} ms** channels", L6),
                   Value("denoise_layer.cuda_graph_compiled_fp8_blocks_ms", "{:.2f} ms blocks", L6)], ", "),
             goal("<= 1.5 ms", Value("denoise_layer.cuda_graph_compiled_fp8_channels_ms", file=L6), 1.5)]),
        Row(["AR decode layer, compiled + CUDA graph (one TP4 micro)",
             Value("ar_decode_layer.cuda_graph_compiled_us", "{:.0f} us", L6),
             Value("ar_decode_layer.cuda_graph_compiled_fp8_channels_us", "{:.0f} us channels", L6), ""]),
        Row(["multi-micro op, T=4096", prefill_runs([M6], 4096, "ms", "{:.2f}", " ms"),
             Join([Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].ms", "**{:.2f} ms** channels", M6),
                   Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].speedup_vs_two_dispatch",
                         "{:.2f}x two dispatches", M6),
                   Value("prefill[variant=multi_micro_fp8,tokens=4096].ms", "{:.2f} ms blocks", M6)], ", "), ""]),
        Row(["grouped GEMMs at T=2674, default tiles: gate/up / down",
             Join([fused_us(G6, "fused", "gate_up"), fused_us(G6, "fused", "down")]),
             Join([fused_us(G6, "fused_fp8.channels", "gate_up"), fused_us(G6, "fused_fp8.channels", "down"),
                   fused(G6, "fused_fp8.channels", "gate_up"), fused(G6, "fused_fp8.channels", "down")],
                  [" / ", " channels (", " / "], suffix=" TFLOP/s)"),
             goal(">= 1100 TFLOP/s", fused(G6, "fused_fp8.channels", "down"), 1100.0, ">=")]),
        Row(["FP8 row quantizations at T=2674: x / the activation", "",
             Join([Value("fused_fp8.channels.quantize_x_per_row_us", "{:.1f}", G6),
                   Value("fused_fp8.channels.quantize_act_per_row_from_amax_us", "{:.1f} us", G6)]), ""]),
        Row(["decode MoE, T=1 / 16 (one micro, 8 routings, CUDA graph), default tiles",
             Join([Value(decode_row(None, "decode_triton", 1) + ".us", "{:.1f}", D6),
                   Value(decode_row(None, "decode_triton", 16) + ".us", "{:.0f} us", D6)]),
             Join([Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".us", "**{:.1f}**", D6),
                   Value(decode_row(None, "decode_triton_fp8_channels", 16) + ".us", "{:.0f} us", D6),
                   Value(decode_row(None, "decode_triton_fp8_blocks", 1) + ".us", "{:.1f}", D6),
                   Value(decode_row(None, "decode_triton_fp8_blocks", 16) + ".us", "{:.0f} us", D6)],
                  [" / ", " channels, ", " / "], suffix=" blocks"),
             Join([Verdict(Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".us", file=D6), 30.0)],
                  prefix="<= 30 us at T=1: ")]),
    ]),
    Table("moe-targets", ["issue 11's target (one H200)", "before session 9", "session 9", "target", "verdict"], [
        Row(["bf16 grouped GEMMs, T=2674, default tiles: gate/up / down (TFLOP/s)",
             Join([fused(f"{FP8_EXPERTS}/bench_grouped_gemm.json", "fused", "gate_up"),
                   fused(f"{FP8_EXPERTS}/bench_grouped_gemm.json", "fused", "down")], suffix=" (session 6)"),
             both_gemms([[(f, _entry("fused", "gate_up", None) + ".tflops") for f in (FLAT, SWEEP)],
                         [(f, _entry("fused", "down", None) + ".tflops") for f in (FLAT, SWEEP)]]),
             ">= 620", Verdict(Runs([(f, _entry("fused", "gate_up", None) + ".tflops") for f in (FLAT, SWEEP)]),
                               620.0, ">=")]),
        Row(["the same with whole tiles (balanced routing, T=3072)", "-",
             Join([fused(BAL, "fused", "gate_up"), fused(BAL, "fused", "down")]), "", "the kernels' own ceiling"]),
        Row(["FP8 grouped GEMMs (channels), default tiles: gate/up / down (TFLOP/s)",
             Join([fused(f"{FP8_EXPERTS}/bench_grouped_gemm.json", "fused_fp8.channels", "gate_up"),
                   fused(f"{FP8_EXPERTS}/bench_grouped_gemm.json", "fused_fp8.channels", "down")], suffix=" (session 6)"),
             Join([Runs([(f, _entry("fused_fp8.channels", "gate_up", None) + ".tflops") for f in (FLAT, SWEEP)],
                        "{:.0f}"),
                   fused(SWEEP, "fused_fp8.channels", "down", "**{:.0f}** (flattened)", tiles=FP8_CH_DOWN_FLAT_TILES)]),
             ">= 1100", Verdict(fused(SWEEP, "fused_fp8.channels", "down", tiles=FP8_CH_DOWN_FLAT_TILES), 1100.0, ">=")]),
        Row(["the same with whole tiles (down: 4 stages, flattened; the 3-stage default was not timed there)", "-",
             Join([fused(BAL, "fused_fp8.channels", "gate_up"),
                   fused(BAL, "fused_fp8.channels", "down", tiles=FP8_CH_DOWN_FLAT_S4_TILES)]), "", ""]),
        Row(["denoise layer, bf16 (compiled + CUDA graph)",
             Runs([(L6, "denoise_layer.cuda_graph_compiled_ms"), (L6, "denoise_layer.cuda_graph_compiled_fused_moe_ms")],
                  "{:.2f}", " ms"),
             Runs([(L9D, "denoise_layer.cuda_graph_compiled_ms"), (L9D, "denoise_layer.cuda_graph_compiled_fused_moe_ms")],
                  "{:.2f}", " ms"), "<= 2.0 ms",
             Verdict(Runs([(L9D, "denoise_layer.cuda_graph_compiled_ms"),
                           (L9D, "denoise_layer.cuda_graph_compiled_fused_moe_ms")]), 2.0)]),
        Row(["denoise layer, FP8 channels",
             Value("denoise_layer.cuda_graph_compiled_fp8_channels_ms", "{:.2f} ms", L6),
             Value("denoise_layer.cuda_graph_compiled_fp8_channels_ms", "**{:.2f} ms**", L9D), "<= 1.5 ms",
             Verdict(Value("denoise_layer.cuda_graph_compiled_fp8_channels_ms", file=L9D), 1.5)]),
        Row(["multi-micro op, T=4096, bf16", prefill_runs([M6], 4096, "ms", "{:.2f}", " ms"),
             Join([prefill_runs([MOE_TARGETS_MOE], 4096, "ms", "{:.2f}", " ms"),
                   prefill_runs([MOE_TARGETS_MOE], 4096, "speedup_vs_two_dispatch", "{:.2f}", "x"),
                   Value("prefill[variant=multi_micro_compiled,tokens=4096].ms", "{:.2f} ms", MOE_TARGETS_MOE)],
                  ["; ", " over two dispatches; compiled "]),
             "<= 2.4 ms, >= 1.2x", Verdict(prefill_runs([MOE_TARGETS_MOE], 4096, "ms", "{:.2f}", ""), 2.4)]),
        Row(["multi-micro op, T=4096, FP8 channels",
             Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].ms", "{:.2f} ms", M6),
             Join([Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].ms", "{:.2f} ms", MOE_TARGETS_MOE),
                   Value("prefill[variant=multi_micro_fp8_channels,tokens=4096].speedup_vs_two_dispatch", "{:.2f}x",
                         MOE_TARGETS_MOE)], " (", suffix=" two dispatches)"), "", ""]),
        Row(["decode MoE, T=1, FP8 channels (CUDA graph)",
             Value(decode_row(None, "decode_triton_fp8_channels_best_config", 1) + ".us", "{:.1f} us (session 7)", X2_MOE_DECODE),
             Runs(FP8_T1_RUNS, "{:.1f}", " us"), "<= 30 us", Verdict(Runs(FP8_T1_RUNS), 30.0)]),
        Row(["decode MoE, T=16, FP8 channels",
             Value(decode_row(None, "decode_triton_fp8_channels_best_config", 16) + ".us", "{:.0f} us (session 7)", X2_MOE_DECODE),
             Runs(FP8_T16_RUNS, "{:.1f}", " us"), "", ""]),
        Row(["decode MoE, T=1, FP8 blocks",
             Value(decode_row(None, "decode_triton_fp8_blocks_best_config", 1) + ".us", "{:.1f} us (session 7)", X2_MOE_DECODE),
             Runs([(f, decode_row(None, "decode_triton_fp8_blocks", 1) + ".us") for f in (MOE_TARGETS_MOE, MOE_TARGETS_PROFILE)], "{:.1f}", " us"),
             "", ""]),
        Row(["AR decode layer, FP8 channels (compiled + CUDA graph)",
             Value("ar_decode_layer.cuda_graph_compiled_fp8_channels_us", "{:.0f} us", L6),
             Value("ar_decode_layer.cuda_graph_compiled_fp8_channels_us", "**{:.0f} us**", L9A), "", ""]),
        Row(["T2I, 2 layers, compiled, FP8 channels: decode per token / denoise step",
             Join([ms("timings_ms.ar_decode_per_token", F6, "{:.2f} ms"), ms("timings_ms.denoise_step", F6)]),
             Join([ms("timings_ms.ar_decode_per_token", f"{MOE_TARGETS}/t2i_2layers_fp8_channels.json", "{:.2f} ms"),
                   ms("timings_ms.denoise_step", f"{MOE_TARGETS}/t2i_2layers_fp8_channels.json")]), "", ""]),
        Row(["the same, FP8 recipe `tensor`", "-",
             Join([ms("timings_ms.ar_decode_per_token", f"{MOE_TARGETS}/t2i_2layers_fp8_tensor.json", "{:.2f} ms"),
                   ms("timings_ms.denoise_step", f"{MOE_TARGETS}/t2i_2layers_fp8_tensor.json")]), "", ""]),
    ], note="Where a figure was measured in several runs of the same code, the median and the range; a verdict "
            "reads the median. The bf16 layer and multi-micro rows time one path twice per run (`auto` is "
            "`fused`), both count. Session 7's decode figures are its swept best, the defaults from then on."),
    Table("moe-decode-bytes", ["decode MoE, one micro, 8 routings, CUDA graph (session 9)", "T", "measured",
                              "bytes read", "floor at 4.3 TB/s", "achieved", "stored `gbps` (bf16 bytes)"], [
        Row([Text(label), Text(str(t)), Value(decode_row(None, v, t) + ".us", "{:.1f} us"),
             recomputed_decode(MOE_TARGETS_MOE, v, t, "mb", "{:.0f} MB"), recomputed_decode(MOE_TARGETS_MOE, v, t, "floor_us", "{:.1f} us"),
             recomputed_decode(MOE_TARGETS_MOE, v, t, "tbps", "{:.2f} TB/s"),
             Value(decode_row(None, v, t) + ".gbps", "{:.0f} GB/s")], file=MOE_TARGETS_MOE)
        for v, label in (("decode_triton", "bf16"), ("decode_triton_fp8_channels", "FP8 channels"),
                         ("decode_triton_fp8_blocks", "FP8 blocks")) for t in (1, 16)
    ], note="`bytes read`, `floor` and `achieved` are recomputed here from the stored raw timings (`us`) and "
            "`distinct_experts` of each row with `bench.floors.moe_decode_expert_bytes` (the formula of commit "
            "d6918a0: e4m3 weights at 1 B plus their float32 "
            "scales; bf16 at 2 B) and one HBM peak, 4.3 TB/s (the copy bandwidth measured on this workplace's "
            "H200; the datasheet's 4.8 is not reachable). The stored `floor_us` and `gbps` of these files counted "
            "bf16 bytes for every row, hence FP8 \"bandwidths\" above the HBM peak; bench_moe now writes the "
            "recomputed form."),
    Table("moe-decode-kernels", ["FP8 channels, T=1, per call, under the CUDA graph", "stage 1 (gate/up)",
                                "stage 2 (down)", "finalize", "kernels", "the op"], [
        Row([Text(name), Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".kernel_us._decode_gate_up_kernel",
                               "{:.1f} us"),
             Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".kernel_us._decode_down_kernel", "{:.1f} us"),
             Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".kernel_us._finalize_kernel", "{:.1f} us"),
             Calc(lambda a, b, c: a + b + c, [
                 Value(decode_row(None, "decode_triton_fp8_channels", 1) + f".kernel_us.{k}")
                 for k in ("_decode_gate_up_kernel", "_decode_down_kernel", "_finalize_kernel")], "{:.1f} us"),
             Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".us", "{:.1f} us")], file=f)
        for f, name in ((MOE_TARGETS_PROFILE, "profiled run"), (MOE_TARGETS_PROFILE_T1, "rerun after the last bench_moe edit"))
    ] + [
        Row(["what stage 1 and 2 read (8 experts: e4m3 + scales), and at what rate",
             Calc(lambda us, n: n * (2 * 768 * 4096 + 4 * 2 * 768) / (us * 1e-6) / 1e12,
                  [Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".kernel_us._decode_gate_up_kernel"),
                   Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".distinct_experts")], "{:.1f} TB/s"),
             Calc(lambda us, n: n * (4096 * 768 + 4 * 4096) / (us * 1e-6) / 1e12,
                  [Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".kernel_us._decode_down_kernel"),
                   Value(decode_row(None, "decode_triton_fp8_channels", 1) + ".distinct_experts")], "{:.1f} TB/s"),
             "", "", ""], file=MOE_TARGETS_PROFILE),
    ], note="Rates recomputed from the profiled kernel times and the same byte count as above."),
    Table("moe-decode-stage1-fp16", ["decode MoE, one micro, 8 routings, CUDA graph (session 7)", "T=1", "T=2", "T=8", "T=16"], [
        Row([Text(label)] + [Value(decode_row(None, v, t) + ".us", "{:.1f}" if t < 8 else "{:.0f}") for t in (1, 2, 8, 16)],
            file=X2_MOE_DECODE)
        for v, label in (("decode_triton", "bf16"), ("decode_triton_fp8_channels", "FP8 channels, stage 1 in bf16 "
                                                                                     "(session 6's default)"),
                         ("decode_triton_fp8_channels_best_config", "FP8 channels, swept best: stage 1 in float16"),
                         ("decode_triton_fp8_blocks_best_config", "FP8 blocks, swept best: stage 1 in float16"))
    ] + [
        Row(["floor, FP8 channels weights (recomputed: e4m3 + scales at 4.3 TB/s)"] + [
            recomputed_decode(X2_MOE_DECODE, "decode_triton_fp8_channels", t, "floor_us", "{:.0f}") for t in (1, 2, 8, 16)])
    ], note="Times in us. The floor is recomputed from the stored distinct-expert counts (see the session 9 "
            "table of bytes)."),
    Table("layers", ["layer (one rank's shapes, no communication)", "eager", "compiled", "compiled + CUDA graph",
                        "floor", "target"], [
        Row(["AR decode, TP4 micro (8 q / 2 KV heads, KV 1500, experts 768, shared 768)",
             Value("ar_decode_layer.eager_us", "{:.0f} us"), Value("ar_decode_layer.compiled_us", "{:.0f} us"),
             Value("ar_decode_layer.cuda_graph_compiled_us", "**{:.0f} us**"),
             Value("ar_decode_layer.floor_us", "{:.0f} us (memory)"),
             Join([Verdict(Value("ar_decode_layer.cuda_graph_compiled_us"), 150.0)], prefix="<= 150 us: ")], file=OP),
        Row(["denoise, TP2 x Ulysses-2 (2674 local tokens, attention over 5348, 2 micros)",
             Value("denoise_layer.eager_ms", "{:.2f} ms"), Value("denoise_layer.compiled_ms", "{:.2f} ms"),
             Value("denoise_layer.cuda_graph_compiled_ms", "**{:.2f} ms**"),
             Value("denoise_layer.floor_ms", "{:.2f} ms (compute)"),
             Join([Verdict(Value("denoise_layer.cuda_graph_compiled_ms"), 2.0)], prefix="<= 2.0 ms: ")], file=OP),
    ]),
    Table("layer-variants", ["denoise layer variant, compiled + CUDA graph", "ms", "a kernel of it, us per call"], [
        Row(["session 1: one masked attention kernel, MoE op", Value("denoise_layer.cuda_graph_compiled_ms", "{:.2f}",
                                                                     f"{H1129}/bench_layers.json"), ""]),
        Row(["same code, masked attention (ablation, session 2)",
             Value("denoise_layer.masked_attention_cuda_graph_compiled_ms", "{:.2f}", OP), ""]),
        Row(["**attention in mask-free pieces** (`plan_segments`), MoE op (default)",
             Value("denoise_layer.cuda_graph_compiled_ms", "**{:.2f}**", OP),
             Value("denoise_layer.top_kernels_us[^cudnn_generated][1]", "attention (cuDNN flash) {:.0f}", OP)]),
        Row(["MoE traced (`--moe-impl graph`), inductor's finalize, CUTLASS grouped GEMMs",
             Value("denoise_layer.cuda_graph_compiled_ms", "{:.2f}", TR),
             Join([Value("denoise_layer.top_kernels_us[^triton_per_fused__to_copy__unsafe_view_add_clamp_min][1]",
                         "inductor's finalize {:.0f}", TR),
                   Value("denoise_layer.top_kernels_us[^_finalize_kernel][1]", "ours {:.0f}", OP)], " against ")]),
        Row(["the same with GEMM autotuning (`--compile-autotune`)",
             Value("denoise_layer.cuda_graph_compiled_autotune_ms", "{:.2f}", TR),
             Join([Calc(lambda a, b, c: a + b + c, [
                 Value("denoise_layer.top_kernels_us[^triton_tem_fused__grouped_mm_add][1]", file=TR),
                 Value("denoise_layer.top_kernels_us[^triton_tem_fused__grouped_mm_select_transpose_15][1]", file=TR),
                 Value("denoise_layer.top_kernels_us[^triton_tem_fused__grouped_mm_select_transpose_16][1]", file=TR)],
                 "Triton grouped-GEMM templates {:.0f}"),
                 Value("denoise_layer.top_kernels_us[^_ZN7cutlass][1]", "CUTLASS {:.0f}", OP)], " against ")]),
    ]),
    Table("grouped-gemm-layouts", ["GEMM (one TP2 rank, T=2674, 64 experts, top-8)", "CUTLASS (`torch._grouped_mm`)",
                    "inductor Triton template (max-autotune)"], [
        Row([Text(label), Join([Value(f"{key}.us", "{:.0f} us"), Value(f"{key}.tflops", "{:.0f} TFLOP/s")], ", "),
             Join([Value(f"{key}_max_autotune.us", "{:.0f} us"), Value(f"{key}_max_autotune.tflops", "{:.0f} TFLOP/s")],
                  ", ") if key != "dense_same_flops_as_gate_up" else "-"], file=GG2)
        for key, label in (("micro_major_gate_up", "gate/up, per micro ([M, E, 2I, H] layout)"),
                           ("expert_major_gate_up", "gate/up, one GEMM over both micros (expert-major layout)"),
                           ("micro_major_down", "down, M*E groups with K = 768"),
                           ("expert_major_down", "down, K = 1536 (expert-major layout)"),
                           ("dense_same_flops_as_gate_up", "dense GEMM of the gate/up's FLOPs"))
    ]),
    Table("kernels-1129", ["op (one H200, HunyuanImage-3 shapes per rank, 2026-11-29)", "figure", "target"], [
        Row(["multi-micro MoE, T=2048 / 4096 / 8192",
             Join([Value(f"prefill[variant=multi_micro,tokens={t}].ms", "{:.2f}") for t in (2048, 4096, 8192)],
                  suffix=" ms"),
             goal("<= 2.4 ms at T=4096", Value("prefill[variant=multi_micro,tokens=4096].ms"), 2.4)], file=K1),
        Row(["speedup vs two dispatches at T=2048 / 4096 / 8192",
             Join([Value(f"prefill[variant=multi_micro,tokens={t}].speedup_vs_two_dispatch", "{:.2f}x")
                   for t in (2048, 4096, 8192)]),
             goal(">= 1.2x at T=4096", Value("prefill[variant=multi_micro,tokens=4096].speedup_vs_two_dispatch"), 1.2,
                  ">=")], file=K1),
        Row(["decode MoE, T=1 / 2 / 8 / 16 (CUDA graph)",
             Join([Value(decode_row(None, "decode_triton", t) + ".us", "{:.1f}" if t < 8 else "{:.0f}")
                   for t in (1, 2, 8, 16)], suffix=" us"),
             Join([Verdict(Value(decode_row(None, "decode_triton", 1) + ".us"), 55.0)], prefix="<= 55 us at T=1: ")],
            file=K1),
        Row(["Ulysses pack, B=1 / B=2 (Triton)",
             Join([attn("ulysses_pack", "triton", 1, "ms", "{:.2f}"), attn("ulysses_pack", "triton", 2, "ms", "{:.2f}"),
                   attn("ulysses_pack", "triton", 1, "gbps", "{:.0f}"), attn("ulysses_pack", "triton", 2, "gbps", "{:.0f}")],
                  [" / ", " ms (", " / "], suffix=" GB/s)"), "B=1: 'auto' takes the torch gather there"]),
        Row(["Ulysses pack, B=1, torch gather", Join([attn("ulysses_pack", "reference", 1, "ms", "{:.2f} ms")]), ""]),
        Row(["Ulysses unpack-out, B=1", Join([attn("ulysses_unpack_out", "triton", 1, "ms", "{:.3f} ms"),
                                              attn("ulysses_unpack_out", "triton", 1, "gbps", "{:.0f} GB/s")], " ("
                                             , suffix=")"), ""]),
        Row(["LSE merge, N=2 / 3 (B=1)",
             Join([attn("lse_merge", "triton", 1, "ms", "{:.3f}", "N=2"), attn("lse_merge", "triton", 1, "ms", "{:.3f}", "N=3"),
                   attn("lse_merge", "triton", 1, "gbps", "{:.0f}", "N=2"), attn("lse_merge", "triton", 1, "gbps", "{:.0f}", "N=3"),
                   Calc(lambda ref, tri: ref / tri, [attn("lse_merge", "reference", 1, "ms", "", "N=2"),
                                                     attn("lse_merge", "triton", 1, "ms", "", "N=2")], "{:.1f}x")],
                  [" / ", " ms (", " / ", " GB/s); "], suffix=" the torch reference's speed (N=2)"), ""]),
    ]),
    Table("hole-flash", ["denoise layer at TP2 x SP2 shapes, compiled + CUDA graph", "ms"], [
        Row(["no hole (a prompt of exact length)", Value("denoise_layer.cuda_graph_compiled_ms", "{:.2f}")],
            file=f"{X2_REGIONS_1130}/bench_layers_hole_flash.json"),
        Row(["a bucket hole, the image rows on FlashAttention-2 varlen (`impl=\"flash\"`)",
             Value("denoise_layer.bucket_hole_cuda_graph_compiled_ms", "{:.2f}")], file=f"{X2_REGIONS_1130}/bench_layers_hole_flash.json"),
        Row(["the masked kernel (one structured mask)", Value("denoise_layer.masked_attention_cuda_graph_compiled_ms",
                                                              "{:.2f}")], file=f"{X2_REGIONS_1130}/bench_layers_hole_flash.json"),
        Row(["a bucket hole with the default key-prefix path (SDPA, key mask), session 9",
             Value("denoise_layer.bucket_hole_cuda_graph_compiled_ms", "{:.2f}")], file=L9D),
    ]),
    Table("split-kv", ["decode attention: 8 requests (one 16k, seven 1k), 32 q / 8 KV heads, d 128, bf16, "
                           "CUDA graph", "per call", "balanced's speed-up over it", "target (issue 30)"], [
        Row([Join([Value("kernel.balanced_programs_per_kv_head")], prefix="**balanced split-KV** (",
                  suffix=" programs per KV head)"), timed("kernel.balanced_us", "{:.2f}"), "-", ""], file=H1202_DECODE_KERNELS),
        Row(["its schedule, built once per step for every layer (apart)", timed("kernel.schedule_build_us", "{:.2f}"),
             "-", ""], file=H1202_DECODE_KERNELS),
        Row([Join([Value("kernel.heuristic_splits")], prefix="static split, the flash-decoding heuristic's count (",
                  suffix=" splits per request)"), timed("kernel.static_heuristic_us", "{:.2f}"),
             Value("kernel.speedup_vs_static_heuristic", "**{:.2f}x**"),
             goal(">= 2x", Value("kernel.speedup_vs_static_heuristic"), 2.0, ">=")], file=H1202_DECODE_KERNELS),
        Row([Join([Value("kernel.static_best_splits")], prefix="static split, the best of the sweep (",
                  suffix=" splits)"),
             Calc(min, [Value(f"kernel.static_us_by_splits.{n}.median") for n in STATIC_SPLITS], "{:.2f} us"),
             Value("kernel.speedup_vs_static_best", "{:.2f}x"),
             goal(">= 2x against it", Value("kernel.speedup_vs_static_best"), 2.0, ">=")], file=H1202_DECODE_KERNELS),
        Row(["static split, the sweep (splits: us)",
             Join([Value(f"kernel.static_us_by_splits.{n}.median", f"{n}: " + "{:.1f}") for n in STATIC_SPLITS], ", "),
             "", ""], file=H1202_DECODE_KERNELS),
        Row(["masked SDPA (the one-request decode step's path)", timed("kernel.sdpa_masked_us", "{:.0f}"),
             Calc(lambda sdpa, balanced: sdpa / balanced, [Value("kernel.sdpa_masked_us.median"), BALANCED],
                  "{:.0f}x"), ""], file=H1202_DECODE_KERNELS),
        Row(["floor: the K/V read once at 4.3 TB/s",
             Join([Value("kernel.floor_us", "{:.1f} us"), Value("kernel.kv_bytes", "{:.1f} MB", scale=1e-6)], " ("
                  , suffix=")"),
             Calc(lambda floor, balanced: balanced / floor, [Value("kernel.floor_us"), BALANCED],
                  "balanced at {:.2f}x the floor"), ""], file=H1202_DECODE_KERNELS),
    ], note="Each op replayed from a CUDA graph; a figure is the median of its timings, with their range. The "
            "best static split is the fastest median of the sweep, recomputed here from the sweep's stored "
            "medians; the issue's target is against the heuristic's count."),
    Table("prologue", ["fused prologue (split + RoPE + QK RMSNorm + KV write), 8 KV heads x 4, d 128, bf16, "
                           "CUDA graph", "fused", "separate ops, eager", "separate ops, compiled",
                           "fused vs eager", "fused vs compiled", "target (issue 30)"], [
        Row([Join([Value(f"prologue.{shape}.batch"), Value(f"prologue.{shape}.rows")], ", S=", prefix=f"{shape} (B=",
                  suffix=")"),
             timed(f"prologue.{shape}.fused_us", fmt), timed(f"prologue.{shape}.separate_eager_us", fmt),
             timed(f"prologue.{shape}.separate_compiled_us", fmt),
             Value(f"prologue.{shape}.speedup_vs_eager", "{:.1f}x"),
             Value(f"prologue.{shape}.speedup_vs_compiled", "**{:.2f}x**"),
             goal(">= 1.5x vs compiled", Value(f"prologue.{shape}.speedup_vs_compiled"), 1.5, ">=")], file=H1202_DECODE_KERNELS)
        for shape, fmt in (("decode", "{:.2f}"), ("prefill", "{:.1f}"))
    ], note="Compiled: the same separate ops under inductor, as the compiled regions run them. Medians of the "
            "timings, with their range."),
    Table("fp8-attention-1202", ["Wan self-attention, 32760 tokens, d 128, batch 1",
                                "1.3B (12 heads)", "TFLOP/s", "rel. L2 vs fp32", "over the best SDPA",
                                "14B (40 heads)", "TFLOP/s", "rel. L2 vs fp32", "over the best SDPA"], [
        Row([label] + _fp8_attention_cells("1.3B", run) + _fp8_attention_cells("14B", run), file=H1202_FP8_ATTENTION)
        for run, label in FP8_ATTENTION_RUNS
    ] + [
        Row(["heads (from the file)", Value('shapes["1.3B"].heads'), "", "", "", Value('shapes["14B"].heads'), "", "",
             ""], file=H1202_FP8_ATTENTION),
    ], note="Each figure: the median of `--iters` calls after the warm-ups (the script's default count; the JSON "
            "does not store it). "
            "TFLOP/s at 4 S^2 D heads. Error: against SDPA's math in float32 on the first 2 heads. \"Over the "
            "best SDPA\": the fastest SDPA backend's time over this one's (cuDNN in both shapes here)."),
    Table("decode-gemv", ["one dense linear of the decode step, M = 1, one H200, us per call (CUDA-graph replays, "
                       "weights cycled past L2)"] + list(GEMV_SHAPES), [
        Row([label] + [Join([Value(f"shapes.{shape}.rows.1.{v}.us.median", "{:.1f}"),
                             Value(f"shapes.{shape}.rows.1.{v}.weight_GBps", "{:.0f} GB/s")], " (", suffix=")")
                       for shape in GEMV_SHAPES], file=GEMV_1202)
        for v, label in GEMV_VARIANTS
    ], note="QKV 6144x4096, O 4096x4096, the shared expert's gate_up 6144x4096 and down 4096x3072, the lm_head "
            "133120x4096. GB/s: the weight's bytes in the dtype that runs over the call's time. The FP8 GEMV with x "
            "quantized inside it runs at ~1.3 TB/s; in it every program computes the row's amax and quantizes x "
            "before and while it streams the weight (the suspected cause, not profiled): fp8_linear now quantizes x "
            "with torch ops (fused upstream by inductor) and passes it in e4m3."),
    Table("decode-gemv-sweep", ["decode GEMV at M = 1, x already e4m3 (fp8) or bf16, one H200",
                             "fp8: default config", "fp8: the sweep's best", "bf16: default", "bf16: the sweep's best"], [
        Row([label, Value(f'sweep.results["{key} fp8 M=1"].default_us', "{:.1f} us"),
             Value(f'sweep.results["{key} fp8 M=1"].best.us', "{:.1f} us"),
             Value(f'sweep.results["{key} 16bit M=1"].default_us', "{:.1f} us"),
             Value(f'sweep.results["{key} 16bit M=1"].best.us', "{:.1f} us")], file=GEMV_SWEEP)
        for label, key in GEMV_SWEEP_KEYS
    ], note="bench_decode_gemv --sweep: each candidate config (kernels/decode_gemv.py's GemvConfig) timed by "
            "CUDA-graph replays with the weights cycled past L2; the best of each shape is now in GEMV_CONFIGS."),
    Table("prologue-prefill", ["fused attention prologue (split + RoPE + QK RMSNorm + KV write), 8 KV heads x 4, d 128, "
                           "bf16, CUDA graph", "fused", "separate ops, compiled", "fused vs compiled",
                           "target (issue 30)"], [
        Row([f"{name} (B={b}, S={s_})", timed(f"prologue.{name}.fused_us", "{:.2f}"),
             timed(f"prologue.{name}.separate_compiled_us", "{:.2f}"),
             Value(f"prologue.{name}.speedup_vs_compiled", "**{:.2f}x**"),
             goal(">= 1.5x", Value(f"prologue.{name}.speedup_vs_compiled"), 1.5, ">=")], file=PROLOGUE_PREFILL)
        for name, b, s_ in (("decode", 8, 1), ("prefill", 1, 4096))
    ] + [
        Row(["prefill, rows a program x warps (the sweep, call 2): us",
             Join([Value(f'prologue.prefill.fused_by_rows_warps_us["{k}"].median', f"{k}: {{:.1f}}")
                   for k in ("1x4", "2x4", "4x4", "8x4", "8x8", "16x4", "16x8", "32x8")], ", "), "", "", ""],
            file=PROLOGUE_SWEEP),
    ], note="Each op replayed from a CUDA graph; the medians of 11 timings with their range. The fused kernel now "
            "takes 8 rows a program at 4 warps at prefill (the sweep's fastest; one row a program before: 49.4 us "
            "in the sweep) and one row at decode. The compiled separate ops are inductor's fusion of the same torch "
            "ops, as the compiled regions run them; they measured 41.0 us at prefill in session 11, 48.1 and 38.2 "
            "us in this session's two runs."),
    Table("fp8-attention", ["FP8 attention (INT8 QK, FP8 PV), head_dim 128, one H200, ms a call",
                                "Wan 1.3B: 12 heads, 32760 x 32760", "Wan 14B: 40 heads, 32760 x 32760",
                                "HunyuanImage-3 T2I denoise: 32 / 8 heads (GQA), 4098 x 5606",
                                "HunyuanImage-3 edit denoise: 32 / 8 heads, 4098 x 9702"], [
        Row(["SDPA bf16, cuDNN (call 2)"] + _att(ATTENTION_SWEEP, "sdpa-cudnn_attention")),
        Row(["SDPA bf16, cuDNN (call 3)"] + _att(ATTENTION_DEFAULT_TILES, "sdpa-cudnn_attention")),
        Row(["SDPA bf16 as dispatched (GQA: enable_gqa) (call 3)"] + _att(ATTENTION_DEFAULT_TILES, "sdpa-dispatched")),
        Row(["session 11's kernel, the quantization compiled (`fp8-attention-1202`)"]
            + _att(H1202_FP8_ATTENTION, "fp8-pv-fp8-cq")),
        Row(["**this session's kernel alone, default tiles** (64 query rows, 128 keys a step, one warpgroup, 3 "
             "stages, TMA; calls 2 and 3)"] + _att_runs(ATTENTION_DEFAULT_RUNS), file=ATTENTION_DEFAULT_TILES),
        Row(["... over cuDNN, call 3 (call 2 for 14B)"]
            + [Value(fp8_run(shape, "fp8-kernel" if shape != "14B" else ATTENTION_DEFAULT_RUN, "speedup_vs_best_sdpa"),
                     "**{:.2f}x**", file=ATTENTION_DEFAULT_TILES if shape != "14B" else ATTENTION_SWEEP) for shape in ATTENTION_SHAPES]),
        Row(["... with its quantization compiled before it (call 3; call 2's kernel default for 14B: 128 x 128 "
             "tiles, 8 warps)"] + [Value(fp8_run(shape, "fp8-pv-fp8-cq", "ms"), "{:.2f} ms",
                                         file=ATTENTION_DEFAULT_TILES if shape != "14B" else ATTENTION_SWEEP) for shape in ATTENTION_SHAPES]),
        Row(["... the logits converted by I2F instead of the bit trick (call 3)"]
            + _att(ATTENTION_DEFAULT_TILES, "sweep-m64-n128-w4-s3-tma-i2f")),
        Row(["... K/V by pointers instead of TMA (call 3)"] + _att(ATTENTION_DEFAULT_TILES, "sweep-m64-n128-w4-s3-ptr")),
        Row(["... 2 stages, registers capped at 168 (three programs an SM) (call 3)"]
            + _att(ATTENTION_DEFAULT_TILES, "sweep-m64-n128-w4-s2-tma-r168")),
        Row(["... 64-key steps (160 registers: three programs an SM) (call 3)"] + _att(ATTENTION_DEFAULT_TILES, "sweep-m64-n64-w4-s3-tma")),
        Row(["128 query rows, 128 keys, 2 warpgroups, 4 stages (call 2)"] + _att(ATTENTION_SWEEP, "sweep-m128-n128-w8-s4-tma")),
        Row(["... each key block's FP8 PV summed apart (max_num_imprecise_acc = 128) (call 2)"]
            + _att(ATTENTION_SWEEP, "sweep-m128-n128-w8-s4-tma-promote")),
        Row(["rel. L2 vs fp32 SDPA math, default tiles (first 2 heads)"]
            + [Value(fp8_run(shape, "fp8-kernel" if shape != "14B" else ATTENTION_DEFAULT_RUN, "rel_l2_vs_fp32"), "{:.2%}",
                     file=ATTENTION_DEFAULT_TILES if shape != "14B" else ATTENTION_SWEEP) for shape in ATTENTION_SHAPES]),
        Row(["... with the PV products summed apart (call 2)"] + _att(ATTENTION_SWEEP, "sweep-m128-n128-w8-s4-tma-promote",
                                                                   "rel_l2_vs_fp32", "{:.2%}")),
        Row(["registers a thread at the default tiles (spilled bytes)"]
            + [Join([Value(fp8_run(shape, ATTENTION_DEFAULT_RUN, "registers"), "{}", file=ATTENTION_SWEEP),
                     Value(fp8_run(shape, ATTENTION_DEFAULT_RUN, "spills"), "{}", file=ATTENTION_SWEEP)], " (", suffix=")")
               for shape in ATTENTION_SHAPES]),
    ], note="bench/bench_fp8_attention.py: random q, k, v in bf16 (k offset by 1), batch 1; each figure the median "
            "of 10 calls after 3 warm-ups, one process per call. The default tiles ran in two calls (call 2's "
            "sweep, call 3's `fp8-kernel`): the median and the range over them (14B: call 2 only). The kernel "
            "alone is timed on operands quantized beforehand; \"quantization compiled\" adds `quantize_qkv` under "
            "torch.compile before the op. Call 1 ran the first version, whose bit-trick path did not compile on "
            "triton 3.6 (its dot lacked out_dtype=int32; `sweep-first-kernel/tests.log`): its I2F rows are superseded by "
            "call 2's."),
    Table("fp8-attention-lazy", ["the FP8 attention kernel alone, one H200, call 6 (ms a call)",
                                 "Wan 1.3B: 12 heads, 32760 x 32760", "HunyuanImage-3 T2I denoise: 32 / 8 heads, "
                                 "4098 x 5606"], [
        Row(["SDPA bf16, cuDNN"] + _lazy_att("sdpa-cudnn_attention")),
        Row(["the default tiles (64 x 128, 3 stages), as `fp8-kernel` / in the sweep"]
            + [Join([Value(fp8_run(shape, r, "ms"), "{:.2f}", file=ATTENTION_LAZY)
                     for r in ("fp8-kernel", "sweep-m64-n128-w4-s3-tma")], " / ", suffix=" ms")
               for shape in LAZY_SHAPES]),
        Row(["... 2 stages, registers capped at 168 (three programs an SM)"]
            + _lazy_att("sweep-m64-n128-w4-s2-tma-r168")),
        Row(["... lazy rescale, tau = 1"] + _lazy_att("sweep-m64-n128-w4-s3-tma-lazy1")),
        Row(["... lazy rescale, tau = 2"] + _lazy_att("sweep-m64-n128-w4-s3-tma-lazy2")),
        Row(["... lazy rescale, tau = 2, 2 stages, 168 registers"]
            + _lazy_att("sweep-m64-n128-w4-s2-tma-r168-lazy2")),
        Row(["rel. L2 vs fp32 SDPA math: default / lazy tau = 2"]
            + [Join([Value(fp8_run(shape, r, "rel_l2_vs_fp32"), "{:.2%}", file=ATTENTION_LAZY)
                     for r in ("fp8-kernel", "sweep-m64-n128-w4-s3-tma-lazy2")], " / ") for shape in LAZY_SHAPES]),
    ], note="bench/bench_fp8_attention.py --sweep, as `fp8-attention` (each figure the median of 10 calls). The "
            "lazy rescale (commit 3e083ca, reverted) rescaled acc and the row sums only when some row's max grew by "
            "more than tau (log2) and made P as P * 448 / 2^tau; a step that skips the rescale saves each thread "
            "its 64 multiplies of acc (of the ~600 instructions a step, `fp8-attention-sass`), but the "
            "block-wide max needs a shared-memory round and a barrier every "
            "iteration, which cost more."),
    Table("fp8-attention-sass", ["the FP8 attention kernel compiled for sm_90 (head_dim 128, TMA), its main loop "
                                 "(one step over 128 keys)", "registers a thread (local bytes)",
                                 "instructions a warp a step", "of them: FADD / FFMA / FMUL / IMAD / MUFU / F2FP"], [
        Row([label, Join([Value(f"tiles.{name}.registers", "{}"), Value(f"tiles.{name}.local_bytes", "{}")], " (",
                         suffix=")"),
             Value(f"tiles.{name}.loop_instructions", "{}"),
             Join([Value(f"tiles.{name}.loop_by_opcode.{op}", "{}") for op in ("FADD", "FFMA", "FMUL", "IMAD", "MUFU",
                                                                               "F2FP")], " / ")], file=ATTENTION_SASS)
        for name, label in (("default", "default tiles: 64 query rows, 4 warps, 3 stages"),
                            ("long-keys", "long-key tiles: 2 stages, at most 168 registers"))
    ], note="Per thread a step holds 64 logits (64 x 128 over 128 threads): one MUFU each (exp2), about one FFMA "
            "(scale and shift), FADD (row sum) and FMUL (the accumulator's rescale), and most IMADs set the "
            "integer accumulator's start bits; F2FP packs P into e4m3 two at a time. The tensor cores' share of a "
            "step: 4.2 MFLOP, ~510 clocks of an SM at 8192 8-bit FLOP a clock."),
]
