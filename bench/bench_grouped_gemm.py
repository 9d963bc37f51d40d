"""torch._grouped_mm on the denoise MoE's shapes: how much the expert weights' layout costs.

    python -m bench.bench_grouped_gemm [--tokens 2674] [--out outputs/bench_grouped_gemm.json]

One TP2 rank of HunyuanImage-3's denoise (64 experts, top-8, hidden 4096, two micros of
intermediate 768 each), random routing. Two layouts of the same weights:
- micro-major (today's [M, E, 2I, H] / [M, E, H, I]): per micro a gate/up GEMM with
  N = 2I, then one down GEMM over M*E groups with K = I, M partials to sum;
- expert-major ([E, M*2I, H] / [E, H, M*I]): ONE gate/up GEMM with N = M*2I and ONE down
  GEMM with K = M*I (the micro sum happens inside the GEMM).
TFLOP/s against 694 (a dense bf16 GEMM on an H200). Decides whether the storage layout
change is worth its cost.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

H, E, TOPK, MICROS, INTER = 4096, 64, 8, 2, 768


def _us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2674)
    p.add_argument("--out", default="outputs/bench_grouped_gemm.json")
    p.add_argument("--autotune", action="store_true", help="also inductor max-autotune (Triton templates)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("bench_grouped_gemm needs CUDA and torch._grouped_mm; nothing to do here.")
        return 0
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = args.tokens * TOPK
    ids = torch.rand(args.tokens, E, device=dev, generator=g).topk(TOPK, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(rows, H, device=dev, dtype=bf, generator=g)
    gu_micro = torch.randn(MICROS, E, 2 * INTER, H, device=dev, dtype=bf, generator=g) * 0.02
    dn_micro = torch.randn(MICROS, E, H, INTER, device=dev, dtype=bf, generator=g) * 0.02
    gu_expert = torch.randn(E, MICROS * 2 * INTER, H, device=dev, dtype=bf, generator=g) * 0.02
    dn_expert = torch.randn(E, H, MICROS * INTER, device=dev, dtype=bf, generator=g) * 0.02
    act_micro = torch.randn(MICROS, rows, INTER, device=dev, dtype=bf, generator=g)
    act_expert = torch.randn(rows, MICROS * INTER, device=dev, dtype=bf, generator=g)
    shift = torch.arange(MICROS, device=dev, dtype=torch.int32).unsqueeze(1) * rows
    down_ends = (ends.unsqueeze(0) + shift).reshape(-1)

    # Each returns its result: a compiled function would drop unused work.
    def micro_gate_up():
        return [torch._grouped_mm(x, gu_micro[m].transpose(-2, -1), offs=ends) for m in range(MICROS)]

    def micro_down():
        return torch._grouped_mm(act_micro.flatten(0, 1), dn_micro.flatten(0, 1).transpose(-2, -1), offs=down_ends)

    def expert_gate_up():
        return torch._grouped_mm(x, gu_expert.transpose(-2, -1), offs=ends)

    def expert_down():
        return torch._grouped_mm(act_expert, dn_expert.transpose(-2, -1), offs=ends)

    dense_a = torch.randn(rows, H, device=dev, dtype=bf, generator=g)
    dense_b = torch.randn(H, MICROS * 2 * INTER, device=dev, dtype=bf, generator=g)

    def dense():
        return torch.mm(dense_a, dense_b)

    gate_up_flop = 2 * rows * H * MICROS * 2 * INTER
    down_flop = 2 * rows * MICROS * INTER * H
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min())}
    cases = [("micro_major_gate_up", micro_gate_up, gate_up_flop),
             ("expert_major_gate_up", expert_gate_up, gate_up_flop),
             ("micro_major_down", micro_down, down_flop),
             ("expert_major_down", expert_down, down_flop),
             ("dense_same_flops_as_gate_up", dense, gate_up_flop)]
    if args.autotune:
        # inductor's grouped-GEMM Triton templates, tuned against the ATen (CUTLASS) kernel.
        for name, fn, flop in list(cases[:4]):
            tuned = torch.compile(fn, mode="max-autotune-no-cudagraphs", fullgraph=True)
            tuned()
            cases.append((f"{name}_max_autotune", tuned, flop))
    for name, fn, flop in cases:
        us = _us(fn)
        result[name] = {"us": round(us, 1), "tflops": round(flop / us / 1e6, 1)}
        print(f"{name:<30}{us:>9.1f} us {flop / us / 1e6:>7.1f} TFLOP/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
