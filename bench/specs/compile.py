"""The compile suite's tables: compile time against depth, regional compilation, a process's start."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value
from bench.specs.runs import CPU_COMPILE, REGIONS_TI2I, X2_REGIONS_1130, X2_REGIONS_1201
from bench.specs.common import goal


def req(i, key, file, fmt="{:.1f}"):
    return Value(f"requests[{i}].timings_ms.{key}", fmt, file)


def cached_mean(i, file):
    """The mean of a request's cached denoise steps: (10 x the mean of all 10 - the first) / 9."""
    return Calc(lambda mean, first: (10 * mean - first) / 9,
                [Value(f"requests[{i}].timings_ms.denoise_step", file=file),
                 Value(f"requests[{i}].timings_ms.denoise_first_step", file=file)], "{:.1f}")


TABLES = [
    Table("cpu-compile-depth", ["mode", "layers", "compile", "graphs", "ops traced", "denoise ms/step", "AR ms/token"], [
        Row([Text(label), Value(f"rows[mode={mode},layers={n}].layers"),
             Value(f"rows[mode={mode},layers={n}].compile_s", "{:.1f} s"), Value(f"rows[mode={mode},layers={n}].graphs"),
             Value(f"rows[mode={mode},layers={n}].ops_traced"),
             Value(f"rows[mode={mode},layers={n}].denoise_ms_per_step", "{:.1f}"),
             Value(f"rows[mode={mode},layers={n}].ar_ms_per_token", "{:.2f}")], file=CPU_COMPILE)
        for mode, label in (("regions", "`--compile-regions`"), ("whole", "whole steps (`--compile`)")) for n in (2, 16)
    ] + [
        Row([Text(f"{label}: 16 / 2 layers"), "", Calc(lambda a, b: a / b, [
            Value(f"rows[mode={mode},layers=16].compile_s"), Value(f"rows[mode={mode},layers=2].compile_s")],
            "**{:.2f}x**" if mode == "regions" else "{:.2f}x"), "", "", "", ""], file=CPU_COMPILE)
        for mode, label in (("regions", "regions"), ("whole", "whole steps"))
    ], note="Target (issue 10): regions' compile time at 16 layers within 1.15x of 2 layers."),
    Table("x2-regions-1130", ["what", "target", "measured"], [
        Row(["cold compile, all phases", goal("<= 90 s", Runs([(f"{X2_REGIONS_1130}/tp2_32_regions.json", "compile.compile_s"),
                                                              (f"{X2_REGIONS_1130}/earlier_tp2_32_regions.json", "compile.compile_s")]),
                                              90.0),
             Join([Runs([(f"{X2_REGIONS_1130}/tp2_32_regions.json", "compile.compile_s"),
                         (f"{X2_REGIONS_1130}/earlier_tp2_32_regions.json", "compile.compile_s")], "{:.1f}", " s"),
                   Value("compile.graphs", "{} graphs", f"{X2_REGIONS_1130}/tp2_32_regions.json"),
                   Value("compile.graph_breaks", "{} breaks", f"{X2_REGIONS_1130}/tp2_32_regions.json")], ", ")]),
        Row(["second process (warm cache): process start to the first denoise step done",
             goal("<= 20 s", Value("first_denoise_step_done_s", file=f"{X2_REGIONS_1130}/tp2_32_regions_warm.json"), 20.0),
             Value("first_denoise_step_done_s", "**{:.1f} s**", f"{X2_REGIONS_1130}/tp2_32_regions_warm.json")]),
        Row(["second process: compile on cache hits",  "",
             Join([Value("compile.compile_s", "{:.1f} s", f"{X2_REGIONS_1130}/tp2_32_regions_warm.json"),
                   Value("compile.cache.fxgraph_cache_hit", "{} FX-graph", f"{X2_REGIONS_1130}/tp2_32_regions_warm.json"),
                   Value("compile.cache.autograd_cache_hit", "{} AOTAutograd hits", f"{X2_REGIONS_1130}/tp2_32_regions_warm.json")],
                  ", ")]),
        Row(["second request, another prompt length in the bucket (1200 vs 1251 tokens)", "0 new graphs, within 5%",
             Join([Value("requests[1].new_graphs", "**{} new graphs**"),
                   req(1, "denoise_step", None), req(0, "denoise_step", None),
                   req(1, "ar_decode_per_token", None, "{:.2f}"), req(0, "ar_decode_per_token", None, "{:.2f}")],
                  ["; denoise ", " vs ", " ms/step, AR ", " vs "], suffix=" ms/token")],
            file=f"{X2_REGIONS_1130}/tp2_32_regions_warm.json"),
    ]),
    Table("x2-regions-1201", ["what", "target", "measured"], [
        Row(["cold compile, all phases", goal("<= 90 s", Value("compile.compile_s"), 90.0),
             Join([Value("compile.compile_s", "**{:.1f} s**"),
                                                         Value("compile.ops_traced", "{} ops traced")], ", ")],
            file=f"{X2_REGIONS_1201}/tp2_32_regions.json"),
        Row(["second process (warm cache): process start to the first denoise step done",
             goal("<= 20 s", Value("first_denoise_step_done_s"), 20.0),
             Join([Value("first_denoise_step_done_s", "**{:.1f} s**"),
                   Value("compile.compile_s", "{:.1f} s"), Value("compile.cache.fxgraph_cache_hit", "{}"),
                   Value("compile.cache.autograd_cache_hit", "{}")], ["; compile ", " on ", " + "],
                  suffix=" cache hits")],
            file=f"{X2_REGIONS_1201}/tp2_32_regions_warm.json"),
        Row(["second request, another prompt length in the bucket", "0 new graphs, within 5%",
             Join([Value("requests[1].new_graphs", "**{} new graphs**"),
                   req(1, "ar_decode_per_token", None, "{:.2f}"), req(0, "ar_decode_per_token", None, "{:.2f}"),
                   req(1, "denoise_step", None), req(0, "denoise_step", None)],
                  ["; AR ", " vs ", " ms/token, denoise ", " vs "], suffix=" ms/step")],
            file=f"{X2_REGIONS_1201}/tp2_32_regions.json"),
    ]),
    Table("single16-regions", ["plan `single`, 16 layers, `--compile --compile-regions`", "cold process", "warm process"], [
        Row(["process start to the first denoise step done", Value("first_denoise_step_done_s", "{:.1f} s",
                                                                   f"{REGIONS_TI2I}/single_16_regions.json"),
             Value("first_denoise_step_done_s", "**{:.1f} s**", f"{REGIONS_TI2I}/single_16_regions_warm.json")]),
        Row(["compile (all on cache hits when warm)", Value("compile.compile_s", "{:.1f} s", f"{REGIONS_TI2I}/single_16_regions.json"),
             Value("compile.compile_s", "{:.1f} s", f"{REGIONS_TI2I}/single_16_regions_warm.json")]),
        Row(["graphs / breaks / recompiles after warm-up",
             Join([Value("compile.graphs", file=f"{REGIONS_TI2I}/single_16_regions.json"),
                   Value("compile.graph_breaks", file=f"{REGIONS_TI2I}/single_16_regions.json"),
                   Value("compile.recompiles_after_warmup", file=f"{REGIONS_TI2I}/single_16_regions.json")]),
             Join([Value("compile.graphs", file=f"{REGIONS_TI2I}/single_16_regions_warm.json"),
                   Value("compile.graph_breaks", file=f"{REGIONS_TI2I}/single_16_regions_warm.json"),
                   Value("compile.recompiles_after_warmup", file=f"{REGIONS_TI2I}/single_16_regions_warm.json")])]),
    ] + [
        Row([f"request {i} ({n} prompt tokens): {what}", fn(i, f"{REGIONS_TI2I}/single_16_regions.json"),
             fn(i, f"{REGIONS_TI2I}/single_16_regions_warm.json")])
        for i, n in ((0, 1251), (1, 1200)) for what, fn in (
            ("AR decode, ms/token", lambda i, f: req(i, "ar_decode_per_token", f, "{:.2f}")),
            ("first denoise step, ms", lambda i, f: req(i, "denoise_first_step", f)),
            ("cached denoise steps, ms/step (mean of 9)", lambda i, f: cached_mean(i, f)),
            ("VAE decode, ms", lambda i, f: req(i, "vae_decode", f, "{:.0f}")),
            ("new graphs", lambda i, f: Value(f"requests[{i}].new_graphs", file=f)))
    ], note="The cached-step mean is recomputed from each request's stored mean of all 10 steps and its first "
            "step: (10 x mean - first) / 9."),
    Table("startup4", ["plan `single`, 4 layers, warm cache", "value"], [
        Row(["process start to the first denoise step done", Value("first_denoise_step_done_s", "{:.1f} s")],
            file=f"{REGIONS_TI2I}/startup_4layers_warm.json"),
        Row(["compile (4 FX-graph and 4 AOTAutograd cache hits)", Value("compile.compile_s", "{:.1f} s")],
            file=f"{REGIONS_TI2I}/startup_4layers_warm.json"),
        Row(["the same, cold cache", Value("compile.compile_s", "{:.1f} s")], file=f"{REGIONS_TI2I}/startup_4layers_cold.json"),
    ]),
]
