"""dtgen's Wan DiT against diffusers' WanTransformer3DModel, in one process on one GPU.

    python -m bench.bench_peers [--models 1.3B,14B-8] [--modes eager,regions,whole]
                                [--variants bf16,dense-fp8,attn-fp8,attn-fp8-pv16,fp8] [--batch 1]
                                [--profile TOP] [--out F]
    python -m bench.bench_peers --tiny       # CPU, float32, small shapes (a check that it runs)

Both models hold the same weights (dtgen's random DiT, N(0, 0.02) matrices, copied into
diffusers' by name: the state-dict keys are the same) and take the same inputs: the latent
of 480x832 x 81 frames (16 x 21 x 60 x 104, 32760 tokens), 512 text rows of width 4096,
timestep 500; bf16 with diffusers' float32 modules in both. Models: "1.3B" is Wan2.1 1.3B's
config at its 30 blocks, "14B-8" the 14B width (5120, 40 heads, FFN 13824) at 8 blocks.

One figure per (model, mode, variant): the median wall time of one forward over `--iters`
runs after a warm-up (CUDA events around the call; the first call of a compiled mode
compiles and is not timed). Modes: "eager"; "regions" (one compiled region per block:
dtgen's `run_block` under torch.compile(fullgraph=True), diffusers'
`compile_repeated_blocks(fullgraph=True)`, as its docs recommend); "whole" (the whole
forward under torch.compile, both). Variants of dtgen (diffusers runs bf16 only):
"bf16"; "dense-fp8" (the blocks' linears in e4m3 with per-channel scales, activations per
token: `--dense-dtype fp8`); "attn-fp8" (the self-attention in kernels/fp8_attention.py,
INT8 QK + FP8 PV: `--attention-dtype fp8`); "attn-fp8-pv16" (INT8 QK + FP16 PV); "fp8"
(dense-fp8 and attn-fp8). Printed per row: ms, dtgen / diffusers (same mode, bf16), and
the relative L2 of the output against dtgen's bf16 run of the same mode (and bf16 dtgen
against diffusers). `--batch 2` runs both CFG rows as one batch in both (what dtgen's
pipeline does; diffusers' WanPipeline makes two calls of batch 1): then ms is per row.
`--profile TOP` (GPU): one more forward of each row under torch.profiler, its kernel time
grouped (attention, GEMMs, inductor's fused kernels, other) and its TOP kernels in the JSON.

Needs diffusers 0.42.1 (a test extra; pure Python; the GPU image has none: pip install
--no-deps --target DIR the wheel and put DIR on PYTHONPATH). Compile time: each mode x
variant compiles its own graphs (one block, or the whole forward), 20-60 s each on an H200.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MODELS = {   # Wan2.1 transformer/config.json values; "-8": the width at 8 blocks
    "1.3B": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14B-8": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=8),
    "tiny": dict(num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=2),
}
VARIANTS = ("bf16", "dense-fp8", "attn-fp8", "attn-fp8-pv16", "fp8")
MODES = ("eager", "regions", "whole")


def dit_config(model: str):
    from models.wan.transformer import WanTransformerConfig
    return WanTransformerConfig.from_dict(dict(
        patch_size=[1, 2, 2], in_channels=16, out_channels=16, text_dim=4096 if model != "tiny" else 64,
        freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        **MODELS[model]))


def random_dit(cfg, device, dtype):
    """dtgen's DiT with random weights in `dtype` (float32 where diffusers keeps float32)."""
    from models.wan.transformer import WanTransformer, keeps_fp32
    with torch.device("meta"):
        dit = WanTransformer(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(dit.named_parameters()):
        t = torch.randn(p.shape, generator=g, device=device) * (0.02 if p.dim() > 1 else 1.0)
        if name.startswith("condition_embedder.time_proj"):
            t = t * 0.1   # a random modulation at full scale drowns the blocks' updates
        owner, _, attr = name.rpartition(".")
        dit.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
            t.to(torch.float32 if keeps_fp32(name) else dtype), requires_grad=False)
    return dit.eval()


def diffusers_dit(ours, cfg, device, dtype):
    """diffusers' WanTransformer3DModel from the same config, holding a copy of `ours`' weights."""
    import diffusers
    config = dict(patch_size=tuple(cfg.patch_size), num_attention_heads=cfg.num_attention_heads,
                  attention_head_dim=cfg.attention_head_dim, in_channels=cfg.in_channels,
                  out_channels=cfg.out_channels, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim,
                  num_layers=cfg.num_layers, cross_attn_norm=cfg.cross_attn_norm, qk_norm="rms_norm_across_heads",
                  eps=cfg.eps, rope_max_seq_len=cfg.rope_max_seq_len)
    with torch.device(device):
        dit = diffusers.WanTransformer3DModel(**config)
    keys = dit.load_state_dict(ours.state_dict())
    assert not keys.missing_keys and not keys.unexpected_keys, keys
    keep = tuple(getattr(dit, "_keep_in_fp32_modules", None) or ())
    for name, param in dit.named_parameters():
        param.data = param.data.to(torch.float32 if any(m in name.split(".") for m in keep) else dtype)
    return dit.eval()


