"""The Wan DiT's denoise step on one GPU, random weights at the published shapes, against its FLOP floor.

One step as `WanT2VPipeline` runs it without a CFG axis: both CFG rows as a batch of 2, every block, the
final layer; bf16; eager, then each block compiled as one region (shared by all blocks). Also the
self-attention alone at the step's shape (SDPA), for its share. Floor: the step's FLOPs at 694 TFLOP/s.
The one-GPU baseline of the scaling targets (Ulysses 2 and CFG 2 on two GPUs: >= 90% efficiency).
"""
from __future__ import annotations

import statistics
import sys
from types import SimpleNamespace

import torch

from bench.bench_peers import WanPeer, random_wan_dit, wan_config
from bench.floors import DENSE_BF16_TFLOPS
from bench.harness import Bench, need_cuda, time_ms

MODULE = "bench.bench_wan"
TEXT_ROWS = 512


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--model", choices=("1.3B", "14B"), default="14B", help="14B is Wan2.2-A14B's expert shape too")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--layers", type=int, default=None, help="fewer blocks (the per-block figures scale)")
    p.add_argument("--iters", type=int, default=3)
    args = b.parse()
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    from dtgen.sequence import SequenceLayout
    from dtgen.denoiser_calls import predict
    from models.wan.transformer import run_block

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = wan_config(**dict(WanPeer.sizes[args.model], **({"num_layers": args.layers} if args.layers else {})))
    dit = random_wan_dit(cfg, "cuda", torch.bfloat16)
    latent = (2, 16, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    x = torch.randn(latent, device="cuda", dtype=torch.bfloat16)
    t = torch.full((2,), 500, device="cuda", dtype=torch.int64)
    text = torch.randn(2, TEXT_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    rt = SimpleNamespace(seq=SequenceLayout())
    D, F, L = cfg.inner_dim, cfg.ffn_dim, TEXT_ROWS
    flops = 2 * cfg.num_layers * (8 * tokens * D * D + 4 * tokens * tokens * D     # self-attention
                                  + 4 * tokens * D * D + 4 * L * D * D + 4 * tokens * L * D   # cross-attention
                                  + 4 * tokens * D * F)                            # FFN
    floor_ms = flops / (DENSE_BF16_TFLOPS * 1e9)
    result = {"model": args.model, "layers": cfg.num_layers, "video": [args.frames, args.height, args.width],
              "tokens": tokens, "rows": 2, "step_tflop": round(flops / 1e12, 1), "floor_ms": round(floor_ms, 1)}
    with torch.no_grad():
        eager = time_ms(lambda: predict(rt, dit, x, t, text), args.iters, warmup=1)
        dit.run_block = torch.compile(run_block, fullgraph=True)
        compiled = time_ms(lambda: predict(rt, dit, x, t, text), args.iters, warmup=2)
        q = torch.randn(2, cfg.num_attention_heads, tokens, cfg.attention_head_dim, device="cuda",
                        dtype=torch.bfloat16)   # one block's self-attention: q, k, v [2, heads, tokens, 128]
        attn = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), args.iters, warmup=2)
    for name, times in (("eager", eager), ("compiled_regions", compiled)):
        ms = statistics.median(times)
        result[name] = {"step_ms": round(ms, 1), "per_block_ms": round(ms / cfg.num_layers, 2),
                        "tflops": round(flops / ms / 1e9, 1), "floor_ratio": round(ms / floor_ms, 3)}
    a_ms = statistics.median(attn)
    result["self_attention"] = {"per_block_ms": round(a_ms, 2),
                                "tflops": round(8 * tokens * tokens * D / a_ms / 1e9, 1),
                                "share_of_compiled_step": round(a_ms * cfg.num_layers
                                                                / result["compiled_regions"]["step_ms"], 3)}
    result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    print(result)
    b.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
