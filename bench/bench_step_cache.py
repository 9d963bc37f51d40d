"""Fewer full denoise steps: HunyuanImage-3 end to end with its step caches against every step in full,
and each step cache's deviation from the uncached run.

`--model t2i` (T2I and TI2I on one model, editing on) or `distil` (the Instruct-Distil sampler): random
weights at the released shapes (`--layers` of 32), FP8 experts, one compiled region per layer, 1251 prompt
tokens and 256 forced AR tokens, 1024x1024; the TI2I edit a random reference and a system prompt that
make its prefill ~6.3k rows. Every shape warmed up first, then each run `--repeats` times (the uncached
50-step baselines once); the JSON holds every repeat and each run's median and range. `--tiny`: the same
runs at tiny shapes on the CPU.
`--deviation` (CPU, float32): with `--model t2i`, each cache on the tiny golden-taylor cases (final
latents' relative L2 and the image's largest uint8 difference against the uncached run); with `--model
wan`, each Wan cache on the tiny Wan default (2 blocks, 9 frames 48x64, CFG 5.0, UniPC): its deviation,
the share of block evaluations it ran, and its denoise time against the uncached run's (MagCache's ratios
calibrated on another seed and prompt first).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import torch

from bench.harness import Bench, rel_err, summary

MODULE = "bench.bench_step_cache"
# (name, spec) of Wan's caches; "{ratios}" is replaced by the calibrated ratios
WAN_CACHES = (
    ("first-block 0.05 (diffusers' default)", "first-block:threshold=0.05"),
    ("first-block 0.1", "first-block:threshold=0.1"),
    ("taylorseer (diffusers' defaults: interval 5, from step 3, order 1, bf16 factors)", "taylorseer"),
    ("taylorseer interval 3, order 2, float32 factors", "taylorseer:interval=3,order=2,factors_dtype=float32"),
    ("magcache (diffusers' defaults: threshold 0.06, 3 skips, retention 0.2)", "magcache:mag_ratios={ratios}"),
    ("taylor (HunyuanImage-3's official: interval 5, order 2)", "taylor"),
)


def _runs(model: str, steps: int, tiny: bool) -> list[tuple[str, dict, int]]:
    """(name, request fields, repeats) of a model's runs."""
    from dtgen.step_cache import TaylorConfig
    from models.hunyuan_image3.requests import filler_ids
    t2i = dict(prompt_ids=filler_ids(30 if tiny else 1250), max_new_tokens=4 if tiny else 256, ignore_stop=True,
               image_size="256x256" if tiny else "1024x1024", seed=1)
    if model == "distil":   # the distilled golden's knobs
        return [("distil", dict(t2i, steps=8, guidance=2.5), 3),
                ("distil_taylor", dict(t2i, steps=8, guidance=2.5,
                                       step_cache=TaylorConfig(interval=3, first_enhance=True)), 3)]
    side = 256 if tiny else 1024
    reference = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    system = "You edit images as the user asks, keeping everything else unchanged. " * (1 if tiny else 16)
    ti2i = dict(t2i, prompt_ids=None, prompt="make the sky a deep red at sunset", reference=reference,
                system_prompt=system, image_size="auto")
    taylor = TaylorConfig()   # the official command line's defaults (interval 5, order 2)
    return [("t2i_taylor", dict(t2i, steps=steps, step_cache=taylor), 3), ("t2i_full", dict(t2i, steps=steps), 1),
            ("ti2i_taylor", dict(ti2i, steps=steps, step_cache=taylor), 3), ("ti2i_full", dict(ti2i, steps=steps), 1)]


def hunyuan_deviation(b: Bench) -> int:
    from dtgen.step_cache import describe
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline, to_uint8
    from models.hunyuan_image3.requests import RequestRun
    from placements.hunyuan_image3 import get_plan
    # the golden harness is test support (tests/support/, not installed): run from a checkout
    from tests.support.golden import (GoldenCase, discover_taylor_cases, sampling_request, sampling_runs,
                                      sampling_sequence)
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
            finals[run] = (req, latents, to_uint8(pipe.decode_image(latents)).int(),
                           (r.record.get("step_cache") or [None])[0])
        base_name = next(n for n, (req, *_rest) in finals.items() if req.step_cache is None)
        _, base, base_image, _ = finals[base_name]
        for run, (req, latents, image, report) in finals.items():
            if req.step_cache is not None:
                full = len(report["full_steps"])
                rows.append({"case": folder.name, "run": run, "against": base_name, "config": describe(req.step_cache),
                             "steps": req.steps, "full_steps": full, "step_share_computed": full / req.steps,
                             "final_latents_rel_l2": rel_err(latents, base),
                             "image_uint8_max_abs_diff": int((image - base_image).abs().max())})
                print(rows[-1], flush=True)
    b.write({"dtype": "float32", "rows": rows}, "cpu")
    return 0


