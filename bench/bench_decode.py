"""Where an AR decode step's time goes, end to end through the pipeline (one GPU).

    python -m bench.bench_decode [--layers 2] [--tokens 64] [--out outputs/bench_decode.json]

Full-width HunyuanImage-3 (random bf16 weights, `--layers` of its 32 layers), plan
`single`, compiled with the CUDA-graph decode step. After a 1251-token prompt it decodes
`--tokens` tokens the way `run_ar` does and reports:
- step: one token's wall time: the sampled id to the host (the stop check, the one sync
  per token), then the compiled decode step (embedding, layers, lm_head, sampling in the
  graph, replayed as a CUDA graph), its logits cloned;
- feed: the same without the per-token sync (what the host-side launch costs);
- device: the GPU time of one step's kernels (torch.profiler), with the top kernels: the
  layers, the lm_head GEMV (a 133120 x 4096 bf16 read: ~0.25 ms at 4.3 TB/s), the sampler.
Floor: the bytes a token must read (every weight but the experts not routed to, plus the
KV cache) at 4.3 TB/s. The gap between wall and device time is host overhead.
"""
from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1251)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="outputs/bench_decode.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU; nothing to do here.")
        return 0
    from dtgen.compile import CompileOptions
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline, Sampling
    from models.hunyuan_image3.presets import full_config
    from placements.hunyuan_image3 import get_plan

    device = torch.device("cuda")
    loaded = load(None, get_plan("single"), 0, 1, torch.bfloat16, device, "auto",
                  random_config=full_config(args.layers))
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=True))
    cfg = pipe.cfg
    rt = pipe.controller.activate("ar")
    ids = [pipe.special.bos] + [5 + i % 200 for i in range(args.prompt_tokens)]
    budget = len(ids) + 2 * args.tokens + 64
    cache = pipe._cache(rt, 1, budget)
    generator = torch.Generator(device=device).manual_seed(0)
    sampling = Sampling(0.6, 1024, 0.95).step_args(cfg.vocab_size, device)      # the pipeline's defaults
    with torch.no_grad():
        _, token = pipe._feed(pipe._prefill_fn, rt, ids, 0, cache, budget, sampling, generator, static_slots=True)
        pos = len(ids)

        def step():   # what run_ar does per token: the token to the host (stop check), the step
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
        step_ms = _ms(step, args.tokens // 2)
        feed_ms = _ms(feed, args.tokens // 4)

        from torch.profiler import ProfilerActivity, profile
        iters = 8
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(((e.key[:90], e.self_device_time_total / iters) for e in events
                      if e.self_device_time_total > 0), key=lambda r: -r[1])
    device_us = sum(us for _, us in kernels)
    cpu_ops = sorted(((e.key[:90], e.self_cpu_time_total / iters) for e in events), key=lambda r: -r[1])

    # Bytes one token must read: the text stack's weights (of the experts only the top-k
    # routed ones), the final norm, the lm_head, and the KV cache up to this position.
    def nbytes(t):
        return t.numel() * t.element_size()
    dense_bytes = sum(nbytes(p) for n, p in pipe.model.named_parameters()
                      if (n.startswith(("model.layers.", "model.ln_f", "lm_head")) and ".experts." not in n))
    experts = pipe.model.model.layers[0].mlp.experts
    per_expert = sum(nbytes(p) // p.shape[1] for p in experts.parameters())   # [M, E, ...]: E is dim 1
    routed_bytes = cfg.num_hidden_layers * cfg.moe_topk[0] * per_expert
    kv_bytes = sum(nbytes(layer.k) + nbytes(layer.v) for layer in cache.layers) * pos / cache.length
    floor_ms = (dense_bytes + routed_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "step_ms": step_ms, "feed_ms": feed_ms, "device_ms": device_us / 1e3,
              "floor_ms": floor_ms, "top_kernels_us": [(k, round(us, 1)) for k, us in kernels[:15]],
              "top_cpu_ops_us": [(k, round(us, 1)) for k, us in cpu_ops[:15]]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"AR decode, {args.layers} layers: step {step_ms:.3f} ms/token (without the per-token sync "
          f"{feed_ms:.3f}); device {device_us / 1e3:.3f} ms; floor {floor_ms:.3f} ms")
    for k, us in kernels[:12]:
        print(f"  gpu {us:>9.1f} us  {k}")
    for k, us in cpu_ops[:12]:
        print(f"  cpu {us:>9.1f} us  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
