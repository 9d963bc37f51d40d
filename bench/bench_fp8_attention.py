"""FP8 attention (kernels/fp8_attention.py) against torch SDPA in bf16, one GPU.

Shapes (head_dim 128, batch 1): Wan's self-attention at 480p x 81 frames (32760 tokens), 12 heads (1.3B)
and 40 (14B); HunyuanImage-3's cached denoise attention, 32 query / 8 KV heads, 4098 image rows over 5606
keys (`hy-t2i`) or 9702 (`hy-ti2i`, an edit's). Timed (CUDA events, median of `--iters`): SDPA bf16 per
backend and as dispatched; FP8 attention with FP8 and FP16 PV, with the quantization compiled ("-cq"),
the quantization alone, and the kernel alone on quantized operands (`--sweep`: at each of its tiles, with
registers and spills); on sm90 the Gluon kernel (kernels/fp8_attention_gluon.py) alone on the same
operands, at its default tiles and its variants (`gluon-*`), against the Triton kernel alone
(`--kernels-only`: just those rows; a table of both last). Error: relative L2 against SDPA's math in
float32 on the first 2 query heads; the Gluon rows also against the Triton kernel's output.

Floors (each shape): the two MMAs at the 8-bit tensor cores' dense rate, and the softmax's exp2s (one
a logit) at the exp2 unit's rate measured here (`_exp2_rate`: MUFU.EX2 in independent chains, the GPU
full, and with 2 warps a scheduler as the attention kernels run): an 8-bit attention kernel at head
dim 128 needs about as many exp2 cycles as MMA cycles.
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.harness import Bench, need_cuda, time_ms

MODULE = "bench.bench_fp8_attention"
HEAD_DIM = 128
# name -> (query heads, KV heads, query rows, keys)
SHAPES = {"1.3B": (12, 12, 32760, 32760), "14B": (40, 40, 32760, 32760),
          "hy-t2i": (32, 8, 4098, 5606), "hy-ti2i": (32, 8, 4098, 9702)}


def _sweep_tiles():
    from kernels.fp8_attention import AttentionTiles as T
    # (registers a thread, from the cubins: m64-n128 231, m64-n64 160: three programs an SM)
    return [T(64, 128, 4, 3), T(64, 128, 4, 3, tma=False), T(64, 128, 4, 3, magic=False), T(64, 128, 4, 2, maxnreg=168),
            T(64, 64, 4, 2), T(64, 64, 4, 3), T(64, 64, 4, 4), T(64, 64, 4, 3, magic=False),
            T(64, 64, 4, 2, maxnreg=128),
            T(64, 64, 4, 3, maxnreg=128), T(128, 64, 4, 3), T(128, 64, 4, 4, tma=False), T(128, 128, 8, 4)]


def _gluon_variants():
    """name -> GluonTiles: the default, and one change from it each."""
    from dataclasses import replace
    from kernels.fp8_attention_gluon import GLUON_TILES as T
    return {"fp8-kernel-gluon": T, "gluon-stages2": replace(T, num_stages=2),
            "gluon-no-pingpong": replace(T, pingpong=False), "gluon-natural-k": replace(T, permuted_k=False),
            "gluon-1wg": replace(T, consumers=1, pingpong=False, maxnreg=128),
            "gluon-n64": replace(T, block_n=64),
            "gluon-poly25": replace(T, poly_exp2=1), "gluon-poly50": replace(T, poly_exp2=2)}


@triton.jit
def _exp2_chains(out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """8 independent exp2 chains a thread (an FMUL each keeps the values in range)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = (offs % 7).to(tl.float32) * -0.05
    b, c, d, e, f, g, h = a - 0.01, a - 0.02, a - 0.03, a - 0.04, a - 0.05, a - 0.06, a - 0.07
    for _ in range(STEPS):
        a = tl.exp2(a) * -0.5
        b = tl.exp2(b) * -0.5
        c = tl.exp2(c) * -0.5
        d = tl.exp2(d) * -0.5
        e = tl.exp2(e) * -0.5
        f = tl.exp2(f) * -0.5
        g = tl.exp2(g) * -0.5
        h = tl.exp2(h) * -0.5
    tl.store(out_ptr + offs, a + b + c + d + e + f + g + h)


def _exp2_rate(iters: int) -> dict:
    """exp2 results a second on this GPU (`_exp2_chains`), with the GPU full (16 warps an SM) and with
    8 warps an SM (2 a scheduler, as the attention kernels' two consumer warpgroups run)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    steps = 4096
    rates = {}
    for label, warps, programs_per_sm in (("full", 8, 2), ("2_warps_a_scheduler", 8, 1)):
        block = 32 * warps
        programs = sms * programs_per_sm
        out = torch.empty(programs * block, device="cuda")
        fn = lambda: _exp2_chains[(programs,)](out, STEPS=steps, BLOCK=block, num_warps=warps)  # noqa: E731
        ms = statistics.median(_time(fn, iters))
        rates[label] = programs * block * steps * 8 / (ms * 1e-3)
    result = {"exp2_per_s": {k: float(f"{v:.4g}") for k, v in rates.items()}}
    clock = _sm_clock_hz()
    if clock:
        result["sm_clock_mhz"] = round(clock / 1e6)
        result["exp2_per_clock_per_sm"] = {k: round(v / sms / clock, 2) for k, v in rates.items()}
    return result


def _sm_clock_hz() -> float | None:
    """The SM clock while the GPU runs (NVML), or None where NVML does not say."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) * 1e6
    except Exception:   # noqa: BLE001 - no NVML: the rate per clock is left out
        return None


