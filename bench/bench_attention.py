"""The sequence-parallel attention kernels on one GPU at HunyuanImage-3's per-rank shapes (TP2 x SP2).

16 query / 4 KV heads, head_dim 128, bf16, 2674 local of 5347 tokens, B = 1 (CFG serial) and 2 (CFG batch):
- Ulysses pack, unpack, pack_out, unpack_out: the Triton op against the torch reference (bytes: every
  element written once and read once);
- LSE combine of N = 2 and 3 partials, and N = 2 straight from Attention2D's packed receive buffer;
- for context, masked attention with LSE (`attention_lse`) for the local queries against every key,
  beside SDPA with the same mask (the model's path, no LSE), in TFLOP/s.
Times: triton.testing.do_bench medians; bandwidth against 4.3 TB/s.
"""
import sys

import torch

from bench.floors import DENSE_BF16_TFLOPS, HBM_TBPS
from bench.harness import Bench, median_ms, need_cuda

MODULE = "bench.bench_attention"
HQ, HKV, D, S_LOCAL, S_TOTAL, SP = 16, 4, 128, 2674, 5347, 2
TEXT = S_TOTAL - 4096 - 3              # text rows before the image block (4096 tokens, 3 tail rows)


def _row(op, variant, B, fn, nbytes=None, flops=None, note=""):
    ms = median_ms(fn)
    row = {"op": op, "variant": variant, "B": B, "ms": ms, "note": note}
    if nbytes is not None:
        row.update(bytes=nbytes, gbps=nbytes / ms / 1e6, x_peak_bw=nbytes / ms / 1e6 / (HBM_TBPS * 1e3))
    if flops is not None:
        row["tflops"] = flops / ms / 1e9
    print(f"{op:<20} {variant:<10} B={B} {ms * 1e3:9.1f} us"
          + (f" {row['gbps']:6.0f} GB/s" if nbytes else "") + (f" {row['tflops']:6.1f} TFLOP/s" if flops else "")
          + f"  {note}", flush=True)
    return row


def bench_ulysses(rnd):
    from dtgen.sp import ulysses_kv_heads
    from kernels.ulysses_pack import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out
    rows, hq = [], HQ // SP
    q_heads = [list(range(j * hq, (j + 1) * hq)) for j in range(SP)]
    kv_heads = ulysses_kv_heads(HQ, HKV, SP)
    n = len(kv_heads[0])
    for B in (1, 2):
        q, k, v = rnd(B, S_LOCAL, HQ, D), rnd(B, S_LOCAL, HKV, D), rnd(B, S_LOCAL, HKV, D)
        send_bytes = SP * B * S_LOCAL * (hq + 2 * n) * D * 2
        out = rnd(B, hq, SP * S_LOCAL, D).transpose(1, 2)   # head-major memory, as SDPA's math path leaves it
        back, recv = rnd(SP, B, S_LOCAL, hq, D), rnd(SP, B, S_LOCAL, hq + 2 * n, D)
        out_bytes = B * SP * S_LOCAL * hq * D * 2
        for impl in ("triton", "reference"):
            rows.append(_row("ulysses_pack", impl, B, lambda: ulysses_pack(q, k, v, q_heads, kv_heads, impl),
                             2 * send_bytes))
            if B > 1:   # a free view at B = 1
                rows.append(_row("ulysses_unpack", impl, B, lambda: ulysses_unpack(recv, impl), 2 * send_bytes))
            rows.append(_row("ulysses_pack_out", impl, B, lambda: ulysses_pack_out(out, SP, impl), 2 * out_bytes))
            rows.append(_row("ulysses_unpack_out", impl, B, lambda: ulysses_unpack_out(back, impl), 2 * out_bytes))
    return rows


def bench_lse_merge(rnd, gen):
    from kernels.lse_merge import lse_merge
    rows = []
    for B in (1, 2):
        elems = B * S_LOCAL * HQ
        for N in (2, 3):
            outs = rnd(N, B, S_LOCAL, HQ, D)
            lses = 3 * torch.randn(N, B, S_LOCAL, HQ, device="cuda", generator=gen)
            for impl in ("triton", "reference"):
                rows.append(_row("lse_merge", impl, B, lambda: lse_merge(outs, lses, None, impl),
                                 (N + 1) * elems * (D * 2 + 4), note=f"N={N}"))
        # Attention2D: straight from the receive buffer (bf16 out + the fp32 lse as 2 lanes)
        buf = rnd(2, B, S_LOCAL, HQ, D + 2)
        buf[..., D:] = (3 * torch.randn(2, B, S_LOCAL, HQ, 1, device="cuda", generator=gen)).view(torch.bfloat16)
        o_view, l_view = buf[..., :D], buf[..., D:].view(torch.float32).squeeze(-1)
        rows.append(_row("lse_merge", "triton", B, lambda: lse_merge(o_view, l_view), 3 * elems * (D * 2 + 4),
                         note="N=2, strided receive buffer"))
    return rows


def bench_attention(rnd):
    import torch.nn.functional as F

    from dtgen.attention import structured_mask
    from kernels.attention_lse import attention_lse
    q, k, v = rnd(1, HQ, S_LOCAL, D), rnd(1, HKV, S_TOTAL, D), rnd(1, HKV, S_TOTAL, D)
    mask = structured_mask(torch.arange(S_LOCAL, 2 * S_LOCAL, device="cuda"), torch.arange(S_TOTAL, device="cuda"),
                           ((TEXT, TEXT + 4096),))
    flops = 4 * HQ * S_LOCAL * S_TOTAL * D
    ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    return [_row("attention_lse", "efficient", 1, lambda: attention_lse(q, k, v, mask), flops=flops,
                 note="2674 queries x 5347 keys, mask from slots, + LSE"),
            _row("sdpa_masked", "torch", 1, lambda: F.scaled_dot_product_attention(q, ke, ve, mask), flops=flops,
                 note="same mask, no LSE (the model's path)")]


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    b.parse("outputs/bench_attention.json")
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    rows = bench_ulysses(rnd) + bench_lse_merge(rnd, gen) + bench_attention(rnd)
    b.write({"shapes": dict(q_heads=HQ, kv_heads=HKV, head_dim=D, local_tokens=S_LOCAL, total_tokens=S_TOTAL, sp=SP,
                            dtype="bfloat16"),
             "peaks": dict(hbm_tbps=HBM_TBPS, dense_bf16_tflops=DENSE_BF16_TFLOPS), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
