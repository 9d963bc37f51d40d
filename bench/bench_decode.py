"""Where an AR decode step's time goes, end to end through the pipeline (one GPU).

    python -m bench.bench_decode [--layers 32] [--moe-dtype fp8] [--dense-dtype model|fp8]
        [--compile-mode regions|step] [--decode-impls triton,sdpa] [--tokens 64] [--out ...]

Full-width HunyuanImage-3 (random weights, `--layers` of its 32 layers; bf16, the routed
experts in FP8 by default as the one-GPU run has them), plan `single`, compiled as the CLI's
`--compile` on GPU (one region per layer; `--compile-mode step`: one graph per step), the
decode step replayed as a CUDA graph. Every `--decode-impls` entry gets its own pipeline
over the one loaded model. After a 1251-token prompt it decodes `--tokens` tokens the way
`run_ar` does and reports, per decode impl:
- step: one token's wall time as `run_ar`'s loop (dtgen/ar.py TokenDecode) has it: the
  compiled decode step launched (embedding, layers, lm_head, sampling in the graph, replayed
  as a CUDA graph), then the host reads the previous step's token (the stop check, one step
  late, so the next launch overlaps this step's device time);
- synced: the host waits for each token before launching the next step (what a batched
  decode does: its rows end at different steps);
- feed: launches alone, no token read (what the host-side launch costs);
- device: the GPU time of one step's kernels (torch.profiler), with the top kernels: the
  layers, the lm_head GEMV (a 133120 x 4096 bf16 read: ~0.25 ms at 4.3 TB/s), the sampler;
  the kernels a step launches and their time by kind (routed experts, dense GEMVs,
  attention, the rest: norms, RoPE, routing, residuals), which says whether the step is
  bound by bytes or by the number of small kernels.
Floor: the bytes a token must read (every weight but the experts not routed to, plus the
KV cache) at 4.3 TB/s. The gap between wall and device time is host overhead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.3e12


def _ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def _kind(name: str) -> str:
    n = name.lower()
    if "decode_gate_up" in n or "decode_down" in n or "moe" in n or "expert" in n:
        return "routed_experts"
    if "nvjet" in n or "gemv" in n or "gemm" in n or "fp8_linear" in n or "scaled_mm" in n or "cutlass" in n:
        return "dense_gemv"
    if "sdpa" in n or "attention" in n or "flash" in n or "split_kv" in n or "qk_norm_rope" in n:
        return "attention"
    return "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1251)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--moe-dtype", choices=("model", "fp8"), default="fp8")
    p.add_argument("--dense-dtype", choices=("model", "fp8"), default="model")
    p.add_argument("--compile-mode", choices=("regions", "step"), default="regions")
    p.add_argument("--decode-impls", default="triton,sdpa", help="comma list of DECODE_IMPLS, each measured")
    p.add_argument("--kernels", type=int, default=40, help="kernels listed per impl")
    p.add_argument("--out", default="outputs/bench_decode.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU; nothing to do here.")
        return 0
    from dtgen.ar import TokenReader
    from dtgen.compile import CompileOptions
    from models.hunyuan_image3.loading import load
    from dtgen.sampling import Sampling
    from models.hunyuan_image3.ar import DECODE_IMPLS
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.presets import full_config
    from placements.hunyuan_image3 import get_plan
    from torch.profiler import ProfilerActivity, profile

    impls = args.decode_impls.split(",")
    for impl in impls:
        if impl not in DECODE_IMPLS:
            raise SystemExit(f"error: --decode-impls: {impl!r} is not one of {DECODE_IMPLS}")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, torch.bfloat16, device, moe_impl="auto",
                  random_config=full_config(args.layers), moe_dtype=args.moe_dtype, dense_dtype=args.dense_dtype)
    load_s = time.perf_counter() - t0
    model = loaded.model
    cfg = model.cfg

    # Bytes one token must read: the text stack's weights (of the experts only the top-k
    # routed ones), the final norm, the lm_head, and the KV cache up to this position.
    def nbytes(t):
        return t.numel() * t.element_size()
    dense_bytes = sum(nbytes(p) for n, p in model.named_parameters()
                      if (n.startswith(("model.layers.", "model.ln_f", "lm_head")) and ".experts." not in n))
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(nbytes(p) for p in experts.parameters()) / cfg.num_experts
    routed_bytes = cfg.num_hidden_layers * cfg.moe_topk[0] * per_expert
    results = {"command": "python -m bench.bench_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": getattr(__import__("triton"), "__version__", None), "layers": args.layers,
               "moe_dtype": args.moe_dtype, "dense_dtype": args.dense_dtype, "compile_mode": args.compile_mode,
               "prompt_tokens": args.prompt_tokens + 1, "load_s": round(load_s, 1),
               "bytes": {"dense": dense_bytes, "routed_experts": routed_bytes}, "hbm_bytes_per_s": HBM_BYTES_PER_S,
               "impls": {}}
    for impl in impls:
        pipe = HunyuanT2IPipeline(model, loaded.tokenizer, loaded.controller, device, decode_impl=impl,
                                  compile_options=CompileOptions(enabled=True, regions=args.compile_mode == "regions"))
        rt = pipe.controller.activate("ar")
        ids = [pipe.special.bos] + [5 + i % 200 for i in range(args.prompt_tokens)]
        budget = len(ids) + 2 * args.tokens + 64
        cache = pipe._cache(rt, 1, budget)
        generator = torch.Generator(device=device).manual_seed(0)
        sampling = Sampling(0.6, 1024, 0.95).step_args(cfg.vocab_size, device)      # the pipeline's defaults
        with torch.no_grad():
            t0 = time.perf_counter()
            _, token = pipe._feed(pipe._prefill_fn, rt, ids, 0, cache, budget, sampling, generator, static_slots=True)
            pos = len(ids)

            reader = TokenReader(device)
            reader.push(token)

            def step():   # what run_ar does per token: launch the step, then read the previous token
                nonlocal token, pos
                _, token = pipe._feed(pipe._decode_fn, rt, token.view(1, 1), pos, cache, budget, sampling, generator)
                reader.pop()
                reader.push(token)
                pos += 1

            def synced():   # the token to the host before the next step is launched
                nonlocal token, pos
                int(token)
                _, token = pipe._feed(pipe._decode_fn, rt, token.view(1, 1), pos, cache, budget, sampling, generator)
                pos += 1

            def feed():   # the step without waiting for its token
                nonlocal token, pos
                _, token = pipe._feed(pipe._decode_fn, rt, token.view(1, 1), pos, cache, budget, sampling, generator)
                pos += 1

            for _ in range(5):          # compile, record the CUDA graph, warm up
                step()
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            step_runs = [_ms(step, max(1, args.tokens // 8)) for _ in range(4)]
            synced_ms = _ms(synced, args.tokens // 4)
            feed_ms = _ms(feed, args.tokens // 4)
            iters = 8
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    step()
                torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sorted(((e.key[:90], e.self_device_time_total / iters, e.count / iters) for e in events
                          if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda r: -r[1])
        if not kernels:   # older profilers: device time on the CPU-side rows
            kernels = sorted(((e.key[:90], e.self_device_time_total / iters, e.count / iters) for e in events
                              if e.self_device_time_total > 0), key=lambda r: -r[1])
        device_us = sum(us for _, us, _ in kernels)
        by_kind: dict[str, dict] = {}
        for name, us, n in kernels:
            row = by_kind.setdefault(_kind(name), {"us": 0.0, "launches": 0.0})
            row["us"] += us
            row["launches"] += n
        kv_bytes = sum(nbytes(layer.k) + nbytes(layer.v) for layer in cache.layers) * pos / cache.length
        floor_ms = (dense_bytes + routed_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        step_ms = statistics.median(step_runs)
        results["impls"][impl] = {
            "step_ms": {"median": step_ms, "min": min(step_runs), "max": max(step_runs), "runs": step_runs},
            "synced_ms": synced_ms, "feed_ms": feed_ms, "device_ms": device_us / 1e3, "floor_ms": floor_ms, "warmup_s": round(warm_s, 1),
            "kernel_launches_per_step": sum(n for _, _, n in kernels),
            "by_kind": {k: {"ms": round(v["us"] / 1e3, 4), "launches": v["launches"]} for k, v in by_kind.items()},
            "kernels": [(k, round(us, 2), n) for k, us, n in kernels[:args.kernels]]}
        print(f"AR decode [{impl}], {args.layers} layers: step {step_ms:.3f} ms/token (runs "
              f"{min(step_runs):.3f}-{max(step_runs):.3f}; each token waited for {synced_ms:.3f}; launches alone "
              f"{feed_ms:.3f}); device "
              f"{device_us / 1e3:.3f} ms in {sum(n for _, _, n in kernels):.0f} launches; floor {floor_ms:.3f} ms",
              flush=True)
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["us"]):
            print(f"  {k:15s} {v['us'] / 1e3:7.3f} ms  {v['launches']:6.0f} launches")
        for k, us, n in kernels[:args.kernels]:
            print(f"  gpu {us:>9.1f} us x{n:5.0f}  {k}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        del pipe, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
