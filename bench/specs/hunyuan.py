"""HunyuanImage-3.0's tables: one H200 (whole requests, phases, kernels), two H200s, CPU."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Section, Table, Value, Verdict
from bench.specs.runs import (ATTENTION, COMPILE_DEPTH, DECODE, DISTIL, GROUPED_GEMM, HYBRID2_16, MEMORY, MOE_DECODE,
                              PROLOGUE, REGIONS_COLD, REGIONS_WARM, SERVE, SERVE_LOAD, SPLIT_KV, STEP_CACHE,
                              STEP_CACHE_DEVIATION, T2I, T2I_CFG_BATCH, TI2I, TI2I_CFG_BATCH, TP2_16, TP2_32,
                              VAE_FLOPS, VAE_SUITE)

PEAK_TARGET_GB = 92.0   # T2I and TI2I on one H200: what a 96 GB card holds


def requests(files, key, fmt="{:.1f}", unit=" ms", scale=1.0) -> Runs:
    """`key` of every request of the CLI's reports: `timings_ms.<key>` of each of `requests`."""
    return Runs([(f, f"requests[{i}].{key}") for f in files for i in range(_REQUESTS[f])], fmt, unit, scale,
                "requests")


_REQUESTS = {T2I: 1, T2I_CFG_BATCH: 1, TI2I: 2, TI2I_CFG_BATCH: 2}


def summary(file, run, key, fmt="{:.0f}", unit=" ms") -> Runs:
    """bench_step_cache's repeats of one run: `summary.<run>.<key>.runs`."""
    return Runs([(file, f"summary.{run}.{key}.runs")], fmt, unit)


def memory(run, key, fmt="{:.1f}", unit=" ms", scale=1.0) -> Runs:
    return Runs([(MEMORY, f"rows[run={run},config=lean_ar,repeat={r}].{key}") for r in range(3)], fmt, unit, scale,
                "requests")


def target(cell, value: float, label: str, op: str = "<=") -> Verdict:
    return Verdict(cell, value, op, label)


def _peak(file):
    return Value("peak_memory_bytes_per_rank[0]", "{:.1f} GB", file, scale=1e-9)


_VAE_BF16_FLOOR = 'runs[0].floor_ms_of_needed["bf16 (measured GEMM rate, bench/floors.py)"]'
_VAE_TF32_FLOOR = 'runs[0].floor_ms_of_needed["tf32 (datasheet, dense)"]'
_ATTENTION_SHAPES = (("hy-t2i", "T2I denoise: 32 / 8 heads (GQA), 4098 x 5606"),
                     ("hy-ti2i", "edit denoise: 32 / 8 heads, 4098 x 9702"))


def _attention(shape, run, key="ms"):
    return Value(f'shapes["{shape}"].runs["{run}"].{key}', file=ATTENTION)


def taylor_rows(kind: str, label: str, target_ms: int) -> list[Row]:
    """A request with the official Taylor cache (its full steps of 50, its time against the
    target) and the same request with no cache: bench_step_cache's `<kind>_taylor`, `<kind>_full`."""
    taylor, full = f"summary.{kind}_taylor", f"summary.{kind}_full"
    return [Row([label, Join([Value(f"{taylor}.full_steps"), Value(f"{taylor}.steps")], " of "),
                 summary(STEP_CACHE, f"{kind}_taylor", "total_ms"), Value(f"{taylor}.peak_memory_gb", "{:.1f} GB"),
                 target(summary(STEP_CACHE, f"{kind}_taylor", "total_ms"), target_ms, f"<= {target_ms} ms")],
                file=STEP_CACHE),
            Row(["... no cache", "50 of 50", summary(STEP_CACHE, f"{kind}_full", "total_ms"),
                 Value(f"{full}.peak_memory_gb", "{:.1f} GB"), ""], file=STEP_CACHE)]


