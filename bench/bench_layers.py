"""One HunyuanImage-3 decoder layer per rank, no communication: eager vs compiled vs CUDA graph.

    python -m bench.bench_layers [--out outputs/bench_layers.json]

Shapes are one rank's share at full width (hidden 4096, 64 experts top-8, head_dim 128):
- AR decode at TP4 (one micro): 8 query heads, 2 KV heads, KV cache of 1500, routed experts
  of intermediate 768, shared MLP 768; one token. Floor: the bytes it must read (attention
  and shared weights, 8 experts, the KV cache) at 4.3 TB/s.
- Denoise at TP2 x Ulysses-2: 2674 local tokens, attention over 5348 (the all-to-all is
  replaced by a local reshuffle of the same bytes), two micros of 768. Floor: its FLOPs at
  694 TFLOP/s (the measured dense bf16 rate).
Targets: AR decode layer <= 150 us, denoise layer <= 2.0 ms.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

H, D, E, TOPK, VOCAB = 4096, 128, 64, 8, 133120
HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS = 694e12


def _layer_config(q_heads: int, kv_heads: int, micro_intermediate: int):
    from models.hunyuan_image3.config import HunyuanImage3Config
    from models.hunyuan_image3.presets import full_config
    cfg = full_config(layers=1)
    cfg.update(num_attention_heads=q_heads, num_key_value_heads=kv_heads,
               moe_intermediate_size=[micro_intermediate], moe_topk=[TOPK], num_shared_expert=[1])
    return HunyuanImage3Config.from_dict(cfg)


def build_layer(q_heads: int, kv_heads: int, micros: int, micro_intermediate: int, device="cuda"):
    """A DecoderLayer with one rank's local shapes, random bf16 weights (router fp32)."""
    from models.hunyuan_image3.model import set_moe_impl
    from models.hunyuan_image3.transformer import DecoderLayer
    cfg = _layer_config(q_heads, kv_heads, micro_intermediate)
    with torch.device("meta"):
        layer = DecoderLayer(cfg, 0)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(layer.named_parameters()):
        shape = list(p.shape)
        if "gate_and_up_proj" in name or "experts.down_proj" in name:
            shape[0] = micros
        if name.endswith("shared_mlp.down_proj"):
            shape[1] = micro_intermediate * micros
        dtype = torch.float32 if "wg" in name else torch.bfloat16
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * (0.02 if len(shape) > 1 else 1.0)
        owner, _, attr = name.rpartition(".")
        layer.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(t.to(dtype), requires_grad=False)
    set_moe_impl(layer, "auto")
    return layer


def fp8_experts_copy(layer, recipe: str):
    """The layer with its routed experts in e4m3 (`kernels.fp8_quant`), as `--moe-dtype fp8`
    stores them: weights and scales replace the bf16 parameters (a copy of the layer)."""
    import copy

    from kernels.fp8_quant import quantize_experts
    from models.hunyuan_image3.model import set_moe_impl
    layer = copy.deepcopy(layer)
    experts = layer.mlp.experts
    experts.use_fp8()
    tensors = quantize_experts(experts.gate_and_up_proj, experts.down_proj, recipe)
    for name, t in zip(("gate_and_up_proj", "gate_and_up_scale", "down_proj", "down_scale"), tensors):
        experts._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    set_moe_impl(layer, "auto")
    return layer


class LocalUlysses(torch.nn.Module):
    """Stands in for the Ulysses exchange on one rank: same shapes, same bytes moved, no peers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v, meta, cache):
        def seq_major(x):  # [B, S, h, D] -> [B, 2S, h/2, D]
            half = x.shape[2] // 2
            return torch.cat([x[:, :, :half], x[:, :, half:]], dim=1)
        out = self.inner(seq_major(q), seq_major(k), seq_major(v), meta, cache)
        S = q.shape[1]
        return torch.cat([out[:, :S], out[:, S:]], dim=2)


def _time_us(fn, graph: bool) -> float:
    """Median microseconds; NaN (with the reason printed) when a variant cannot run."""
    try:
        return _time_us_or_raise(fn, graph)
    except Exception as e:  # a variant that fails to capture must not hide the others
        print(f"  variant failed ({'graph' if graph else 'plain'}): {type(e).__name__}: {str(e)[:300]}")
        return float("nan")


def _time_us_or_raise(fn, graph: bool) -> float:
    import triton.testing
    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


PROFILE = False


def _top_kernels(fn, iters: int = 10, top: int = 15) -> list[tuple[str, float]]:
    """Device time per call of the heaviest kernels of `fn` (microseconds), under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.self_device_time_total / iters) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [(k, round(us, 1)) for k, us in rows[:top]]


