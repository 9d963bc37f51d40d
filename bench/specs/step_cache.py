"""The step-cache suite's tables: fewer full denoise steps, end to end and in accuracy."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Table, Text, Value, Verdict
from bench.specs.runs import STEP_CACHE_DEVIATION, STEP_CACHE_DISTIL, STEP_CACHE_T2I, WAN_CACHE
from bench.specs.common import goal


def _repeats(file: str, run: str, key: str, n: int) -> Runs:
    """bench_step_cache's repeats of one run: a timing of each."""
    return Runs([(file, f"rows[run={run},repeat={i}].timings_ms.{key}") for i in range(n)], "{:.0f}", " ms")


def _step_cache_row(label: str, file: str, run: str, n: int, target: float | None) -> Row:
    total = _repeats(file, run, "total", n)
    full = Runs([(file, f"rows[run={run},repeat={i}].timings_ms.denoise_full_step") for i in range(n)], "{:.1f}",
                " ms")
    cached = (Runs([(file, f"rows[run={run},repeat={i}].timings_ms.denoise_cached_step") for i in range(n)],
                   "{:.2f}", " ms") if run.endswith("taylor") else Text("-"))
    ratio = (Calc(lambda c, f: 100 * c / f, [cached, full], "{:.1f}%") if run.endswith("taylor") else Text("-"))
    return Row([label, Join([Value(f"summary.{run}.full_steps"), Value(f"summary.{run}.steps")], " of "),
                total if target is None else Join([total, Verdict(total, target)], ": "), full, cached, ratio,
                Value(f"summary.{run}.peak_memory_gb", "{:.1f} GB")], file=file)


TABLES = [
    Table("step-cache-hunyuan", ["HunyuanImage-3, 32 layers, FP8 experts, 1024x1024", "steps in full", "end to end",
                                 "a full step", "a cached step", "cached / full", "peak"], [
        _step_cache_row("T2I, 50 steps, Taylor defaults (target <= 7000 ms)", STEP_CACHE_T2I, "t2i_taylor", 3, 7000),
        _step_cache_row("T2I, 50 steps, no cache", STEP_CACHE_T2I, "t2i_full", 1, None),
        _step_cache_row("TI2I edit, 50 steps, Taylor defaults (target <= 9000 ms)", STEP_CACHE_T2I, "ti2i_taylor", 3,
                        9000),
        _step_cache_row("TI2I edit, 50 steps, no cache", STEP_CACHE_T2I, "ti2i_full", 1, None),
        _step_cache_row("Instruct-Distil, 8 steps (target <= 4500 ms)", STEP_CACHE_DISTIL, "distil", 3, 4500),
        _step_cache_row("Instruct-Distil, 8 steps, Taylor (interval 3, first-enhance)", STEP_CACHE_DISTIL,
                        "distil_taylor", 3, None),
        Row(["a cached step against a full one, T2I (target <= 3%)", "", "", "", "",
             goal("<= 3%", Calc(lambda c, f: 100 * c / f,
                                [_repeats(STEP_CACHE_T2I, "t2i_taylor", "denoise_cached_step", 3),
                                 _repeats(STEP_CACHE_T2I, "t2i_taylor", "denoise_full_step", 3)]), 3.0), ""]),
    ], note="Random weights, 1251 prompt tokens and 256 forced AR tokens (the edit: a random 1024x1024 reference, "
            "a ~6.3k-row prefill), serial CFG, one region per layer compiled; end to end is AR + denoise + VAE "
            "(+ the condition encode for the edit). A full step is the mean of the later steps computed in full "
            "(the whole-sequence first step left out); the model was loaded with the editing encoders, which "
            "adds to the peak. The uncached baselines ran once each (20-25 s)."),
    Table("step-cache-wan", ["Wan2.1 1.3B shapes, 480x832 x 81 frames, bf16, eager", "video (50 steps)",
                             "a full step", "a reused step", "steps in full"], [
        Row([label, Value(f"runs.{run}.video_s", "{:.2f} s" if "uncached" not in run else "-"),
             Value(f"runs.{run}.full_step_ms", "{:.1f} ms"),
             Value(f"runs.{run}.cached_step_ms", "{:.1f} ms") if "uncached" not in run else "-",
             Value(f"runs.{run}.full_steps", lambda steps: f"{len(steps)}")], file=WAN_CACHE)
        for run, label in (("dtgen uncached", "dtgen, no cache (5 steps)"),
                           ("diffusers uncached", "diffusers, no cache (5 steps)"),
                           ("dtgen first-block", "dtgen, `first-block:threshold=0.05`"),
                           ("diffusers first-block", "diffusers, `apply_first_block_cache(0.05)`"))
    ] + [
        Row(["dtgen / diffusers, first-block video (target <= 1, the same decisions)",
             Join([Value("ratio_video_dtgen_over_diffusers", "{:.3f}"),
                   Verdict(Value("ratio_video_dtgen_over_diffusers"), 1.0)], ": "),
             "", "", Value("same_decisions", lambda same: "same decisions" if same else "**decisions differ**")],
            file=WAN_CACHE),
    ], note="One run of each, in one process on the same weights (random, the time projection scaled by 0.01 "
            "so that blocks' residuals move as trained ones do), noise and prompt embeddings; every step ends on "
            "a device sync in both. Both decide for each CFG branch at each step; all 100 decisions agree. The "
            "uncached runs (5 steps) give the full step's cost without a cache."),
    Table("step-cache-deviation", ["tiny golden case", "run", "steps in full", "final latents, rel. L2 vs uncached",
                                   "image, largest uint8 difference"], [
        Row([Value(f"rows[run={run}].case"), run, Join([Value(f"rows[run={run}].full_steps"),
                                                        Value(f"rows[run={run}].steps")], " of "),
             Value(f"rows[run={run}].final_latents_rel_l2", "{:.3f}"),
             Value(f"rows[run={run}].image_uint8_max_abs_diff")], file=STEP_CACHE_DEVIATION)
        for run in ("taylor_default", "taylor_enhance", "taylor_split", "distil_taylor")
    ], note="dtgen's own runs of the golden-taylor cases (CPU, float32), each cache against the same case's "
            "uncached run: what a cache moves, beside what it saves."),
]