REQUEST = Table("hunyuan-h200-requests", "Whole requests (AR, denoise, VAE)", [
    "request (1024x1024, 256 AR tokens)", "steps in full", "end to end", "peak", "target"], [
    Row(["T2I: FP8 experts, dense linears and attention; serial CFG", "10 of 10",
         requests([T2I], "timings_ms.total", "{:.0f}"), _peak(T2I), ""]),
    Row(["... both CFG branches as one batch (`--cfg-mode batch`)", "10 of 10",
         requests([T2I_CFG_BATCH], "timings_ms.total", "{:.0f}"), _peak(T2I_CFG_BATCH), ""]),
    *taylor_rows("t2i", "T2I: FP8 experts; 50 steps, the Taylor cache (official defaults)", 7000),
    Row(["T2I: FP8 experts; Instruct-Distil, 8 steps", "8 of 8", summary(DISTIL, "distil", "total_ms"),
         Value("summary.distil.peak_memory_gb", "{:.1f} GB"),
         target(summary(DISTIL, "distil", "total_ms"), 4500, "<= 4500 ms")], file=DISTIL),
    Row(["... with the Taylor cache (interval 3, first-enhance)",
         Join([Value("summary.distil_taylor.full_steps"), Value("summary.distil_taylor.steps")], " of "),
         summary(DISTIL, "distil_taylor", "total_ms"), Value("summary.distil_taylor.peak_memory_gb", "{:.1f} GB"), ""],
        file=DISTIL),
    Row(["edit (TI2I): FP8 experts, dense linears and attention; `--kv-caches keep-ar`, bf16 VAE, 4 chunks",
         "10 of 10", requests([TI2I], "timings_ms.total", "{:.0f}"), _peak(TI2I), ""]),
    Row(["... `--cfg-mode batch`", "10 of 10", requests([TI2I_CFG_BATCH], "timings_ms.total", "{:.0f}"),
         _peak(TI2I_CFG_BATCH), ""]),
    *taylor_rows("ti2i", "edit: FP8 experts; 50 steps, the Taylor cache", 9000),
], note="Random weights at the released shapes (32 layers), 1251 prompt tokens (the edit: a random 1024x1024 "
        "reference), 256 forced AR tokens, one region per layer compiled, the decode step a CUDA graph; a run is "
        "one request, after the process's warm-up. The 10-step requests keep the VAE in the checkpoint's float32 "
        "(T2I) or load it in bf16 (the edit); the step-cache runs measure the FP8 experts with the dense linears "
        "and attention in bf16. A peak is `torch.cuda.max_memory_allocated` of the process (the step-cache runs "
        "load the editing encoders too).")

