"""Where HunyuanImage-3's AR decode step's time goes, end to end through the pipeline (one GPU).

Full-width model (random weights, `--layers` of 32), plan `single`, compiled as the CLI's `--compile`
(`--compile-mode`), the step replayed as a CUDA graph; each `--decode-impls` entry its own pipeline
over the one model. After a 1251-token prompt, per impl: `step` (a token as run_ar's loop has it:
launch, then read the previous token), `synced` (the host waits for each token), `feed` (launches
alone), `device` (the kernels' GPU time, torch.profiler, by kind and the top kernels). Floor: the
bytes a token reads (weights but the experts not routed to, plus the KV cache) at 4.3 TB/s.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.floors import HBM_TBPS
from bench.harness import Bench, kernel_profile, need_cuda, wall_ms

MODULE = "bench.bench_decode"


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1251)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--moe-dtype", choices=("model", "fp8"), default="fp8")
    p.add_argument("--dense-dtype", choices=("model", "fp8"), default="model")
    p.add_argument("--compile-mode", choices=("regions", "step"), default="regions")
    p.add_argument("--decode-impls", default="triton,sdpa", help="comma list of DECODE_IMPLS, each measured")
    p.add_argument("--kernels", type=int, default=40, help="kernels listed per impl")
    args = b.parse("outputs/bench_decode.json")
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    from dtgen.ar import TokenReader
    from dtgen.compile import CompileOptions
    from dtgen.sampling import Sampling
    from models.hunyuan_image3.ar import DECODE_IMPLS
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.presets import full_config
    from placements.hunyuan_image3 import get_plan

    impls = args.decode_impls.split(",")
    for impl in impls:
        if impl not in DECODE_IMPLS:
            raise SystemExit(f"error: --decode-impls: {impl!r} is not one of {DECODE_IMPLS}")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, torch.bfloat16, device, moe_impl="auto",
                  random_config=full_config(args.layers), moe_dtype=args.moe_dtype, dense_dtype=args.dense_dtype)
    load_s = time.perf_counter() - t0
    model, cfg = loaded.model, loaded.model.cfg

    def nbytes(t):
        return t.numel() * t.element_size()
    # a token reads the text stack's weights (of the experts only the top-k routed ones), ln_f, the lm_head
    dense_bytes = sum(nbytes(p) for n, p in model.named_parameters()
                      if (n.startswith(("model.layers.", "model.ln_f", "lm_head")) and ".experts." not in n))
    per_expert = sum(nbytes(p) for p in model.model.layers[0].mlp.experts.parameters()) / cfg.num_experts
    routed_bytes = cfg.num_hidden_layers * cfg.moe_topk[0] * per_expert
    results = {"layers": args.layers, "moe_dtype": args.moe_dtype, "dense_dtype": args.dense_dtype,
               "compile_mode": args.compile_mode, "prompt_tokens": args.prompt_tokens + 1, "load_s": round(load_s, 1),
               "bytes": {"dense": dense_bytes, "routed_experts": routed_bytes}, "hbm_bytes_per_s": HBM_TBPS * 1e12,
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

            def feed(read: str | None = None):
                """One decode step; read "late": the previous token after the launch (run_ar's loop),
                "first": this token before it (a batched decode's rows end at different steps)."""
                nonlocal token, pos
                if read == "first":
                    int(token)
                _, token = pipe._feed(pipe._decode_fn, rt, token.view(1, 1), pos, cache, budget, sampling, generator)
                if read == "late":
                    reader.pop()
                    reader.push(token)
                pos += 1

            for _ in range(5):          # compile, record the CUDA graph, warm up
                feed("late")
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            step_runs = [wall_ms(lambda: feed("late"), max(1, args.tokens // 8)) for _ in range(4)]
            synced_ms = wall_ms(lambda: feed("first"), args.tokens // 4)
            feed_ms = wall_ms(feed, args.tokens // 4)
            prof = kernel_profile(lambda: feed("late"), calls=8, top=args.kernels)
        by_kind = prof["by_kind"]
        if "inductor" in by_kind:   # this table's kinds: inductor's fused kernels count as "other"
            extra = by_kind.pop("inductor")
            other = by_kind.setdefault("other", {"us": 0.0, "launches": 0.0})
            other["us"], other["launches"] = other["us"] + extra["us"], other["launches"] + extra["launches"]
        kv_bytes = sum(nbytes(layer.k) + nbytes(layer.v) for layer in cache.layers) * pos / cache.length
        floor_ms = (dense_bytes + routed_bytes + kv_bytes) / (HBM_TBPS * 1e12) * 1e3
        step_ms = statistics.median(step_runs)
        results["impls"][impl] = {
            "step_ms": {"median": step_ms, "min": min(step_runs), "max": max(step_runs), "runs": step_runs},
            "synced_ms": synced_ms, "feed_ms": feed_ms, "device_ms": prof["device_us"] / 1e3, "floor_ms": floor_ms,
            "warmup_s": round(warm_s, 1), "kernel_launches_per_step": prof["launches"],
            "by_kind": {k: {"ms": round(v["us"] / 1e3, 4), "launches": v["launches"]} for k, v in by_kind.items()},
            "kernels": prof["top"]}
        print(f"AR decode [{impl}], {args.layers} layers: step {step_ms:.3f} ms/token (runs {min(step_runs):.3f}-"
              f"{max(step_runs):.3f}; each token waited for {synced_ms:.3f}; launches alone {feed_ms:.3f}); device "
              f"{prof['device_us'] / 1e3:.3f} ms in {prof['launches']:.0f} launches; floor {floor_ms:.3f} ms")
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["us"]):
            print(f"  {k:15s} {v['us'] / 1e3:7.3f} ms  {v['launches']:6.0f} launches")
        for k, us, n in prof["top"]:
            print(f"  gpu {us:>9.1f} us x{n:5.0f}  {k}")
        b.write(results)
        pipe = cache = None   # freed before the next impl's pipeline
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
