"""The vae suite's tables: the VAE decode, its convolutions, its floor."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Value
from bench.specs.runs import H1202_MEMORY_PROBE, VAE_CONV, VAE_FLOPS, VAE_SUITE_FUSIONS, VAE_SUITE_KV_POLICY
from bench.specs.common import goal


VAE_RATES = (("plain fp32 (no tensor cores; datasheet 67 TFLOP/s)", "fp32 (datasheet, no tensor cores)"),
             ("TF32 tensor cores (datasheet, dense: 494.7 TFLOP/s)", "tf32 (datasheet, dense)"),
             ("bf16 tensor cores (measured GEMM rate: 694 TFLOP/s)", "bf16 (measured GEMM rate, bench/floors.py)"))


VAE_LEVELS = (("level4_128ch_1024", "128 ch, 1024^2"), ("level3_256ch_512", "256 ch, 512^2"),
              ("level2_512ch_256", "512 ch, 256^2"))
VAE_VARIANTS = (("conv3d", "`conv3d`: F.conv3d on NCDHW (what the decoder runs)"),
                ("conv3d_cl_resident", "`conv3d_cl_resident`: F.conv3d, channels_last_3d kept (no layout copies timed)"),
                ("taps2d", "`taps2d`: the frames as 2-D images, one conv2d per time tap (one copy in, one out)"),
                ("taps2d_cl_resident", "`taps2d_cl_resident`: the same on channels_last frames kept (no copies timed)"),
                ("fold2d", "`fold2d`: the frames folded into channels, one conv2d (16 frame-taps)"))


def _conv(shape, dtype, variant, key):
    return f"rows[shape={shape},dtype={dtype},variant={variant}].{key}"
VAE_SUITE0 = (("fp32_plain_eager", "fp32, the plain ops (F.conv3d, nn.GroupNorm): the reference"),
              ("fp32_fast_eager", "fp32, the decoder's fast paths"),
              ("fp32_tf32_plain_eager", "fp32, TF32 on (torch's default for convolutions), plain ops"),
              ("fp32_tf32_fast_eager", "fp32, TF32 on, fast paths"),
              ("bf16_plain_eager", "bf16, plain ops"),
              ("bf16_fast_eager", "bf16, fast paths"))


VAE_CL_ROWS = (("bf16_fast_eager", "decode, NCDHW (the path before; the reference of the decode rows)"),
                ("bf16_cl_eager", "decode, **channels-last resident**"),
                ("bf16_cl_cached_eager", "decode, channels-last, its 2-D kernels kept (not per call)"),
                ("bf16_fast_chunks4_eager", "decode, NCDHW, `--vae-chunks 4`"),
                ("bf16_cl_chunks4_eager", "decode, **channels-last, `--vae-chunks 4`** (what `lean` runs now)"),
                ("bf16_cl_compiled", "decode, channels-last, torch.compile (inductor) of the decoder"),
                ("enc_bf16_fast_eager", "encode, NCDHW (the reference of the encode rows)"),
                ("enc_bf16_cl_eager", "encode, channels-last"),
                ("enc_bf16_fast_chunks4_eager", "encode, NCDHW, `--vae-chunks 4`"),
                ("enc_bf16_cl_chunks4_eager", "encode, **channels-last, `--vae-chunks 4`** (what `lean` runs now)"))


TABLES = [
    Table("vae-before", ["VAE decode, 1024x1024, one H200, alone", "each timed call",
                      "median and range", "bf16 / fp32", "target (issue 29)"], [
        Row([f"{dtype} weights and activations", Value(f"vae_ms.{dtype}", "{:.1f}"),
             Runs([(H1202_MEMORY_PROBE, f"vae_ms.{dtype}[{i}]") for i in range(3)], "{:.1f}", " ms"),
             Calc(lambda b, f: b / f, [Runs([(H1202_MEMORY_PROBE, f"vae_ms.bf16[{i}]") for i in range(3)]),
                                       Runs([(H1202_MEMORY_PROBE, f"vae_ms.fp32[{i}]") for i in range(3)])], "{:.2f}")
             if dtype == "bf16" else "-",
             goal("<= 150 ms", Runs([(H1202_MEMORY_PROBE, f"vae_ms.{dtype}[{i}]") for i in range(3)]), 150.0)],
            file=H1202_MEMORY_PROBE)
        for dtype in ("fp32", "bf16")
    ], note="Wall time of one `vae.decode` to a device sync: the listed calls, after warm-up calls, in one "
            "process (the \"runs\" are these calls, not separate processes). bf16 / fp32: the ratio of the "
            "medians."),
    Table("vae-floor", ["HunyuanImage-3 VAE decode, 1024x1024 (4 frames decoded, the last kept)",
                            "TFLOP", "floor at that rate", "can the 150 ms target (issue 29) be met at this rate?"], [
        Row(["what `vae.decode` asks of its convolutions now (3T frame-taps at T = 4)",
             Value("runs[0].flops_now", "{:.1f}", scale=1e-12), "", ""], file=VAE_FLOPS),
        Row(["the frame-taps that meet a frame (3T - 2): no exact method computes fewer",
             Value("runs[0].flops_needed", "{:.1f}", scale=1e-12), "", ""], file=VAE_FLOPS),
        *[Row([f"... at {label}", "", Value(f"runs[0].floor_ms_of_needed[\"{key}\"]", "{:.0f} ms"),
               goal("floor <= 150 ms", Value(f"runs[0].floor_ms_of_needed[\"{key}\"]"), 150.0)], file=VAE_FLOPS)
          for label, key in VAE_RATES],
    ], note="Counted on the meta device (no GPU) with the released VAE config; per convolution, checked against "
            "torch's FLOP counter (the JSON's `flops_counter_matches_now`). A floor is the needed FLOPs at the "
            "rate; the datasheet rates are upper bounds, so nothing runs under those floors. The verdicts say "
            "whether the target is reachable at all in that arithmetic."),
    Table("vae-conv", ["the VAE's 3x3x3 convolution over 4 frames (one of a level's), one H200: ms, the median "
                           "of 10 calls"] + [f"{d}: {lv}" for d in ("fp32 (TF32)", "bf16") for _, lv in VAE_LEVELS]
          + ["largest rel. difference vs conv3d of its dtype: fp32 / bf16"], [
        Row([label] + [Join([Value(_conv(shape, dtype, variant, "median_ms"), "{:.2f}"),
                             Value(_conv(shape, dtype, variant, "tflops_of_needed"), "{:.0f}")], " (",
                            suffix=" TFLOP/s)")
                       for dtype in ("float32", "bfloat16") for shape, _ in VAE_LEVELS]
            + [Join([Calc(lambda *v: max(v), [Value(_conv(shape, dtype, variant, "max_rel_diff_vs_conv3d"))
                                              for shape, _ in VAE_LEVELS], "{:.2g}")
                     for dtype in ("float32", "bfloat16")], " / ")], file=VAE_CONV)
        for variant, label in VAE_VARIANTS
    ], note="bench/probes/vae_conv_probe.py: each variant computes the same convolution from the same NCDHW input "
            "to an NCDHW output, so its time includes the layout changes it needs; the `*_resident` ones leave "
            "them out (what they would cost if the whole decoder kept that layout). fp32 runs on cuDNN's default "
            "TF32. TFLOP/s counts the 10 frame-taps every exact method needs. The largest difference is over the "
            "three levels, against conv3d in the same dtype. The whole decode (`bench_vae --suite`) did not run in "
            "this call (`NO_VAE_SUITE=1`)."),
    Table("vae-suite", ["bench_vae --suite, the 1024x1024 decode alone, one H200", "ms (median)",
                             "first call", "peak", "rel. L2 vs the fp32 reference"], [
        Row([label, Value(f"results.{name}.ms", "{:.1f}"), Value(f"results.{name}.first_call_s", "{:.1f} s"),
             Value(f"results.{name}.peak_gib", "{:.1f} GiB"), Value(f"results.{name}.rel_l2", "{:.2g}")],
            file=VAE_SUITE_KV_POLICY)
        for name, label in VAE_SUITE0
    ], note="Random weights at the official VAE's shapes, 64x64 latents. The run hit its 200 s limit after these six "
            "variants (the fp32 plain decode's first call took its cuDNN search: 129 s); the JSON keeps what it "
            "measured. A peak is the variant's first call's, cuDNN's algorithm search included (bench_vae's "
            "docstring): the fast paths' 136.8 GiB are that search's, not the decode's steady state."),
    Table("vae-channels-last", ["bench_vae --suite --only-bf16, the official VAE's shapes at 1024x1024, one H200",
                         "ms (median)", "peak (first call)", "rel. L2 vs its reference", "speed-up vs its reference"], [
        Row([label, Value(f"results.{name}.ms", "{:.1f}"), Value(f"results.{name}.peak_gib", "{:.1f} GiB"),
             Value(f"results.{name}.rel_l2", "{:.3f}"),
             Value(f"results.{name}.speedup_vs_ref", "{:.2f}x") if not name.endswith("fast_eager") else "-"],
            file=VAE_SUITE_FUSIONS)
        for name, label in VAE_CL_ROWS
    ], note="Random weights, bf16. Channels-last resident (`HunyuanVAE.set_channels_last`, on by default for a "
            "bf16/fp16 VAE on CUDA: `--vae-layout auto`): the activation stays channels_last_3d, 3x3x3 "
            "convolutions run as one 2-D convolution per time tap over channels_last frames, GroupNorm reads the "
            "strided map, depth-to-space writes channels-last. The rel. L2 is against the NCDHW bf16 path (both "
            "bf16: rounding order; the NCDHW bf16 decode is 1.2% from fp32, `vae-suite`). The compiled "
            "variant's first call took 95.8 s (the JSON), so the pipeline does not compile the VAE."),
]