PHASES = Table("hunyuan-h200-phases", "Phases against their floors and targets", [
    "figure", "dtgen", "floor", "target"], [
    Row(["AR decode a token, `decode step` (FP8 experts, dense FP8, CUDA graph)",
         Runs([(DECODE, "impls.triton.step_ms.runs")], "{:.3f}", " ms", what="repeats"),
         Value("impls.triton.floor_ms", "{:.2f} ms (bytes)"),
         target(Runs([(DECODE, "impls.triton.step_ms.runs")]), 5.0, "<= 5.0 ms")], file=DECODE),
    Row(["AR decode a token in the T2I request",
         requests([T2I, T2I_CFG_BATCH], "timings_ms.ar_decode_per_token", "{:.2f}"),
         "as above", target(requests([T2I, T2I_CFG_BATCH], "timings_ms.ar_decode_per_token"), 5.0, "<= 5.0 ms")]),
    Row(["AR decode a token in the edit",
         requests([TI2I, TI2I_CFG_BATCH], "timings_ms.ar_decode_per_token", "{:.2f}"),
         "", target(requests([TI2I, TI2I_CFG_BATCH], "timings_ms.ar_decode_per_token"), 6.0, "<= 6.0 ms")]),
    Row(["DiT full step, T2I, serial CFG", requests([T2I], "timings_ms.denoise_full_step"), "",
         target(requests([T2I], "timings_ms.denoise_full_step"), 280.0, "<= 280 ms")]),
    Row(["... `--cfg-mode batch`", requests([T2I_CFG_BATCH], "timings_ms.denoise_full_step"), "",
         target(requests([T2I_CFG_BATCH], "timings_ms.denoise_full_step"), 280.0, "<= 280 ms")]),
    Row(["DiT full step, edit, serial CFG", requests([TI2I], "timings_ms.denoise_full_step"), "",
         target(requests([TI2I], "timings_ms.denoise_full_step"), 350.0, "<= 350 ms")]),
    Row(["... `--cfg-mode batch`", requests([TI2I_CFG_BATCH], "timings_ms.denoise_full_step"), "",
         target(requests([TI2I_CFG_BATCH], "timings_ms.denoise_full_step"), 350.0, "<= 350 ms")]),
    Row(["the edit's condition encode (the reference through the vision tower and the VAE encoder)",
         requests([TI2I, TI2I_CFG_BATCH], "timings_ms.condition_encode"), "",
         target(requests([TI2I, TI2I_CFG_BATCH], "timings_ms.condition_encode"), 200.0, "<= 200 ms")]),
    Row(["VAE decode in the T2I request (float32)", requests([T2I], "timings_ms.vae_decode"),
         Value(_VAE_TF32_FLOOR, "{:.0f} ms (FLOPs at TF32's datasheet rate)", file=VAE_FLOPS),
         target(requests([T2I], "timings_ms.vae_decode"), 150.0, "<= 150 ms")]),
    Row(["VAE decode alone, bf16, channels-last, 4 chunks (`--vae-dtype bfloat16 --vae-chunks 4`)",
         Runs([(VAE_SUITE, "results.bf16_cl_chunks4_eager.ms")], "{:.1f}", " ms"),
         Value(_VAE_BF16_FLOOR, "{:.0f} ms (FLOPs)", file=VAE_FLOPS), ""]),
    Row(["peak memory, T2I, `--dense-dtype fp8 --kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4`",
         memory("t2i", "peak_bytes", "{:.2f}", " GB", 1e-9), "",
         target(memory("t2i", "peak_bytes", scale=1e-9), PEAK_TARGET_GB, "<= 92 GB")]),
    Row(["peak memory, edit, the same flags", memory("ti2i", "peak_bytes", "{:.2f}", " GB", 1e-9), "",
         target(memory("ti2i", "peak_bytes", scale=1e-9), PEAK_TARGET_GB, "<= 92 GB")]),
    Row(["the server over the CLI, a T2I request each with its PNG (FP8 experts, 10 steps)",
         Join([Runs([(SERVE, "overhead.against_cli_with_its_image.difference_ms")], "{:.1f}", " ms", what="requests"),
               Value("overhead.against_cli_with_its_image.overhead", "{:.2%} of the request")], "; "), "",
         target(Value("overhead.against_cli_with_its_image.overhead"), 0.02, "<= 2%")], file=SERVE),
    Row(["compile, an empty cache (T2I, 4 graphs: every region, both phases)",
         Runs([(T2I, "compile.compile_s")], "{:.1f}", " s"), "", ""]),
    Row(["process warm-up before the first request (compile included)",
         Runs([(T2I, "warmup_ms")], "{:.1f}", " s", 1e-3), "", ""]),
], note="The requests of the table above; `decode step` repeats its timed loop (each repeat: the median of its "
        "steps). The AR floor is the bytes a step reads (dense and routed experts' weights, FP8) at 4.3 TB/s. "
        "The VAE floors are the FLOPs its convolutions need at a rate (`vae flops`): float32 runs "
        "no faster than TF32's datasheet rate, bf16 at the measured GEMM rate. The memory rows are `memory "
        "levers` runs of 4 denoise steps. The server's overhead: the median of the per-request differences "
        "between what the HTTP client waited and the CLI's total with its PNG write; the verdict reads the "
        "median share.")

