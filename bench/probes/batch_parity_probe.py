"""A probe (one H200, 2026-12-02): are batched denoise steps equal to the same requests alone on
CUDA? 4 requests of one bucket (bench_batch's), full width, --layers layers, in float32 (where
the difference must be rounding: ~1e-5) and bf16, eager and compiled regions; the first step's
velocity and the final latents, batched against alone (relative L2 per request)."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from bench.bench_batch import _requests
from dtgen.batching import per_member
from dtgen.compile import CompileOptions
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.tiny import tiny_config
from placements.hunyuan_image3 import get_plan


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="CPU check of this script")
    args = p.parse_args()
    dev = torch.device("cpu" if args.tiny else "cuda")
    out = {"command": "python -m bench.probes.batch_parity_probe --layers %d" % args.layers, "rows": []}
    reqs = _requests(SimpleNamespace(batch=4, steps=3, size="256x256" if args.tiny else "1024x1024", max_new_tokens=0,
                                     cfg_mode="serial", step_cache=None), tiny=args.tiny)
    runs = ((torch.float32, False),) if args.tiny else (
        (torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True))
    for dtype, compiled in runs:
        t0 = time.perf_counter()
        loaded = load(None, get_plan("single"), 0, 1, dtype, dev, random_config=tiny_config(2) if args.tiny else full_config(args.layers))
        pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, dev,
                                  compile_options=CompileOptions(enabled=compiled, regions=True),
                                  prompt_bucket=16 if args.tiny else 256)
        alone = [pipe.generate(r) for r in reqs]
        batched = pipe.generate_batch(reqs, per_member([lambda *a: None] * 4))
        for k, (a, b) in enumerate(zip(alone, batched)):
            row = {"dtype": str(dtype), "compiled": compiled, "request": k,
                   "velocity0_rel_l2": rel(b.record["velocity"][0], a.record["velocity"][0]),
                   "latents_rel_l2": rel(b.latents, a.latents), "latents_max_abs": float((b.latents.float().cpu() - a.latents.float().cpu()).abs().max()),
                   "latents_std": float(a.latents.float().std())}
            out["rows"].append(row)
            print(row, flush=True)
        # the control: the same requests alone again, with CFG as one batch (other GEMM shapes)
        ctrl = pipe.generate(replace(reqs[0], cfg_mode="batch"))
        print({"control_cfg_batch_vs_serial_latents_rel_l2": rel(ctrl.latents, alone[0].latents), "dtype": str(dtype),
               "compiled": compiled}, flush=True)
        out["rows"].append({"control_cfg_batch_vs_serial_latents_rel_l2": rel(ctrl.latents, alone[0].latents),
                            "dtype": str(dtype), "compiled": compiled})
        print(f"{dtype} compiled={compiled}: {time.perf_counter() - t0:.0f} s", flush=True)
        del pipe, loaded
        torch.cuda.empty_cache()
        open(args.out, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