def wan_deviation(b: Bench, steps: int, repeats: int) -> int:
    import os

    from models import registry
    from models.wan.pipeline import WanT2VPipeline   # the pipeline whose step caches this measures
    torch.set_num_threads(1)
    wan = registry.spec("wan")   # its tiny default, loader, plans and request
    load_before = os.getloadavg()[0]
    loaded = wan.load("loader")(wan.load("tiny")(), wan.load("plans").PLANS["single"])
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    blocks = len(loaded.model.transformer.blocks)
    req = wan.load("request")(prompt="A red fox runs through fresh snow at golden hour, cinematic", height=48,
                              width=64, num_frames=9, steps=steps, guidance_scale=5.0, seed=0)

    def run(spec):
        times, result = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = pipe.generate(replace(req, step_cache=spec), decode=False)
            times.append((time.perf_counter() - t0) * 1e3 - result.timings_ms["encode"])
        return result, statistics.median(times)

    calibration = pipe.generate(replace(req, prompt="a small bird flies over the sea at night", seed=1,
                                        step_cache="magcache:calibrate=true"), decode=False)
    ratios = "/".join(f"{r:.5f}" for r in calibration.record["step_cache"]["mag_ratios"])
    base, base_ms = run(None)
    rows = []
    for name, spec in WAN_CACHES:
        result, ms = run(spec.format(ratios=ratios))
        report = result.record["step_cache"]
        if report["method"] == "first-block":   # block 0 always runs; the others where a row runs in full
            evaluations = sum(1 + (blocks - 1) * sum(full) / len(full) for full in report["full_rows"])
        else:
            evaluations = blocks * len(report["full_steps"])
        rows.append({"cache": name, "spec": spec if report["method"] != "magcache" else "magcache:mag_ratios=...",
                     "full_steps": len(report["full_steps"]), "cached_steps": len(report["cached_steps"]),
                     "full_step_list": report["full_steps"], "rel_l2_final_latents": rel_err(result.latents,
                                                                                            base.latents),
                     "max_abs_diff_final_latents": float((result.latents - base.latents).abs().max()),
                     "block_share": round(evaluations / (blocks * steps), 4), "denoise_ms": round(ms, 1),
                     "measured_speedup": round(base_ms / ms, 3)})
        print(f"{name}: {rows[-1]['full_steps']} full, rel L2 {rows[-1]['rel_l2_final_latents']:.2e}, block share "
              f"{rows[-1]['block_share']:.1%}, {rows[-1]['measured_speedup']:.2f}x", flush=True)
    b.write({"what": "tiny Wan default (2 blocks, 36 tokens a step, 9 frames 48x64), float32, CPU, 1 thread, CFG "
                     "5.0 batch of 2, UniPC; deviation = final latents against the uncached run", "steps": steps,
             "uncached_denoise_ms": round(base_ms, 1),
             "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],   # other jobs on the cores
             "magcache_ratios_calibrated_on": "seed 1, 'a small bird flies over the sea at night'",
             "magcache_ratios": [float(r) for r in ratios.split("/")], "caches": rows}, "cpu")
    return 0


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--deviation", action="store_true", help="instead: each cache's deviation (CPU, tiny models)")
    p.add_argument("--model", choices=("t2i", "distil", "wan"), default="t2i", help="wan: with --deviation only")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=None, help="repeats of every run (default: 3, baselines 1)")
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all of the model's)")
    p.add_argument("--tiny", action="store_true", help="the tiny architecture on the CPU (a smoke test)")
    args = b.parse()
    if args.deviation:
        return wan_deviation(b, args.steps, args.repeats or 3) if args.model == "wan" else hunyuan_deviation(b)
    if args.model == "wan":
        p.error("--model wan: only with --deviation (bench.bench_wan_cache times Wan's caches)")
    from dtgen.compile import CompileOptions
    from dtgen.host import settle_heap
    from dtgen.step_cache import describe
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.presets import full_config
    from models.hunyuan_image3.requests import T2IRequest, filler_ids, warmup_request
    from models.hunyuan_image3.tiny import tiny_config
    from placements.hunyuan_image3 import get_plan

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    distil = args.model == "distil"
    config = tiny_config(2) if args.tiny else full_config(args.layers, distilled=distil)
    if args.tiny and distil:
        config.update(cfg_distilled=True, use_meanflow=True)
        config["tiny_special_token_ids" if "tiny_special_token_ids" in config else "special_token_ids"].update(
            {"<guidance>": 491, "<timestep_r>": 492})
    runs = _runs(args.model, args.steps, args.tiny)
    if args.runs:
        unknown = sorted(set(args.runs.split(",")) - {r[0] for r in runs})
        if unknown:
            p.error(f"--runs {unknown}: this model's runs are {[r[0] for r in runs]}")
        runs = [r for r in runs if r[0] in args.runs.split(",")]
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, torch.bfloat16 if cuda else torch.float32, device,
                  random_config=config, moe_dtype="fp8" if cuda else "model",
                  image_editing=any("reference" in fields for _, fields, _ in runs))
    load_s = time.perf_counter() - t0
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=cuda, regions=True))
    requests = {name: T2IRequest(**fields) for name, fields, _ in runs}
    warm = {}
    for name, req in requests.items():   # every shape once (full, KV-cached and cached steps), untimed
        key = "edit" if req.reference is not None else "t2i"   # the shapes; the cache changes none
        if key not in warm:
            t0 = time.perf_counter()
            pipe.generate(warmup_request(replace(req, forced_tokens=filler_ids(req.max_new_tokens)), cached_step=True))
            warm[key] = round(time.perf_counter() - t0, 1)
    settle_heap()
    rows = []
    for name, fields, repeats in runs:
        req = requests[name]
        for i in range(args.repeats or repeats):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            result = pipe.generate(req)
            t = {k: round(v, 3) for k, v in result.timings_ms.items()}
            report = (result.record.get("step_cache") or [None])[0]
            rows.append({"run": name, "repeat": i, "steps": req.steps, "timings_ms": t,
                         "step_cache": describe(req.step_cache),
                         "full_steps": report["full_steps"] if report else list(range(req.steps)),
                         "tokens": len(result.tokens), "edit": req.reference is not None,
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None})
            print(f"{name} #{i}: total {t['total']:.0f} ms, denoise {t['denoise_step']:.1f} ms/step (full "
                  f"{t.get('denoise_full_step', t['denoise_step']):.1f}, cached "
                  f"{t.get('denoise_cached_step', float('nan')):.2f})", flush=True)
    runs_summary = {}
    for name, _, _ in runs:
        mine = [r for r in rows if r["run"] == name]
        s = {"total_ms": summary([r["timings_ms"]["total"] for r in mine]),
             "full_steps": len(mine[0]["full_steps"]), "steps": mine[0]["steps"]}
        for key in ("denoise_full_step", "denoise_cached_step", "denoise_first_step", "ar_decode_per_token",
                    "ar_prefill", "vae_decode", "condition_encode"):
            if all(key in r["timings_ms"] for r in mine):
                s[key + "_ms"] = summary([r["timings_ms"][key] for r in mine])
        if "denoise_cached_step_ms" in s and "denoise_full_step_ms" in s:
            s["cached_over_full"] = s["denoise_cached_step_ms"]["median"] / s["denoise_full_step_ms"]["median"]
        peaks = [r["peak_memory_bytes"] for r in mine if r["peak_memory_bytes"]]
        if peaks:
            s["peak_memory_gb"] = max(peaks) / 1e9
        runs_summary[name] = s
    b.write({"dtype": "bfloat16" if cuda else "float32", "model": args.model,
             "layers": None if args.tiny else args.layers, "moe_dtype": "fp8-channels" if cuda else "model",
             "compile": "regions" if cuda else "off", "load_s": round(load_s, 1), "warmup_s": warm,
             "summary": runs_summary, "rows": rows}, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
