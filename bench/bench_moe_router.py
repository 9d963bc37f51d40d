"""The MoE router of an AR decode step: today's torch ops against the fused dtgen::moe_route_topk.

    python -m bench.bench_moe_router [--tokens 1,8] [--sweep] [--out outputs/bench_moe_router.json]

At HunyuanImage-3's router shapes (E=64 experts, K=8, H=4096, x bf16, the weight fp32) for
each token count: (a) the torch ops of `MoE.route` (`F.linear` in fp32, softmax, topk,
renormalise), eager and compiled by inductor (fullgraph), and (b) the fused op (impl
"triton": its two kernels; "auto" takes them up to kernels.moe_router.TRITON_MAX_TOKENS
tokens). Every figure is the per-call time of a CUDA graph of `--graph-iters` calls, the
median (and range) of `--repeats` replays; the layer's ~14 us route (H200, torch 2.11) is
what the fused op replaces, 32 times a step. Each fused row also says whether its ids equal
the eager ops' and its largest weight difference. `--sweep` adds the fused op at other
tile sizes (kernels.moe_router.RouterConfig). `--no-compile` skips inductor. The JSON
(--out) holds the command. `--smoke` runs tiny shapes on CPU (the kernels under
TRITON_INTERPRET=1) to check the script; no timings worth reading.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SWEEP = [(16, 128, 4, 2), (8, 128, 4, 1), (16, 64, 2, 1), (16, 256, 4, 1), (32, 128, 4, 1), (64, 64, 4, 1),
         (16, 128, 2, 1), (16, 128, 8, 1), (32, 256, 8, 1)]   # block_e, block_h, logits_warps, topk_warps


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--graph-iters", type=int, default=100)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="outputs/bench_moe_router.json")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    from bench.bench_decode_batch import _time_us
    from kernels.moe_router import RouterConfig, moe_route_topk, moe_route_topk_triton, route_from_logits

    def torch_route(x, w, top_k):
        """MoE.route's torch ops (norm_topk_prob=True, as the released config)."""
        return route_from_logits(torch.nn.functional.linear(x.float(), w.float()), top_k, True, 1.0)

    dev = torch.device("cuda" if cuda else "cpu")
    E, K, H = (7, 2, 72) if args.smoke else (args.experts, args.top_k, args.hidden)
    reps, iters = (2, 1) if args.smoke else (args.repeats, args.graph_iters)
    t_start = time.perf_counter()
    result = {"command": " ".join(["python -m bench.bench_moe_router"] + (argv if argv is not None else sys.argv[1:])),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "experts": E, "top_k": K, "hidden": H,
              "x_dtype": "bfloat16", "weight_dtype": "float32", "graph_iters": iters, "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(E, H, device=dev, generator=gen) / H ** 0.5).float()
    compiled = None if (args.no_compile or not cuda) else torch.compile(torch_route, fullgraph=True, dynamic=False)
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
        ref_ids, ref_w = torch_route(x, w, K)
        row = {"tokens": T}

        def check(name, out):
            row[name + "_ids_match"] = bool(torch.equal(out[0], ref_ids))
            row[name + "_max_weight_diff"] = (out[1] - ref_w).abs().max().item()

        row["torch_eager_us"] = _time_us(lambda: torch_route(x, w, K), reps, iters, cuda)
        if compiled is not None:
            check("torch_compiled", compiled(x, w, K))
            row["torch_compiled_us"] = _time_us(lambda: compiled(x, w, K), reps, iters, cuda)
        check("fused", moe_route_topk(x, w, K, impl="triton"))
        row["fused_us"] = _time_us(lambda: moe_route_topk(x, w, K, impl="triton"), reps, iters, cuda)
        row["fused_speedup_vs_eager"] = row["torch_eager_us"]["median"] / row["fused_us"]["median"]
        line = (f"T={T}: torch eager {row['torch_eager_us']['median']:.2f} us"
                + (f", compiled {row['torch_compiled_us']['median']:.2f} us" if compiled is not None else "")
                + f"; fused {row['fused_us']['median']:.2f} us ({row['fused_speedup_vs_eager']:.1f}x eager), "
                f"ids match {row['fused_ids_match']}, max |dw| {row['fused_max_weight_diff']:.1e}")
        print(line, flush=True)
        if args.sweep:
            sweep = {}
            for be, bh, lw, tw in SWEEP:
                cfg = RouterConfig(block_e=be, block_h=bh, logits_warps=lw, topk_warps=tw)
                name = f"e{be}_h{bh}_w{lw}_{tw}"
                out = moe_route_topk_triton(x, w, K, config=cfg)
                sweep[name] = {"us": _time_us(lambda cfg=cfg: moe_route_topk_triton(x, w, K, config=cfg),
                                              reps, iters, cuda),
                               "ids_match": bool(torch.equal(out[0], ref_ids))}
                print(f"  sweep {name}: {sweep[name]['us']['median']:.2f} us, ids match {sweep[name]['ids_match']}",
                      flush=True)
            row["sweep"] = sweep
        result["rows"].append(row)
    result["wall_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