def _timed(fn, iters: int, cuda: bool) -> tuple[float, torch.Tensor]:
    out = fn()   # warm-up (compiles)
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _kernel_kind(name: str) -> str:
    """A Wan forward's kernels by what they do (the profile's grouping)."""
    n = name.lower()
    if "attention" in n or "sdpa" in n or "flash" in n or "fmha" in n:
        return "attention"
    if any(k in n for k in ("nvjet", "gemm", "cutlass", "xmma", "scaled_mm", "matmul")):
        return "gemm"
    if n.startswith("triton_"):
        return "inductor (norms, modulation, RoPE, quantization, residuals)"
    return "other"


def _profile(fn, top: int) -> dict:
    """One forward under torch.profiler: kernel time by kind and the `top` kernels (ms a forward)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda r: -r[1])
    kinds: dict[str, float] = {}
    for name, ms, _ in kernels:
        kinds[_kernel_kind(name)] = kinds.get(_kernel_kind(name), 0.0) + ms
    return {"kernels_ms": round(sum(ms for _, ms, _ in kernels), 2),
            "by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [(name[:100], round(ms, 3), n) for name, ms, n in kernels[:top]]}


def set_attention(dit, variant: str) -> None:
    """The blocks' self-attention cores for `variant` (SDPA, or FP8 attention)."""
    from dtgen.attention import LocalAttention
    from dtgen.fp8 import use_fp8_attention
    if variant in ("attn-fp8", "fp8"):
        use_fp8_attention(dit.self_attentions(), dit.cfg.attention_head_dim, pv="fp8")
    elif variant == "attn-fp8-pv16":
        use_fp8_attention(dit.self_attentions(), dit.cfg.attention_head_dim, pv="fp16")
    else:
        for attention in dit.self_attentions():
            attention.core = LocalAttention()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_peers", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1.3B,14B-8", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--modes", default="eager,regions", help=f"comma-separated, of {MODES}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"dtgen's, comma-separated, of {VARIANTS}")
    p.add_argument("--latent", default="21x60x104", help="latent FRAMESxHEIGHTxWIDTH (480p x 81 frames: 21x60x104)")
    p.add_argument("--text", type=int, default=512, help="text rows")
    p.add_argument("--batch", type=int, default=1, help="rows per forward in both (2: both CFG rows at once)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the tiny model at a small latent")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="GPU: after each timed row, one more forward under torch.profiler; the row gets its "
                        "kernel time by kind and its TOP kernels")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    models, modes, variants = (args.models.split(","), args.modes.split(","), args.variants.split(","))
    if args.tiny:
        models, device, dtype, args.latent, args.text = ["tiny"], "cpu", torch.float32, "3x6x8", 16
    else:
        device, dtype = "cuda", torch.bfloat16
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --tiny)", file=sys.stderr)
            return 2
    for name, values, known in (("--models", models, MODELS), ("--modes", modes, MODES),
                                ("--variants", variants, VARIANTS)):
        bad = [v for v in values if v not in known]
        if bad:
            print(f"{name}: unknown {bad}; known: {list(known)}", file=sys.stderr)
            return 2
    try:
        frames, height, width = (int(v) for v in args.latent.split("x"))
    except ValueError:
        print(f"--latent {args.latent!r}: expected FRAMESxHEIGHTxWIDTH, e.g. 21x60x104", file=sys.stderr)
        return 2
    try:
        import diffusers
    except ImportError:
        print("needs diffusers 0.42.1 (pip install --no-deps diffusers==0.42.1, or its wheel on PYTHONPATH)",
              file=sys.stderr)
        return 2
    from dtgen.fp8 import quantize_linears_
    from models.wan.model import FP8_LINEARS
    from models.wan.transformer import run_block

    cuda = device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False   # each model's shapes compile static, as a server's
    rows = []
    result = {"what": "Wan DiT forward, dtgen vs diffusers' WanTransformer3DModel, one process, same weights "
                      "and inputs",
              "command": "python -m bench.bench_peers " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "diffusers": diffusers.__version__, "dtype": str(dtype).replace("torch.", ""),
              "latent": [16, frames, height, width], "tokens": frames * (height // 2) * (width // 2),
              "text_rows": args.text, "batch": args.batch, "iters": args.iters,
              # FP8 attention's Q/K/V quantization: torch ops before the kernel op, so regions
              # fuse it into the block's graph and eager runs it eagerly (kernels/fp8_attention.py)
              "attention_quant": "in-graph",
              "models": {m: MODELS[m] for m in models}, "rows": rows, "complete": False}

    def dump(complete=False):   # after every row: a run cut short still leaves what it measured
        result["complete"] = complete
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    for model in models:
        torch._dynamo.reset()
        cfg = dit_config(model)
        ours = random_dit(cfg, device, dtype)
        theirs = diffusers_dit(ours, cfg, device, dtype)
        ours_fp8 = None
        if any(v in ("dense-fp8", "fp8") for v in variants):
            ours_fp8 = copy.deepcopy(ours)
            quantize_linears_(ours_fp8, FP8_LINEARS)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(args.batch, 16, frames, height, width, generator=g, device=device).to(dtype)
        t = torch.full((args.batch,), 500.0, device=device)
        text = torch.randn(args.batch, args.text, cfg.text_dim, generator=g, device=device).to(dtype)
        for mode in modes:
            torch._dynamo.reset()
            for block in theirs.modules():   # undo the last mode's per-block compile (nn.Module.compile)
                block._compiled_call_impl = None
            if mode == "regions":
                theirs.compile_repeated_blocks(fullgraph=True)
                theirs_fn = theirs
            elif mode == "whole":
                theirs_fn = torch.compile(theirs, fullgraph=True)
            else:
                theirs_fn = theirs
            with torch.no_grad():
                t0 = time.perf_counter()
                ref_ms, ref_out = _timed(lambda: theirs_fn(hidden_states=x, timestep=t, encoder_hidden_states=text,
                                                           return_dict=False)[0], args.iters, cuda)
                wall = time.perf_counter() - t0
                rows.append({"model": model, "mode": mode, "who": "diffusers", "variant": "bf16",
                             "ms": round(ref_ms / args.batch, 2), "wall_s": round(wall, 1)})
                if args.profile and cuda:
                    rows[-1]["profile"] = _profile(lambda: theirs_fn(hidden_states=x, timestep=t,
                                                                     encoder_hidden_states=text, return_dict=False),
                                                   args.profile)
                print(f"{model:6s} {mode:8s} diffusers {'bf16':14s} {ref_ms / args.batch:9.2f} ms"
                      f"   ({wall:.0f} s with warm-up)", flush=True)
                dump()
                base_out = None
                for variant in variants:
                    dit = ours_fp8 if variant in ("dense-fp8", "fp8") else ours
                    set_attention(dit, variant)
                    dit.run_block = torch.compile(run_block, fullgraph=True) if mode == "regions" else run_block
                    fn = torch.compile(dit.forward, fullgraph=True) if mode == "whole" else dit.forward
                    t0 = time.perf_counter()
                    ms, out = _timed(lambda: fn(x, t, text), args.iters, cuda)
                    wall = time.perf_counter() - t0
                    profiled = _profile(lambda: fn(x, t, text), args.profile) if args.profile and cuda else None
                    dit.run_block = run_block
                    set_attention(dit, "bf16")
                    if variant == "bf16":
                        base_out = out
                    row = {"model": model, "mode": mode, "who": "dtgen", "variant": variant,
                           "ms": round(ms / args.batch, 2), "ratio_vs_diffusers": round(ms / ref_ms, 3),
                           "rel_l2_vs_dtgen_bf16": None if base_out is None else
                           float((out.float() - base_out.float()).norm() / base_out.float().norm()),
                           "rel_l2_vs_diffusers": float((out.float() - ref_out.float()).norm()
                                                        / ref_out.float().norm()),
                           "wall_s": round(wall, 1)}
                    if profiled:
                        row["profile"] = profiled
                        print("    kernels by kind (ms a forward): " + ", ".join(
                            f"{k} {v:.1f}" for k, v in profiled["by_kind_ms"].items()), flush=True)
                    rows.append(row)
                    err = row["rel_l2_vs_dtgen_bf16"]
                    print(f"{model:6s} {mode:8s} dtgen     {variant:14s} {row['ms']:9.2f} ms  dtgen/diffusers "
                          f"{row['ratio_vs_diffusers']:.3f}  rel L2 vs bf16 "
                          f"{'-' if err is None else f'{err:.2e}'}  vs diffusers {row['rel_l2_vs_diffusers']:.2e}"
                          f"   ({wall:.0f} s)", flush=True)
                    dump()
        del ours, theirs, ours_fp8
        if cuda:
            torch.cuda.empty_cache()
    dump(complete=True)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
