"""Wan's tables: its DiT against diffusers' on one H200, its step caches, its attention kernel; the caches' accuracy."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Section, Table, Value, Verdict
from bench.specs.runs import (ATTENTION, ATTENTION_14B, LORA_BATCH_WAN, LORA_LOAD_CPU, WAN_14B_STEP, WAN_CACHE,
                              WAN_CACHE_DEVIATION, WAN_PEERS, WAN_STEP)

L2_BOUND = 0.03   # an FP8 option counts against a ratio target only within 3% relative L2 of dtgen's bf16


def peer(model, who, variant, key):
    return f"rows[model={model},mode=regions,who={who},variant={variant}].{key}"


def both(model, who, variant, key, fmt="{:.1f}", unit=" ms") -> Runs:
    """A figure of the two runs of `peers wan` that ran it."""
    return Runs([(f, peer(model, who, variant, key)) for f in WAN_PEERS], fmt, unit)


def forward_floor(file):
    """One forward's FLOP floor: half `dit wan`'s step floor, whose step runs both CFG rows."""
    return Calc(lambda step: step / 2, [Value("floor_ms", file=file)], "{:.0f} ms (FLOPs)")


def _row(model, variant, label, floor, goal):
    ratio = both(model, "dtgen", variant, "ratio_vs_diffusers", "{:.3f}", "")
    error = ("rel_l2_vs_diffusers", "{:.2%} from diffusers") if variant == "bf16" else \
        ("rel_l2_vs_dtgen_bf16", "{:.2%} from dtgen's bf16")
    verdict = Verdict(ratio, goal, "<=", f"dtgen / diffusers <= {goal}") if goal else ""
    return Row([label, Join([both(model, "dtgen", variant, "ms"), Value(peer(model, "dtgen", variant, error[0]),
                                                                         error[1], WAN_PEERS[1])], ", "),
                both(model, "diffusers", "bf16", "ms"), ratio, floor, verdict])


def _attention(shape, run, file, fmt):
    return Value(f'shapes["{shape}"].runs["{run}"].ms', fmt, file)


PEERS = Table("wan-h200", "The DiT against diffusers, and its attention kernel", [
    "figure", "dtgen", "peer, same GPU and inputs (diffusers 0.42.1, bf16, unless named)", "dtgen / peer", "floor",
    "target"], [
    _row("1.3B", "bf16", "Wan2.1 1.3B forward (30 blocks), bf16, compiled", forward_floor(WAN_STEP), None),
    _row("1.3B", "attn-fp8", "... self-attention in FP8 (`--attention-dtype fp8`)", "", 0.75),
    _row("14B-8", "bf16", "Wan2.1 14B width, 8 of 40 blocks, bf16, compiled", forward_floor(WAN_14B_STEP), 0.70),
    _row("14B-8", "attn-fp8", "... self-attention in FP8", "", None),
    Row(["1.3B denoise step (both CFG rows), compiled, `dit wan`", Runs([(WAN_STEP, "compiled_regions.step_ms")],
                                                                        "{:.0f}", " ms"),
         "", "", Value("floor_ms", "{:.0f} ms (FLOPs)", WAN_STEP), ""]),
    Row(["1.3B video, 50 steps, first-block cache (threshold 0.05), eager",
         Runs([(WAN_CACHE, "runs[\"dtgen first-block\"].video_s")], "{:.2f}", " s"),
         Value('runs["diffusers first-block"].video_s', "{:.2f} s (`apply_first_block_cache`)", WAN_CACHE),
         Value("ratio_video_dtgen_over_diffusers", "{:.3f}", WAN_CACHE), "",
         Verdict(Value("ratio_video_dtgen_over_diffusers", file=WAN_CACHE), 1.0, "<=", "dtgen / diffusers <= 1")]),
    Row(["... the same video uncached (from 5 steps)", Runs([(WAN_CACHE, 'runs["dtgen uncached"].video_s_at_steps')],
                                                          "{:.2f}", " s"),
         Value('runs["diffusers uncached"].video_s_at_steps', "{:.2f} s", WAN_CACHE), "", "", ""]),
    *[Row([f"FP8 attention kernel alone, {label}", _attention(shape, "fp8-kernel", file, "{:.2f} ms (1 run)"),
           _attention(shape, "sdpa-cudnn_attention", file, "torch SDPA bf16, cuDNN: {:.2f} ms"),
           Calc(lambda a, b: a / b, [_attention(shape, "fp8-kernel", file, "{}"),
                                     _attention(shape, "sdpa-cudnn_attention", file, "{}")], "{:.3f}"), "", ""])
      for shape, label, file in (("1.3B", "1.3B: 12 heads, 32760 x 32760", ATTENTION),
                                 ("14B", "14B: 40 heads, 32760 x 32760 (long-key tiles)", ATTENTION_14B))],
], note="`peers wan`: dtgen's DiT and diffusers' WanTransformer3DModel in one process on the same random weights and "
        "inputs (480x832 x 81 frames: 32760 tokens, 512 text rows, batch 1), each compiled one region per block; "
        "a run is a process, its figure the median of 3 forwards. A ratio target counts an FP8 option only within "
        f"{L2_BOUND:.0%} relative L2 of dtgen's bf16 output (attn-fp8 at 14B width is over it). The forward's floor "
        "is half `dit wan`'s step floor (its step runs both CFG rows). The video rows run the DiT alone (no text "
        "encoder, no VAE) with random weights whose time projection is scaled by 0.01, so blocks' residuals move "
        "as trained ones do; both decide the same steps.")

CACHE_ACCURACY = Table("wan-cpu", "Step caches' accuracy (tiny Wan, CPU)", [
    "cache (`--step-cache`)", "steps in full (of 50)", "final latents, rel. L2 from uncached"], [
    Row([Join([Value(f"caches[{i}].cache"), Value(f"caches[{i}].spec", "`{}`")], ": "),
         Value(f"caches[{i}].full_steps"), Value(f"caches[{i}].rel_l2_final_latents", "{:.2e}")],
        file=WAN_CACHE_DEVIATION)
    for i in range(6)
], note="The tiny Wan (2 blocks, 9 frames 48x64) in float32, CFG 5.0, UniPC; each cache against the same run uncached.")



def lora_batch_rows(file, model) -> list[Row]:
    """`lora batch`: four requests with four adapters as one batch against four batches of
    one (and without adapters), images/min and the ratio, and where the batch's time goes."""
    def ratio(key):
        return Join([Value(f"{key}.median", "{:.2f}x"), Value(f"{key}.min", "{:.2f}"), Value(f"{key}.max", "{:.2f}")],
                    [" (", "-"], suffix=")")

    def phases(name):
        return Join([Value(f"phases_ms.{name}.{p}", "{:.0f}") for p in ("encode", "denoise", "decode")],
                    [" / ", " / "], suffix=" ms")
    return [
        Row([f"{model}: 4 requests, 4 rank-4 adapters, one batch against four (images/min, CPU ranks)",
             Join([Value("images_per_min.batch_of_4.median", "{:.0f}"),
                   Value("images_per_min.four_of_1.median", "{:.0f} images/min")], " against "),
             Join([ratio("ratio"), Verdict(Value("ratio.median"), 3.0, ">=", ">= 3x")], "; ")], file=file),
        Row([f"{model}: the same requests without adapters", "", ratio("ratio_no_adapters")], file=file),
        Row([f"{model}: encode / denoise / decode, the batch against the four", Join(
            [phases("batch_of_4"), phases("four_of_1")], " against "), ""], file=file),
    ]


