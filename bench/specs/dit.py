"""The dit suite's tables: the denoise transformer's step (Wan's DiT; HunyuanImage-3's, batched and profiled)."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Table, Text, Value
from bench.specs.runs import H1202_BATCH, H1202_BATCH_PARITY, T2I_LM_HEAD_FP8, WAN_1201
from bench.specs.common import gb, goal, ms


W13, W14 = f"{WAN_1201}/bench_wan_1.3B.json", f"{WAN_1201}/bench_wan_14B_8layers.json"


BATCH_MODES = (("one_at_a_time", "4 requests, one at a time"), ("batched", "**4 requests batched** (one denoise batch)"))


PARITY_CONFIGS = ((0, "float32, eager"), (5, "bf16, eager"), (10, "bf16, compiled regions"))   # first row of each


DENOISE_TOP = "profile.top_kernels.denoise"
DENOISE_REGION = "profile.regions.denoise[region={}]"
DENOISE_LISTED = [Value(f"{DENOISE_TOP}[{i}][1]") for i in range(40)]   # --profile-top 40
DENOISE_GROUPS = (  # label, kernel-name prefixes (each matches one listed kernel)
    ("routed experts: `_gate_up_act_kernel`, `_down_sum_kernel`, x quantized (`_quantize_rows_by_amax_kernel`, "
     "`_quantize_rows_kernel`), `_finalize_kernel`, the rows' gather (`vectorized_gather_kernel`)",
     ("_gate_up_act_kernel", "_down_sum_kernel", "_quantize_rows_by_amax_kernel", "_quantize_rows_kernel",
      "_finalize_kernel", "void at::native::vectorized_gather_kernel")),
    ("attention: cuDNN's SDPA (`cudnn_generated_fort_native_sdpa_sm90_flash_...` and `..._sm80_flash_...`)",
     ("cudnn_generated_fort_native_sdpa_sm90", "cudnn_generated_fort_native_sdpa_sm80")),
    ("dense linears in FP8: cuBLAS's `nvjet_sm90_qqtst_...` (`torch._scaled_mm`)", ("nvjet_sm90_qqtst",)),
    ("the image modules' convolutions: cuDNN `sm90_xmma_fprop_...` (2 kernels) and its `nchwToNhwcKernel`",
     ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x128",
      "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x256",
      "void cudnn::engines_precompiled::nchwToNhwcKernel")),
    ("copies (`direct_copy_kernel_cuda`)",
     ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy",)),
)


def _denoise_kernels(prefixes, what: int) -> list[Value]:
    return [Value(f"{DENOISE_TOP}[^{p}][{what}]") for p in prefixes]


def _share_of_listed(cells: list) -> Calc:
    n = len(cells)
    return Calc(lambda *v: 100 * sum(v[:n]) / sum(v[n:]), cells + DENOISE_LISTED, "{:.1f}%")


def _sum(cells: list, fmt: str) -> Calc:
    return Calc(lambda *v: sum(v), cells, fmt)


def _region(name: str) -> Join:
    r = DENOISE_REGION.format(name)
    return Join([Value(f"{r}.wall_ms", "{:.1f}"), Value(f"{r}.compute_ms", "{:.1f}"), Value(f"{r}.idle_ms", "{:.1f}")],
                [" = ", " + "], suffix=" ms")


_GROUPED = [p for _, prefixes in DENOISE_GROUPS for p in prefixes]
_OTHER_MS = Calc(lambda *v: sum(v[len(_GROUPED):]) - sum(v[:len(_GROUPED)]),
                 _denoise_kernels(_GROUPED, 1) + DENOISE_LISTED, "{:.1f} ms")
_OTHER_SHARE = Calc(lambda *v: 100 * (1 - sum(v[:len(_GROUPED)]) / sum(v[len(_GROUPED):])),
                    _denoise_kernels(_GROUPED, 1) + DENOISE_LISTED, "{:.1f}%")


TABLES = [
    Table("wan-dit", ["model", "blocks", "eager", "compiled (one region per block)", "TFLOP/s compiled", "floor",
                      "ratio to floor", "self-attention share", "self-attention TFLOP/s"], [
        Row(["Wan2.1 1.3B (12 heads), per step", Value("layers"), ms("eager.step_ms", fmt="{:.0f} ms"),
             ms("compiled_regions.step_ms", fmt="**{:.0f} ms**"), Value("compiled_regions.tflops", "{:.0f}"),
             ms("floor_ms", fmt="{:.0f} ms"), Value("compiled_regions.floor_ratio", "{:.2f}"),
             Value("self_attention.share_of_compiled_step", "{:.0%}"), Value("self_attention.tflops", "{:.0f}")],
            file=W13),
        Row(["Wan2.1 14B (40 heads), per block", Join([Value("layers"), Text("40")], " of "),
             ms("eager.per_block_ms"), ms("compiled_regions.per_block_ms", fmt="**{:.1f} ms**"),
             Value("compiled_regions.tflops", "{:.0f}"),
             Calc(lambda f, n: f / n, [Value("floor_ms"), Value("layers")], "{:.0f} ms"),
             Value("compiled_regions.floor_ratio", "{:.2f}"), Value("self_attention.share_of_compiled_step", "{:.0%}"),
             Value("self_attention.tflops", "{:.0f}")], file=W14),
    ]),
    Table("wan-tiny", ["run", "graphs", "graph breaks", "recompiles after warm-up", "denoise step"], [
        Row(["tiny default, `--compile`, one H200", Value("compile.graphs"), Value("compile.graph_breaks"),
             Value("compile.recompiles_after_warmup"), ms("timings_ms.denoise_step")], file=f"{WAN_1201}/wan_tiny.json"),
    ]),
    Table("dit-batch", ["HunyuanImage-3, 32 layers, 4 same-bucket 1024x1024 requests, 10 steps, serial CFG",
                        "wall time", "images/min", "denoise ms/step", "peak allocated", "target (issue 30)"], [
        Row([label, Value(f"summary.{mode}.seconds.median", "{:.2f} s"),
             Value(f"summary.{mode}.images_per_min.median", "{:.2f}"),
             Join([Value(f"summary.{mode}.denoise_step_ms.median", "{:.1f} ms"),
                   Value(f"rows[mode={mode}].denoise_batch[0]", "{}")], " (a batch of ", suffix=")"),
             gb(f"rows[mode={mode}].peak_memory_bytes"), ""], file=H1202_BATCH)
        for mode, label in BATCH_MODES
    ] + [
        Row(["speed-up: images/min batched / one at a time", "", Value("speedup", "**{:.3f}x**"),
             Calc(lambda batched, one: batched / one, [Value("summary.batched.denoise_step_ms.median"),
                                                       Value("summary.one_at_a_time.denoise_step_ms.median")],
                  "the batch's step: {:.2f}x one request's"), "",
             goal(">= 2.5x", Value("speedup"), 2.5, ">=")], file=H1202_BATCH),
        Row(["the largest latent difference, batched against alone", "",
             Value("max_latent_diff_batched_vs_alone", "{:.2f}"), "", "", ""], file=H1202_BATCH),
        Row(["the 4 requests' prompt tokens (no AR tokens: `max_new_tokens` 0)", Value("prompt_tokens"), "", "", "",
             ""], file=H1202_BATCH),
    ], note="One repeat of each mode (single runs). The batch's step over one request's step is computed here from the two stored "
            "medians. The latent difference is the largest absolute one over the 4 requests (max-abs, not relative: "
            "see the probe below)."),
    Table("dit-batch-parity", ["denoise batched (4 requests) vs each alone, CUDA, 2 layers at full width, 3 steps",
                               "first-step velocity rel. L2 (requests 0-3)", "final latents rel. L2 (requests 0-3)",
                               "control: the same request alone with CFG as one batch, final latents rel. L2"], [
        Row([Join([Value(f"rows[{first}].dtype"), Value(f"rows[{first}].compiled", "compiled {}")], ", ",
                  prefix=f"**{label}** (", suffix=")"),
             Join([Value(f"rows[{first + i}].velocity0_rel_l2", "{:.2%}") for i in range(4)], ", "),
             Join([Value(f"rows[{first + i}].latents_rel_l2", "{:.2%}") for i in range(4)], ", "),
             Value(f"rows[{first + 4}].control_cfg_batch_vs_serial_latents_rel_l2", "**{:.2%}**")], file=H1202_BATCH_PARITY)
        for first, label in PARITY_CONFIGS
    ], note="The probe's 4 requests are bench_batch's (one bucket, 1024x1024), through the released width at "
            "2 layers, random weights. The control changes only the batch shape of one request (its CFG's two "
            "branches in one batch instead of two calls): the batched requests' final latents differ from alone by "
            "the same order as the control does, in float32 as in bf16."),
    Table("dit-profile", ["HunyuanImage-3 T2I CLI, 32 layers, FP8 experts, dense linears in FP8, compiled, "
                              "1024x1024, serial CFG", "ms", "launches", "share of the 40 listed kernels",
                              "target (issue 29)"], [
        Row(["DiT step: a full step of the timed request (the mean of its later steps)",
             Value("timings_ms.denoise_full_step", "**{:.1f} ms**"), "", "",
             goal("<= 280 ms", Value("timings_ms.denoise_full_step"), 280.0)], file=T2I_LM_HEAD_FP8),
        Row(["profiled: the later (KV-cached) step, wall = compute + idle", _region("denoise_step"), "", "", ""],
            file=T2I_LM_HEAD_FP8),
        Row(["profiled: the first (whole-sequence) step, wall = compute + idle", _region("denoise_first_step"), "", "",
             ""], file=T2I_LM_HEAD_FP8),
        Row(["kernels of the **two** profiled steps together: the 40 listed",
             _sum(DENOISE_LISTED, "{:.1f} ms"),
             _sum([Value(f"{DENOISE_TOP}[{i}][2]") for i in range(40)], "{:.0f}"), "100%", ""], file=T2I_LM_HEAD_FP8),
        Row(["... the two steps' compute (the regions', for comparison)",
             _sum([Value(DENOISE_REGION.format(r) + ".compute_ms") for r in ("denoise_first_step", "denoise_step")],
                  "{:.1f} ms"), "", "", ""], file=T2I_LM_HEAD_FP8),
    ] + [
        Row([label, _sum(_denoise_kernels(prefixes, 1), "{:.1f} ms"), _sum(_denoise_kernels(prefixes, 2), "{:.0f}"),
             _share_of_listed(_denoise_kernels(prefixes, 1)), ""], file=T2I_LM_HEAD_FP8)
        for label, prefixes in DENOISE_GROUPS
    ] + [
        Row(["... of the routed experts: `_gate_up_act_kernel` / `_down_sum_kernel`",
             Join([Value(f"{DENOISE_TOP}[^{k}][1]", "{:.1f}") for k in ("_gate_up_act_kernel", "_down_sum_kernel")],
                  " / ", suffix=" ms"),
             Join([Value(f"{DENOISE_TOP}[^{k}][2]", "{:.0f}") for k in ("_gate_up_act_kernel", "_down_sum_kernel")],
                  " / "),
             Join([_share_of_listed([Value(f"{DENOISE_TOP}[^{k}][1]")]) for k in ("_gate_up_act_kernel",
                                                                                  "_down_sum_kernel")], " / "), ""],
            file=T2I_LM_HEAD_FP8),
        Row(["everything else listed (inductor's fused kernels, fp32 cuBLAS GEMMs, top-k, sorts, memsets, ...)",
             _OTHER_MS, "", _OTHER_SHARE, ""], file=T2I_LM_HEAD_FP8),
    ], note="The CLI with `--profile --profile-steps 2 --profile-top 40`: after the timed request, one more under the "
            "profiler with 2 denoise steps, the first (whole-sequence) step and one KV-cached step. The kernel rows "
            "are totals over **both** profiled steps (each CFG branch of each, in every layer), not a step's; the "
            "share is of the 40 listed kernels' total. The groups are sums of the listed kernels named in each "
            "label, computed here; \"everything else\" is the listed total less the groups. The full step is the "
            "timed request's (10 steps, unprofiled)."),
]
