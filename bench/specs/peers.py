"""The peers suite's tables: Wan's and Qwen-Image's DiTs against diffusers'."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value, Verdict
from bench.specs.runs import (ATTENTION_14B_LONG_KEYS, ATTENTION_SWEEP, H1202_WAN_PEERS, QWEN_FP8,
                              QWEN_PEERS_BIAS_IN_GEMM, QWEN_PEERS_BIAS_OUTSIDE, QWEN_PEERS_FIRST, QWEN_PEERS_ROPE_REAL,
                              WAN_PEERS_COMPILED_QUANT, WAN_PEERS_FP8_KERNEL, WAN_PEERS_LONG_KEYS)
from bench.specs.common import ATTENTION_DEFAULT_RUN, fp8_run, goal, peer


PEER_VARIANTS = ("bf16", "dense-fp8", "attn-fp8", "fp8")
PEER_TARGETS = {"14B-8": 0.70, "1.3B": 0.75}   # the targets: dtgen / diffusers, compiled (regions)
PEER_L2_BOUND = 0.03                           # ... at relative L2 <= 3% against bf16


def _peer_target(model, mode, variant):
    if mode != "regions":
        return Text("")
    ratio = Value(peer(model, mode, "dtgen", variant, "ratio_vs_diffusers"))
    cells = [goal(f"<= {PEER_TARGETS[model]:.2f}", ratio, PEER_TARGETS[model])]
    if variant != "bf16":
        cells.append(goal("rel. L2 <= 3%", Value(peer(model, mode, "dtgen", variant, "rel_l2_vs_dtgen_bf16")),
                          PEER_L2_BOUND))
    return Join(cells, "; ")


def _fastest_within_bound(*values):
    """values: (ratio, rel L2) per variant; the smallest ratio of those within the L2 bound."""
    pairs = list(zip(values[0::2], values[1::2]))
    return min(r for r, l2 in pairs if l2 <= PEER_L2_BOUND)


def _peers_runs(files: list[str], path: str, fmt: str, unit: str = "") -> Runs:
    return Runs([(f, path) for f in files], fmt, unit)


_PEERS_ROWS = (("before (this session's first run): the row-split linears' bias added outside the GEMM, RoPE as "
                "complex ops", [QWEN_PEERS_BIAS_OUTSIDE], "regions"),
               ("the bias in the GEMM again (Linear.defer_bias)", QWEN_PEERS_BIAS_IN_GEMM, "regions"),
               ("**and RoPE in real arithmetic under compile** (what runs now)", QWEN_PEERS_ROPE_REAL, "regions"),
               ("eager, the bias in the GEMM (RoPE: complex ops, as diffusers')", QWEN_PEERS_BIAS_IN_GEMM, "eager"))


def _qwen_variant(variant: str, key: str) -> str:
    return f"modes.regions.variants.{variant}.{key}"


QWEN_FP8_VARIANTS = (("dense-fp8", "dtgen, dense-fp8: the blocks' linears in e4m3 (`--dense-dtype fp8`)"),
                     ("attn-fp8", "dtgen, attn-fp8: the joint attention in FP8 (`--attention-dtype fp8`)"),
                     ("fp8", "dtgen, fp8: both"))


def _fastest_within(model: str, file: str, fmt: str = "{:.3f}") -> Calc:
    return Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k), file=file) for v in PEER_VARIANTS
                                        for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")], fmt)


def _wan_peer_cells(model, variant, earlier):
    """A Wan-vs-diffusers row's first cells (the row's file: the run): model, variant, dtgen's ms,
    diffusers' ms, the ratio, the ratio in `earlier`, the relative L2 (bf16: against diffusers)."""
    return [model, f"**{variant}**" if variant == "bf16" else variant,
            Value(peer(model, "regions", "dtgen", variant, "ms"), "{:.1f} ms"),
            Value(peer(model, "regions", "diffusers", "bf16", "ms"), "{:.1f} ms"),
            Value(peer(model, "regions", "dtgen", variant, "ratio_vs_diffusers"), "**{:.3f}**"),
            Value(peer(model, "regions", "dtgen", variant, "ratio_vs_diffusers"), "{:.3f}", file=earlier),
            Value(peer(model, "regions", "dtgen", variant, "rel_l2_vs_diffusers"), "- (vs diffusers: {:.2%})")
            if variant == "bf16" else Value(peer(model, "regions", "dtgen", variant, "rel_l2_vs_dtgen_bf16"), "{:.2%}")]