def _time(fn, iters):
    return time_ms(fn, iters, warmup=3)


def _tiles_name(t) -> str:
    return (f"m{t.block_m}-n{t.block_n}-w{t.num_warps}-s{t.num_stages}" + ("-tma" if t.tma else "-ptr")
            + ("" if t.magic else "-i2f") + (f"-r{t.maxnreg}" if t.maxnreg else ""))


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--shapes", default="1.3B,14B,hy-t2i,hy-ti2i")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="time the kernel alone at every tile of SWEEP")
    p.add_argument("--kernels-only", action="store_true",
                   help="only the Triton and Gluon kernels alone on quantized operands (no SDPA, no quantization)")
    args = b.parse()
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; known {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from kernels import fp8_attention as fa
    from kernels import fp8_attention_gluon as fg
    gluon_problem = fg.gluon_problem(torch.device("cuda"))
    D = HEAD_DIM
    result = {"what": "attention: FP8 attention vs SDPA bf16", "head_dim": D,
              "default_tiles": _tiles_name(fa.DEFAULT_TILES),
              "long_key_tiles": f"{_tiles_name(fa.LONG_KEY_TILES)} from {fa.LONG_KEYS} keys", "shapes": {}}
    result["exp2_rate"] = exp2 = _exp2_rate(args.iters)
    print(f"exp2 rate: {exp2}", flush=True)
    for name in args.shapes.split(","):
        Hq, Hkv, Sq, Sk = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, Hq, Sq, D, generator=g, device="cuda").bfloat16()
        k, v = (torch.randn(1, Hkv, Sk, D, generator=g, device="cuda").bfloat16() for _ in range(2))
        k = k + 1.0
        group = Hq // Hkv
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        flops = 4 * Sq * Sk * D * Hq
        exact = F.scaled_dot_product_attention(q[:, :2].float(), ke[:, :2].float(), ve[:, :2].float())
        rows = {}
        runs = {}
        if not args.kernels_only:
            runs.update({f"sdpa-{b.name.lower()}": (lambda b=b: _sdpa(q, ke, ve, b, sdpa_kernel))
                         for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION)})
            runs["sdpa-dispatched"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)
            runs["fp8-pv-fp8"] = lambda: fa.fp8_attention(q, k, v, pv="fp8")
            runs["fp8-pv-fp16"] = lambda: fa.fp8_attention(q, k, v, pv="fp16")
            if gluon_problem is None:
                runs["fp8-pv-fp8-gluon"] = lambda: fa.fp8_attention(q, k, v, impl="gluon")
            runs["fp8-quantize-only"] = lambda: fa.quantize_qkv(q, k, v)
            compiled = torch.compile(fa.quantize_qkv, fullgraph=True, dynamic=False)
            runs["fp8-quantize-compiled"] = lambda: compiled(q, k, v)
            # the quantization compiled with the op after it, as a compiled region runs them
            with_compiled_quant = torch.compile(fa.fp8_attention, fullgraph=True, dynamic=False)
            runs["fp8-pv-fp8-cq"] = lambda: with_compiled_quant(q, k, v, pv="fp8")
        operands = fa.quantize_qkv(q, k, v)
        kernel_runs = {"fp8-kernel": fa.default_tiles(Sk)}     # the op's tiles for this key count
        if args.sweep:
            kernel_runs.update({f"sweep-{_tiles_name(t)}": t for t in _sweep_tiles()})
        for run, tiles in kernel_runs.items():
            runs[run] = (lambda t=tiles: fa._fp8_attention_triton(*operands, Sq, Sk, Hq, q.dtype, t).transpose(1, 2))
        gluon_runs = _gluon_variants() if gluon_problem is None else {}
        for run, tiles in gluon_runs.items():
            runs[run] = (lambda t=tiles: fg.fp8_attention_gluon(*operands, Sq, Sk, Hq, q.dtype, t).transpose(1, 2))
        if gluon_problem is not None:
            rows["fp8-kernel-gluon"] = {"error": gluon_problem}
        tl_out = None
        for run, fn in runs.items():
            try:
                times = _time(fn, args.iters)
            except Exception as e:   # a backend or tile that refuses the shape: recorded, not fatal
                rows[run] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                print(f"{name:7s} {run:34s} refused: {rows[run]['error']}", flush=True)
                continue
            ms = statistics.median(times)
            row = {"ms": round(ms, 3), "ms_min": round(min(times), 3), "ms_max": round(max(times), 3),
                   "tflops": round(flops / ms / 1e9, 1)}
            if not run.startswith("fp8-quantize"):
                out = fn()[:, :2].float()
                row["rel_l2_vs_fp32"] = float((out - exact).norm() / exact.norm())
                if run == "fp8-kernel":
                    tl_out = out
                elif run in gluon_runs and tl_out is not None:
                    row["rel_l2_vs_tl_kernel"] = float((out - tl_out).norm() / tl_out.norm())
            rows[run] = row
            print(f"{name:7s} {run:34s} {ms:8.3f} ms ({min(times):.3f}-{max(times):.3f})  {row['tflops']:7.1f} TFLOP/s"
                  + (f"  rel L2 vs fp32 {row['rel_l2_vs_fp32']:.2e}" if "rel_l2_vs_fp32" in row else "")
                  + (f"  vs tl kernel {row['rel_l2_vs_tl_kernel']:.2e}" if "rel_l2_vs_tl_kernel" in row else ""),
                  flush=True)
        for run, tiles in kernel_runs.items():
            if "ms" in rows.get(run, {}):
                rows[run].update(_registers(fa, operands, Sq, Sk, Hq, q.dtype, tiles))
        for run, tiles in gluon_runs.items():
            if "ms" in rows.get(run, {}):
                rows[run].update(_registers_of(fg.launch_fp8_attention_gluon(*operands, Sq, Sk, Hq, q.dtype, tiles)[1]))
        best = min((r["ms"] for n, r in rows.items() if n.startswith("sdpa") and "ms" in r), default=None)
        for n, r in rows.items():
            if best and n.startswith(("fp8-pv", "fp8-kernel", "sweep", "gluon")) and "ms" in r:
                r["speedup_vs_best_sdpa"] = round(best / r["ms"], 3)
        print(f"{name:7s} speed-up over the best SDPA: " + ", ".join(
            f"{n} {r['speedup_vs_best_sdpa']:.3f}x" for n, r in rows.items() if "speedup_vs_best_sdpa" in r))
        result["shapes"][name] = {"heads": Hq, "kv_heads": Hkv, "query_rows": Sq, "keys": Sk, "runs": rows,
                                  "floors_ms": _floors_ms(flops, Sq * Sk * Hq, exp2["exp2_per_s"])}
    b.write(result)
    _print_kernel_table(result["shapes"])
    return 0


