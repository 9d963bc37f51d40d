"""The Wan DiT's denoise step on one GPU, random weights at the published shapes.

    python -m bench.bench_wan --model 14B [--height 480 --width 832 --frames 81] [--layers N] [--out F]

One step as `WanT2VPipeline` runs it without a CFG axis: both CFG rows as a batch of 2, every
block, the final layer; bf16; eager, then each block compiled as one region (shared by all
blocks). Also the self-attention alone at the step's shape (SDPA), for the attention share.
Floor: the step's FLOPs at 694 TFLOP/s (the measured dense bf16 rate on an H200). This is the
1-GPU baseline of the scaling targets (Ulysses 2 and CFG 2 on two GPUs: >= 90% efficiency).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

BF16_FLOPS = 694e12
TEXT_ROWS = 512
# Wan2.1 transformer/config.json values (the diffusers repos); 14B is Wan2.2-A14B's expert shape too.
MODELS = {
    "1.3B": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14B": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
}


def dit_config(model: str, layers: int | None = None):
    from models.wan.transformer import WanTransformerConfig
    cfg = dict(patch_size=[1, 2, 2], in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
               cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
               **MODELS[model])
    if layers:
        cfg["num_layers"] = layers
    return WanTransformerConfig.from_dict(cfg)


def random_dit(cfg, device="cuda"):
    """The DiT with random weights (bf16, float32 where diffusers keeps float32)."""
    from models.wan.transformer import WanTransformer, keeps_fp32
    with torch.device("meta"):
        dit = WanTransformer(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(dit.named_parameters()):
        t = torch.randn(p.shape, generator=g, device=device) * (0.02 if p.dim() > 1 else 1.0)
        owner, _, attr = name.rpartition(".")
        dtype = torch.float32 if keeps_fp32(name) else torch.bfloat16
        dit.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(t.to(dtype), requires_grad=False)
    return dit


def step_flops(cfg, rows: int, tokens: int) -> float:
    D, F, L = cfg.inner_dim, cfg.ffn_dim, TEXT_ROWS
    per_layer = 8 * tokens * D * D + 4 * tokens * tokens * D           # self-attention: q, k, v, o; QK^T and PV
    per_layer += 4 * tokens * D * D + 4 * L * D * D + 4 * tokens * L * D  # cross-attention
    per_layer += 4 * tokens * D * F                                     # FFN
    return rows * cfg.num_layers * per_layer


def _time(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="14B")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--layers", type=int, default=None, help="fewer blocks (the per-block figures scale)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from dtgen.sequence import SequenceLayout
    from dtgen.denoiser_calls import predict
    from models.wan.transformer import run_block

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = dit_config(args.model, args.layers)
    dit = random_dit(cfg)
    latent = (2, 16, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    x = torch.randn(latent, device="cuda", dtype=torch.bfloat16)
    t = torch.full((2,), 500, device="cuda", dtype=torch.int64)
    text = torch.randn(2, TEXT_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    rt = SimpleNamespace(seq=SequenceLayout())
    flops = step_flops(cfg, 2, tokens)
    floor_ms = flops / BF16_FLOPS * 1e3
    result = {"model": args.model, "layers": cfg.num_layers, "video": [args.frames, args.height, args.width],
              "tokens": tokens, "rows": 2, "step_tflop": round(flops / 1e12, 1), "floor_ms": round(floor_ms, 1),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    with torch.no_grad():
        eager = _time(lambda: predict(rt, dit, x, t, text), 1, args.iters)
        dit.run_block = torch.compile(run_block, fullgraph=True)
        compiled = _time(lambda: predict(rt, dit, x, t, text), 2, args.iters)
        # the self-attention alone, one block's worth: q, k, v [2, heads, tokens, 128]
        q = torch.randn(2, cfg.num_attention_heads, tokens, cfg.attention_head_dim, device="cuda",
                        dtype=torch.bfloat16)
        attn = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), 2, args.iters)
    attn_flops = 2 * 4 * tokens * tokens * cfg.inner_dim
    for name, times in (("eager", eager), ("compiled_regions", compiled)):
        ms = statistics.median(times)
        result[name] = {"step_ms": round(ms, 1), "per_block_ms": round(ms / cfg.num_layers, 2),
                        "tflops": round(flops / ms / 1e9, 1), "floor_ratio": round(ms / floor_ms, 3)}
    a_ms = statistics.median(attn)
    result["self_attention"] = {"per_block_ms": round(a_ms, 2), "tflops": round(attn_flops / a_ms / 1e9, 1),
                                "share_of_compiled_step": round(a_ms * cfg.num_layers
                                                                / result["compiled_regions"]["step_ms"], 3)}
    result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
