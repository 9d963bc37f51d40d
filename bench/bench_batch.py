"""DiT step batching on one GPU: 4 concurrent requests of one bucket, their denoise steps as
rows of one batch (`HunyuanT2IPipeline.generate_batch`), against the same 4 one at a time.

    python -m bench.bench_batch --out bench/results/h200-.../bench_batch.json      # one H200
    python -m bench.bench_batch --tiny --out bench/results/cpu-.../bench_batch.json  # tiny, on the CPU

The target: images/min of 4 concurrent 1024x1024 requests, one bucket, >= 2.5x one
at a time. Random weights at the released shapes (`--layers`, 32), FP8 experts (channels),
compiled with one region per layer (as bench/bench_step_cache.py loads them); 4 prompts of
different lengths in one 256-row bucket (different RoPE positions and padding per row),
different seeds and guidance, 50 steps, no CoT by default (`--max-new-tokens` 0: the AR phase
is the prefill and the ratio head); with `--max-new-tokens N` each request decodes N tokens
(`ignore_stop`), one request at a time alone and all 4 together when batched
(`run_ar_batch`). Every shape is
warmed up first (one request, then the batch of 4: each compiles its own graphs), then each
mode runs `--repeats` times. Both modes do the whole request: AR, denoise, VAE decode
(each request's VAE decode in turn in both). The JSON holds every repeat and the speedup
(images/min batched over one at a time, medians); the batched latents' largest difference
from the one-at-a-time ones is printed and kept (bf16 on the GPU: rounding of other GEMM
shapes, not zero).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dtgen.batching import per_member
from dtgen.compile import CompileOptions
from dtgen.host import settle_heap
from dtgen.step_cache import describe, parse_step_cache
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest, filler_ids, warmup_request
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.tiny import tiny_config
from placements.hunyuan_image3 import get_plan


def _requests(args, tiny: bool) -> list[T2IRequest]:
    """`args.batch` requests of one 256-row bucket (tiny: one 16-row bucket), each its own
    prompt length, seed and guidance."""
    lengths = [12, 9, 14, 6, 11, 7, 13, 8] if tiny else [1250, 1210, 1170, 1130, 1240, 1200, 1160, 1140]
    return [T2IRequest(prompt_ids=filler_ids(lengths[k % len(lengths)]), seed=1 + k, guidance=[5.0, 3.5, 7.0, 4.5][k % 4],
                       steps=args.steps, image_size=args.size, max_new_tokens=args.max_new_tokens, ignore_stop=True,
                       cfg_mode=args.cfg_mode, step_cache=parse_step_cache(args.step_cache))
            for k in range(args.batch)]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="concurrent requests (one bucket)")
    p.add_argument("--steps", type=int, default=None, help="denoise steps (default 50; --tiny: 4)")
    p.add_argument("--size", default=None, help="image size HxW (default 1024x1024; --tiny: 256x256)")
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--cfg-mode", choices=("serial", "batch"), default="serial")
    p.add_argument("--step-cache", default=None, help="e.g. taylor (every request of the batch its own cache)")
    p.add_argument("--repeats", type=int, default=None, help="runs of each mode (default 3; --tiny: 1)")
    p.add_argument("--tiny", action="store_true", help="the tiny architecture on the CPU (a smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    args.steps = args.steps or (4 if tiny else 50)
    args.size = args.size or ("256x256" if tiny else "1024x1024")
    repeats = args.repeats or (1 if tiny else 3)
    if args.batch < 1:
        raise SystemExit(f"error: --batch must be >= 1, got {args.batch}")
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    config = tiny_config(2) if tiny else full_config(args.layers)
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, dtype, device, random_config=config,
                  moe_dtype="model" if tiny else "fp8")
    load_s = time.perf_counter() - t0
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=not tiny, regions=True),
                              prompt_bucket=16 if tiny else 256)
    reqs = _requests(args, tiny)
    quiet = per_member([lambda *a: None] * len(reqs))
    # Warm-up, untimed: one request's graphs, then the batch's (its own shapes).
    t0 = time.perf_counter()
    warm = [replace(warmup_request(r, cached_step=r.step_cache is not None),
                    forced_tokens=filler_ids(r.max_new_tokens)) for r in reqs]
    pipe.generate(warm[0])
    single_warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe.generate_batch(warm, quiet)
    batch_warm_s = time.perf_counter() - t0
    print(f"warm-up: one request {single_warm_s:.1f} s, the batch of {len(reqs)} {batch_warm_s:.1f} s", flush=True)
    settle_heap()
    rows, alone_latents, batched_latents = [], None, None
    for i in range(repeats):
        for mode in ("one_at_a_time", "batched"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            if mode == "one_at_a_time":
                results = [pipe.generate(r) for r in reqs]
            else:
                results = pipe.generate_batch(reqs, quiet)
                bad = [r for r in results if isinstance(r, BaseException)]
                if bad:
                    raise bad[0]
            _sync(device)
            seconds = time.perf_counter() - t0
            latents = [r.latents.float().cpu() for r in results]
            if mode == "one_at_a_time":
                alone_latents = latents
            else:
                batched_latents = latents
            rows.append({"mode": mode, "repeat": i, "seconds": round(seconds, 3),
                         "images_per_min": round(60 * len(reqs) / seconds, 3),
                         "denoise_step_ms": [round(r.timings_ms["denoise_step"], 3) for r in results],
                         "denoise_batch": [(r.record.get("denoise_batch") or [1])[0] for r in results],
                         "timings_ms": [{k: round(v, 3) for k, v in r.timings_ms.items()} for r in results],
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                         else None})
            print(f"{mode} #{i}: {seconds:.2f} s for {len(reqs)} images = {60 * len(reqs) / seconds:.2f} images/min, "
                  f"denoise {rows[-1]['denoise_step_ms'][0]:.1f} ms/step", flush=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(alone_latents, batched_latents))
    summary = {mode: {"seconds": _summary([r["seconds"] for r in rows if r["mode"] == mode]),
                      "images_per_min": _summary([r["images_per_min"] for r in rows if r["mode"] == mode]),
                      "denoise_step_ms": _summary([r["denoise_step_ms"][0] for r in rows if r["mode"] == mode])}
               for mode in ("one_at_a_time", "batched")}
    speedup = summary["batched"]["images_per_min"]["median"] / summary["one_at_a_time"]["images_per_min"]["median"]
    out = {"command": "python -m bench.bench_batch " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or "cpu", "torch": torch.__version__,
           "triton": getattr(__import__("triton"), "__version__", None), "dtype": str(dtype).replace("torch.", ""),
           "layers": None if tiny else args.layers, "moe_dtype": "model" if tiny else "fp8-channels",
           "compile": "off" if tiny else "regions", "requests": len(reqs), "steps": args.steps, "size": args.size,
           "prompt_tokens": [len(r.prompt_ids) + 1 for r in reqs], "max_new_tokens": args.max_new_tokens,
           "cfg_mode": args.cfg_mode, "step_cache": describe(reqs[0].step_cache), "load_s": round(load_s, 1),
           "warmup_s": {"one": round(single_warm_s, 1), "batch": round(batch_warm_s, 1)},
           "target": "images/min batched >= 2.5x one at a time (4 concurrent 1024x1024, one bucket)",
           "speedup": round(speedup, 3), "max_latent_diff_batched_vs_alone": diff, "summary": summary, "rows": rows}
    print(f"images/min: one at a time {summary['one_at_a_time']['images_per_min']['median']:.2f}, batched "
          f"{summary['batched']['images_per_min']['median']:.2f}: {speedup:.2f}x (target >= 2.5x); "
          f"denoise ms/step {summary['one_at_a_time']['denoise_step_ms']['median']:.1f} -> "
          f"{summary['batched']['denoise_step_ms']['median']:.1f} for {len(reqs)}; latents differ by <= {diff:.3g}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
