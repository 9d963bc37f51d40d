"""Benchmark the sequence-parallel attention kernels on one GPU at HunyuanImage-3 shapes.

    python -m bench.bench_attention [--out outputs/bench_attention.json]

Shapes, per rank at TP2 x SP2 (HunyuanImage-3: 32 query / 8 KV heads, head_dim 128; a
1024x1024 image plus prompt is 5347 tokens, 2674 per SP rank after padding): 16 query and 4
KV heads, bf16. B = 1 (CFG serial) and B = 2 (CFG batch).

- Ulysses pack (q/k/v -> send buffer [2, B, 2674, 12, 128]), unpack (receive buffer ->
  [B, 5348, 12, 128]; a free view at B = 1, so timed at B = 2 only), pack_out (attention
  output [B, 5348, 8, 128] stored head-major -> [2, B, 2674, 8, 128]) and unpack_out
  ([2, B, 2674, 8, 128] -> [B, 2674, 16, 128]): Triton op vs the torch reference.
  Bytes = 2 x the output buffer (every element written once and read once).
- LSE combine: N = 2 and 3 partials [N, B, 2674, 16, 128] bf16 with float32 LSEs ->
  bf16 output and float32 LSE (ring at SP2: 2 blocks, + the cached text part = 3);
  also N = 2 read straight from Attention2D's packed receive buffer [2, B, 2674, 16, 130]
  (strided views). Bytes = N * (out + lse) read + out + lse written.
- For context, masked attention with LSE (`attention_lse`, efficient-attention kernel)
  for the 2674 local queries against all 5347 keys, in TFLOP/s (4 * B * Hq * Sq * Sk * D
  FLOPs), beside F.scaled_dot_product_attention with the same boolean mask (the model's
  path; no LSE).

Achieved bandwidth is compared with 4.3 TB/s (H200 HBM3e). Times are medians of
triton.testing.do_bench. Without CUDA it prints a message and exits 0.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

HQ, HKV, D, S_LOCAL, S_TOTAL, SP = 16, 4, 128, 2674, 5347, 2
TEXT = S_TOTAL - 4096 - 3              # text rows before the image block (4096 tokens, 3 tail rows)
PEAK_TBPS, PEAK_TFLOPS = 4.3, 694.0


def median_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _row(op, variant, B, ms, nbytes=None, flops=None, note=""):
    row = {"op": op, "variant": variant, "B": B, "ms": ms, "note": note}
    if nbytes is not None:
        row["bytes"] = nbytes
        row["gbps"] = nbytes / ms / 1e6
        row["x_peak_bw"] = row["gbps"] / (PEAK_TBPS * 1e3)
    if flops is not None:
        row["tflops"] = flops / ms / 1e9
    return row


def bench_ulysses(gen):
    from dtgen.sp import ulysses_kv_heads
    from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out

    rows = []
    hq = HQ // SP
    q_heads = [list(range(j * hq, (j + 1) * hq)) for j in range(SP)]
    kv_heads = ulysses_kv_heads(HQ, HKV, SP)
    n = len(kv_heads[0])

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    for B in (1, 2):
        q, k, v = rnd(B, S_LOCAL, HQ, D), rnd(B, S_LOCAL, HKV, D), rnd(B, S_LOCAL, HKV, D)
        send_bytes = SP * B * S_LOCAL * (hq + 2 * n) * D * 2
        for impl in ("triton", "reference"):
            rows.append(_row("ulysses_pack", impl, B, median_ms(lambda: ulysses_pack(q, k, v, q_heads, kv_heads, impl)),
                             2 * send_bytes))
        if B > 1:
            recv = rnd(SP, B, S_LOCAL, hq + 2 * n, D)
            for impl in ("triton", "reference"):
                rows.append(_row("ulysses_unpack", impl, B, median_ms(lambda: ulysses_unpack(recv, impl)),
                                 2 * send_bytes))
        out = rnd(B, hq, SP * S_LOCAL, D).transpose(1, 2)   # head-major memory, as SDPA's math path leaves it
        out_bytes = B * SP * S_LOCAL * hq * D * 2
        for impl in ("triton", "reference"):
            rows.append(_row("ulysses_pack_out", impl, B, median_ms(lambda: ulysses_pack_out(out, SP, impl)),
                             2 * out_bytes))
        back = rnd(SP, B, S_LOCAL, hq, D)
        for impl in ("triton", "reference"):
            rows.append(_row("ulysses_unpack_out", impl, B, median_ms(lambda: ulysses_unpack_out(back, impl)),
                             2 * out_bytes))
        print(f"ulysses B={B}: " + ", ".join(f"{r['op']}/{r['variant']} {r['ms'] * 1e3:.1f} us"
                                             for r in rows if r["B"] == B), flush=True)
    return rows


def bench_lse_merge(gen):
    from kernels.lse_merge import lse_merge

    rows = []
    for B in (1, 2):
        for N in (2, 3):
            outs = torch.randn(N, B, S_LOCAL, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
            lses = 3 * torch.randn(N, B, S_LOCAL, HQ, device="cuda", generator=gen)
            elems = B * S_LOCAL * HQ
            nbytes = N * elems * (D * 2 + 4) + elems * (D * 2 + 4)
            for impl in ("triton", "reference"):
                rows.append(_row("lse_merge", impl, B, median_ms(lambda: lse_merge(outs, lses, None, impl)), nbytes,
                                 note=f"N={N}"))
        # Attention2D: straight from the receive buffer (bf16 out + the fp32 lse as 2 lanes).
        buf = torch.randn(2, B, S_LOCAL, HQ, D + 2, device="cuda", generator=gen, dtype=torch.bfloat16)
        buf[..., D:] = (3 * torch.randn(2, B, S_LOCAL, HQ, 1, device="cuda", generator=gen)).view(torch.bfloat16)
        o_view, l_view = buf[..., :D], buf[..., D:].view(torch.float32).squeeze(-1)
        elems = B * S_LOCAL * HQ
        rows.append(_row("lse_merge", "triton", B, median_ms(lambda: lse_merge(o_view, l_view)),
                         3 * elems * (D * 2 + 4), note="N=2, strided receive buffer"))
        print(f"lse_merge B={B}: " + ", ".join(f"{r['variant']} ({r['note']}) {r['ms'] * 1e3:.1f} us"
                                               for r in rows if r["B"] == B), flush=True)
    return rows


def bench_attention(gen):
    import torch.nn.functional as F

    from dtgen.attention import structured_mask
    from kernels.attention_lse import attention_lse

    rows = []
    B = 1
    q = torch.randn(B, HQ, S_LOCAL, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, S_TOTAL, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, S_TOTAL, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    mask = structured_mask(torch.arange(S_LOCAL, 2 * S_LOCAL, device="cuda"), torch.arange(S_TOTAL, device="cuda"),
                     ((TEXT, TEXT + 4096),))
    flops = 4 * B * HQ * S_LOCAL * S_TOTAL * D
    rows.append(_row("attention_lse", "efficient", B, median_ms(lambda: attention_lse(q, k, v, mask)),
                     flops=flops, note="2674 queries x 5347 keys, mask from slots, + LSE"))
    ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    rows.append(_row("sdpa_masked", "torch", B, median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, mask)),
                     flops=flops, note="same mask, no LSE (the model's path)"))
    print("attention: " + ", ".join(f"{r['op']} {r['ms']:.3f} ms" for r in rows), flush=True)
    return rows


def print_table(rows):
    print(f"\nSP attention kernels, HunyuanImage-3 per rank at TP2 x SP2 (Hq {HQ}, Hkv {HKV}, D {D}, "
          f"{S_LOCAL} local / {S_TOTAL} tokens), bf16")
    print(f"{'op':<20} {'variant':<10} {'B':>2} {'us':>9} {'GB/s':>8} {'x 4.3TB/s':>9} {'TFLOP/s':>8}  note")
    for r in rows:
        gbps = f"{r['gbps']:>8.0f}" if "gbps" in r else f"{'':>8}"
        frac = f"{r['x_peak_bw']:>9.2f}" if "x_peak_bw" in r else f"{'':>9}"
        tflops = f"{r['tflops']:>8.1f}" if "tflops" in r else f"{'':>8}"
        print(f"{r['op']:<20} {r['variant']:<10} {r['B']:>2} {r['ms'] * 1e3:>9.1f} {gbps} {frac} {tflops}  {r['note']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_attention.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention measures CUDA kernels on a GPU; no CUDA device is visible here, nothing to do.")
        return 0
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = bench_ulysses(gen) + bench_lse_merge(gen) + bench_attention(gen)
    report = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, local_tokens=S_LOCAL, total_tokens=S_TOTAL, sp=SP,
                    dtype="bfloat16"),
        peaks=dict(hbm_tbps=PEAK_TBPS, dense_bf16_tflops=PEAK_TFLOPS),
        notes=["times are medians of triton.testing.do_bench (ms)",
               "bytes: every element written once and read once (2 x the output buffer) for the Ulysses "
               "layouts; N partials + lses read and one output + lse written for lse_merge",
               "ulysses_unpack is a free view at B = 1 (not timed)"],
        rows=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
