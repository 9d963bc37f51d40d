"""The e2e suite's tables: the CLI's whole request, on one GPU and on two, and where the targets stand."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value, Verdict
from bench.specs.runs import (ATTENTION_14B_LONG_KEYS, DECODE_FUSIONS_REVERTED, DECODE_PDL, DECODE_SIDE_STREAM_FIRST,
                              DECODE_SIDE_STREAM_SUNK, H1129, H1129_LAYERS, H1202_LEVERS, H1202_T2I_DENSE_FP8,
                              MEMORY_FUSIONS, MEMORY_FUSIONS_REVERTED, REGIONS_TI2I, SECOND_REQUEST, T2I_ATTENTION_FP8,
                              T2I_CFG_BATCH, T2I_LM_HEAD_FP8, TI2I_ATTENTION_FP8, TI2I_CFG_BATCH, TI2I_KV_POLICY,
                              TI2I_LEAN, VAE_FLOPS, WAN_PEERS_FP8_KERNEL, WAN_PEERS_LONG_KEYS, X2_1130, X2_PLANS,
                              X2_REGIONS_1201)
from bench.specs.common import cell_with_verdict, fp8_run, goal, lever, ms, PEAK_TARGET, peer, rank0_gb


def kernel(file, phase, prefix, per: float, fmt="{:.2f} ms"):
    """A profiled run's kernel (`profile.top_kernels.<phase>`: [name, total ms, calls]) per unit."""
    return Calc(lambda total: total / per, [Value(f"profile.top_kernels.{phase}[^{prefix}][1]", file=file)], fmt)


def per_call_us(file, phase, prefix, fmt="{:.1f} us"):
    total = Value(f"profile.top_kernels.{phase}[^{prefix}][1]", file=file)
    calls = Value(f"profile.top_kernels.{phase}[^{prefix}][2]", file=file)
    return Calc(lambda t, n: t / n * 1e3, [total, calls], fmt)


def multigpu(folder, plan, dtype, key):
    return (f"{folder}/multigpu-{plan}-{dtype}.json", f"plans.{plan}.{key}")


DEVIATIONS = ("eager_vs_single_logits", "eager_vs_single_velocity", "compiled_vs_eager_logits",
              "compiled_vs_eager_velocity", "compiled_vs_single_velocity")


def deviations(dtype, fn):
    """fn (min or max) over every deviation of every 2-rank plan, both 2026-11-30 runs and
    the regions job of 2026-12-01."""
    cells = [Value(path, file=f) for folder in (X2_1130, X2_PLANS) for plan in ("tp2", "hybrid2", "hybrid2-cfg")
             for f, path in (multigpu(folder, plan, dtype, k) for k in DEVIATIONS)]
    cells += [Value(f"plans.tp2.{k}", file=f"{X2_REGIONS_1201}/tp2+regions-{dtype}.json") for k in DEVIATIONS]
    return Calc(lambda *v: fn(v), cells, "{:.2g}")
TP2_32 = f"{X2_PLANS}/tp2_32.json"
TABLE = f"{X2_PLANS}/table.json"

TE, TC = f"{REGIONS_TI2I}/ti2i_1gpu.json", f"{REGIONS_TI2I}/ti2i_1gpu_compiled.json"


def _peak_cell(run, config):
    measured = Value(lever(run, config, "peak_bytes"), "{:.1f} GB measured", scale=1e-9)
    key = "t2i_process_peak_bytes" if run == "t2i" else "projected_peak_bytes"
    projected = Value(lever(run, config, key), "{:.1f} GB", scale=1e-9)
    return Join([measured, projected, Verdict(projected, PEAK_TARGET)],
                [", " + ("a T2I process " if run == "t2i" else "projected "), ": "], suffix=" (projected)")


def _levers(run, config, key, target, fmt="{:.1f} ms"):
    return cell_with_verdict(Value(lever(run, config, key), fmt, H1202_LEVERS), target)


HEADLINE = [  # label, target text, run, timings key, target, format, the dense CLI's key
    ("HunyuanImage-3 T2I, 32 layers: AR decode", "<= 5.0 ms/token", "t2i", "ar_decode_per_token", 5.0, "{:.2f} ms"),
    ("DiT step, serial CFG (T2I, a full step)", "<= 280 ms", "t2i", "denoise_full_step", 280.0, "{:.1f} ms"),
    ("VAE decode 1024x1024 (in the T2I request)", "<= 150 ms", "t2i", "vae_decode", 150.0, "{:.1f} ms"),
    ("TI2I: condition encode", "<= 200 ms", "ti2i", "condition_encode", 200.0, "{:.1f} ms"),
    ("TI2I: AR decode", "<= 6.0 ms/token", "ti2i", "ar_decode_per_token", 6.0, "{:.2f} ms"),
    ("TI2I: DiT step (a full step)", "<= 350 ms", "ti2i", "denoise_full_step", 350.0, "{:.1f} ms"),
]


_COND_TOP = "profile.top_kernels.condition"


def _short_kernel(name: str) -> str:
    return "`" + (name if len(name) <= 70 else name[:67] + "...") + "`"


def _two_requests(key, file, fmt="{:.1f}"):
    """A CLI run's two requests' `timings_ms[key]`, "a / b ms"."""
    return Join([Value(f"requests[{i}].timings_ms.{key}", fmt, file=file) for i in (0, 1)], " / ", suffix=" ms")


# every one-H200 target with every run on main's code (the table `hy-targets-h200`)
def _target_runs(refs, fmt="{:.2f}", unit=" ms"):
    return Runs(list(refs), fmt, unit)


