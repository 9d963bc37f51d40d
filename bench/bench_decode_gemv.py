"""The AR decode step's dense GEMVs on one GPU: kernels/decode_gemv.py against torch, TB/s against the floor.

HunyuanImage-3's per-layer QKV [6144, 4096], O [4096, 4096], shared-expert gate_up [6144, 4096] and down
[4096, 3072], and the lm_head [133120, 4096] (`--lm-head`), at `--rows` rows of x, with e4m3 weights as the
benchmarked decode runs them (`--dense-dtype fp8`: x quantized upstream, the GEMV streams the weight) and in
bf16. Per shape and weight kind: `torch` (F.linear on the bf16 weight; rowwise torch._scaled_mm on the e4m3
one, x already quantized), `table` (decode_gemv with the config GEMV_CONFIGS gives it: what runs today),
`stream` (the persistent kernel), `tma` (its TMA-ring form, Hopper) and with `--sweep` every candidate of
`candidates()` (the fastest of the table's kernel and all these per shape: a GEMV_CONFIGS entry printed).
Each is timed as one CUDA graph of `--graph-iters` calls cycling through weight copies >= 4x the L2,
replayed `--repeats` times: microseconds a call (median, range), the weight's TB/s (median, range), the
floor (the weight's bytes in the dtype that runs at bench.floors.HBM_TBPS) and the error against
decode_gemv_reference.
`--smoke`: tiny shapes (on the CPU the Triton kernels interpreted), to check the script.
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
L2_BYTES = 50 * 2 ** 20
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (6144, 4096), "down": (4096, 3072)}
LM_HEAD = {"lm_head": (133120, 4096)}
SMOKE_SHAPES = {"qkv": (96, 64), "down": (40, 72)}
KINDS = ("fp8", "16bit")


def stream_config(kind: str, block_n: int = 8, chunk_bytes: int = 8192, num_warps: int = 4,
                  programs_per_sm: int = 2, tma: bool = False, stages: int = 4):
    """A config of the stream kernel (tma: its TMA ring, `stages` blocks in flight) with
    `chunk_bytes` of weight per block of block_n rows."""
    from kernels.decode_gemv import GemvConfig
    elem = 1 if kind == "fp8" else 2
    return GemvConfig(block_n=block_n, block_k=chunk_bytes // (block_n * elem), num_warps=num_warps,
                      num_stages=stages if tma else 1, stream=not tma, tma=tma, programs_per_sm=programs_per_sm)


def candidates(kind: str) -> dict:
    """The sweep's candidates: the stream kernel by rows a tile, bytes a chunk, warps, programs a SM
    (its registers hold 2 chunks ahead: ~220 registers a thread at 8 KB / 4 warps for e4m3, so at
    most 2 programs a SM there); the TMA kernel by the same and blocks in flight (stages x chunk of
    shared memory a program, <= 128 KB a SM)."""
    out = {}
    for bn, chunk, warps, pps in ((8, 8192, 4, 1), (8, 8192, 4, 2), (8, 8192, 8, 2), (8, 16384, 8, 1),
                                  (4, 8192, 4, 2), (16, 8192, 4, 2), (16, 16384, 8, 1), (8, 4096, 4, 4),
                                  (4, 4096, 4, 4)):
        out[f"stream_n{bn}_{chunk // 1024}k_w{warps}_p{pps}"] = stream_config(kind, bn, chunk, warps, pps)
    for bn, chunk, warps, stages, pps in ((8, 8192, 4, 4, 1), (8, 8192, 4, 6, 1), (8, 8192, 4, 8, 1),
                                          (8, 8192, 4, 4, 2), (8, 8192, 4, 6, 2), (8, 8192, 4, 8, 2),
                                          (16, 8192, 4, 6, 2), (8, 16384, 8, 4, 1), (8, 16384, 8, 6, 1),
                                          (16, 16384, 8, 4, 2), (8, 4096, 4, 8, 2), (8, 4096, 4, 8, 3)):
        out[f"tma_n{bn}_{chunk // 1024}k_w{warps}_s{stages}_p{pps}"] = stream_config(kind, bn, chunk, warps, pps,
                                                                                    True, stages)
    return out


class Weights:
    """One shape's weight in the kind's dtype, `copies` of it (same values, other addresses:
    the graph's calls read HBM, not L2), and its per-channel scales for e4m3."""

    def __init__(self, n: int, k: int, kind: str, dev: torch.device, cuda: bool):
        from kernels.fp8_quant import quantize_weight_channels
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, device=dev, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        self.scale = None
        if kind == "fp8":
            w, self.scale = quantize_weight_channels(w)
        copies = max(1, math.ceil(4 * L2_BYTES / w.nbytes)) if cuda else 1
        self.copies = [w] + [w.clone() for _ in range(copies - 1)]
        self.bytes = w.nbytes


def variants(kind: str, sweep: bool, cuda: bool) -> dict:
    """name -> config (None: the table's, "torch": torch's op)."""
    out = {"torch": "torch"} if cuda else {}
    out.update(table=None, stream=stream_config(kind))
    if cuda:   # the TMA kernel: Hopper only, not under the interpreter
        out.update(tma=stream_config(kind, tma=True, programs_per_sm=2, stages=6))
    if sweep:
        out.update(candidates(kind))
    return out


def run_variant(cfg, x, xq, xs, ws: Weights, args, cuda: bool):
    """(the call on one weight, timing summary in us)."""
    from kernels.decode_gemv import decode_gemv_triton
    s = ws.scale
    if cfg == "torch":
        if s is None:
            fn = lambda w: F.linear(x, w)   # noqa: E731
        else:
            fn = lambda w: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1),  # noqa: E731
                                            out_dtype=x.dtype)
    elif s is None:
        fn = lambda w: decode_gemv_triton(x, w, config=cfg)   # noqa: E731
    else:
        fn = lambda w: decode_gemv_triton(xq, w, s, x_scale=xs.view(-1), out_dtype=x.dtype, config=cfg)  # noqa: E731
    calls = [lambda w=ws.copies[i % len(ws.copies)]: fn(w) for i in range(args.graph_iters)]
    return fn, graph_time_us(calls, args.repeats, cuda)


