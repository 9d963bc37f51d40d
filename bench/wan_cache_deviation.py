"""What each step cache costs in accuracy and buys in time, on the tiny Wan default (CPU).

    python -m bench.wan_cache_deviation [--steps 50] [--repeats 3] [--out F]

One process, float32, one CPU thread, the tiny default (a random Wan 2.1 written as a diffusers
folder; 2 blocks, 48x64 px, 9 frames), CFG 5.0, UniPC. For every cache: the relative L2 of
its final latents against the uncached run from the same noise, which steps ran in full, the
share of the DiT's block evaluations it ran (what bounds the speed-up where the blocks are
the cost, as at 480p), and the measured denoise time against the uncached run's (median of
`--repeats`; on this model the per-step work outside the blocks, the head and the time and
text embeddings, is a large share, so the measured figure stays below the block share's).
MagCache's ratios are calibrated first on another seed and prompt (calibrate=true), then used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

DEFAULT_OUT = "bench/results/cpu-2026-12-01-wan-cache/deviation.json"
# (name, spec); "{ratios}" is replaced by the calibrated ratios.
CACHES = (
    ("first-block 0.05 (diffusers' default)", "first-block:threshold=0.05"),
    ("first-block 0.1", "first-block:threshold=0.1"),
    ("taylorseer (diffusers' defaults: interval 5, from step 3, order 1, bf16 factors)", "taylorseer"),
    ("taylorseer interval 3, order 2, float32 factors", "taylorseer:interval=3,order=2,factors_dtype=float32"),
    ("magcache (diffusers' defaults: threshold 0.06, 3 skips, retention 0.2)", "magcache:mag_ratios={ratios}"),
    ("taylor (HunyuanImage-3's official: interval 5, order 2)", "taylor"),
)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wan_cache_deviation", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from models import registry
    from models.wan.pipeline import WanT2VPipeline   # the pipeline whose step caches this measures

    wan = registry.spec("wan")   # its tiny default, loader, plans and request
    T2VRequest = wan.load("request")
    load_before = os.getloadavg()[0]
    loaded = wan.load("loader")(wan.load("tiny")(), wan.load("plans").PLANS["single"])
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    blocks = len(loaded.model.transformer.blocks)
    req = T2VRequest(prompt="A red fox runs through fresh snow at golden hour, cinematic", height=48, width=64,
                     num_frames=9, steps=args.steps, guidance_scale=5.0, seed=0)

    def run(spec):
        times, result = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = pipe.generate(replace(req, step_cache=spec), decode=False)
            times.append((time.perf_counter() - t0) * 1e3 - result.timings_ms["encode"])
        return result, statistics.median(times)

    calibration = pipe.generate(replace(req, prompt="a small bird flies over the sea at night", seed=1,
                                        step_cache="magcache:calibrate=true"), decode=False)
    ratios = "/".join(f"{r:.5f}" for r in calibration.record["step_cache"]["mag_ratios"])
    base, base_ms = run(None)
    rows = []
    for name, spec in CACHES:
        spec = spec.format(ratios=ratios)
        result, ms = run(spec)
        report = result.record["step_cache"]
        if report["method"] == "first-block":   # block 0 always runs; the others where a row runs in full
            evaluations = sum(1 + (blocks - 1) * sum(rows_) / len(rows_) for rows_ in report["full_rows"])
        else:
            evaluations = blocks * len(report["full_steps"])
        rows.append({"cache": name, "spec": spec if report["method"] != "magcache" else "magcache:mag_ratios=...",
                     "full_steps": len(report["full_steps"]), "cached_steps": len(report["cached_steps"]),
                     "full_step_list": report["full_steps"],
                     "rel_l2_final_latents": rel_l2(result.latents, base.latents),
                     "max_abs_diff_final_latents": float((result.latents - base.latents).abs().max()),
                     "block_share": round(evaluations / (blocks * args.steps), 4),
                     "denoise_ms": round(ms, 1), "measured_speedup": round(base_ms / ms, 3)})
    out = {"command": "python -m bench.wan_cache_deviation" + (f" --steps {args.steps}" if args.steps != 50 else "")
           + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
           "what": "tiny Wan default (2 blocks, 36 tokens a step, 9 frames 48x64), one process, float32, CPU, "
                   "1 thread, CFG 5.0 batch of 2, UniPC; deviation = final latents against the uncached run",
           "steps": args.steps, "torch": torch.__version__, "uncached_denoise_ms": round(base_ms, 1),
           "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],   # other jobs on the cores
           "note": "block_share is exact (the share of block evaluations the cache ran; first-block always "
                   "runs block 0, half of this 2-block model, 1/30 of Wan 1.3B); measured_speedup is wall time "
                   "on a shared 2-core machine, indicative only",
           "magcache_ratios_calibrated_on": "seed 1, 'a small bird flies over the sea at night'",
           "magcache_ratios": [float(r) for r in ratios.split("/")], "caches": rows}
    width = max(len(r["cache"]) for r in rows)
    print(f"{'cache':<{width}}  full  rel L2     block share  speed-up (measured)")
    for r in rows:
        print(f"{r['cache']:<{width}}  {r['full_steps']:>4}  {r['rel_l2_final_latents']:.2e}   {r['block_share']:>6.1%}"
              f"       {r['measured_speedup']:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
