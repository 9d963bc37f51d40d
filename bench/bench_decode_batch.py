"""Batched AR decode on one GPU: the split-KV kernel, the fused prologue, the whole decode step.

    python -m bench.bench_decode_batch [--parts kernel,prologue,step] [--out outputs/bench_decode_batch.json]

- kernel: decode attention at the released model's shapes (32 q / 8 kv heads, head_dim 128,
  bf16) for 8 requests of skewed lengths (one 16k, seven 1k): the load-balanced split-KV
  kernel against the static split (fixed splits per request: the flash-decoding heuristic's
  count, and a sweep of counts), and the masked SDPA the one-request decode step runs.
  Each op (schedule prebuilt: a step builds it once for 32 layers; its own time apart) is
  replayed from a CUDA graph of `--graph-iters` calls.
- prologue: split + RoPE + QK RMSNorm + KV write, fused against the separate torch ops
  (eager, and compiled by inductor as the compiled regions would), at decode (8 requests, one
  row each) and prefill (one request, 4096 rows) shapes, each replayed from a CUDA graph.
  `--prologue-rows 1,4,8,16,32` also times the fused kernel at each rows-per-program at the
  prefill shape (`fused_by_rows_us`; `--prologue-warps 4,8` crosses them with warp counts,
  `fused_by_rows_warps_us`), and checks each gives the default launch's output bit for bit;
  `fused_us` stays the default choice (`fused_launch`: its rows per program and warps).
- step: the AR decode step of the 32-layer model (random weights, FP8 experts, compiled
  regions, the step replayed as a CUDA graph) for 8 requests of 1-6k tokens against one
  request (at the batch's mean and at its longest length), with the batched kernels, and one
  request on the masked-SDPA path. The caches hold random K/V (attention's cost depends on
  lengths only). Also reported: the routed experts' bytes a step must read (uniform routing:
  8 tokens touch ~42 of 64 experts per layer, one token 8), the floor that bounds the ratio.

Every figure is the median of `--repeats` timings with its range; the JSON holds the command.
`--smoke` runs tiny shapes (on CPU: the Triton kernels under TRITON_INTERPRET=1) to check the
script, no timings worth reading.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.timing import graph_time_us, summary

HBM_BYTES_PER_S = 4.3e12


_summary = summary


def _time_us(fn, repeats: int, iters: int, cuda: bool) -> dict:
    """Per-call microseconds of fn: on CUDA a graph of `iters` calls replayed `repeats` times;
    on the CPU (smoke, the interpreter) one call a repeat."""
    return graph_time_us([fn] * (iters if cuda else 1), repeats, cuda, warm=3)


def bench_kernel(args, dev, cuda) -> dict:
    from dtgen.attention import attend
    from kernels.split_kv_decode import (balanced_schedule, default_num_programs, heuristic_splits,
                                         split_kv_decode, static_schedule)

    if args.smoke:
        B, Hq, Hkv, D, lens = 4, 8, 2, 64, [300, 20, 20, 20]
    else:
        B, Hq, Hkv, D, lens = 8, 32, 8, 128, [16384] + [1024] * 7
    L = max(lens)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, L, D, device=dev, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, L, D, device=dev, generator=gen).to(dtype)
    lengths = torch.tensor(lens, device=dev)
    programs = default_num_programs(dev, Hkv)
    splits = heuristic_splits(B, Hkv, dev)
    reps, iters = args.repeats, args.graph_iters
    balanced = balanced_schedule(lengths, L, programs)
    out = {"batch": B, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "lengths": lens, "dtype": str(dtype),
           "balanced_programs_per_kv_head": programs, "heuristic_splits": splits}
    out["balanced_us"] = _time_us(lambda: split_kv_decode(q, k, v, lengths, balanced, impl="triton"), reps, iters, cuda)
    out["schedule_build_us"] = _time_us(lambda: balanced_schedule(lengths, L, programs), reps, iters, cuda)
    static = {}
    for s in sorted({1, 2, 4, 8, 16, 32, 64, splits}):
        sch = static_schedule(lengths, L, s)
        static[s] = _time_us(lambda sch=sch: split_kv_decode(q, k, v, lengths, sch, impl="triton"), reps, iters, cuda)
    out["static_us_by_splits"] = {str(s): t for s, t in static.items()}
    out["static_heuristic_us"] = static[splits]
    best = min(static, key=lambda s: static[s]["median"])
    out["static_best_splits"] = best
    out["speedup_vs_static_heuristic"] = static[splits]["median"] / out["balanced_us"]["median"]
    out["speedup_vs_static_best"] = static[best]["median"] / out["balanced_us"]["median"]
    # The one-request step's attention today: masked SDPA over the whole cache, per request row.
    mask = torch.arange(L, device=dev)[None, :] < lengths[:, None]
    out["sdpa_masked_us"] = _time_us(lambda: attend(q[:, :, None], k, v, mask[:, None, None, :]), reps, iters, cuda)
    kv_bytes = 2 * sum(lens) * Hkv * D * k.element_size()
    out["kv_bytes"] = kv_bytes
    out["floor_us"] = kv_bytes / HBM_BYTES_PER_S * 1e6
    print(f"kernel: balanced {out['balanced_us']['median']:.1f} us, static ({splits} splits) "
          f"{static[splits]['median']:.1f} us -> {out['speedup_vs_static_heuristic']:.2f}x "
          f"(best static: {best} splits, {static[best]['median']:.1f} us -> {out['speedup_vs_static_best']:.2f}x); "
          f"masked SDPA {out['sdpa_masked_us']['median']:.1f} us; schedule {out['schedule_build_us']['median']:.1f} us; "
          f"floor {out['floor_us']:.1f} us")
    return out


def bench_prologue(args, dev, cuda) -> dict:
    from kernels.qk_norm_rope_kv import (prologue_launch_config, qk_norm_rope_kv, qk_norm_rope_kv_reference,
                                         qk_norm_rope_kv_triton)
    from models.hunyuan_image3.rope import rope_cos_sin

    Hkv, G, D, L = (2, 4, 64, 64) if args.smoke else (8, 4, 128, 8192)
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {"decode": (8, 1), "prefill": (1, 16 if args.smoke else 4096)}
    compiled = torch.compile(qk_norm_rope_kv_reference, fullgraph=True) if cuda else None
    out = {"kv_heads": Hkv, "group": G, "head_dim": D, "dtype": str(dtype)}
    for name, (B, S) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(1)
        qkv = torch.randn(B, S, Hkv * (G + 2) * D, device=dev, generator=gen).to(dtype)
        per_row = S == 1
        pos = (torch.randint(0, L, (B, 1, 2), device=dev, generator=gen) if per_row
               else torch.arange(S, device=dev)[:, None].expand(S, 2))
        cos, sin = rope_cos_sin(pos, D, 10000.0)
        qw = torch.rand(D, device=dev, generator=gen).to(dtype) + 0.5
        kw = torch.rand(D, device=dev, generator=gen).to(dtype) + 0.5
        slots = pos[..., 0].contiguous() if per_row else torch.arange(S, device=dev)
        kc = torch.zeros(B, Hkv, L, D, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        args_ = (qkv, cos, sin, qw, kw, 1e-5, kc, vc, slots, G)
        row = {"batch": B, "rows": S}
        block_s, warps = prologue_launch_config(B * S, Hkv, G, D)
        row["fused_launch"] = {"rows_per_program": block_s, "num_warps": warps}
        row["fused_us"] = _time_us(lambda: qk_norm_rope_kv(*args_, impl="triton"), args.repeats, args.graph_iters, cuda)
        if name == "prefill" and args.prologue_rows:
            row.update(_prologue_sweep(args, cuda, args_, qk_norm_rope_kv_triton, prologue_launch_config))
        row["separate_eager_us"] = _time_us(lambda: qk_norm_rope_kv_reference(*args_), args.repeats,
                                            args.graph_iters, cuda)
        if compiled is not None:
            row["separate_compiled_us"] = _time_us(lambda: compiled(*args_), args.repeats, args.graph_iters, cuda)
        row["speedup_vs_eager"] = row["separate_eager_us"]["median"] / row["fused_us"]["median"]
        if compiled is not None:
            row["speedup_vs_compiled"] = row["separate_compiled_us"]["median"] / row["fused_us"]["median"]
        out[name] = row
        print(f"prologue {name} (B={B}, S={S}): fused {row['fused_us']['median']:.2f} us "
              f"({block_s} rows/program, {warps} warps), separate eager "
              f"{row['separate_eager_us']['median']:.2f} us ({row['speedup_vs_eager']:.2f}x)"
              + (f", separate compiled {row['separate_compiled_us']['median']:.2f} us "
                 f"({row['speedup_vs_compiled']:.2f}x)" if compiled is not None else ""))
    return out


def _int_list(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _prologue_sweep(args, cuda, args_, kernel, launch_config) -> dict:
    """The fused kernel at each --prologue-rows at its default warps (and at each --prologue-warps);
    every launch's q and caches checked against the default launch's, bit for bit."""
    qkv, _, _, _, _, _, kc, vc, _, G = args_
    B, S, _ = qkv.shape
    Hkv, D = kc.shape[1], kc.shape[3]

    def outputs(**launch):
        kc.zero_()
        vc.zero_()
        q = kernel(*args_, **launch)
        return q.clone(), kc.clone(), vc.clone()

    default = outputs()
    warps_list = [None] + _int_list(args.prologue_warps)      # None: the rows' own default warps
    by_rows, by_rows_warps, equal = {}, {}, {}
    for rows in _int_list(args.prologue_rows):
        for w in warps_list:
            _, warps = launch_config(B * S, Hkv, G, D, rows, w)
            key = f"{rows}x{warps}"
            if key in by_rows_warps:
                continue
            got = outputs(rows_per_program=rows, num_warps=warps)
            equal[key] = all(torch.equal(a, b) for a, b in zip(got, default))
            t = _time_us(lambda rows=rows, warps=warps: kernel(*args_, rows_per_program=rows, num_warps=warps),
                         args.repeats, args.graph_iters, cuda)
            by_rows_warps[key] = {"rows_per_program": rows, "num_warps": warps, **t}
            if w is None:
                by_rows[str(rows)] = {"num_warps": warps, **t}
            print(f"  prologue prefill at {rows} rows/program, {warps} warps: {t['median']:.2f} us"
                  + ("" if equal[key] else " (output differs from the default launch's)"))
    out = {"fused_by_rows_us": by_rows, "fused_equal_to_default": equal}
    if args.prologue_warps:
        out["fused_by_rows_warps_us"] = by_rows_warps
    return out


def bench_step(args, dev, cuda) -> dict:
    from dtgen.compile import CompileOptions
    from dtgen.sampling import Sampling
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.presets import full_config
    from models.hunyuan_image3.tiny import tiny_config
    from placements.hunyuan_image3 import get_plan

    config = tiny_config() if args.smoke else full_config(args.layers)
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = load(None, get_plan("single"), 0, 1, dtype, dev, random_config=config,
                  moe_dtype="fp8" if cuda else "model")
    out = {"layers": config["num_hidden_layers"], "moe_dtype": "fp8-channels" if cuda else "model",
           "compile": "regions + CUDA-graph step" if cuda else "off"}
    pipes = {impl: HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, dev, decode_impl=impl,
                                      compile_options=CompileOptions(enabled=cuda, regions=True))
             for impl in ("triton", "sdpa")}
    lens = [32, 48, 64, 80] if args.smoke else [int(x) for x in torch.linspace(1024, 6144, 8).round().tolist()]
    mean_len, longest = int(sum(lens) / len(lens)), max(lens)
    L = -(-(longest + 8) // 256) * 256
    out["batch_lengths"] = lens
    V = loaded.model.cfg.vocab_size
    sampling = Sampling(0.6, 1024, 0.95).step_args(V, dev)      # the pipeline's defaults
    gen = torch.Generator(device=dev).manual_seed(0)

    def run(impl: str, positions: list[int]) -> dict:
        pipe = pipes[impl]
        rt = pipe.controller.activate("ar")
        N = len(positions)
        cache = pipe._cache(rt, N, L, reuse=f"bench-{impl}-{N}")
        for layer in cache.layers:   # random K/V: attention's cost depends on the lengths only
            layer.k.normal_(generator=gen)
            layer.v.normal_(generator=gen)
        ids = torch.full((N, 1), 5, device=dev)
        pos = torch.tensor(positions, device=dev)
        uniform = torch.rand(V, device=dev, generator=gen)
        if N == 1 and impl == "sdpa":   # the one-request step as run_ar feeds it (masked SDPA)
            def step():
                return pipe._decode_fn(rt, ids, pos, cache, L, uniform, sampling)
        else:
            def step():
                return pipe._decode_batch_fn(rt, ids, pos, cache, (uniform,) * N, (sampling,) * N)
        for _ in range(3):   # compile, record the CUDA graph, warm up
            step()
        times = []
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.step_iters):
                step()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / args.step_iters)
        return _summary(times)

    out["batch8_ms"] = run("triton", lens)
    out["one_request_mean_len_ms"] = run("triton", [mean_len])
    out["one_request_longest_ms"] = run("triton", [longest])
    out["one_request_sdpa_longest_ms"] = run("sdpa", [longest])
    out["ratio_vs_one_mean"] = out["batch8_ms"]["median"] / out["one_request_mean_len_ms"]["median"]
    out["ratio_vs_one_longest"] = out["batch8_ms"]["median"] / out["one_request_longest_ms"]["median"]
    cfg = loaded.model.cfg
    E, K = cfg.num_experts, cfg.moe_topk[0]
    experts = loaded.model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() * p.element_size() // p.shape[1] for p in experts.parameters())
    distinct = {n: E * (1 - (1 - K / E) ** n) for n in (1, len(lens))}
    out["expected_distinct_experts_per_layer"] = distinct
    out["routed_expert_floor_ms"] = {str(n): cfg.num_hidden_layers * d * per_expert / HBM_BYTES_PER_S * 1e3
                                     for n, d in distinct.items()}
    print(f"step ({out['layers']} layers): 8 requests {out['batch8_ms']['median']:.3f} ms; one request "
          f"{out['one_request_mean_len_ms']['median']:.3f} ms at {mean_len} tokens "
          f"({out['ratio_vs_one_mean']:.2f}x), {out['one_request_longest_ms']['median']:.3f} ms at {longest} "
          f"({out['ratio_vs_one_longest']:.2f}x); one request on masked SDPA "
          f"{out['one_request_sdpa_longest_ms']['median']:.3f} ms; routed-expert floor "
          f"{out['routed_expert_floor_ms']}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="kernel,prologue,step")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--graph-iters", type=int, default=50)
    p.add_argument("--step-iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--prologue-rows", default=None,
                   help="comma list of rows per program (powers of two) to time the fused prologue at, at prefill")
    p.add_argument("--prologue-warps", default=None,
                   help="comma list of num_warps crossed with --prologue-rows (default: each rows' own choice)")
    p.add_argument("--out", default="outputs/bench_decode_batch.json")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"kernel", "prologue", "step"})
    if unknown:
        raise SystemExit(f"error: --parts {unknown}: choose from kernel, prologue, step")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_decode_batch needs a CUDA GPU (or --smoke); nothing to do here.")
        return 0
    dev = torch.device("cuda" if cuda else "cpu")
    result = {"command": " ".join(["python -m bench.bench_decode_batch"] + (argv if argv is not None else sys.argv[1:])),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "smoke": args.smoke}
    with torch.no_grad():
        for part in parts:
            result[part] = {"kernel": bench_kernel, "prologue": bench_prologue, "step": bench_step}[part](args, dev, cuda)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))   # after every part: a late failure keeps the rest
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