TARGET_DECODE_BENCH = [(DECODE_FUSIONS_REVERTED, "impls.triton.step_ms.median"), (DECODE_PDL[1], "impls.triton.step_ms.median"),
                    (DECODE_SIDE_STREAM_SUNK, 'impls["triton+inline"].step_ms.median'),
                    (DECODE_SIDE_STREAM_FIRST, 'impls["triton+inline"].step_ms.median')]
TARGET_DECODE_CLI = [(T2I_ATTENTION_FP8, "timings_ms.ar_decode_per_token"), (T2I_CFG_BATCH, "timings_ms.ar_decode_per_token")]
TARGET_T2I_DIT = [(T2I_LM_HEAD_FP8, "timings_ms.denoise_full_step"), (T2I_ATTENTION_FP8, "timings_ms.denoise_full_step")]
TARGET_TI2I_DIT = [(f, f"requests[{i}].timings_ms.denoise_full_step") for f in (TI2I_LEAN, TI2I_ATTENTION_FP8) for i in (0, 1)]
TARGET_TI2I_DIT_BATCH = [(TI2I_CFG_BATCH, f"requests[{i}].timings_ms.denoise_full_step") for i in (0, 1)]
TARGET_PEAKS = {run: [(f, f"rows[run={run},config=lean_ar,repeat={r}].peak_bytes") for f, repeats in
                   ((MEMORY_FUSIONS, (0, 1)), (MEMORY_FUSIONS_REVERTED, (0, 1, 2))) for r in repeats] for run in ("t2i", "ti2i")}
TARGET_COND = ([(MEMORY_FUSIONS, f"rows[run=ti2i,config=lean_ar,repeat={r}].timings_ms.condition_encode") for r in (0, 1)]
            + [(MEMORY_FUSIONS_REVERTED, f"rows[run=ti2i,config=lean_ar,repeat={r}].timings_ms.condition_encode") for r in (0, 1, 2)]
            + [(f, f"requests[{i}].timings_ms.condition_encode") for f in (TI2I_ATTENTION_FP8, TI2I_CFG_BATCH) for i in (0, 1)])
TARGET_TI2I_AR = ([(MEMORY_FUSIONS_REVERTED, f"rows[run=ti2i,config=lean_ar,repeat={r}].timings_ms.ar_decode_per_token")
                for r in (0, 1, 2)]
               + [(f, f"requests[{i}].timings_ms.ar_decode_per_token") for f in (TI2I_LEAN, TI2I_ATTENTION_FP8, TI2I_CFG_BATCH)
                  for i in (0, 1)])

def _target_peaks(run):
    return Runs([(f, p) for f, p in TARGET_PEAKS[run]], "{:.2f}", " GB", scale=1e-9)


