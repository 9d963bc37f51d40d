"""The AR decode step's dense linears on one GPU: cuBLAS and _scaled_mm against kernels/decode_gemv.py.

HunyuanImage-3's per-layer QKV, O, shared-expert gate_up and down, and the lm_head, at M = 1 and 8 rows:
cublas_bf16 (F.linear), gemv_bf16, scaled_mm_fp8 (x quantized by inductor-compiled torch ops, rowwise
_scaled_mm) and its GEMM alone, gemv_fp8 (x quantized inside), fp8_linear_gemv (what kernels.fp8_linear
runs at <= 16 rows) and the GEMV alone on a quantized x. Microseconds a call (a CUDA graph of
`--graph-iters` calls cycling through weight copies >= 4x the L2, replayed `--repeats` times), weight
GB/s, each GEMV's error against its reference, and a 32-layer token's dense time from the M = 1 figures.
`--sweep`: candidate GemvConfigs per shape, M and weight kind, the best printed as GEMV_CONFIGS entries.
`--smoke`: tiny shapes (on CPU the Triton kernels interpreted), to check the script.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from bench.floors import HBM_TBPS
from bench.harness import Bench, graph_time_us, interpret_triton_on_cpu, need_cuda, rel_err

MODULE = "bench.bench_decode_gemv"
HBM_BYTES_PER_S = HBM_TBPS * 1e12
L2_BYTES = 50 * 2 ** 20
LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (6144, 4096), "down": (4096, 3072),
          "lm_head": (133120, 4096)}
SMOKE_SHAPES = {"qkv": (96, 64), "o": (64, 64), "down": (64, 48)}


class Weights:
    """One shape's weights: `copies` bf16 copies and their e4m3 quantizations (one scale
    vector: the copies are the same matrix, only their addresses differ)."""

    def __init__(self, n: int, k: int, dev: torch.device, cuda: bool, seed: int = 0):
        from kernels.fp8_quant import quantize_weight_channels
        gen = torch.Generator(device=dev).manual_seed(seed)
        w = (torch.randn(n, k, device=dev, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        self.q, self.scale = quantize_weight_channels(w)
        bf16_copies = max(1, math.ceil(4 * L2_BYTES / w.nbytes)) if cuda else 1
        fp8_copies = max(1, math.ceil(4 * L2_BYTES / self.q.nbytes)) if cuda else 1
        self.bf16 = [w] + [w.clone() for _ in range(bf16_copies - 1)]
        self.fp8 = [self.q] + [self.q.clone() for _ in range(fp8_copies - 1)]
        self.n, self.k = n, k


def _calls(fn, weights: list, iters: int):
    return [lambda w=weights[i % len(weights)]: fn(w) for i in range(iters)]


def bench_shapes(args, dev, cuda) -> dict:
    from kernels.decode_gemv import decode_gemv_reference, decode_gemv_triton
    from kernels.fp8_linear import quantize_activation_rows

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = torch.bfloat16
    # Today's FP8 path as the compiled model runs it: the row quantization fused by inductor.
    quant = torch.compile(quantize_activation_rows, dynamic=True) if cuda else quantize_activation_rows
    out = {}
    for name, (n, k) in shapes.items():
        t0 = time.perf_counter()
        ws = Weights(n, k, dev, cuda)
        row = {"n": n, "k": k, "bf16_weight_bytes": n * k * 2, "fp8_weight_bytes": n * k,
               "copies_bf16": len(ws.bf16), "copies_fp8": len(ws.fp8), "rows": {}}
        for m in rows_list:
            x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(dtype)
            xq, xs = quantize_activation_rows(x)
            s = ws.scale
            variants = {
                "cublas_bf16": (lambda w: F.linear(x, w), ws.bf16, 2),
                "gemv_bf16": (lambda w: decode_gemv_triton(x, w), ws.bf16, 2),
                "gemv_fp8": (lambda w: decode_gemv_triton(x, w, s), ws.fp8, 1),
            }
            if cuda:
                def scaled_mm(w):
                    q, sx = quant(x)
                    return torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=dtype)
                variants["scaled_mm_fp8"] = (scaled_mm, ws.fp8, 1)
                variants["scaled_mm_fp8_gemm_only"] = (
                    lambda w: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=dtype),
                    ws.fp8, 1)

                def fp8_linear_path(w):   # what kernels.fp8_linear now runs at <= 16 rows
                    q, sx = quant(x)
                    return decode_gemv_triton(q, w, s, x_scale=sx.view(-1), out_dtype=dtype)
                variants["fp8_linear_gemv"] = (fp8_linear_path, ws.fp8, 1)
                variants["gemv_fp8_x_quantized"] = (   # the GEMV alone (the model fuses the quantization upstream)
                    lambda w: decode_gemv_triton(xq, w, s, x_scale=xs.view(-1), out_dtype=dtype), ws.fp8, 1)
            res = {}
            for vname, (fn, weights, elem) in variants.items():
                t = graph_time_us(_calls(fn, weights, args.graph_iters), args.repeats, cuda)
                res[vname] = {"us": t, "weight_GBps": n * k * elem / (t["median"] * 1e-6) / 1e9,
                              "floor_us": n * k * elem / HBM_BYTES_PER_S * 1e6}
            res["gemv_bf16"]["rel_err_vs_reference"] = rel_err(decode_gemv_triton(x, ws.bf16[0]),
                                                            decode_gemv_reference(x, ws.bf16[0]))
            res["gemv_fp8"]["rel_err_vs_reference"] = rel_err(decode_gemv_triton(x, ws.q, s),
                                                           decode_gemv_reference(x, ws.q, s))
            row["rows"][str(m)] = res
            print(f"{name:8s} N={n:6d} K={k:5d} M={m:2d}: " + ", ".join(
                f"{v} {r['us']['median']:7.1f} us ({r['weight_GBps']:5.0f} GB/s)" for v, r in res.items()), flush=True)
        row["seconds"] = time.perf_counter() - t0
        out[name] = row
        del ws
        if cuda:
            torch.cuda.empty_cache()
    return out


# The lm_head each variant's token uses: the FP8 dense option leaves it bf16.
HEAD_OF = {"cublas_bf16": "cublas_bf16", "gemv_bf16": "gemv_bf16", "gemv_fp8": "gemv_bf16",
           "scaled_mm_fp8": "cublas_bf16", "scaled_mm_fp8_gemm_only": "cublas_bf16",
           "fp8_linear_gemv": "cublas_bf16", "gemv_fp8_x_quantized": "cublas_bf16"}


def step_estimate(shapes: dict, m: str = "1") -> dict:
    """Dense milliseconds of one decode token (32 layers' QKV, O, gate_up, down + the lm_head)
    from the per-call medians, and the same at HBM bandwidth."""
    if not all(s in shapes and m in shapes[s]["rows"] for s in SHAPES):
        return {}
    t = {s: {v: r["us"]["median"] for v, r in shapes[s]["rows"][m].items()} for s in SHAPES}
    layer = ("qkv", "o", "gate_up", "down")
    est = {v: (LAYERS * sum(t[s][v] for s in layer) + t["lm_head"][HEAD_OF[v]]) / 1e3 for v in t["qkv"]}
    fp8_layers = LAYERS * sum(SHAPES[s][0] * SHAPES[s][1] for s in layer) / HBM_BYTES_PER_S * 1e3
    head = SHAPES["lm_head"][0] * SHAPES["lm_head"][1] * 2 / HBM_BYTES_PER_S * 1e3
    return {"rows": int(m), "dense_ms_per_token": est, "lm_head_of": HEAD_OF,
            "floor_ms_bf16": 2 * fp8_layers + head, "floor_ms_fp8_dense": fp8_layers + head}


def sweep_candidates(kind: str, rows: int) -> list:
    from kernels.decode_gemv import GemvConfig as C
    kx = 2 if kind == "fp8" else 1     # e4m3: twice the K per chunk for the same bytes
    if rows == 1:
        return [C(8, 512 * kx, 4, 1), C(16, 512 * kx, 4, 1), C(16, 512 * kx, 4, 3), C(16, 1024 * kx, 8, 2),
                C(32, 512 * kx, 8, 2), C(32, 256 * kx, 4, 2), C(16, 256, 4, 4, dot=True, prequant=False),
                C(64, 256, 4, 3, dot=True, prequant=False)] + ([C(16, 1024, 4, 1, prequant=True)] if kind == "fp8" else [])
    pre = kind == "fp8"
    return [C(16, 256, 4, 3, dot=True, prequant=pre), C(16, 512, 4, 3, dot=True, prequant=pre),
            C(32, 256, 4, 3, dot=True, prequant=pre), C(16, 128, 4, 5, dot=True, prequant=pre),
            C(64, 256, 4, 3, split_k=2, dot=True, prequant=pre), C(32, 512, 8, 3, dot=True, prequant=pre),
            C(16, 512 * kx, 4, 2, prequant=pre)] + ([C(16, 512, 4, 3, dot=True, prequant=False)] if pre else [])


def bench_sweep(args, dev, cuda) -> dict:
    from kernels.decode_gemv import config_for, decode_gemv_triton
    from kernels.fp8_linear import quantize_activation_rows

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    distinct = {}
    for name, nk in shapes.items():
        distinct.setdefault(nk, name)
    rows_list = [int(r) for r in args.rows.split(",")]
    deadline = time.perf_counter() + args.sweep_budget_s
    out, entries, skipped = {}, [], []
    for (n, k), name in distinct.items():
        ws = Weights(n, k, dev, cuda)
        for kind in ("16bit", "fp8"):
            weights, s = (ws.bf16, None) if kind == "16bit" else (ws.fp8, ws.scale)
            for m in rows_list:
                x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(torch.bfloat16)
                # e4m3 weights: x comes quantized, as kernels.fp8_linear passes it
                q, sx = quantize_activation_rows(x) if kind == "fp8" else (x, None)
                extra = {"x_scale": sx.view(-1), "out_dtype": x.dtype} if kind == "fp8" else {}
                default = config_for(n, k, kind, m)
                cands = [default] + [c for c in sweep_candidates(kind, m) if c != default]
                if args.smoke:
                    cands = [replace(c, block_k=min(c.block_k, 64)) for c in cands[:3]]
                timed = []
                for cfg in cands:
                    if time.perf_counter() > deadline:
                        skipped.append({"shape": name, "kind": kind, "rows": m, "config": asdict(cfg)})
                        continue
                    try:
                        t = graph_time_us(_calls(lambda w, cfg=cfg: decode_gemv_triton(q, w, s, config=cfg, **extra),
                                            weights, args.graph_iters), max(3, args.repeats // 2), cuda)
                    except Exception as err:   # a config this GPU cannot run (shared memory, registers)
                        timed.append({"config": asdict(cfg), "error": f"{type(err).__name__}: {str(err)[:200]}"})
                        continue
                    timed.append({"config": asdict(cfg), "us": t["median"]})
                ok = [r for r in timed if "us" in r]
                key = f"{name} N={n} K={k} {kind} M={m}"
                out[key] = {"timed": timed}
                if not ok:
                    continue
                best = min(ok, key=lambda r: r["us"])
                default_us = next((r["us"] for r in ok if r["config"] == asdict(default)), None)
                out[key].update(best=best, default_us=default_us)
                bcfg = best["config"]
                cls = "m1" if m == 1 else "m16"
                entry = (f'    ({n}, {k}, "{kind}", "{cls}"): GemvConfig(block_n={bcfg["block_n"]}, '
                         f'block_k={bcfg["block_k"]}, num_warps={bcfg["num_warps"]}, num_stages={bcfg["num_stages"]}, '
                         f'split_k={bcfg["split_k"]}, dot={bcfg["dot"]}, prequant={bcfg["prequant"]}),')
                entries.append(entry)
                print(f"sweep {key}: best {best['us']:.1f} us {bcfg} (default {default_us} us)", flush=True)
        del ws
        if cuda:
            torch.cuda.empty_cache()
    print("GEMV_CONFIGS entries (kernels/decode_gemv.py), the best per shape/kind/rows class:")
    print("\n".join(entries))
    return {"results": out, "entries": entries, "skipped_over_budget": skipped}


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--rows", default="1,8")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--graph-iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-budget-s", type=float, default=80.0)
    p.add_argument("--smoke", action="store_true")
    args = b.parse("outputs/bench_decode_gemv.json")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return need_cuda(MODULE + " (or --smoke)")
    if args.smoke:
        args.repeats, args.graph_iters = min(args.repeats, 2), min(args.graph_iters, 2)
    dev = torch.device("cuda" if cuda else "cpu")
    result = {"smoke": args.smoke, "hbm_bytes_per_s": HBM_BYTES_PER_S}
    t0 = time.perf_counter()
    with torch.no_grad():
        result["shapes"] = bench_shapes(args, dev, cuda)
        result["step_estimate"] = {m: step_estimate(result["shapes"], m) for m in args.rows.split(",")}
        for m, est in result["step_estimate"].items():
            if est:
                print(f"dense ms per decode token at M={m}: " + ", ".join(
                    f"{v} {t:.3f}" for v, t in est["dense_ms_per_token"].items())
                    + f" (floors: bf16 {est['floor_ms_bf16']:.3f}, fp8 dense {est['floor_ms_fp8_dense']:.3f})")
        b.write(result, dev, quiet=True)
        if args.sweep:
            result["sweep"] = bench_sweep(args, dev, cuda)
    result["seconds"] = time.perf_counter() - t0
    b.write(result, dev)
    return 0


if __name__ == "__main__":
    interpret_triton_on_cpu()
    sys.exit(main())