def bench_ar_decode() -> dict:
    from dtgen.attention import AttentionMeta, LayerKVCache
    from models.hunyuan_image3.rope import rope_cos_sin
    layer = build_layer(8, 2, 1, 768)
    kv_len = 1500
    cache = LayerKVCache(torch.randn(1, 2, kv_len, D, device="cuda", dtype=torch.bfloat16),
                         torch.randn(1, 2, kv_len, D, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, 1, H, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([kv_len - 1], device="cuda")
    cos, sin = rope_cos_sin(slots.unsqueeze(-1).repeat(1, 2), D, 10000.0)
    meta = AttentionMeta(slots)

    def step():
        return layer(x, cos, sin, meta, cache)

    compiled = torch.compile(step, fullgraph=True)
    weight_bytes = (sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if "experts" not in n)
                    + TOPK * 3 * 768 * H * 2)
    floor_us = (weight_bytes + 2 * cache.k.numel() * 2) / HBM_BYTES_PER_S * 1e6
    with torch.no_grad():
        rows = {"eager_us": _time_us(step, False), "compiled_us": _time_us(compiled, False),
                "cuda_graph_eager_us": _time_us(step, True), "cuda_graph_compiled_us": _time_us(compiled, True)}
        kernels = {"": _top_kernels(compiled)} if PROFILE else {}
        for recipe in ("channels", "blocks"):
            fp8_layer = fp8_experts_copy(layer, recipe)
            fp8_step = torch.compile(lambda fp8_layer=fp8_layer: fp8_layer(x, cos, sin, meta, cache), fullgraph=True)
            rows[f"cuda_graph_compiled_fp8_{recipe}_us"] = _time_us(fp8_step, True)
            if PROFILE and recipe == "channels":
                kernels["_fp8_channels"] = _top_kernels(fp8_step)
    best = min(v for k, v in rows.items() if v == v and "fp8" not in k)  # bf16 variants; FP8 has its own target
    return {**rows, **{f"top_kernels{k}_us": v for k, v in kernels.items()}, "floor_us": floor_us, "best_us": best, "target_us": 150.0, "best_over_floor": best / floor_us}


def bench_denoise() -> dict:
    from dtgen.sequence import SlotHole
    from dtgen.attention import AttentionMeta
    from models.hunyuan_image3.rope import rope_cos_sin
    from models.hunyuan_image3.model import set_moe_impl
    layer = build_layer(16, 4, 2, 768)
    for m in layer.modules():
        if hasattr(m, "core"):
            m.core = LocalUlysses(m.core)
    local, total, text = 2674, 5348, 1251
    x = torch.randn(1, local, H, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(total, device="cuda")
    cos, sin = rope_cos_sin(slots[:local].unsqueeze(-1).repeat(1, 2), D, 10000.0)
    # The pipeline's meta: static slot runs, so the attention runs mask-free pieces (the
    # image rows dense, the text causal); `masked` is the ablation with one masked kernel.
    meta = AttentionMeta(slots, ((text, total),), slot_runs=((0, total),))
    masked_meta = AttentionMeta(slots, ((text, total),))
    # A bucketed prompt: padding rows [1100, 1247) inside the text (a SlotHole); the image
    # rows then run flash attention over a key prefix of data-dependent length.
    hole_meta = AttentionMeta(slots, ((text, total),), slot_runs=((0, total),),
                              hole=SlotHole(torch.tensor(1100, device="cuda"), 1247))

    def step():
        return layer(x, cos, sin, meta, None)

    def masked_step():
        return layer(x, cos, sin, masked_meta, None)

    def hole_step():
        return layer(x, cos, sin, hole_meta, None)

    compiled = torch.compile(step, fullgraph=True)
    compiled_masked = torch.compile(masked_step, fullgraph=True)
    compiled_hole = torch.compile(hole_step, fullgraph=True)
    # The MoE's grouped GEMMs traced and tuned by inductor (MoE impl "graph" with
    # CompileOptions.autotune, i.e. --compile-autotune); compiled on first call, below.
    compiled_tuned = torch.compile(step, fullgraph=True, options={"max_autotune_gemm": True})
    qkv = 2 * local * H * (16 + 8) * D
    attn = 4 * total * total * D * 8   # QK^T and PV over 8 heads after the exchange
    o = 2 * local * 16 * D * H
    moe = 2 * local * TOPK * 3 * 1536 * H   # two micros of 768: 1536 per expert
    shared = 2 * local * 3 * 1536 * H
    flops = qkv + attn + o + moe + shared
    floor_ms = flops / BF16_FLOPS * 1e3
    with torch.no_grad():
        rows = {"eager_ms": _time_us(step, False) / 1e3, "compiled_ms": _time_us(compiled, False) / 1e3,
                "cuda_graph_compiled_ms": _time_us(compiled, True) / 1e3}
        kernels = {"": _top_kernels(compiled)} if PROFILE else {}  # the default path (MoE ops)
        masked_ms = _time_us(compiled_masked, True) / 1e3
        hole_ms = _time_us(compiled_hole, True) / 1e3
        set_moe_impl(layer, "fused")
        rows["cuda_graph_compiled_fused_moe_ms"] = _time_us(torch.compile(step, fullgraph=True), True) / 1e3
        for recipe in ("channels", "blocks"):
            fp8_layer = fp8_experts_copy(layer, recipe)
            fp8_step = torch.compile(lambda fp8_layer=fp8_layer: fp8_layer(x, cos, sin, meta, None), fullgraph=True)
            rows[f"cuda_graph_compiled_fp8_{recipe}_ms"] = _time_us(fp8_step, True) / 1e3
            if PROFILE and recipe == "channels":
                kernels["_fp8_channels"] = _top_kernels(fp8_step)
        set_moe_impl(layer, "graph")
        rows["cuda_graph_compiled_autotune_ms"] = _time_us(compiled_tuned, True) / 1e3
    best = min(v for k, v in rows.items() if v == v and "fp8" not in k)  # bf16 variants; FP8 has its own target
    return {**rows, "masked_attention_cuda_graph_compiled_ms": masked_ms,
            "bucket_hole_cuda_graph_compiled_ms": hole_ms, **{f"top_kernels{k}_us": v for k, v in kernels.items()},
            "tflop": flops / 1e12, "floor_ms": floor_ms, "best_ms": best, "target_ms": 2.0,
            "best_over_floor": best / floor_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="outputs/bench_layers.json")
    p.add_argument("--profile", action="store_true", help="also list each compiled layer's top kernels")
    p.add_argument("--layer", choices=("both", "ar_decode", "denoise"), default="both")
    args = p.parse_args(argv)
    global PROFILE
    PROFILE = args.profile
    if not torch.cuda.is_available():
        print("bench_layers needs a CUDA GPU; nothing to do here.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.layer in ("both", "ar_decode"):
        result["ar_decode_layer"] = bench_ar_decode()
    if args.layer in ("both", "denoise"):
        result["denoise_layer"] = bench_denoise()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'layer':<14}{'eager':>10}{'compiled':>10}{'cudagraph':>11}{'floor':>9}{'target':>8}")
    if "ar_decode_layer" in result:
        a = result["ar_decode_layer"]
        print(f"{'AR decode us':<14}{a['eager_us']:>10.1f}{a['compiled_us']:>10.1f}"
              f"{a['cuda_graph_compiled_us']:>11.1f}{a['floor_us']:>9.1f}{a['target_us']:>8.0f}")
        print(f"AR decode layer, FP8 experts (channels / blocks): {a['cuda_graph_compiled_fp8_channels_us']:.1f} / "
              f"{a['cuda_graph_compiled_fp8_blocks_us']:.1f} us")
    if "denoise_layer" in result:
        d = result["denoise_layer"]
        print(f"{'denoise ms':<14}{d['eager_ms']:>10.3f}{d['compiled_ms']:>10.3f}"
              f"{d['cuda_graph_compiled_ms']:>11.3f}{d['floor_ms']:>9.3f}{d['target_ms']:>8.1f}")
        print(f"denoise layer, GEMMs tuned by inductor (--compile-autotune): "
              f"{d['cuda_graph_compiled_autotune_ms']:.3f} ms")
        print(f"denoise layer, fused Triton MoE GEMMs (--moe-impl fused): "
              f"{d['cuda_graph_compiled_fused_moe_ms']:.3f} ms")
        print(f"denoise layer, FP8 experts (channels / blocks): {d['cuda_graph_compiled_fp8_channels_ms']:.3f} / "
              f"{d['cuda_graph_compiled_fp8_blocks_ms']:.3f} ms (target 1.5)")
        print(f"denoise layer with one masked attention kernel (ablation): "
              f"{d['masked_attention_cuda_graph_compiled_ms']:.3f} ms")
    for name in ("ar_decode_layer", "denoise_layer"):
        for variant in ("", "_fp8_channels"):
            for kernel, us in result.get(name, {}).get(f"top_kernels{variant}_us") or []:
                print(f"  {name + variant:<28}{us:>9.1f} us  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
