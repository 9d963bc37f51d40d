"""Fewer full denoise steps, end to end on one GPU: HunyuanImage-3 with its step caches
against every step in full, in one process per model.

    python -m bench.bench_step_cache --model t2i --out t2i.json      # T2I and TI2I (one model, editing on)
    python -m bench.bench_step_cache --model distil --out distil.json  # the Instruct-Distil sampler
    python -m bench.bench_step_cache --model t2i --tiny               # the same runs, tiny, on the CPU

Random weights at the released shapes (`--layers`, 32; `--model distil`: Instruct-Distil's
config, cfg_distilled + use_meanflow), FP8 experts (channels), compiled with one region per
layer; 1251 prompt tokens and 256 forced AR tokens, 1024x1024 (the shapes of the step caches'
targets). TI2I: a random 1024x1024 reference and a system prompt that makes the edit's
prefill ~6.3k rows, as in the seed's TI2I measurement. Every shape is warmed up first (its
full, KV-cached and cached-step graphs), then each run repeats `--repeats` times (the
uncached 50-step baselines once: 20 s and more each). The JSON holds every repeat; the
printed table gives the median and the range.
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

from dtgen.compile import CompileOptions
from dtgen.host import settle_heap
from dtgen.step_cache import TaylorConfig, describe
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest, filler_ids, warmup_request
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.tiny import tiny_config
from placements.hunyuan_image3 import get_plan

# The official command line's defaults (interval 5, order 2); the distilled golden's knobs.
TAYLOR = TaylorConfig()
DISTIL_TAYLOR = TaylorConfig(interval=3, first_enhance=True)


def _runs(model: str, steps: int, tiny: bool) -> list[tuple[str, dict, int]]:
    """(name, request fields, repeats)."""
    size = "256x256" if tiny else "1024x1024"
    t2i = dict(prompt_ids=filler_ids(1250 if not tiny else 30), max_new_tokens=256 if not tiny else 4,
               ignore_stop=True, image_size=size, seed=1)
    if model == "distil":
        return [("distil", dict(t2i, steps=8, guidance=2.5), 3),
                ("distil_taylor", dict(t2i, steps=8, guidance=2.5, step_cache=DISTIL_TAYLOR), 3)]
    gen = torch.Generator().manual_seed(5)
    side = 256 if tiny else 1024
    reference = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=gen)
    # ~1150 text rows before the image rows, as the seed's TI2I prefill (6290 rows at 1024 px)
    system = "You edit images as the user asks, keeping everything else unchanged. " * (16 if not tiny else 1)
    ti2i = dict(t2i, prompt_ids=None, prompt="make the sky a deep red at sunset", reference=reference,
                system_prompt=system, image_size="auto")
    return [("t2i_taylor", dict(t2i, steps=steps, step_cache=TAYLOR), 3),
            ("t2i_full", dict(t2i, steps=steps), 1),
            ("ti2i_taylor", dict(ti2i, steps=steps, step_cache=TAYLOR), 3),
            ("ti2i_full", dict(ti2i, steps=steps), 1)]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def deviation(out: str | None) -> int:
    """Each cache's deviation from the uncached run on the tiny golden-taylor cases (CPU,
    float32, dtgen's own runs): final latents' relative L2 and the image's largest uint8
    difference, beside the share of steps computed in full (what the cache saves)."""
    from models.hunyuan_image3.pipeline import to_uint8
    from models.hunyuan_image3.requests import RequestRun
    # The golden harness is test support (tests/support/, not installed): run from a checkout.
    from tests.support.golden import GoldenCase, discover_taylor_cases, sampling_runs, sampling_request
    from tests.support.golden import sampling_sequence
    rows = []
    for folder in discover_taylor_cases():
        case = GoldenCase(folder)
        loaded = load(folder, get_plan("single"), dtype=torch.float32)
        pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
        finals = {}
        for run in sampling_runs(case):
            req = sampling_request(case, run)
            r = RequestRun.fresh(pipe.device)
            latents = pipe.run_denoise(req, sampling_sequence(case, pipe), r)
            report = (r.record.get("step_cache") or [None])[0]
            finals[run] = (req, latents, to_uint8(pipe.decode_image(latents)).int(), report)
        base_name = next(n for n, (req, *_rest) in finals.items() if req.step_cache is None)
        _, base, base_image, _ = finals[base_name]
        for run, (req, latents, image, report) in finals.items():
            if req.step_cache is None:
                continue
            full = len(report["full_steps"])
            rows.append({"case": folder.name, "run": run, "against": base_name, "config": describe(req.step_cache),
                         "steps": req.steps, "full_steps": full, "step_share_computed": full / req.steps,
                         "final_latents_rel_l2": float((latents - base).norm() / base.norm()),
                         "image_uint8_max_abs_diff": int((image - base_image).abs().max())})
            print(json.dumps(rows[-1]), flush=True)
    print("| case | run | full steps | final latents rel L2 vs uncached | image max diff (of 255) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['run']} | {r['full_steps']} of {r['steps']} | {r['final_latents_rel_l2']:.3f} | "
              f"{r['image_uint8_max_abs_diff']} |")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"command": "python -m bench.bench_step_cache --deviation --out " + out,
                                         "date": time.strftime("%Y-%m-%d"), "device": "cpu", "dtype": "float32",
                                         "torch": torch.__version__, "rows": rows}, indent=2))
        print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_step_cache")
    p.add_argument("--deviation", action="store_true",
                   help="instead: each cache's deviation from the uncached run on the tiny golden cases (CPU)")
    p.add_argument("--model", choices=("t2i", "distil"), default="t2i")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=None, help="repeats of every run (default: 3, baselines 1)")
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all of the model's)")
    p.add_argument("--tiny", action="store_true", help="the tiny architecture on the CPU (a smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.deviation:
        return deviation(args.out)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    distil = args.model == "distil"
    config = tiny_config(2) if args.tiny else full_config(args.layers, distilled=distil)
    if args.tiny and distil:
        config.update(cfg_distilled=True, use_meanflow=True)
        config["tiny_special_token_ids" if "tiny_special_token_ids" in config else "special_token_ids"].update(
            {"<guidance>": 491, "<timestep_r>": 492})
    runs = _runs(args.model, args.steps, args.tiny)
    if args.runs:
        wanted = args.runs.split(",")
        unknown = sorted(set(wanted) - {r[0] for r in runs})
        if unknown:
            raise SystemExit(f"error: --runs {unknown}: this model's runs are {[r[0] for r in runs]}")
        runs = [r for r in runs if r[0] in wanted]
    editing = any("reference" in fields for _, fields, _ in runs)
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, dtype, device, random_config=config,
                  moe_dtype="fp8" if device.type == "cuda" else "model", image_editing=editing)
    load_s = time.perf_counter() - t0
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=device.type == "cuda", regions=True))
    requests = {name: T2IRequest(**fields) for name, fields, _ in runs}
    # Warm up every shape once (full, KV-cached and cached steps: warmup_request), untimed.
    warm = {}
    for name, req in requests.items():
        key = "edit" if req.reference is not None else "t2i"   # the shapes; the cache changes none
        if key not in warm:
            t0 = time.perf_counter()
            pipe.generate(warmup_request(replace(req, forced_tokens=filler_ids(req.max_new_tokens)), cached_step=True))
            warm[key] = round(time.perf_counter() - t0, 1)
            print(f"warm-up {name}: {warm[key]} s", flush=True)
    settle_heap()
    rows = []
    for name, fields, repeats in runs:
        req = requests[name]
        for i in range(args.repeats or repeats):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            result = pipe.generate(req)
            t = {k: round(v, 3) for k, v in result.timings_ms.items()}
            report = (result.record.get("step_cache") or [None])[0]
            rows.append({"run": name, "repeat": i, "steps": req.steps, "timings_ms": t,
                         "step_cache": describe(req.step_cache),
                         "full_steps": report["full_steps"] if report else list(range(req.steps)),
                         "tokens": len(result.tokens), "edit": req.reference is not None,
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                         else None})
            print(f"{name} #{i}: total {t['total']:.0f} ms, denoise {t['denoise_step']:.1f} ms/step "
                  f"(full {t.get('denoise_full_step', t['denoise_step']):.1f}, cached "
                  f"{t.get('denoise_cached_step', float('nan')):.2f}), AR {t['ar_decode_per_token']:.2f} ms/token",
                  flush=True)
    summary = {}
    for name, _, _ in runs:
        mine = [r for r in rows if r["run"] == name]
        s = {"total_ms": _summary([r["timings_ms"]["total"] for r in mine]),
             "full_steps": len(mine[0]["full_steps"]), "steps": mine[0]["steps"]}
        for key in ("denoise_full_step", "denoise_cached_step", "denoise_first_step", "ar_decode_per_token",
                    "ar_prefill", "vae_decode", "condition_encode"):
            if all(key in r["timings_ms"] for r in mine):
                s[key + "_ms"] = _summary([r["timings_ms"][key] for r in mine])
        if "denoise_cached_step_ms" in s and "denoise_full_step_ms" in s:
            s["cached_over_full"] = s["denoise_cached_step_ms"]["median"] / s["denoise_full_step_ms"]["median"]
        peaks = [r["peak_memory_bytes"] for r in mine if r["peak_memory_bytes"]]
        if peaks:
            s["peak_memory_gb"] = max(peaks) / 1e9
        summary[name] = s
    out = {"command": "python -m bench.bench_step_cache " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or "cpu", "torch": torch.__version__,
           "triton": getattr(__import__("triton"), "__version__", None), "dtype": str(dtype).replace("torch.", ""),
           "model": args.model, "layers": None if args.tiny else args.layers, "moe_dtype": "fp8-channels"
           if device.type == "cuda" else "model", "compile": "regions" if device.type == "cuda" else "off",
           "load_s": round(load_s, 1), "warmup_s": warm, "summary": summary, "rows": rows}
    print("| run | steps (full) | total ms, median (range) | full step ms | cached step ms | cached / full | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        tot = s["total_ms"]
        full = s.get("denoise_full_step_ms", {}).get("median")
        cached = s.get("denoise_cached_step_ms", {}).get("median")
        ratio = s.get("cached_over_full")
        print(f"| {name} | {s['steps']} ({s['full_steps']}) | {tot['median']:.0f} ({tot['min']:.0f}-{tot['max']:.0f}) | "
              f"{'-' if full is None else f'{full:.1f}'} | {'-' if cached is None else f'{cached:.2f}'} | "
              f"{'-' if ratio is None else f'{100 * ratio:.1f}%'} | {s.get('peak_memory_gb', float('nan')):.1f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