def bench(args, dev, cuda) -> dict:
    from kernels.decode_gemv import config_for, decode_gemv_reference
    from kernels.fp8_quant import quantize_activation_rows

    shapes = SMOKE_SHAPES if args.smoke else {**SHAPES, **(LM_HEAD if args.lm_head else {})}
    distinct = {}
    for name, nk in shapes.items():   # gate_up is QKV's shape: measured once, reported under both names
        distinct.setdefault(nk, []).append(name)
    rows_list = [int(r) for r in args.rows.split(",")]
    out, best_entries = {}, []
    for (n, k), names in distinct.items():
        for kind in args.kinds.split(","):
            ws = Weights(n, k, kind, dev, cuda)
            weight_bytes = ws.bytes
            floor_us = weight_bytes / (HBM_TBPS * 1e12) * 1e6
            for m in rows_list:
                x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m))
                x = x.to(torch.bfloat16)
                xq, xs = quantize_activation_rows(x) if kind == "fp8" else (None, None)
                ref = decode_gemv_reference(x, ws.copies[0], ws.scale)
                key = f"{'/'.join(names)} N={n} K={k} {kind} M={m}"
                res = {"n": n, "k": k, "kind": kind, "rows": m, "weight_bytes": weight_bytes, "floor_us": floor_us,
                       "table_config": asdict(config_for(n, k, kind, m)), "variants": {}}
                for vname, cfg in variants(kind, args.sweep, cuda).items():
                    if args.smoke and cfg not in (None, "torch"):
                        cfg = replace(cfg, block_k=min(cfg.block_k, 32))
                    try:
                        fn, t = run_variant(cfg, x, xq, xs, ws, args, cuda)
                    except Exception as err:   # a candidate this GPU cannot run
                        res["variants"][vname] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                        continue
                    tbps = {q: weight_bytes / (t[q] * 1e-6) / 1e12 for q in ("median", "min", "max")}
                    # the slowest run streams the least TB/s
                    row = {"us": t, "TBps": {"median": tbps["median"], "min": tbps["max"], "max": tbps["min"]},
                           "of_floor": floor_us / t["median"],
                           "rel_err_vs_reference": rel_err(fn(ws.copies[0]), ref)}
                    if cfg not in (None, "torch"):
                        row["config"] = asdict(cfg)
                    res["variants"][vname] = row
                out[key] = res
                timed = {v: r for v, r in res["variants"].items() if "config" in r and "us" in r}
                table_us = res["variants"].get("table", {}).get("us", {}).get("median", math.inf)
                if args.sweep and timed:
                    best = min(timed, key=lambda v: timed[v]["us"]["median"])
                    c = timed[best]["config"]
                    res["best_persistent"] = best
                    cls = "m1" if m == 1 else "m16"
                    if timed[best]["us"]["median"] >= table_us:
                        best_entries.append(f'    # ({n}, {k}, "{kind}", "{cls}"): the table\'s config stays '
                                            f'({table_us:.2f} us; {best} {timed[best]["us"]["median"]:.2f})')
                        continue
                    best_entries.append(
                        f'    ({n}, {k}, "{kind}", "{cls}"): GemvConfig(block_n={c["block_n"]}, '
                        f'block_k={c["block_k"]}, num_warps={c["num_warps"]}, num_stages={c["num_stages"]}, '
                        f'{"tma" if c["tma"] else "stream"}=True, programs_per_sm={c["programs_per_sm"]}),   '
                        f'# {best}: {timed[best]["us"]["median"]:.2f} us, '
                        f'table {table_us:.2f} us')
            del ws
            if cuda:
                torch.cuda.empty_cache()
    return {"results": out, "sweep_entries": best_entries}