TABLES = [
    Table("second-request", ["`single`, 16 layers, compiled regions, 10 steps", "prompt tokens",
                                 "cached steps, mean (min-max)", "first step", "SM clock, power", "new allocations"], [
        Row([f"request {i}", Value(f"requests[{i}].prompt_tokens"),
             Join([Value(f"requests[{i}].cached_step_ms.mean", "{:.1f}"),
                   Value(f"requests[{i}].cached_step_ms.min", "{:.1f}"),
                   Value(f"requests[{i}].cached_step_ms.max", "{:.1f}")], [" (", "-"], suffix=") ms"),
             Value(f"requests[{i}].timings_ms.denoise_first_step", "{:.1f} ms"),
             Join([Value(f"requests[{i}].gpu_during_cached_steps.sm_mhz_mean", "{:.0f} MHz"),
                   Value(f"requests[{i}].gpu_during_cached_steps.power_w_mean", "{:.0f} W")], ", "),
             Value(f"requests[{i}].allocator.num_device_alloc")], file=SECOND_REQUEST)
        for i in range(6)
    ], note="Six requests of one process, two prompt lengths in one bucket, alternating (bench/second_request.py): "
            "the later requests run as fast as the first. The GPU reported the software power cap as its clock "
            "limit throughout (nvidia-smi)."),
    Table("x2-targets", ["run", "figure", "measured", "target"], [
        Row(["`tp2`, 32 layers", "AR decode", Value("@[2].ar_decode_ms_per_token", "**{:.2f} ms/token** (256 tokens)"),
             goal("<= 6 ms/token", Value("@[2].ar_decode_ms_per_token"), 6.0)], file=TABLE),
        Row(["`tp2`, 32 layers", "DiT step (mean of 10; the first, whole-sequence step)",
             Join([Value("@[2].dit_ms_per_step", "**{:.1f} ms**"), Value("@[2].dit_first_step_ms", "{:.1f}")],
                  " (first: ", suffix=")"), goal("<= 280 ms", Value("@[2].dit_ms_per_step"), 280.0)], file=TABLE),
        Row(["`tp2`, 32 layers", "NCCL share of the wall time",
             Join([Value("@[2].nccl_share_ar_decode"), Value("@[2].nccl_share_denoise")], "; denoise ",
                  prefix="AR decode "), ""], file=TABLE),
        Row(["`tp2`, 32 layers", "phase switch",
             Join([Value("@[2].phase_switch_ms", "{:.2f} ms"), Value("@[2].phase_switch_agree_ms", "{:.2f} ms"),
                   Value("@[2].phase_switch_allocated_bytes"), Value("@[2].weights_copied")],
                  [" (the gloo phase agreement ", "), ", " bytes allocated, "], suffix=" weights copied"), ""],
            file=TABLE),
        Row(["`tp2`, 32 layers", "memory per rank",
             Join([Value("@[2].weights_gb_per_rank[0]", "{:.1f} GB weights"),
                   Value("@[2].peak_gb_per_rank[0]", "{:.1f} GB peak")], ", "), ""], file=TABLE),
        Row(["`tp2`, 32 layers", "cold compile",
             Join([Value("@[2].cold_compile_s", "{:.0f} s"), Value("@[2].graphs", "{} graphs"),
                   Value("@[2].recompiles_after_warmup", "{} recompiles after warm-up")], ", "), ""], file=TABLE),
        Row(["`hybrid2` vs `tp2`, 16 layers", "DiT ms/step (first step)",
             Join([Value("@[0].dit_ms_per_step", "hybrid2 **{:.1f}**"), Value("@[0].dit_first_step_ms", " ({:.1f})"),
                   Value("@[1].dit_ms_per_step", ", tp2 **{:.1f}**"), Value("@[1].dit_first_step_ms", " ({:.1f})")], ""),
             goal("hybrid2 ahead on DiT", Calc(lambda h, t: h - t, [Value("@[0].dit_ms_per_step"),
                                                                   Value("@[1].dit_ms_per_step")]), 0.0)], file=TABLE),
        Row(["`hybrid2` vs `tp2`, 16 layers", "AR ms/token",
             Join([Value("@[0].ar_decode_ms_per_token", "hybrid2 {:.2f}"),
                   Value("@[1].ar_decode_ms_per_token", "tp2 {:.2f}")], ", "),
             goal("hybrid2 not behind on AR", Calc(lambda h, t: h - t, [Value("@[0].ar_decode_ms_per_token"),
                                                                        Value("@[1].ar_decode_ms_per_token")]), 0.0)],
            file=TABLE),
        Row(["`hybrid2` vs `tp2`, 16 layers", "weights / peak per rank, cold compile",
             Join([Value("@[0].weights_gb_per_rank[0]", "hybrid2 {:.1f}"), Value("@[0].peak_gb_per_rank[0]", " / {:.1f} GB"),
                   Value("@[0].cold_compile_s", ", {:.0f} s"), Value("@[1].weights_gb_per_rank[0]", "; tp2 {:.1f}"),
                   Value("@[1].peak_gb_per_rank[0]", " / {:.1f} GB"), Value("@[1].cold_compile_s", ", {:.0f} s")], ""),
             ""], file=TABLE),
    ], note="Targets: issue 9's. For reference, the seed's figures on 4 x H200 (its report, not measured here): "
            "46.3 ms/token and 285.1 ms/step."),
    Table("x2-tp2-profile", ["`tp2`, 32 layers, rank 0, per unit", "wall", "compute", "NCCL alone",
                            "waiting for the other rank", "idle", "compute + NCCL"], [
        Row(["AR decode, per token", ms("profile.regions.ar[region=ar_decode].per_unit_ms.wall_ms", fmt="{:.2f} ms"),
             ms("profile.regions.ar[region=ar_decode].per_unit_ms.compute_ms", fmt="{:.2f} ms"),
             ms("profile.regions.ar[region=ar_decode].per_unit_ms.communication_ms", fmt="{:.2f} ms"),
             ms("profile.regions.ar[region=ar_decode].per_unit_ms.waiting_ms", fmt="{:.2f} ms"),
             ms("profile.regions.ar[region=ar_decode].per_unit_ms.idle_ms", fmt="{:.2f} ms"),
             Calc(lambda a, b: a + b, [Value("profile.regions.ar[region=ar_decode].per_unit_ms.compute_ms"),
                                       Value("profile.regions.ar[region=ar_decode].per_unit_ms.communication_ms")],
                  "{:.2f} ms")], file=TP2_32),
        Row(["denoise, per cached step", ms("profile.regions.denoise[region=denoise_step].per_unit_ms.wall_ms"),
             ms("profile.regions.denoise[region=denoise_step].per_unit_ms.compute_ms"),
             ms("profile.regions.denoise[region=denoise_step].per_unit_ms.communication_ms"),
             ms("profile.regions.denoise[region=denoise_step].per_unit_ms.waiting_ms"),
             ms("profile.regions.denoise[region=denoise_step].per_unit_ms.idle_ms"),
             Calc(lambda a, b: a + b,
                  [Value("profile.regions.denoise[region=denoise_step].per_unit_ms.compute_ms"),
                   Value("profile.regions.denoise[region=denoise_step].per_unit_ms.communication_ms")],
                  "{:.1f} ms")], file=TP2_32),
    ], note="One more run after the timed one, under the profiler (`--profile`, 3 denoise steps)."),
    Table("x2-tp2-kernels", ["`tp2`, 32 layers, rank 0", "per token (AR) or per step (denoise)", "per call"], [
        Row(["AR: decode MoE stage 1 (`_decode_gate_up_kernel`)", kernel(TP2_32, "ar", "_decode_gate_up", 256),
             per_call_us(TP2_32, "ar", "_decode_gate_up")]),
        Row(["AR: decode MoE stage 2 (`_decode_down_kernel`)", kernel(TP2_32, "ar", "_decode_down", 256),
             per_call_us(TP2_32, "ar", "_decode_down")]),
        Row(["AR: dense GEMVs (three cuBLAS `nvjet_..._64x8` kernels: qkv, o, shared MLP)",
             Calc(lambda a, b, c: (a + b + c) / 256, [
                 Value("profile.top_kernels.ar[^nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK][1]", file=TP2_32),
                 Value("profile.top_kernels.ar[^nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT][1]", file=TP2_32),
                 Value("profile.top_kernels.ar[^nvjet_sm90_tst_64x8_64x16_4x1_v_badd][1]", file=TP2_32)], "{:.2f} ms"),
             ""]),
        Row(["AR: the attention mask, built again in every layer (`triton_poi_fused__scaled_dot_product...`)",
             kernel(TP2_32, "ar", "triton_poi_fused__scaled_dot_product", 256),
             per_call_us(TP2_32, "ar", "triton_poi_fused__scaled_dot_product")]),
        Row(["AR: attention (cuDNN)", kernel(TP2_32, "ar", "cudnn_generated", 256),
             per_call_us(TP2_32, "ar", "cudnn_generated")]),
        Row(["AR: router top-k (`gatherTopK` + `bitonicSortKVInPlace`)",
             Calc(lambda a, b: (a + b) / 256, [
                 Value("profile.top_kernels.ar[^void at::native::sbtopk::gatherTopK][1]", file=TP2_32),
                 Value("profile.top_kernels.ar[^void at::native::bitonicSortKVInPlace][1]", file=TP2_32)], "{:.2f} ms"),
             Calc(lambda a, b, n: (a + b) / n * 1e3, [
                 Value("profile.top_kernels.ar[^void at::native::sbtopk::gatherTopK][1]", file=TP2_32),
                 Value("profile.top_kernels.ar[^void at::native::bitonicSortKVInPlace][1]", file=TP2_32),
                 Value("profile.top_kernels.ar[^void at::native::sbtopk::gatherTopK][2]", file=TP2_32)], "{:.1f} us")]),
        Row(["AR: NCCL all-reduce", kernel(TP2_32, "ar", "ncclDevKernel_AllReduce", 256),
             per_call_us(TP2_32, "ar", "ncclDevKernel_AllReduce")]),
        Row(["denoise: the MoE's grouped GEMMs (CUTLASS `_grouped_mm`)", kernel(TP2_32, "denoise", "_ZN7cutlass", 3,
                                                                                 "{:.0f} ms"), ""]),
        Row(["denoise: NCCL all-reduce (2 per layer and branch)", kernel(TP2_32, "denoise", "ncclDevKernel_AllReduce", 3,
                                                                          "{:.1f} ms"), ""]),
        Row(["denoise: attention (cuDNN flash)", kernel(TP2_32, "denoise", "cudnn_generated", 3, "{:.1f} ms"), ""]),
    ], note="Per token: the profiled run's total over its 256 AR tokens; per step: over its 3 denoise steps "
            "(the whole-sequence first step and two cached ones)."),
    Table("x2-switch", ["`tp2`, 32 layers", "phase switch", "longest GC pause in the timed run"], [
        Row(["session 1 (GC not yet frozen)", ms("phase_switch.ms"), "-"], file=f"{X2_1130}/tp2_32.json"),
        Row(["session 2 (heap frozen after warm-up)", ms("phase_switch.ms", fmt="{:.2f} ms"),
             ms("gc_pauses_per_rank[0].max_ms", fmt="{:.2f} ms")], file=TP2_32),
    ]),
    Table("x2-tests", ["`make test-gpu2`, 2 x H200", "largest deviation", "smallest", "bound"], [
        Row(["float32: compiled vs eager vs one process, logits and velocities, `tp2` / `hybrid2` / `hybrid2-cfg` "
             "(and `tp2` with regions)", deviations("float32", max), deviations("float32", min), "1e-4"]),
        Row(["bfloat16, the same plans, relative to the largest value", deviations("bfloat16", max),
             deviations("bfloat16", min), "0.15 (tests/hunyuan_image3/test_multigpu.py)"]),
    ], note="Each job also checks: replays identical, 0 recompiles after warm-up, CUDA-graph decode with 0 cudagraph "
            "skips, compiled sampling drew eager's tokens (float32)."),
    Table("h200-2layers", ["plan `single`, 2 of 32 layers, full width", "eager", "compiled, session 1",
                           "compiled, session 2"], [
        Row(["AR prefill (1251 tokens)", ms("timings_ms.ar_prefill", f"{H1129}/t2i_full_2layers.json", "{:.0f} ms"),
             ms("timings_ms.ar_prefill", f"{H1129}/t2i_full_2layers_compiled.json"),
             ms("timings_ms.ar_prefill", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json")]),
        Row(["AR decode, ms/token (tokens)",
             Join([Value("timings_ms.ar_decode_per_token", "{:.1f}", f"{H1129}/t2i_full_2layers.json"),
                   Value("tokens_generated", "{}", f"{H1129}/t2i_full_2layers.json")], " (", suffix=")"),
             Join([Value("timings_ms.ar_decode_per_token", "{:.1f}", f"{H1129}/t2i_full_2layers_compiled.json"),
                   Value("tokens_generated", "{}", f"{H1129}/t2i_full_2layers_compiled.json")], " (", suffix=")"),
             Join([Value("timings_ms.ar_decode_per_token", "**{:.2f}**", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json"),
                   Value("tokens_generated", "{}", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json")], " (", suffix=")")]),
        Row(["denoise step (2 branches x 5608 tokens)", ms("timings_ms.denoise_step", f"{H1129}/t2i_full_2layers.json",
                                                          "{:.0f} ms"),
             ms("timings_ms.denoise_step", f"{H1129}/t2i_full_2layers_compiled.json"),
             Join([ms("timings_ms.denoise_step", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json"),
                   Text("4 steps: the heavier first step weighs 1/4")], " (", suffix=")")]),
        Row(["VAE decode (fp32, 1024x1024)", ms("timings_ms.vae_decode", f"{H1129}/t2i_full_2layers.json", "{:.0f} ms"),
             ms("timings_ms.vae_decode", f"{H1129}/t2i_full_2layers_compiled.json", "{:.0f} ms"),
             ms("timings_ms.vae_decode", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json", "{:.0f} ms")]),
        Row(["phase switch (bytes allocated, weights copied)"] + [
            Join([ms("phase_switch.ms", f, "{:.2f} ms"), Value("phase_switch.allocated_bytes_delta", "{} B", f),
                  Value("phase_switch.weights_copied", "{} copies", f)], ", ")
            for f in (f"{H1129}/t2i_full_2layers.json", f"{H1129}/t2i_full_2layers_compiled.json",
                      f"{H1129_LAYERS}/t2i_full_2layers_compiled.json")]),
        Row(["compile (graphs, breaks, recompiles after warm-up, seconds)", "-"] + [
            Join([Value("compile.graphs", "{} graphs", f), Value("compile.graph_breaks", "{} breaks", f),
                  Value("compile.recompiles_after_warmup", "{} recompiles", f), Value("compile.compile_s", "{:.0f} s", f)],
                 ", ") for f in (f"{H1129}/t2i_full_2layers_compiled.json", f"{H1129_LAYERS}/t2i_full_2layers_compiled.json")]),
        Row(["resident weights / peak memory"] + [
            Join([rank0_gb("storage_bytes_per_rank", f), rank0_gb("peak_memory_bytes_per_rank", f)], " / ")
            for f in (f"{H1129}/t2i_full_2layers.json", f"{H1129}/t2i_full_2layers_compiled.json",
                      f"{H1129_LAYERS}/t2i_full_2layers_compiled.json")]),
    ]),
    Table("ti2i", ["image editing, plan `single`, full width, 4 layers", "eager", "compiled (`--compile`)"], [
        Row(["condition encode (VAE encoder + posterior sample; vision tower + aligner), once per request",
             ms("timings_ms.condition_encode", TE, "{:.0f} ms"),
             ms("timings_ms.condition_encode", TC, "{:.0f} ms (not compiled)")]),
        Row(["AR prefill (the condition's rows in the prompt)", ms("timings_ms.ar_prefill", TE),
             ms("timings_ms.ar_prefill", TC)]),
        Row(["AR decode", ms("timings_ms.ar_decode_per_token", TE, "{:.2f} ms/token"),
             ms("timings_ms.ar_decode_per_token", TC, "{:.2f} ms/token (CUDA graph)")]),
        Row(["denoise step, mean of 10 (first, whole sequence)",
             Join([ms("timings_ms.denoise_step", TE), Value("timings_ms.denoise_first_step", "{:.0f}", TE)], " (",
                  suffix=")"),
             Join([ms("timings_ms.denoise_step", TC), Value("timings_ms.denoise_first_step", "{:.0f}", TC)], " (",
                  suffix=")")]),
        Row(["VAE decode", ms("timings_ms.vae_decode", TE, "{:.0f} ms"), ms("timings_ms.vae_decode", TC, "{:.0f} ms")]),
        Row(["compile", "", Join([Value("compile.graphs", "{} graphs", TC), Value("compile.graph_breaks", "{} breaks", TC),
                                  Value("compile.recompiles_after_warmup", "{} recompiles", TC),
                                  Value("compile.compile_s", "{:.0f} s", TC)], ", ")]),
        Row(["weights / peak", "", Join([rank0_gb("storage_bytes_per_rank", TC),
                                         rank0_gb("peak_memory_bytes_per_rank", TC)])]),
    ]),
    Table("hy-targets-levers", ["issue 29 target (one H200)", "target", "no lever", "every lever",
                          "every lever and dense FP8 (T2I CLI)"], [
        Row([label, target_text, _levers(run, "baseline", f"timings_ms.{key}", target, fmt),
             _levers(run, "all", f"timings_ms.{key}", target, fmt),
             cell_with_verdict(Value(f"timings_ms.{key}", fmt, H1202_T2I_DENSE_FP8), target) if run == "t2i" else "-"])
        for label, target_text, run, key, target, fmt in HEADLINE[:3]
    ] + [
        Row(["peak memory, T2I", "<= 92 GB", _peak_cell("t2i", "baseline"), _peak_cell("t2i", "all"),
             Join([Value("peak_memory_bytes_per_rank[0]", "{:.1f} GB measured", H1202_T2I_DENSE_FP8, scale=1e-9),
                   Verdict(Value("peak_memory_bytes_per_rank[0]", file=H1202_T2I_DENSE_FP8, scale=1e-9), PEAK_TARGET)],
                  ": ")], file=H1202_LEVERS),
        Row(["peak memory, TI2I", "<= 92 GB", _peak_cell("ti2i", "baseline"), _peak_cell("ti2i", "all"), "-"],
            file=H1202_LEVERS),
    ] + [
        Row([label, target_text, _levers(run, "baseline", f"timings_ms.{key}", target, fmt),
             _levers(run, "all", f"timings_ms.{key}", target, fmt), "-"])
        for label, target_text, run, key, target, fmt in HEADLINE[3:]
    ], note="Single runs (one request each, no repeats): a figure is that request's, not a median. No lever and "
            "every lever: bench_memory's `baseline` and `all` rows (4 denoise steps); the last column: the CLI with "
            "every lever and `--dense-dtype fp8` (10 steps). The peaks' verdicts are on the projected figure (T2I: "
            "a T2I process's, without the editing modules; TI2I: without the bench-only fp32 VAE), the dense-FP8 "
            "CLI's on its measured peak."),
    Table("ti2i-condition", ["the CLI's TI2I edit, one H200: the condition encode's kernels (the profiled "
                                 "request; the VAE in fp32, TF32 convolutions)", "ms", "launches"], [
        Row(["the condition region: wall / compute / idle",
             Join([Value(f"profile.regions.condition[region=condition_encode].{k}", "{:.1f}")
                   for k in ("wall_ms", "compute_ms", "idle_ms")], " / ", suffix=" ms"), ""], file=TI2I_KV_POLICY),
    ] + [
        Row([Value(f"{_COND_TOP}[{i}][0]", _short_kernel), Value(f"{_COND_TOP}[{i}][1]", "{:.1f}"),
             Value(f"{_COND_TOP}[{i}][2]", "{:.0f}")], file=TI2I_KV_POLICY)
        for i in range(10)
    ], note="examples.hunyuan_t2i --image (a random 1024x1024 reference), dense FP8, `--profile-top 40`: the "
            "condition phase's ten costliest kernels. This run kept the checkpoint's fp32 VAE (no --vae-dtype): "
            "cuDNN's TF32 convolutions, its NCHW/NHWC conversions and the GroupNorm passes (`bn_fw_inf`, Welford) "
            "are the VAE encoder's; the vision tower is the `nvjet`/SDPA rows further down the JSON's list."),
    Table("ti2i-lean", ["the CLI's edit with the lean levers (`--dense-dtype fp8 --kv-caches keep-ar --vae-dtype "
                           "bfloat16 --vae-chunks 4`; the VAE channels-last by `--vae-layout auto`), one H200, two "
                           "requests after its warm-up", "condition encode: <= 200", "AR decode / token: <= 6.0",
                           "DiT full step: <= 350", "VAE decode", "request total"], [
        Row([f"request {i + 1}",
             cell_with_verdict(Value(f"requests[{i}].timings_ms.condition_encode", "{:.1f} ms"), 200.0),
             cell_with_verdict(Value(f"requests[{i}].timings_ms.ar_decode_per_token", "{:.2f} ms"), 6.0),
             cell_with_verdict(Value(f"requests[{i}].timings_ms.denoise_full_step", "{:.1f} ms"), 350.0),
             Value(f"requests[{i}].timings_ms.vae_decode", "{:.1f} ms"),
             Value(f"requests[{i}].timings_ms.total", "{:.1f} ms")], file=TI2I_LEAN)
        for i in (0, 1)
    ] + [
        Row(["the process's peak (`torch.cuda.max_memory_allocated`): <= 92 GB",
             cell_with_verdict(Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9), PEAK_TARGET),
             "", "", "", ""], file=TI2I_LEAN),
    ], note="examples.hunyuan_t2i --image (a random 1024x1024 reference), random weights at the released shapes, "
            "FP8 experts, compiled regions, 256 AR tokens, 10 steps, serial CFG; the CLI runs one untimed warm-up "
            "request first (it records the decode graph), so both timed requests decode on it. One run."),
    Table("hy-fp8-attention", ["HunyuanImage-3 CLI, 32 layers, FP8 experts, dense FP8, compiled, one H200",
                               "`--attention-dtype fp8` (call 5)", "without (the same levers, an earlier call)",
                               "target (issue 29)"], [
        Row(["edit, request 1: DiT full step",
             Value("requests[0].timings_ms.denoise_full_step", "{:.1f} ms", file=TI2I_ATTENTION_FP8),
             Value("requests[0].timings_ms.denoise_full_step", "{:.1f} ms (`ti2i-lean`)", file=TI2I_LEAN),
             goal("<= 350", Value("requests[0].timings_ms.denoise_full_step", file=TI2I_ATTENTION_FP8), 350.0)]),
        Row(["edit, request 2: DiT full step",
             Value("requests[1].timings_ms.denoise_full_step", "{:.1f} ms", file=TI2I_ATTENTION_FP8),
             Value("requests[1].timings_ms.denoise_full_step", "{:.1f} ms (`ti2i-lean`)", file=TI2I_LEAN),
             goal("<= 350", Value("requests[1].timings_ms.denoise_full_step", file=TI2I_ATTENTION_FP8), 350.0)]),
        Row(["edit, requests 1 / 2: condition encode",
             _two_requests("condition_encode", TI2I_ATTENTION_FP8, "{:.1f}"),
             _two_requests("condition_encode", TI2I_LEAN, "{:.1f}"), "<= 200"]),
        Row(["edit, requests 1 / 2: AR decode a token",
             _two_requests("ar_decode_per_token", TI2I_ATTENTION_FP8, "{:.2f}"),
             _two_requests("ar_decode_per_token", TI2I_LEAN, "{:.2f}"), "<= 6.0"]),
        Row(["edit: the process's peak", Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9,
                                                file=TI2I_ATTENTION_FP8),
             Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9, file=TI2I_LEAN), "<= 92"]),
        Row(["T2I (the VAE in the checkpoint's dtype, KV caches kept): DiT full step",
             Value("timings_ms.denoise_full_step", "{:.1f} ms", file=T2I_ATTENTION_FP8),
             Value("timings_ms.denoise_full_step", "{:.1f} ms (`dit-profile`)", file=T2I_LM_HEAD_FP8),
             goal("<= 280", Value("timings_ms.denoise_full_step", file=T2I_ATTENTION_FP8), 280.0)]),
        Row(["T2I: AR decode a token", Value("timings_ms.ar_decode_per_token", "{:.2f} ms", file=T2I_ATTENTION_FP8),
             Value("timings_ms.ar_decode_per_token", "{:.2f} ms", file=T2I_LM_HEAD_FP8),
             goal("<= 5.0", Value("timings_ms.ar_decode_per_token", file=T2I_ATTENTION_FP8), 5.0)]),
    ], note="One run each. The edit: `--image` (a random 1024x1024 reference) with `--kv-caches keep-ar --vae-dtype "
            "bfloat16 --vae-chunks 4`, two requests after the CLI's warm-up; the earlier column is session 18's call "
            "3, the same command without `--attention-dtype fp8`. T2I: the earlier column is session 17's call 1 "
            "(the same command, which also profiled a request after the timed one). FP8 attention runs the image "
            "rows (and an edit's condition rows) over their key prefix; its quantization (`quantize_qkv`) runs "
            "inside the compiled layer region."),
    Table("cfg-batch", ["HunyuanImage-3 CLI, 32 layers, FP8 experts, dense FP8, FP8 attention, compiled, one H200",
                            "`--cfg-mode batch` (call 5)", "serial CFG, the default (session 19 call 5)",
                            "target (issue 29)"], [
        Row(["T2I: DiT full step", Value("timings_ms.denoise_full_step", "{:.1f} ms", file=T2I_CFG_BATCH),
             Value("timings_ms.denoise_full_step", "{:.1f} ms", file=T2I_ATTENTION_FP8),
             goal("<= 280", Value("timings_ms.denoise_full_step", file=T2I_CFG_BATCH), 280.0)]),
        Row(["T2I: the first (whole-sequence) step", Value("timings_ms.denoise_first_step", "{:.1f} ms", file=T2I_CFG_BATCH),
             Value("timings_ms.denoise_first_step", "{:.1f} ms", file=T2I_ATTENTION_FP8), ""]),
        Row(["T2I: AR decode a token", Value("timings_ms.ar_decode_per_token", "{:.2f} ms", file=T2I_CFG_BATCH),
             Value("timings_ms.ar_decode_per_token", "{:.2f} ms", file=T2I_ATTENTION_FP8), "<= 5.0"]),
        Row(["T2I: the process's peak (no lean levers)", Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB",
                                                                scale=1e-9, file=T2I_CFG_BATCH),
             Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9, file=T2I_ATTENTION_FP8), ""]),
        Row(["edit, requests 1 / 2: DiT full step",
             _two_requests("denoise_full_step", TI2I_CFG_BATCH, "{:.1f}"),
             _two_requests("denoise_full_step", TI2I_ATTENTION_FP8, "{:.1f}"),
             goal("<= 350", Runs([(TI2I_CFG_BATCH, f"requests[{i}].timings_ms.denoise_full_step") for i in (0, 1)]),
                  350.0)]),
        Row(["edit, requests 1 / 2: condition encode",
             _two_requests("condition_encode", TI2I_CFG_BATCH, "{:.1f}"),
             _two_requests("condition_encode", TI2I_ATTENTION_FP8, "{:.1f}"), "<= 200"]),
        Row(["edit: the process's peak (`--kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4`)",
             Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9, file=TI2I_CFG_BATCH),
             Value("peak_memory_bytes_per_rank[0]", "{:.2f} GB", scale=1e-9, file=TI2I_ATTENTION_FP8),
             goal("<= 92", Value("peak_memory_bytes_per_rank[0]", scale=1e-9, file=TI2I_CFG_BATCH), 92.0)]),
    ], note="One run each, the same commands but for `--cfg-mode batch` (the two CFG branches as one batch of 2 "
            "rows through every layer). The condition encode runs no CFG: its two figures differ by run "
            "(session 18's five runs: 183.5-231.3 ms, `memory-lean-ar`)."),
    Table("hy-targets-h200", ["issue 29 target (one H200, 32 layers, FP8 experts, dense FP8, compiled regions)", "target",
                          "every run on main's code", "verdict (the median)", "where it stops (the table that shows it)"], [
        Row(["T2I AR decode a token, bench_decode (the median of each run)", "<= 5.0 ms",
             _target_runs(TARGET_DECODE_BENCH, "{:.3f}"), Verdict(_target_runs(TARGET_DECODE_BENCH), 5.0),
             "kernels 4.93-4.96 ms a step, floor 3.02 ms of bytes; the routed experts stream at 3.5-3.8 TB/s, the "
             "dense GEMVs (12-25 MB each) at 2.3-2.8; three fusions, PDL and a side stream measured and dropped "
             "(`decode-fusions`, `decode-fusion-kernels`, `decode-pdl`, `decode-side-stream`)"]),
        Row(["T2I AR decode a token, the CLI", "<= 5.0 ms", _target_runs(TARGET_DECODE_CLI),
             Verdict(_target_runs(TARGET_DECODE_CLI), 5.0), "as above"]),
        Row(["T2I DiT full step, serial CFG (the default), without / with `--attention-dtype fp8`", "<= 280 ms", _target_runs(TARGET_T2I_DIT, "{:.1f}"),
             Verdict(_target_runs(TARGET_T2I_DIT), 280.0),
             "the routed experts' grouped GEMMs are 52% of the kernels at 842-868 TFLOP/s (whole tiles 919-998: "
             "the Triton kernels' ceiling), cuDNN's attention 22%, cuBLAS's FP8 GEMMs 11% "
             "(`dit-profile`, `moe-targets`)"]),
        Row(["... with `--cfg-mode batch`", "<= 280 ms", Value("timings_ms.denoise_full_step", "{:.1f} ms", file=T2I_CFG_BATCH),
             Verdict(Value("timings_ms.denoise_full_step", file=T2I_CFG_BATCH), 280.0), "(`cfg-batch`)"]),
        Row(["TI2I DiT full step, serial CFG, without / with `--attention-dtype fp8`", "<= 350 ms", _target_runs(TARGET_TI2I_DIT, "{:.1f}"),
             Verdict(_target_runs(TARGET_TI2I_DIT), 350.0), "as the T2I step, over a longer key prefix "
             "(`ti2i-lean`, `hy-fp8-attention`)"]),
        Row(["... with `--cfg-mode batch`", "<= 350 ms", _target_runs(TARGET_TI2I_DIT_BATCH, "{:.1f}"),
             Verdict(_target_runs(TARGET_TI2I_DIT_BATCH), 350.0), "its peak 93.12 GB (`cfg-batch`)"]),
        Row(["peak memory, T2I (`--kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4`)", "<= 92 GB",
             _target_peaks("t2i"), Verdict(_target_peaks("t2i"), PEAK_TARGET), "`memory-lean-ar`"]),
        Row(["peak memory, TI2I (the same levers)", "<= 92 GB", _target_peaks("ti2i"),
             Verdict(_target_peaks("ti2i"), PEAK_TARGET), "`memory-lean-ar`; `--cfg-mode batch` 93.12 GB (`cfg-batch`)"]),
        Row(["TI2I condition encode", "<= 200 ms", _target_runs(TARGET_COND, "{:.1f}"), Verdict(_target_runs(TARGET_COND), 200.0),
             "`memory-lean-ar`, `hy-fp8-attention`, `cfg-batch`"]),
        Row(["TI2I AR decode a token", "<= 6.0 ms", _target_runs(TARGET_TI2I_AR), Verdict(_target_runs(TARGET_TI2I_AR), 6.0),
             "the 6.12 ms is a process's first request, which records the decode graph (`memory-lean-ar`)"]),
        Row(["Wan 1.3B, 30 blocks, compiled: dtgen / diffusers (FP8 attention, 2.81% from bf16)", "<= 0.75",
             Value(peer("1.3B", "regions", "dtgen", "attn-fp8", "ratio_vs_diffusers"), "{:.3f}", file=WAN_PEERS_LONG_KEYS),
             Verdict(Value(peer("1.3B", "regions", "dtgen", "attn-fp8", "ratio_vs_diffusers"), file=WAN_PEERS_LONG_KEYS), 0.75),
             "attention is 64% of the profiled forward's kernels (FP8: 1.39x faster than the bf16 run's cuDNN), "
             "cuBLAS's bf16 GEMMs 25% (82 TFLOP by our count: ~810 TFLOP/s); dense FP8 did not pay at this width "
             "(`wan-peers-compiled-quant`); the kernel's softmax and MMAs barely overlap (docs/design.md) (`wan-peers-long-keys`, "
             "`fp8-attention-lazy`)"]),
        Row(["Wan 14B width, 8 blocks: the fastest within 3% relative L2 of bf16 (bf16 itself)", "<= 0.70",
             Runs([(WAN_PEERS_FP8_KERNEL, peer("14B-8", "regions", "dtgen", "bf16", "ratio_vs_diffusers")),
                   (WAN_PEERS_LONG_KEYS, peer("14B-8", "regions", "dtgen", "bf16", "ratio_vs_diffusers"))], "{:.3f}"),
             Verdict(Runs([(WAN_PEERS_FP8_KERNEL, peer("14B-8", "regions", "dtgen", "bf16", "ratio_vs_diffusers")),
                           (WAN_PEERS_LONG_KEYS, peer("14B-8", "regions", "dtgen", "bf16", "ratio_vs_diffusers"))]), 0.70),
             Join(["each FP8 option alone is over 3% at this width: attention 4.45% (0.830, `wan-peers-long-keys`), dense 3.35% "
                   "(0.870, `wan-peers-compiled-quant`); P's e4m3 rounding is the attention's error (`fp8-attention`); its "
                   "FP16-PV form (",
                   Value(fp8_run("14B", "fp8-pv-fp16", "rel_l2_vs_fp32"), "{:.2%}", file=ATTENTION_14B_LONG_KEYS),
                   " from fp32) is no faster than cuDNN at 14B: ",
                   Value(fp8_run("14B", "fp8-pv-fp16", "ms"), "{:.2f} ms", file=ATTENTION_14B_LONG_KEYS),
                   " with its quantization eager (",
                   Value(fp8_run("14B", "fp8-quantize-only", "ms"), "{:.2f} ms", file=ATTENTION_14B_LONG_KEYS),
                   " of it) against cuDNN's ",
                   Value(fp8_run("14B", "sdpa-cudnn_attention", "ms"), "{:.2f} ms", file=ATTENTION_14B_LONG_KEYS), " (call 7)"], "")]),
        Row(["VAE decode 1024x1024, float32 (golden-exact)", "<= 150 ms",
             Join([Value('runs[0].floor_ms_of_needed["tf32 (datasheet, dense)"]', "{:.0f} ms even at TF32's "
                         "datasheet rate (not exact)", file=VAE_FLOPS),
                   Value('runs[0].floor_ms_of_needed["fp32 (datasheet, no tensor cores)"]', "{:.0f} ms in exact "
                         "float32", file=VAE_FLOPS)], "; ", prefix="floor "),
             "below its floor", "the convolutions' FLOPs (`vae-floor`); bf16 decode "
             "171.4 ms compiled, 222.0 eager (`vae-channels-last`)"]),
    ], note="Each figure's runs are every measurement of main's code for that figure (the sessions' tables name "
            "them; code since changed only in what those runs do not time); a verdict reads the median. The "
            "decode bench rows are each run's own median of four; the DiT, AR and encode rows one request each."),
]
