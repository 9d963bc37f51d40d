"""FP8 attention (kernels/fp8_attention.py) against torch SDPA in bf16, at Wan's shapes, one GPU.

    python -m bench.bench_fp8_attention [--shapes 1.3B,14B] [--iters 10] [--out F]

Self-attention of one Wan block at 480p x 81 frames (32760 tokens, head_dim 128): 12 heads
(1.3B) and 40 (14B), batch 1. Timed (CUDA events, median of `--iters` after 3 warm-ups):
SDPA bf16 with each backend alone (flash, cuDNN, memory-efficient; one that refuses the
shape is reported as such), FP8 attention with FP8 PV and with FP16 PV (Q, K, V quantized by
eager torch ops), with FP8 PV and the quantization compiled ("-cq"), and the quantization
alone, eager and compiled (the share of it that is not the kernel). Error: relative L2 of each
output against SDPA's math in float32 on the first 2 heads (the full float32 reference
would hold [S, S] logits per head). TFLOP/s at 4 * S^2 * D * heads FLOPs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"1.3B": 12, "14B": 40}
TOKENS, HEAD_DIM = 32760, 128


def _time(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_fp8_attention", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1.3B,14B")
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from kernels.fp8_attention import fp8_attention, quantize_qkv
    S, D = args.tokens, HEAD_DIM
    result = {"what": "Wan self-attention, FP8 attention vs SDPA bf16", "command": "python -m bench.bench_fp8_attention "
              + " ".join(argv if argv is not None else sys.argv[1:]), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "tokens": S, "head_dim": D, "shapes": {}}
    for name in args.shapes.split(","):
        H = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, H, S, D, generator=g, device="cuda").bfloat16() for _ in range(3))
        k = k + 1.0
        flops = 4 * S * S * D * H
        exact = F.scaled_dot_product_attention(q[:, :2].float(), k[:, :2].float(), v[:, :2].float())
        rows = {}
        runs = {f"sdpa-{b.name.lower()}": (lambda b=b: _sdpa(q, k, v, b, sdpa_kernel))
                for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)}
        runs["fp8-pv-fp8"] = lambda: fp8_attention(q, k, v, pv="fp8")
        runs["fp8-pv-fp16"] = lambda: fp8_attention(q, k, v, pv="fp16")
        runs["fp8-quantize-only"] = lambda: quantize_qkv(q, k, v)
        compiled = torch.compile(quantize_qkv, fullgraph=True, dynamic=False)
        runs["fp8-quantize-compiled"] = lambda: compiled(q, k, v)

        # the quantization compiled with the op after it, as a compiled region runs them
        with_compiled_quant = torch.compile(fp8_attention, fullgraph=True, dynamic=False)
        runs["fp8-pv-fp8-cq"] = lambda: with_compiled_quant(q, k, v, pv="fp8")
        for run, fn in runs.items():
            try:
                ms = _time(fn, args.iters)
            except RuntimeError as e:
                rows[run] = {"error": str(e).splitlines()[0][:200]}
                print(f"{name:5s} {run:18s} refused: {rows[run]['error']}", flush=True)
                continue
            row = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            if not run.startswith("fp8-quantize"):
                out = fn()[:, :2].float()
                row["rel_l2_vs_fp32"] = float((out - exact).norm() / exact.norm())
            rows[run] = row
            print(f"{name:5s} {run:18s} {ms:8.3f} ms  {row['tflops']:7.1f} TFLOP/s"
                  + (f"  rel L2 vs fp32 {row['rel_l2_vs_fp32']:.2e}" if "rel_l2_vs_fp32" in row else ""), flush=True)
        best = min((r["ms"] for n, r in rows.items() if n.startswith("sdpa") and "ms" in r), default=None)
        for n in ("fp8-pv-fp8", "fp8-pv-fp16", "fp8-pv-fp8-cq"):
            if best and "ms" in rows.get(n, {}):
                rows[n]["speedup_vs_best_sdpa"] = round(best / rows[n]["ms"], 3)
                print(f"{name:5s} {n:18s} speed-up over the best SDPA: {rows[n]['speedup_vs_best_sdpa']:.3f}x")
        result["shapes"][name] = {"heads": H, "runs": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


def _sdpa(q, k, v, backend, sdpa_kernel):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v)


if __name__ == "__main__":
    sys.exit(main())
