"""Qwen-Image's tables: its MMDiT against diffusers' on one H200, bf16 and the FP8 options; LoRA adapters in
one batch on the CPU."""
from __future__ import annotations

from bench.report_cells import Row, Runs, Section, Table, Value, Verdict
from bench.specs.runs import LORA_BATCH_QWEN, QWEN_BF16, QWEN_FP8
from bench.specs.wan import lora_batch_rows

BF16_RUNS = (*QWEN_BF16, QWEN_FP8)


def regions(key, fmt="{:.1f}", unit=" ms") -> Runs:
    return Runs([(f, f"modes.regions.{key}") for f in BF16_RUNS], fmt, unit)


def _variant(variant, label):
    base = f"modes.regions.variants.{variant}"
    return Row([label, Runs([(QWEN_FP8, f"{base}.ms")], "{:.1f}", " ms"),
                Value("modes.regions.diffusers.ms", "{:.1f} ms (the same run)"),
                Value(f"{base}.ratio_over_diffusers", "{:.3f}"),
                Value(f"{base}.rel_l2_vs_dtgen_bf16", "{:.2e} from dtgen's bf16"), "", ""], file=QWEN_FP8)


PEERS = Table("qwen-h200", "The MMDiT against diffusers", [
    "Qwen-Image forward, 1024x1024 + 256 text rows, 60 blocks, compiled", "dtgen",
    "diffusers 0.42.1, bf16 (same GPU, weights, inputs)", "dtgen / diffusers", "error", "floor", "target"], [
    Row(["bf16", regions("dtgen.ms"), regions("diffusers.ms"), regions("ratio_dtgen_over_diffusers", "{:.3f}", ""),
         Value("modes.regions.rel_l2_outputs", "{:.2e} from diffusers", QWEN_FP8),
         Value("floor_ms", "{:.1f} ms (FLOPs)", QWEN_FP8),
         Verdict(regions("ratio_dtgen_over_diffusers"), 1.0, "<=", "<= 1")]),
    _variant("dense-fp8", "dense linears in FP8 (`--dense-dtype fp8`)"),
    _variant("attn-fp8", "joint attention in FP8 (`--attention-dtype fp8`)"),
    _variant("fp8", "both"),
], note="`peers qwen`: dtgen's MMDiT and diffusers' QwenImageTransformer2DModel in one process on the same random "
        "weights and inputs, one CFG branch, each compiled one region per block (diffusers' "
        "compile_repeated_blocks); a run is a process, its figure the median of 10 forwards after 3 warm-ups. An "
        "FP8 variant is timed against the same run's diffusers bf16. The floor is the forward's FLOPs at the bf16 "
        "rate; FP8 GEMMs peak higher, so an FP8 variant may run under it.")

LORA_CPU = Table("qwen-lora-cpu", "LoRA: adapters in one batch (CPU)", ["figure", "dtgen", "ratio, target"],
                 lora_batch_rows(LORA_BATCH_QWEN, "tiny Qwen-Image"),
                 note="As Wan's CPU table: one process, float32, 1 thread of a 2-core machine, the batch and "
                      "the four runs interleaved (7 rounds: median, min-max); the batch's rows equal each request "
                      "alone (asserted).")

SECTIONS = [Section("Qwen-Image, one H200", [PEERS]), Section("Qwen-Image, CPU", [LORA_CPU])]