# the 8-bit tensor cores' dense rate (INT8 Q K^T and e4m3 P V alike), H100 / H200 SXM datasheet
DENSE_8BIT_TFLOPS = 1979.0


def _floors_ms(flops: float, logits: int, exp2_per_s: dict) -> dict:
    return {"mma_8bit": round(flops / DENSE_8BIT_TFLOPS / 1e9, 3),
            **{f"exp2_{k}": round(logits / v * 1e3, 3) for k, v in exp2_per_s.items()}}


def _print_kernel_table(shapes: dict) -> None:
    """The Triton kernel alone against each Gluon row: ms (median, range), TFLOP/s, errors, speed-up."""
    print(f"\n{'shape':8s} {'kernel':20s} {'ms':>8s} {'range':>15s} {'TFLOP/s':>8s} {'vs fp32':>9s} {'vs tl':>9s} "
          f"{'tl/this':>7s} {'regs':>5s}")
    for name, shape in shapes.items():
        runs = shape["runs"]
        tl_ms = runs.get("fp8-kernel", {}).get("ms")
        print(f"{name:8s} floors (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in shape["floors_ms"].items()))
        for run, r in runs.items():
            if run != "fp8-kernel" and not run.startswith("gluon") and run != "fp8-kernel-gluon":
                continue
            if "ms" not in r:
                print(f"{name:8s} {run:20s} {r.get('error', '')[:90]}")
                continue
            print(f"{name:8s} {run:20s} {r['ms']:8.3f} {r['ms_min']:7.3f}-{r['ms_max']:<7.3f} {r['tflops']:8.1f} "
                  f"{r['rel_l2_vs_fp32']:9.2e} {r.get('rel_l2_vs_tl_kernel', float('nan')):9.2e} "
                  f"{(tl_ms / r['ms'] if tl_ms else float('nan')):7.3f} {r.get('registers', '')!s:>5s}")


def _registers(fa, operands, Sq, Sk, Hq, dtype, tiles) -> dict:
    """Registers a thread and spilled bytes of the kernel at these tiles (Triton's compiled
    kernel), or {} where this Triton does not say."""
    return _registers_of(fa.launch_fp8_attention(*operands, Sq, Sk, Hq, dtype, tiles)[1])


def _registers_of(compiled) -> dict:
    try:
        compiled._init_handles()
        return {"registers": compiled.n_regs, "spills": compiled.n_spills}
    except AttributeError:
        return {}


def _sdpa(q, k, v, backend, sdpa_kernel):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v)


if __name__ == "__main__":
    sys.exit(main())