WAN_KERNEL_KINDS = ("attention", "gemm", "inductor (norms, modulation, RoPE, quantization, residuals)", "other")


TABLES = [
    Table("wan-peers-1202", ["model", "mode", "dtgen variant", "dtgen", "diffusers (bf16)", "dtgen / diffusers",
                            "rel. L2 vs dtgen bf16", "target (issue 29)"], [
        Row([model, mode, f"**{variant}**" if variant == "bf16" else variant,
             Value(peer(model, mode, "dtgen", variant, "ms"), "{:.1f} ms"),
             Value(peer(model, mode, "diffusers", "bf16", "ms"), "{:.1f} ms"),
             Value(peer(model, mode, "dtgen", variant, "ratio_vs_diffusers"), "{:.3f}"),
             Value(peer(model, mode, "dtgen", variant, "rel_l2_vs_diffusers"), "- (vs diffusers: {:.2%})")
             if variant == "bf16" else Value(peer(model, mode, "dtgen", variant, "rel_l2_vs_dtgen_bf16"), "{:.2%}"),
             _peer_target(model, mode, variant)], file=H1202_WAN_PEERS)
        for model in ("1.3B", "14B-8") for mode in ("eager", "regions") for variant in PEER_VARIANTS
    ] + [
        Row([model, "regions", "the fastest within 3% rel. L2", "", "",
             Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k)) for v in PEER_VARIANTS
                                          for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")], "**{:.3f}**"),
             "",
             goal(f"<= {PEER_TARGETS[model]:.2f}",
                  Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k)) for v in PEER_VARIANTS
                                               for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")]),
                  PEER_TARGETS[model])], file=H1202_WAN_PEERS)
        for model in ("1.3B", "14B-8")
    ] + [
        Row(["timed forwards per figure (the median shown), after one warm-up call", "", "", Value("iters"), "", "", "",
             ""], file=H1202_WAN_PEERS),
    ], note="One process, one run of the script: each figure is the median of that many forwards (CUDA events), "
            "not a median over runs. Same weights (random) and inputs in both: 480x832 x 81 frames (32760 tokens), "
            "512 text rows, batch 1, bf16; 1.3B is Wan2.1 1.3B at its 30 blocks, 14B-8 the 14B width at 8 blocks. "
            "Regions: one compiled region per block (diffusers: `compile_repeated_blocks(fullgraph=True)`). "
            "dense-fp8: the blocks' linears in e4m3 (per-channel scales); attn-fp8: the self-attention in FP8 "
            "attention (INT8 QK, FP8 PV); fp8: both. The fastest within 3% is picked here from the stored ratios "
            "and errors (the 3% bound applied to both models)."),
    Table("qwen-peers-first", ["Qwen-Image MMDiT, one forward, 1024x1024 + 256 text rows, 60 layers, bf16, one H200",
                             "dtgen", "diffusers", "dtgen / diffusers (target <= 1.0)", "rel L2"], [
        Row([mode, Value(f"modes.{mode}.dtgen.ms", "{:.1f} ms"), Value(f"modes.{mode}.diffusers.ms", "{:.1f} ms"),
             Join([Value(f"modes.{mode}.ratio_dtgen_over_diffusers", "{:.3f}"),
                   Verdict(Value(f"modes.{mode}.ratio_dtgen_over_diffusers"), 1.0)], ": "),
             Value(f"modes.{mode}.rel_l2_outputs", "{:.2e}")], file=QWEN_PEERS_FIRST)
        for mode in ("eager", "regions")
    ], note="Both modules on the same weight tensors and inputs in one process (bench/bench_qwen_peers.py); regions: "
            "diffusers' compile_repeated_blocks(fullgraph=True) against dtgen's block region. The medians of 10 "
            "calls after 3 warm-up calls (the JSON holds each call's time). The floor: 73.1 TFLOP at 694 TFLOP/s, "
            "105.3 ms."),
    Table("qwen-peers-bias-rope", ["Qwen-Image MMDiT, one forward, 1024x1024 + 256 text rows, 60 layers, bf16, one H200",
                             "dtgen", "diffusers", "dtgen / diffusers", "target (issue 31)", "rel L2"], [
        Row([label, _peers_runs(files, f"modes.{mode}.dtgen.ms", "{:.1f}", " ms"),
             _peers_runs(files, f"modes.{mode}.diffusers.ms", "{:.1f}", " ms"),
             _peers_runs(files, f"modes.{mode}.ratio_dtgen_over_diffusers", "{:.3f}"),
             goal("<= 1.0", _peers_runs(files, f"modes.{mode}.ratio_dtgen_over_diffusers", "{:.3f}"), 1.0)
             if mode == "regions" else "",
             _peers_runs(files, f"modes.{mode}.rel_l2_outputs", "{:.2e}")], file=files[0])
        for label, files, mode in _PEERS_ROWS
    ] + [
        Row(["launches a forward, regions: dtgen (before / now) against diffusers",
             Join([Value("modes.regions.dtgen.kernels.launches", "{:.0f}", QWEN_PEERS_BIAS_OUTSIDE),
                   Value("modes.regions.dtgen.kernels.launches", "{:.0f}", QWEN_PEERS_ROPE_REAL[0]),
                   Value("modes.regions.diffusers.kernels.launches", "{:.0f}", QWEN_PEERS_ROPE_REAL[0])],
                  [" / ", " against "]), "", "", "", ""], file=QWEN_PEERS_ROPE_REAL[0]),
    ], note="Both modules on the same weight tensors and inputs in one process (bench/bench_qwen_peers.py); regions: "
            "diffusers' compile_repeated_blocks(fullgraph=True) against dtgen's block region. Each run: the median of "
            "10 calls after 3 warm-ups; a row gives the median and range over its runs (separate processes, one "
            "GPU call for each group of rows). The verdict is on the median ratio. The target is on the compiled "
            "(regions) forward; eager is shown for reference (its second run's dtgen time, 206 ms, is an outlier "
            "of that run)."),
    Table("qwen-fp8", ["Qwen-Image MMDiT, one forward, 1024x1024 + 256 text rows, 60 layers, one region per "
                           "block compiled, one H200", "ms", "over diffusers (bf16)",
                           "rel. L2 (dtgen bf16: vs diffusers; an FP8 variant: vs dtgen bf16)", "target (issue 31)"], [
        Row(["diffusers 0.42.1 `QwenImageTransformer2DModel`, bf16", Value("modes.regions.diffusers.ms", "{:.1f} ms"),
             "-", "-", ""], file=QWEN_FP8),
        Row(["**dtgen, bf16**", Value("modes.regions.dtgen.ms", "{:.1f} ms"),
             Value("modes.regions.ratio_dtgen_over_diffusers", "{:.3f}"),
             Value("modes.regions.rel_l2_outputs", "{:.2e}"),
             goal("<= 1.0", Value("modes.regions.ratio_dtgen_over_diffusers"), 1.0)], file=QWEN_FP8),
    ] + [
        Row([label, Value(_qwen_variant(variant, "ms"), "{:.1f} ms"),
             Value(_qwen_variant(variant, "ratio_over_diffusers"), "{:.3f}"),
             Value(_qwen_variant(variant, "rel_l2_vs_dtgen_bf16"), "{:.2e}"), ""], file=QWEN_FP8)
        for variant, label in QWEN_FP8_VARIANTS
    ] + [
        Row([Join(["the floor: the forward's ", Value("flops", "{:.1f}", scale=1e-12),
                   " TFLOP at 694 TFLOP/s (the dense bf16 GEMM rate)"], ""),
             Value("floor_ms", "{:.1f} ms"),
             Calc(lambda floor, theirs: floor / theirs, [Value("floor_ms"), Value("modes.regions.diffusers.ms")],
                  "{:.3f}"), "", ""], file=QWEN_FP8),
    ], note="Both modules on the same weight tensors and inputs in one process (bench/bench_qwen_peers.py); diffusers' "
            "compile_repeated_blocks(fullgraph=True) against dtgen's block region. One run: each figure the median of "
            "10 calls after 3 warm-ups. Each FP8 variant is timed against the same diffusers bf16 figure. The floor "
            "is a bf16 one: FP8 GEMMs have a higher peak rate, so an FP8 variant may run under it."),
    Table("wan-peers-compiled-quant", ["model (compiled: one region per block)", "dtgen variant", "dtgen", "diffusers (bf16)",
                            "dtgen / diffusers", "session 11 (`wan-peers-1202`): dtgen / diffusers",
                            "rel. L2 vs dtgen bf16", "target (issue 29)"], [
        Row([model, f"**{variant}**" if variant == "bf16" else variant,
             Value(peer(model, "regions", "dtgen", variant, "ms"), "{:.1f} ms"),
             Value(peer(model, "regions", "diffusers", "bf16", "ms"), "{:.1f} ms"),
             Value(peer(model, "regions", "dtgen", variant, "ratio_vs_diffusers"), "{:.3f}"),
             Value(peer(model, "regions", "dtgen", variant, "ratio_vs_diffusers"), "{:.3f}", H1202_WAN_PEERS),
             Value(peer(model, "regions", "dtgen", variant, "rel_l2_vs_diffusers"), "- (vs diffusers: {:.2%})")
             if variant == "bf16" else Value(peer(model, "regions", "dtgen", variant, "rel_l2_vs_dtgen_bf16"), "{:.2%}"),
             _peer_target(model, "regions", variant)], file=WAN_PEERS_COMPILED_QUANT)
        for model in ("1.3B", "14B-8") for variant in PEER_VARIANTS
    ] + [
        Row([model, "the fastest within 3% rel. L2", "", "", _fastest_within(model, WAN_PEERS_COMPILED_QUANT, "**{:.3f}**"),
             _fastest_within(model, H1202_WAN_PEERS), "",
             goal(f"<= {PEER_TARGETS[model]:.2f}",
                  Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k)) for v in PEER_VARIANTS
                                               for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")]),
                  PEER_TARGETS[model])], file=WAN_PEERS_COMPILED_QUANT)
        for model in ("1.3B", "14B-8")
    ] + [
        Row(["timed forwards per figure (the median shown), after one warm-up call", "", "", "", Value("iters"), "",
             "", ""], file=WAN_PEERS_COMPILED_QUANT),
    ], note="As `wan-peers-1202` (bench/bench_peers.py), compiled regions only: one process, one run; each figure the "
            "median of that many forwards (CUDA events). Same weights (random) and inputs in both: 480x832 x 81 "
            "frames (32760 tokens), 512 text rows, batch 1, bf16; 1.3B is Wan2.1 1.3B at its 30 blocks, 14B-8 the "
            "14B width at 8 blocks. dense-fp8: the blocks' linears in e4m3 (per-channel scales); attn-fp8: the "
            "self-attention in FP8 attention (INT8 QK, FP8 PV), its Q/K/V quantization now torch ops inside the "
            "compiled region (the JSON's `attention_quant`: in-graph; session 11: eager, inside the op); fp8: both. "
            "The fastest within 3% is picked here from the stored ratios and errors."),
    Table("wan-peers-fp8-kernel", ["Wan (compiled: one region per block), one H200", "dtgen variant", "dtgen",
                            "diffusers (bf16)", "dtgen / diffusers", "session 17 (`wan-peers-compiled-quant`)",
                            "rel. L2 vs dtgen bf16", "target (issue 29)"], [
        Row(_wan_peer_cells(model, variant, WAN_PEERS_COMPILED_QUANT) + [_peer_target(model, "regions", variant)],
            file=WAN_PEERS_FP8_KERNEL)
        for model in ("1.3B", "14B-8") for variant in ("bf16", "attn-fp8", "fp8")
    ] + [
        Row([model, "the fastest within 3% rel. L2", "", "",
             Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k), file=WAN_PEERS_FP8_KERNEL)
                                          for v in ("bf16", "attn-fp8", "fp8")
                                          for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")], "**{:.3f}**"),
             _fastest_within(model, WAN_PEERS_COMPILED_QUANT), "",
             goal(f"<= {PEER_TARGETS[model]:.2f}",
                  Calc(_fastest_within_bound, [Value(peer(model, "regions", "dtgen", v, k), file=WAN_PEERS_FP8_KERNEL)
                                               for v in ("bf16", "attn-fp8", "fp8")
                                               for k in ("ratio_vs_diffusers", "rel_l2_vs_dtgen_bf16")]),
                  PEER_TARGETS[model])])
        for model in ("1.3B", "14B-8")
    ], note="As `wan-peers-compiled-quant` (bench/bench_peers.py, one process, each figure the median of 3 forwards), with "
            "this session's FP8 attention kernel (default tiles); dense-fp8 alone was not run (session 17: 0.994 / "
            "0.870, 2.53% / 3.35%). The session-17 column's fastest within 3% picks among its four variants."),
    Table("wan-peers-long-keys", ["Wan (compiled: one region per block), one H200, call 7", "dtgen variant", "dtgen",
                      "diffusers (bf16)", "dtgen / diffusers", "session 19 (`wan-peers-fp8-kernel`)", "rel. L2 vs dtgen bf16",
                      "kernels of one profiled forward: attention / GEMMs / inductor's fused kernels / other",
                      "target (issue 29)"], [
        Row(_wan_peer_cells(model, variant, WAN_PEERS_FP8_KERNEL) + [
             Join([Value(peer(model, "regions", "dtgen", variant, f'profile.by_kind_ms["{kind}"]'), "{:.0f}")
                   for kind in WAN_KERNEL_KINDS], " / ", suffix=" ms"),
             _peer_target(model, "regions", variant)], file=WAN_PEERS_LONG_KEYS)
        for model in ("1.3B", "14B-8") for variant in ("bf16", "attn-fp8")
    ] + [
        Row([model, "diffusers", "", Value(peer(model, "regions", "diffusers", "bf16", "ms"), "{:.1f} ms"), "", "", "",
             Join([Value(peer(model, "regions", "diffusers", "bf16", f'profile.by_kind_ms["{kind}"]'), "{:.0f}")
                   for kind in WAN_KERNEL_KINDS], " / ", suffix=" ms"), ""], file=WAN_PEERS_LONG_KEYS)
        for model in ("1.3B", "14B-8")
    ] + [
        Row(["14B's attention alone (40 heads, 32760 x 32760): the FP8 kernel at the long-key tiles / cuDNN bf16",
             "attn-fp8", Value(fp8_run("14B", "fp8-kernel", "ms"), "{:.2f} ms"),
             Value(fp8_run("14B", "sdpa-cudnn_attention", "ms"), "{:.2f} ms (cuDNN)"),
             Value(fp8_run("14B", "fp8-kernel", "speedup_vs_best_sdpa"), "{:.2f}x faster"),
             Value(fp8_run("14B", ATTENTION_DEFAULT_RUN, "ms"), "{:.2f} ms (default tiles)", file=ATTENTION_SWEEP),
             Value(fp8_run("14B", "fp8-kernel", "rel_l2_vs_fp32"), "{:.2%} (vs fp32)"), "", ""], file=ATTENTION_14B_LONG_KEYS),
    ], note="As `wan-peers-fp8-kernel` (bench/bench_peers.py, one process, each figure the median of 3 forwards), with FP8 "
            "attention at its new long-key tiles (three programs an SM from 16384 keys). `--profile 12`: one more "
            "forward of each row under torch.profiler, its kernel time by kind (attention: the SDPA or FP8 "
            "attention kernels, self- and cross-attention; GEMMs: cuBLAS; inductor's: norms, modulation, RoPE, "
            "residuals and FP8 attention's Q/K/V quantization)."),
]