LORA_CPU = Table("wan-lora-cpu", "LoRA: adapters in one batch, loading and switching (CPU)", [
    "figure", "dtgen", "ratio, target"], [
    *lora_batch_rows(LORA_BATCH_WAN, "tiny Wan"),
    Row(["load of a rank-64 adapter at the 14B width, 2 blocks (20 linears), float32: first / median",
         Join([Value("first_load_ms", "{:.0f}"), Value("load_ms.median", "{:.0f} ms")], " / "),
         Join([Value("adapter_bytes", lambda v: f"{v / 1e6:.0f} MB file")], "")], file=LORA_LOAD_CPU),
    Row(["switching a request to a resident adapter (`set_rows`): every row alike / 4 rows, 4 adapters",
         Join([Value("switch_uniform_us.median", "{:.0f}"), Value("switch_mixed_4_rows_us.median", "{:.0f} us")],
              " / "), "0 ms: no weight read or copied"], file=LORA_LOAD_CPU),
], note="One process, float32, torch on 1 thread of a 2-core machine; the batch and the four "
        "runs interleaved (7 rounds: median, min-max). The batch's rows equal each request alone (asserted). On the "
        "tiny models most of the work grows with the rows (the text encoder over 512 padded positions, the DiT's "
        "cross-attention over them, the VAE's convolutions), so the batch gains under 3x with or without adapters. "
        "The load on the CPU: the 14B width at 2 of its 40 blocks (the GPU step `lora_load_wan` loads the "
        "whole 40-block adapter).")

SECTIONS = [Section("Wan, one H200", [PEERS]), Section("Wan, CPU", [CACHE_ACCURACY, LORA_CPU])]