LAYERS = 32


def token_estimate(results: dict, kind: str = "fp8", rows: int = 1) -> dict:
    """Each variant's dense GEMV microseconds of one decode token (32 layers' QKV, O, gate_up and
    down, plus the lm_head where measured) from the medians, and the same at the floor: what the
    benchmarked FP8 decode step (every one of these linears in e4m3) would spend in them."""
    per_shape = {}
    for res in results.values():
        if res["kind"] == kind and res["rows"] == rows:
            for name in ("qkv", "o", "gate_up", "down", "lm_head"):
                if (res["n"], res["k"]) == {**SHAPES, **LM_HEAD}[name]:
                    per_shape[name] = res
    if not all(name in per_shape for name in SHAPES):
        return {}
    names = [*SHAPES, *(["lm_head"] if "lm_head" in per_shape else [])]
    count = {name: 1 if name == "lm_head" else LAYERS for name in names}
    variants = set.intersection(*({v for v, r in per_shape[name]["variants"].items() if "us" in r} for name in names))
    out = {v: sum(count[name] * per_shape[name]["variants"][v]["us"]["median"] for name in names)
           for v in sorted(variants)}
    out["floor"] = sum(count[name] * per_shape[name]["floor_us"] for name in names)
    return {"kind": kind, "rows": rows, "shapes": names, "us_per_token": out}


def print_table(results: dict) -> None:
    print(f"{'shape':34s} {'variant':26s} {'us median [range]':>24s} {'TB/s median [range]':>22s} "
          f"{'floor us':>8s} {'of floor':>8s} {'rel err':>8s}")
    for key, res in results.items():
        for v, r in res["variants"].items():
            if "error" in r:
                print(f"{key:34s} {v:26s} {r['error'][:80]}")
                continue
            u, b = r["us"], r["TBps"]
            print(f"{key:34s} {v:26s} {u['median']:8.2f} [{u['min']:6.2f}-{u['max']:6.2f}] "
                  f"{b['median']:6.2f} [{b['min']:5.2f}-{b['max']:5.2f}] {res['floor_us']:8.2f} "
                  f"{r['of_floor']:8.2f} {r['rel_err_vs_reference']:8.1e}")


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--rows", default="1", help="rows of x, comma-separated (<= 16)")
    p.add_argument("--repeats", type=int, default=9, help="graph replays timed per variant")
    p.add_argument("--graph-iters", type=int, default=40, help="calls in the timed CUDA graph")
    p.add_argument("--sweep", action="store_true", help="time every persistent candidate; print GEMV_CONFIGS entries")
    p.add_argument("--lm-head", action="store_true", help="also the lm_head [133120, 4096]")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"weight kinds, comma-separated, of {KINDS}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpreted), to check the script")
    args = b.parse("outputs/bench_decode_gemv.json")
    if any(int(r) > 16 or int(r) < 1 for r in args.rows.split(",")):
        p.error(f"--rows: each must be 1..16, got {args.rows}")
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        p.error(f"--kinds: {unknown} unknown; known: {KINDS}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return need_cuda(MODULE + " (or --smoke)")
    if args.smoke:
        args.repeats, args.graph_iters = min(args.repeats, 2), min(args.graph_iters, 2)
    dev = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    with torch.no_grad():
        result = bench(args, dev, cuda)
    result["token_estimate"] = token_estimate(result["results"]) if not args.smoke else {}
    result.update(smoke=args.smoke, hbm_tbps=HBM_TBPS, seconds=time.perf_counter() - t0)
    b.write(result, dev)
    if result["sweep_entries"]:
        print("GEMV_CONFIGS entries (kernels/decode_gemv.py), the fastest persistent candidate per shape:")
        print("\n".join(result["sweep_entries"]))
    print_table(result["results"])
    est = result["token_estimate"]
    if est:
        print(f"dense GEMV us per decode token ({est['kind']}, M={est['rows']}, {'+'.join(est['shapes'])}): " +
              ", ".join(f"{v} {us:.0f}" for v, us in sorted(est["us_per_token"].items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    interpret_triton_on_cpu()
    sys.exit(main())