GROUPED_GATE_UP = "fused.gate_up[0].tflops"   # the run's default tiles: the first entry (timed first)
KERNELS = Table("hunyuan-h200-kernels", "Kernels against torch's ops (HunyuanImage-3 shapes)", [
    "kernel", "dtgen", "torch (same GPU, same inputs)", "floor", "target"], [
    *[Row([f"FP8 attention (INT8 QK, FP8 PV), {label}", Join([
        Value(f'shapes["{shape}"].runs["fp8-kernel"].ms', "{:.3f} ms (1 run)"),
        Value(f'shapes["{shape}"].runs["fp8-kernel"].rel_l2_vs_fp32', "{:.2%} from fp32")], ", "),
        Value(f'shapes["{shape}"].runs["sdpa-cudnn_attention"].ms', "SDPA bf16, cuDNN: {:.3f} ms"), "",
        target(Calc(lambda ours, theirs: ours / theirs, [_attention(shape, "fp8-kernel"),
                                                          _attention(shape, "sdpa-cudnn_attention")]), 1.0,
               "faster than cuDNN")], file=ATTENTION) for shape, label in _ATTENTION_SHAPES],
    Row(["decode attention, balanced split-KV (8 requests: one 16k, seven 1k)",
         Value("kernel.balanced_us.median", "{:.2f} us (median of the replays)"),
         Value("kernel.sdpa_masked_us.median", "masked SDPA: {:.0f} us"),
         Value("kernel.floor_us", "{:.1f} us (K/V bytes)"),
         target(Value("kernel.speedup_vs_static_heuristic"), 2.0, ">= 2x over a static split", ">=")], file=SPLIT_KV),
    *[Row([f"fused attention prologue (split, RoPE, QK RMSNorm, KV write), {name}",
           Value(f"prologue.{name}.fused_us.median", "{:.2f} us"),
           Value(f"prologue.{name}.separate_compiled_us.median", "the same ops compiled: {:.2f} us"), "",
           target(Value(f"prologue.{name}.speedup_vs_compiled"), 1.5, ">= 1.5x", ">=")], file=PROLOGUE)
      for name in ("decode", "prefill")],
    Row(["MoE grouped GEMM gate/up, bf16, T=2674, 64 experts, top-8",
         Runs([(f, GROUPED_GATE_UP) for f in GROUPED_GEMM], "{:.0f}", " TFLOP/s"),
         Value("expert_major_gate_up.tflops", "torch._grouped_mm: {:.0f} TFLOP/s", file=GROUPED_GEMM[0]),
         "694 TFLOP/s", target(Runs([(f, GROUPED_GATE_UP) for f in GROUPED_GEMM]), 620.0, ">= 620 TFLOP/s", ">=")]),
    Row(["... FP8 experts (per-channel scales)",
         Runs([(f, "fused_fp8.channels.gate_up[0].tflops") for f in GROUPED_GEMM], "{:.0f}", " TFLOP/s"), "", "",
         target(Runs([(f, "fused_fp8.channels.gate_up[0].tflops") for f in GROUPED_GEMM]), 1100.0,
                ">= 1100 TFLOP/s", ">=")]),
    Row(["MoE decode, FP8 experts, one token (one micro, 8 routings, CUDA graph)",
         Runs([(f, "decode[variant=decode_triton_fp8_channels,tokens=1].us") for f in MOE_DECODE], "{:.1f}", " us"),
         "", "", target(Runs([(f, "decode[variant=decode_triton_fp8_channels,tokens=1].us") for f in MOE_DECODE]),
                        30.0, "<= 30 us")]),
], note="Each op alone (`kernels fp8-attention`, `split-kv`, `prologue`, `grouped-gemm`, `moe`), each figure the "
        "median of its timed calls after warm-ups; a run is a process. The FP8 attention kernel is timed on "
        "operands quantized beforehand (default tiles: 64 query rows, 128 keys a step), its error against SDPA's "
        "math in float32. torch._grouped_mm is timed on the same routed rows, expert-major. The MoE GEMMs' floor: "
        "the dense bf16 GEMM rate.")

