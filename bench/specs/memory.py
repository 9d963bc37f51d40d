"""The memory suite's tables: one request's peak, phase by phase, with the memory levers."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value, Verdict
from bench.specs.runs import (H1202_LEVERS, H1202_MEMORY_PROBE, H1202_T2I_DENSE_FP8, MEMORY_FUSIONS,
                              MEMORY_FUSIONS_REVERTED, MEMORY_KV_POLICY, MEMORY_LEAN, MEMORY_LEAN_MEASURED)
from bench.specs.common import cell_with_verdict, gb, lever, ms, PEAK_TARGET


MEMORY_VAE_LINES = ("hunyuan_image3/vae.py:122 forward", "hunyuan_image3/vae.py:185 forward",
                    "hunyuan_image3/vae.py:125 forward", "hunyuan_image3/vae.py:121 forward")


def _site(request, where):
    return Value(f"{request}.sites[^{where}][1]", "{:.2f} GB")


LEVER_CONFIGS = (("baseline", "none"), ("all_fp32_vae", "release KV, VAE chunks, MoE chunks (fp32 VAE)"),
                 ("all", "**all**: release KV, bf16 VAE, VAE chunks, MoE chunks"))


def _lever_row(run, config, label):
    peak = Value(lever(run, config, "peak_bytes"), scale=1e-9)
    projected = Value(lever(run, config, "projected_peak_bytes"), scale=1e-9)
    verdicts = [Verdict(peak, PEAK_TARGET), Verdict(projected, PEAK_TARGET)]
    labels = ["measured ", ", projected ", ", T2I process "]
    if run == "t2i":
        verdicts.append(Verdict(Value(lever(run, config, "t2i_process_peak_bytes"), scale=1e-9), PEAK_TARGET))
    verdict = Join([c for pair in zip([Text(l) for l in labels], verdicts) for c in pair], "")
    return Row([run.upper(), label, gb(lever(run, config, "peak_bytes")), gb(lever(run, config, "projected_peak_bytes")),
                gb(lever(run, config, "peak_over_weights_bytes")),
                gb(lever(run, config, "t2i_process_peak_bytes")) if run == "t2i" else "-",
                ms(lever(run, config, "timings_ms.ar_decode_per_token"), fmt="{:.2f} ms"),
                ms(lever(run, config, "timings_ms.denoise_full_step")), ms(lever(run, config, "timings_ms.vae_decode")),
                ms(lever(run, config, "timings_ms.condition_encode")) if run == "ti2i" else "-", verdict],
               file=H1202_LEVERS)


DENSE_PEAK = Value("peak_memory_bytes_per_rank[0]", scale=1e-9)
DENSE_WEIGHTS = Value("storage_bytes_per_rank[0]", scale=1e-9)


def _memory(run, key):
    return f"rows[run={run},config=lean].{key}"


def _memory_timing(run, key, target=None, fmt="{:.1f} ms"):
    value = Value(_memory(run, f"timings_ms.{key}"), fmt)
    return value if target is None else cell_with_verdict(value, target)


def _phase_peaks(run, phases):
    return Join([Value(_memory(run, f"phases.{p}.peak_bytes"), "{:.1f}", scale=1e-9) for p in phases], " / ",
                suffix=" GB")


def _kv(run, config, repeat, key):
    return f"rows[run={run},config={config},repeat={repeat}].{key}"


def _kv_row(run, config, repeat, label):
    timing = lambda key, fmt="{:.1f} ms": Value(_kv(run, config, repeat, f"timings_ms.{key}"), fmt)
    ar_target, dit_target = (5.0, 280.0) if run == "t2i" else (6.0, 350.0)
    peak = Value(_kv(run, config, repeat, "peak_bytes"), "{:.2f} GB", scale=1e-9)
    return Row([label, cell_with_verdict(peak, PEAK_TARGET),
                cell_with_verdict(timing("ar_decode_per_token", "{:.2f} ms"), ar_target),
                cell_with_verdict(timing("condition_encode"), 200.0) if run == "ti2i" else "-",
                cell_with_verdict(timing("denoise_full_step"), dit_target), timing("vae_decode"), timing("total")],
               file=MEMORY_KV_POLICY)


def _cond_runs() -> Runs:
    return Runs([(MEMORY_FUSIONS, f"rows[run=ti2i,config=lean_ar,repeat={r}].timings_ms.condition_encode") for r in (0, 1)]
                + [(MEMORY_FUSIONS_REVERTED, f"rows[run=ti2i,config=lean_ar,repeat={r}].timings_ms.condition_encode")
                   for r in (0, 1, 2)], "{:.1f}", " ms")


TABLES = [
    Table("memory-before", ["HunyuanImage-3, 32 layers, FP8 experts, compiled regions, 1024x1024, 10 steps",
                         "T2I", "TI2I edit", "target (issue 29)"], [
        Row(["allocated before the request (weights and what stays resident)",
             Value("t2i.before_gb", "{:.1f} GB"), Value("ti2i.before_gb", "{:.1f} GB"), ""], file=H1202_MEMORY_PROBE),
        Row(["peak from the end of the AR prefill through the first denoise step (the probe's `ar`)", Value("t2i.peaks_gb.ar", "{:.1f} GB"), Value("ti2i.peaks_gb.ar", "{:.1f} GB"), ""],
            file=H1202_MEMORY_PROBE),
        Row(["peak from the end of the first denoise step through the VAE decode (the probe's `denoise`)",
             Value("t2i.peaks_gb.denoise", "**{:.1f} GB**"), Value("ti2i.peaks_gb.denoise", "**{:.1f} GB**"),
             Join([Verdict(Value("t2i.peaks_gb.denoise"), 92.0), Verdict(Value("ti2i.peaks_gb.denoise"), 92.0)], " / ",
                  prefix="<= 92 GB: ")], file=H1202_MEMORY_PROBE),
        Row(["the most allocated over the before-figure (replayed allocator trace)",
             Value("t2i.over_gb", "**{:.2f} GB**"), Value("ti2i.over_gb", "**{:.2f} GB**"), ""], file=H1202_MEMORY_PROBE),
    ] + [
        Row([f"live at that moment: `{where}`", _site("t2i", where), _site("ti2i", where), ""], file=H1202_MEMORY_PROBE)
        for where in MEMORY_VAE_LINES + ("hunyuan_image3/pipeline.py:432 _feed",)
    ] + [
        Row(["live at that moment: the four VAE lines above together",
             *[Calc(lambda *v: sum(v), [Value(f"{r}.sites[^{w}][1]") for w in MEMORY_VAE_LINES], "{:.2f} GB")
               for r in ("t2i", "ti2i")], ""], file=H1202_MEMORY_PROBE),
        Row(["live at that moment: every other site",
             *[Calc(lambda over, *v: over - sum(v), [Value(f"{r}.over_gb")] +
                    [Value(f"{r}.sites[^{w}][1]") for w in MEMORY_VAE_LINES + ("hunyuan_image3/pipeline.py:432 _feed",)],
                    "{:.2f} GB") for r in ("t2i", "ti2i")], ""], file=H1202_MEMORY_PROBE),
        Row(["VAE decode inside the request", Value("t2i.timings_ms.vae_decode", "{:.0f} ms"),
             Value("ti2i.timings_ms.vae_decode", "{:.0f} ms"), ""], file=H1202_MEMORY_PROBE),
    ], note="The probe resets the peak when the pipeline reports a new phase, and the pipeline reports a phase "
            "after its first unit (`ar` after the prefill, `denoise` after the first step, `vae` after the decode): "
            "the VAE decode's allocations land in the `denoise` peak, and the prefill's (the edit's condition "
            "encode too) in no per-phase peak, only in the replayed trace. The allocator trace is "
            "replayed from the start of the request: the most live at once, grouped by the first project frame "
            "of each block's allocation. \"Every other site\" is the most-allocated figure less the five sites "
            "listed (the JSON lists the rest by site)."),
    Table("memory-levers", ["run", "memory levers", "peak (measured)", "projected peak", "peak over the weights",
                         "a T2I process's peak", "AR decode / token", "DiT full step", "VAE decode",
                         "condition encode", "<= 92 GB (issue 29)"], [
        _lever_row(run, config, label) for run in ("t2i", "ti2i") for config, label in LEVER_CONFIGS
    ] + [
        Row(["T2I, the CLI", "**all, and dense linears in FP8** (`--dense-dtype fp8`)", gb("peak_memory_bytes_per_rank[0]"),
             "- (measured in a T2I process)",
             Calc(lambda peak, weights: peak - weights, [DENSE_PEAK, DENSE_WEIGHTS], "{:.1f} GB"),
             gb("peak_memory_bytes_per_rank[0]"), ms("timings_ms.ar_decode_per_token", fmt="{:.2f} ms"),
             ms("timings_ms.denoise_full_step"), ms("timings_ms.vae_decode"), "-",
             Join([Verdict(DENSE_PEAK, PEAK_TARGET)], prefix="measured ")], file=H1202_T2I_DENSE_FP8),
        Row(["", "weights: bench_memory (all resident, editing modules too) / its T2I process / the dense-FP8 CLI",
             Join([gb("weights_bytes", H1202_LEVERS), gb("t2i_process_weights_bytes", H1202_LEVERS),
                   gb("storage_bytes_per_rank[0]", H1202_T2I_DENSE_FP8)], " / "), "", "", "", "", "", "", "", ""]),
    ], note="32 layers, FP8 experts (channels), compiled regions, 1024x1024, 1251 prompt tokens, 256 AR tokens, "
            "serial CFG; bench_memory: 4 denoise steps, the CLI: 10. One run of each (no repeats): a timing is that "
            "request's. Measured: `torch.cuda.max_memory_allocated` over the request. bench_memory holds the editing "
            "modules and the fp32 VAE in every config (a bf16 VAE copy stands in for `--vae-dtype bfloat16`): the "
            "projected peak is the measured one less the bytes a real process would not hold (the JSON's "
            "`bench_only_bytes`), and a T2I process's, the projected one less the editing modules' planned bytes. The "
            "CLI row is a T2I process with every lever, measured; its peak over the weights is computed here "
            "(peak less `storage_bytes_per_rank`)."),
    Table("memory-lean", ["bench_memory `lean`: release KV, bf16 VAE, VAE chunks (no MoE chunks); dense linears "
                         "(and the lm_head) in FP8", "peak (measured)", "projected peak: <= 92 GB (issue 29)",
                         "a T2I process's peak: <= 92 GB", "peak over the weights",
                         "phase peaks, measured: condition / AR / denoise / VAE", "condition encode",
                         "AR decode / token", "DiT full step", "VAE decode"], [
        Row(["T2I", gb(_memory("t2i", "peak_bytes")),
             cell_with_verdict(gb(_memory("t2i", "projected_peak_bytes")), PEAK_TARGET),
             cell_with_verdict(gb(_memory("t2i", "t2i_process_peak_bytes")), PEAK_TARGET),
             gb(_memory("t2i", "peak_over_weights_bytes")),
             Join([_phase_peaks("t2i", ("ar", "denoise", "vae"))], prefix="- / "), "-",
             _memory_timing("t2i", "ar_decode_per_token", 5.0, "{:.2f} ms"),
             _memory_timing("t2i", "denoise_full_step", 280.0), _memory_timing("t2i", "vae_decode", 150.0)],
            file=MEMORY_LEAN),
        Row(["TI2I (edit)", gb(_memory("ti2i", "peak_bytes")),
             cell_with_verdict(gb(_memory("ti2i", "projected_peak_bytes")), PEAK_TARGET), "-",
             gb(_memory("ti2i", "peak_over_weights_bytes")), _phase_peaks("ti2i", ("condition", "ar", "denoise", "vae")),
             _memory_timing("ti2i", "condition_encode", 200.0),
             _memory_timing("ti2i", "ar_decode_per_token", 6.0, "{:.2f} ms"),
             _memory_timing("ti2i", "denoise_full_step", 350.0), _memory_timing("ti2i", "vae_decode")],
            file=MEMORY_LEAN),
        Row(["targets (issue 29): T2I / TI2I", "", "", "", "", "", "- / <= 200 ms", "<= 5.0 / <= 6.0 ms",
             "<= 280 / <= 350 ms", "<= 150 ms / -"]),
        Row(["resident weights: all (editing modules and the fp32 VAE too) / a T2I process's; the bench-only bytes",
             Join([gb("weights_bytes"), gb("t2i_process_weights_bytes"), gb(_memory("t2i", "bench_only_bytes"))],
                  [" / ", "; "]), "", "", "", "", "", "", "", ""], file=MEMORY_LEAN),
    ], note="32 layers, FP8 experts (channels), compiled regions, 1024x1024, 1251 prompt tokens, 256 AR tokens, 4 "
            "denoise steps, serial CFG; one request of each (no repeats): a timing is that request's. Measured: "
            "`torch.cuda.max_memory_allocated`, per phase reset at the phase's start. This run held the fp32 VAE "
            "besides the bf16 one, so the measured peaks include it: the verdicts are on the **projected** peak "
            "(the measured one less the JSON's `bench_only_bytes`, the fp32 VAE) and, for T2I, on a T2I process's "
            "(the projected one less the editing modules' planned bytes). Peak over the weights: the JSON's, the "
            "projected peak less every resident weight, the fp32 VAE's among them but not the bf16 copy's: for a "
            "process that loads the bf16 VAE alone it is low by the difference of the two copies."),
    Table("memory-lean-measured", ["bench_memory `lean` as in `memory-lean`, the VAE loaded in bf16 alone (what a user's "
                                  "process holds)", "peak (measured): <= 92 GB (issue 29)",
                                  "call 1's projection (`memory-lean`)", "peak over the weights",
                                  "phase peaks, measured: condition / AR / denoise / VAE", "condition encode",
                                  "AR decode / token", "DiT full step", "VAE decode"], [
        Row(["T2I", cell_with_verdict(Value(_memory("t2i", "peak_bytes"), "{:.2f} GB", scale=1e-9), PEAK_TARGET),
             Value(_memory("t2i", "projected_peak_bytes"), "{:.2f} GB", MEMORY_LEAN, scale=1e-9),
             Value(_memory("t2i", "peak_over_weights_bytes"), "{:.2f} GB", scale=1e-9),
             Join([Join([Value(_memory("t2i", f"phases.{p}.peak_bytes"), "{:.2f}", scale=1e-9)
                         for p in ("ar", "denoise", "vae")], " / ")], prefix="- / ", suffix=" GB"), "-",
             _memory_timing("t2i", "ar_decode_per_token", 5.0, "{:.2f} ms"),
             _memory_timing("t2i", "denoise_full_step", 280.0), _memory_timing("t2i", "vae_decode", 150.0)],
            file=MEMORY_LEAN_MEASURED),
        Row(["T2I in a process without the editing modules (the measured peak less their weights)",
             cell_with_verdict(Value(_memory("t2i", "t2i_process_peak_bytes"), "{:.2f} GB", scale=1e-9),
                                PEAK_TARGET), "", "", "", "", "", "", ""], file=MEMORY_LEAN_MEASURED),
        Row(["TI2I (edit)", cell_with_verdict(Value(_memory("ti2i", "peak_bytes"), "{:.2f} GB", scale=1e-9),
                                               PEAK_TARGET),
             Value(_memory("ti2i", "projected_peak_bytes"), "{:.2f} GB", MEMORY_LEAN, scale=1e-9),
             Value(_memory("ti2i", "peak_over_weights_bytes"), "{:.2f} GB", scale=1e-9),
             Join([Value(_memory("ti2i", f"phases.{p}.peak_bytes"), "{:.2f}", scale=1e-9)
                   for p in ("condition", "ar", "denoise", "vae")], " / ", suffix=" GB"),
             _memory_timing("ti2i", "condition_encode", 200.0),
             _memory_timing("ti2i", "ar_decode_per_token", 6.0, "{:.2f} ms"),
             _memory_timing("ti2i", "denoise_full_step", 350.0), _memory_timing("ti2i", "vae_decode")],
            file=MEMORY_LEAN_MEASURED),
        Row(["targets (issue 29): T2I / TI2I", "", "", "", "", "- / <= 200 ms", "<= 5.0 / <= 6.0 ms",
             "<= 280 / <= 350 ms", "<= 150 ms / -"]),
        Row(["resident weights: all / a T2I process's (no editing modules); held for the bench only; the VAE "
             "loaded in bf16",
             Join([Value("weights_bytes", "{:.2f} GB", scale=1e-9),
                   Value("t2i_process_weights_bytes", "{:.2f} GB", scale=1e-9),
                   Value(_memory("t2i", "bench_only_bytes"), "{:.0f} bytes"),
                   Value("vae_loaded_in_bf16", lambda v: "yes" if v else "no")], [" / ", "; ", "; "]),
             "", "", "", "", "", "", ""], file=MEMORY_LEAN_MEASURED),
    ], note="32 layers, FP8 experts (channels), dense linears and the lm_head in FP8, compiled regions, 1024x1024, "
            "1251 prompt tokens, 256 AR tokens, 4 denoise steps, serial CFG; one request of each (no repeats): a "
            "timing is that request's. Measured: `torch.cuda.max_memory_allocated`, per phase reset at the phase's "
            "start. Every config asked for the bf16 VAE, so bench_memory loaded it in bf16 alone, as "
            "`--vae-dtype bfloat16` does (the JSON's `vae_loaded_in_bf16`): nothing is held for the bench only and the "
            "peaks are measured, not projected. The T2I run's process also holds the editing modules (the vision "
            "tower, the VAE encoder); the second row subtracts their planned bytes (all resident weights less a T2I "
            "process's). Call 1's projection: its measured peak less the fp32 VAE it also held."),
    Table("kv-policy", ["bench_memory, 32 layers, dense FP8, bf16 VAE, VAE chunks 4: KV-cache policy, request "
                            "(two in a row)", "peak (measured): <= 92 GB", "AR decode / token: <= 5.0 (T2I) / "
                            "6.0 (TI2I)", "condition encode: <= 200", "DiT full step: <= 280 (T2I) / 350 (TI2I)",
                            "VAE decode", "request total"], [
        _kv_row(run, config, repeat, f"{run.upper()}, `{policy}`, request {repeat + 1}")
        for run in ("t2i", "ti2i") for config, policy in (("lean", "release"), ("lean_ar", "keep-ar"))
        for repeat in (0, 1)
    ], note="`lean`: `--kv-caches release`; `lean_ar`: `--kv-caches keep-ar` (new: the denoise caches released "
            "before the VAE decode, the AR cache kept), each with `--vae-dtype bfloat16 --vae-chunks 4`. 1024x1024, "
            "1251 prompt tokens (T2I), 256 AR tokens, 4 denoise steps, serial CFG. Each config's two requests run "
            "in a row from an empty pool: the first records the CUDA-graph decode under either policy, the second "
            "does again under `release` and not under `keep-ar`. One run of each request: its own timings."),
    Table("memory-lean-ar", ["bench_memory `lean_ar` (`--dense-dtype fp8 --kv-caches keep-ar --vae-dtype bfloat16 "
                          "--vae-chunks 4`; the bf16 VAE now channels-last), main at call 2, three requests in a "
                          "row", "peak (measured): <= 92 GB", "AR decode / token: <= 5.0 (T2I) / 6.0 (TI2I)",
                          "condition encode: <= 200", "DiT full step: <= 280 (T2I) / 350 (TI2I)", "VAE decode",
                          "request total"], [
        Row([f"{run.upper()}, request {r + 1}",
             cell_with_verdict(Value(f"rows[run={run},config=lean_ar,repeat={r}].peak_bytes", "{:.2f} GB",
                                      scale=1e-9), PEAK_TARGET),
             cell_with_verdict(Value(f"rows[run={run},config=lean_ar,repeat={r}].timings_ms.ar_decode_per_token",
                                      "{:.2f} ms"), 5.0 if run == "t2i" else 6.0),
             cell_with_verdict(Value(f"rows[run={run},config=lean_ar,repeat={r}].timings_ms.condition_encode",
                                      "{:.1f} ms"), 200.0) if run == "ti2i" else "-",
             cell_with_verdict(Value(f"rows[run={run},config=lean_ar,repeat={r}].timings_ms.denoise_full_step",
                                      "{:.1f} ms"), 280.0 if run == "t2i" else 350.0),
             Value(f"rows[run={run},config=lean_ar,repeat={r}].timings_ms.vae_decode", "{:.1f} ms"),
             Value(f"rows[run={run},config=lean_ar,repeat={r}].timings_ms.total", "{:.1f} ms")], file=MEMORY_FUSIONS_REVERTED)
        for run in ("t2i", "ti2i") for r in (0, 1, 2)
    ] + [
        Row(["TI2I condition encode, every run of the channels-last encoder (call 1: 2 requests, call 2: 3)", "", "",
             cell_with_verdict(_cond_runs(), 200.0), "", "", ""]),
    ], note="As `kv-policy`, call 2 (three requests of each kind in a row; the first records the decode graph). "
            "The condition encode ran the same code in call 1 (whose decode kernels were the reverted fusions, "
            "which the encode does not run): its last row takes all five runs, the median against the target."),
]
