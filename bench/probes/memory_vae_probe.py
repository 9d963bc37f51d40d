"""A probe (one H200, 2026-12-02): where the peak over the weights goes in the 32-layer T2I/TI2I
run, and where the fp32 VAE decode spends its time. Prints tables; writes JSON to --out."""
from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import replace

import torch

from dtgen.compile import CompileOptions
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest, filler_ids, warmup_request
from models.hunyuan_image3.presets import full_config
from placements.hunyuan_image3 import get_plan

GB = 1e9


def live_at_peak(snapshot) -> tuple[int, list]:
    """Replay the recorded allocator trace: the largest total of blocks allocated during the
    recording, and those blocks grouped by their first project frame."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, total, best, best_live = {}, 0, -1, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] in ("free_completed",):
            old = live.pop(e["addr"], None)
            if old is not None:
                total -= old["size"]
        if total > best:
            best, best_live = total, dict(live)
    groups = collections.Counter()
    for e in best_live.values():
        where = "?"
        for f in e.get("frames", []):
            fn = f.get("filename", "")
            if any(k in fn for k in ("/dtgen/", "/models/", "/kernels/")):
                where = f"{fn.split('/')[-2]}/{fn.split('/')[-1]}:{f.get('line')} {f.get('name')}"
                break
        groups[where] += e["size"]
    return best, groups.most_common(25)


def run_one(pipe, req, device):
    peaks = collections.OrderedDict()
    state = {"phase": None}

    def progress(phase, done, total):
        if phase != state["phase"]:
            if state["phase"] is not None:
                peaks[state["phase"]] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            state["phase"] = phase
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    result = pipe.generate(req, progress=progress)
    torch.cuda.synchronize()
    peaks[state["phase"]] = torch.cuda.max_memory_allocated(device)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    best, groups = live_at_peak(snap)
    return base, peaks, best, groups, result.timings_ms


def vae_probe(device, out):
    from bench.bench_vae import OFFICIAL_VAE, build_vae
    rows = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        vae = build_vae(OFFICIAL_VAE, dtype, device)
        z = torch.randn(1, 32, 64, 64, device=device, dtype=dtype)
        with torch.no_grad():
            for _ in range(2):
                vae.decode(z)
            torch.cuda.synchronize()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter(); vae.decode(z); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
            rows[name] = ts
            print(f"VAE decode {name}: {[round(t, 1) for t in ts]} ms; peak {torch.cuda.max_memory_allocated() / GB:.1f} GB",
                  flush=True)
            if name == "fp32":
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    vae.decode(z); torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=90)
                print(table)
                (out / "vae_fp32_profile.txt").write_text(table)
        del vae
        torch.cuda.empty_cache()
    return rows


def vae_is_5d(vae) -> bool:
    return any(isinstance(m, torch.nn.Conv3d) for m in vae.modules())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    from pathlib import Path
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    vae_rows = vae_probe(device, out)
    loaded = load(None, get_plan("single"), 0, 1, torch.bfloat16, device, random_config=full_config(args.layers),
                  moe_dtype="fp8", image_editing=True)
    print(f"weights: {torch.cuda.memory_allocated() / GB:.2f} GB", flush=True)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=True, regions=True))
    t2i = T2IRequest(prompt_ids=filler_ids(1250), max_new_tokens=256, ignore_stop=True, image_size="1024x1024",
                     seed=1, steps=10)
    gen = torch.Generator().manual_seed(5)
    ref = torch.randint(0, 256, (1024, 1024, 3), dtype=torch.uint8, generator=gen)
    system = "You edit images as the user asks, keeping everything else unchanged. " * 16
    ti2i = replace(t2i, prompt_ids=None, prompt="make the sky a deep red at sunset", reference=ref,
                   system_prompt=system, image_size="auto")
    result = {"vae_ms": vae_rows}
    for name, req in (("t2i", t2i), ("ti2i", ti2i)):
        t0 = time.perf_counter()
        pipe.generate(warmup_request(replace(req, forced_tokens=filler_ids(req.max_new_tokens))))
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        base, peaks, best, groups, timings = run_one(pipe, req, device)
        print(f"== {name}: allocated before the request {base / GB:.2f} GB; peak per phase (GB): "
              + ", ".join(f"{k} {v / GB:.2f}" for k, v in peaks.items()))
        print(f"   most allocated during the request {best / GB:.2f} GB over it; live then, by site:")
        for where, size in groups:
            print(f"   {size / GB:8.3f} GB  {where}")
        print("   timings:", {k: round(v, 1) for k, v in timings.items()}, flush=True)
        result[name] = {"before_gb": base / GB, "peaks_gb": {k: v / GB for k, v in peaks.items()},
                        "over_gb": best / GB, "sites": [(w, s / GB) for w, s in groups], "timings_ms": timings}
        (out / "memory_vae_probe.json").write_text(json.dumps(result, indent=1))
    # Where a T2I request's GPU time goes, by kernel (3 steps, 16 tokens; CUDA-graph decode off
    # so the decode kernels show too).
    from torch.profiler import ProfilerActivity, profile
    pipe2 = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                               compile_options=CompileOptions(enabled=True, regions=True, decode_cuda_graph=False))
    short = replace(t2i, steps=4, max_new_tokens=24)
    pipe2.generate(short)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = pipe2.generate(short)
        torch.cuda.synchronize()
    print("timings", {k: round(v, 1) for k, v in r.timings_ms.items()})
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=110)
    print(table)
    (out / "t2i_kernels.txt").write_text(table)


if __name__ == "__main__":
    main()
