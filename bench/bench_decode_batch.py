"""Batched AR decode's kernels on one GPU: the split-KV attention and the fused attention prologue.

- kernel: decode attention at the released shapes (32 q / 8 kv heads, head_dim 128, bf16) for 8
  requests of skewed lengths (one 16k, seven 1k): the balanced split-KV schedule against static
  splits (the heuristic's count and a sweep) and the masked SDPA of the one-request step.
- prologue: split + RoPE + QK RMSNorm + KV write fused against the separate torch ops (eager and
  inductor-compiled), at decode (8 rows) and prefill (4096 rows).
Ops replay from a CUDA graph of `--graph-iters` calls; each figure is the median of `--repeats` with its
range. `--smoke`: tiny shapes (on CPU the Triton kernels interpreted), to check the script.
"""
from __future__ import annotations

import sys

import torch

from bench.floors import HBM_TBPS
from bench.harness import Bench, graph_time_us, interpret_triton_on_cpu, need_cuda

MODULE = "bench.bench_decode_batch"
PARTS = ("kernel", "prologue")


def _time_us(args, cuda, fn) -> dict:
    return graph_time_us([fn] * (args.graph_iters if cuda else 1), args.repeats, cuda, warm=3)


def bench_kernel(args, dev, cuda) -> dict:
    from dtgen.attention import attend
    from kernels.split_kv_decode import (balanced_schedule, default_num_programs, heuristic_splits,
                                         split_kv_decode, static_schedule)

    B, Hq, Hkv, D, lens = (4, 8, 2, 64, [300, 20, 20, 20]) if args.smoke else (8, 32, 8, 128, [16384] + [1024] * 7)
    L = max(lens)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(*shape, device=dev, generator=gen).to(dtype)
               for shape in ((B, Hq, D), (B, Hkv, L, D), (B, Hkv, L, D)))
    lengths = torch.tensor(lens, device=dev)
    programs, splits = default_num_programs(dev, Hkv), heuristic_splits(B, Hkv, dev)
    balanced = balanced_schedule(lengths, L, programs)
    out = {"batch": B, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "lengths": lens, "dtype": str(dtype),
           "balanced_programs_per_kv_head": programs, "heuristic_splits": splits,
           "balanced_us": _time_us(args, cuda, lambda: split_kv_decode(q, k, v, lengths, balanced, impl="triton")),
           "schedule_build_us": _time_us(args, cuda, lambda: balanced_schedule(lengths, L, programs))}
    static = {s: _time_us(args, cuda, lambda sch=static_schedule(lengths, L, s):
                          split_kv_decode(q, k, v, lengths, sch, impl="triton"))
              for s in sorted({1, 2, 4, 8, 16, 32, 64, splits})}
    best = min(static, key=lambda s: static[s]["median"])
    out.update(static_us_by_splits={str(s): t for s, t in static.items()}, static_heuristic_us=static[splits],
               static_best_splits=best,
               speedup_vs_static_heuristic=static[splits]["median"] / out["balanced_us"]["median"],
               speedup_vs_static_best=static[best]["median"] / out["balanced_us"]["median"])
    mask = torch.arange(L, device=dev)[None, :] < lengths[:, None]   # the one-request step: masked SDPA per row
    out["sdpa_masked_us"] = _time_us(args, cuda, lambda: attend(q[:, :, None], k, v, mask[:, None, None, :]))
    out["kv_bytes"] = 2 * sum(lens) * Hkv * D * k.element_size()
    out["floor_us"] = out["kv_bytes"] / (HBM_TBPS * 1e12) * 1e6
    print(f"kernel: balanced {out['balanced_us']['median']:.1f} us, static ({splits} splits) "
          f"{static[splits]['median']:.1f} us -> {out['speedup_vs_static_heuristic']:.2f}x (best static: {best} "
          f"splits -> {out['speedup_vs_static_best']:.2f}x); masked SDPA {out['sdpa_masked_us']['median']:.1f} us; "
          f"floor {out['floor_us']:.1f} us")
    return out


def bench_prologue(args, dev, cuda) -> dict:
    from kernels.qk_norm_rope_kv import prologue_launch_config, qk_norm_rope_kv, qk_norm_rope_kv_reference
    from models.hunyuan_image3.rope import rope_cos_sin

    Hkv, G, D, L = (2, 4, 64, 64) if args.smoke else (8, 4, 128, 8192)
    dtype = torch.bfloat16 if cuda else torch.float32
    compiled = torch.compile(qk_norm_rope_kv_reference, fullgraph=True) if cuda else None
    out = {"kv_heads": Hkv, "group": G, "head_dim": D, "dtype": str(dtype)}
    for name, (B, S) in {"decode": (8, 1), "prefill": (1, 16 if args.smoke else 4096)}.items():
        gen = torch.Generator(device=dev).manual_seed(1)
        qkv = torch.randn(B, S, Hkv * (G + 2) * D, device=dev, generator=gen).to(dtype)
        pos = (torch.randint(0, L, (B, 1, 2), device=dev, generator=gen) if S == 1
               else torch.arange(S, device=dev)[:, None].expand(S, 2))
        cos, sin = rope_cos_sin(pos, D, 10000.0)
        qw, kw = (torch.rand(D, device=dev, generator=gen).to(dtype) + 0.5 for _ in range(2))
        slots = pos[..., 0].contiguous() if S == 1 else torch.arange(S, device=dev)
        kc = torch.zeros(B, Hkv, L, D, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        op_args = (qkv, cos, sin, qw, kw, 1e-5, kc, vc, slots, G)
        block_s, warps = prologue_launch_config(B * S, Hkv, G, D)
        row = {"batch": B, "rows": S, "fused_launch": {"rows_per_program": block_s, "num_warps": warps},
               "fused_us": _time_us(args, cuda, lambda: qk_norm_rope_kv(*op_args, impl="triton"))}
        row["separate_eager_us"] = _time_us(args, cuda, lambda: qk_norm_rope_kv_reference(*op_args))
        row["speedup_vs_eager"] = row["separate_eager_us"]["median"] / row["fused_us"]["median"]
        line = f", separate eager {row['separate_eager_us']['median']:.2f} us ({row['speedup_vs_eager']:.2f}x)"
        if compiled is not None:
            row["separate_compiled_us"] = _time_us(args, cuda, lambda: compiled(*op_args))
            row["speedup_vs_compiled"] = row["separate_compiled_us"]["median"] / row["fused_us"]["median"]
            line += f", compiled {row['separate_compiled_us']['median']:.2f} us ({row['speedup_vs_compiled']:.2f}x)"
        out[name] = row
        print(f"prologue {name} (B={B}, S={S}): fused {row['fused_us']['median']:.2f} us ({block_s} rows/program, "
              f"{warps} warps){line}")
    return out


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--graph-iters", type=int, default=50)
    p.add_argument("--smoke", action="store_true")
    args = b.parse("outputs/bench_decode_batch.json")
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        raise SystemExit(f"error: --parts {sorted(set(parts) - set(PARTS))}: choose from {', '.join(PARTS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return need_cuda(MODULE + " (or --smoke)")
    dev = torch.device("cuda" if cuda else "cpu")
    result = {"smoke": args.smoke}
    with torch.no_grad():
        for part in parts:
            result[part] = {"kernel": bench_kernel, "prologue": bench_prologue}[part](args, dev, cuda)
            b.write(result, dev, quiet=True)   # after every part: a late failure keeps the rest
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    interpret_triton_on_cpu()
    sys.exit(main())