X2 = Table("hunyuan-h200x2", "T2I on plan `tp2` (bf16 experts)", ["figure", "dtgen", "target"], [
    Row(["T2I request end to end, 32 layers, 10 steps", Runs([(TP2_32, "timings_ms.total")], "{:.0f}", " ms"), ""]),
    Row(["AR decode a token", Runs([(TP2_32, "timings_ms.ar_decode_per_token")], "{:.2f}", " ms"),
         target(Value("timings_ms.ar_decode_per_token", file=TP2_32), 6.0, "<= 6 ms")]),
    Row(["DiT step (the mean of 10)", Runs([(TP2_32, "timings_ms.denoise_step")], "{:.1f}", " ms"),
         target(Value("timings_ms.denoise_step", file=TP2_32), 280.0, "<= 280 ms")]),
    Row(["peak memory a rank", Runs([(TP2_32, "peak_memory_bytes_per_rank[0]")], "{:.1f}", " GB", 1e-9), ""]),
    Row(["compile, an empty cache (compiled regions)", Runs([(REGIONS_COLD, "compile.compile_s")], "{:.1f}", " s"),
         target(Value("compile.compile_s", file=REGIONS_COLD), 90.0, "<= 90 s")]),
    Row(["a second process (warm cache): start to the first denoise step done",
         Runs([(REGIONS_WARM, "first_denoise_step_done_s")], "{:.1f}", " s"),
         target(Value("first_denoise_step_done_s", file=REGIONS_WARM), 20.0, "<= 20 s")]),
    Row(["16 layers: DiT step, `hybrid2` (TP2 x SP2 denoise) / `tp2`",
         Join([Value("timings_ms.denoise_step", "{:.1f}", HYBRID2_16),
               Value("timings_ms.denoise_step", "{:.1f} ms", TP2_16)], " / "),
         target(Calc(lambda h, t: h - t, [Value("timings_ms.denoise_step", file=HYBRID2_16),
                                                       Value("timings_ms.denoise_step", file=TP2_16)]), 0.0,
                             "`hybrid2` ahead")]),
], note="torchrun, one process a GPU, NCCL; random weights at the released shapes, bf16 experts (no FP8), 1251 "
        "prompt tokens, 256 AR tokens, 1024x1024, 10 steps, compiled, one request each.")

CPU = Table("hunyuan-cpu", "Step caches' accuracy, compile time, the server under load", [
    "figure", "dtgen", "target"], [
    *[Row([Join([Value(f"rows[run={run}].case"), Value(f"rows[run={run}].full_steps"), Value(f"rows[run={run}].steps")],
                [f", {run}: ", " of "], suffix=" steps in full"),
           Join([Value(f"rows[run={run}].final_latents_rel_l2", "final latents {:.3f} rel. L2 from uncached"),
                 Value(f"rows[run={run}].image_uint8_max_abs_diff", "image up to {} of 255")], ", "), ""],
          file=STEP_CACHE_DEVIATION) for run in ("taylor_default", "taylor_enhance", "taylor_split", "distil_taylor")],
    *[Row([f"cold compile, {label}: 2 / 16 layers", Join([Value(f"rows[mode={mode},layers=2].compile_s", "{:.1f}"),
                                                         Value(f"rows[mode={mode},layers=16].compile_s", "{:.1f} s")],
                                                        " / "),
           target(Calc(lambda a, b: a / b, [Value(f"rows[mode={mode},layers=16].compile_s"),
                                            Value(f"rows[mode={mode},layers=2].compile_s")]), 1.15,
                  "16 layers within 1.15x of 2") if mode == "regions" else ""], file=COMPILE_DEPTH)
      for mode, label in (("regions", "one region per layer"), ("whole", "whole steps"))],
    *[Row([f"the server under load (tiny model), concurrency {c}: images/min, p50 / p99",
           Join([Value(f"load[concurrency={c}].images_per_min", "{:.1f}"),
                 Value(f"load[concurrency={c}].latency_ms.p50", "{:.0f}"),
                 Value(f"load[concurrency={c}].latency_ms.p99", "{:.0f} ms")], [", ", " / "]),
           Verdict(Value(f"load[concurrency={c}].every_request_answered", lambda v: v), 1.0, ">=",
                   "every request answered")], file=SERVE_LOAD) for c in (1, 4, 16)],
], note="The step-cache cases are the golden tiny models in float32, each cache against the same case run "
        "uncached. Compile: the reduced-width model on this CPU. The load: 40 requests a level, random sizes, "
        "10% cancelled, 5% malformed, 5% clients that leave, on a shared 2-core machine (its throughput, not "
        "the server's alone).")

SECTIONS = [Section("HunyuanImage-3.0, one H200", [REQUEST, PHASES, KERNELS]),
            Section("HunyuanImage-3.0, 2 x H200", [X2]),
            Section("HunyuanImage-3.0, CPU", [CPU])]
