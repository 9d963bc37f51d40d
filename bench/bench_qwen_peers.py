"""Qwen-Image's MMDiT on one GPU, dtgen against diffusers' QwenImageTransformer2DModel, side by side.

    python -m bench.bench_qwen_peers [--image-size 1024x1024] [--text-rows 256] [--layers 60] [--kernels N] [--out F]
    python -m bench.bench_qwen_peers --tiny            # CPU smoke run at tiny shapes (eager only)

One forward of the transformer for one CFG branch (QwenImagePipeline calls it once per branch
and step; dtgen's pipeline too), batch 1, 1024x1024 -> 64x64 patches = 4096 image rows plus
`--text-rows` text rows, bf16, random weights at the published shapes (Qwen/Qwen-Image
transformer/config.json: 60 layers, 24 heads x 128, joint_attention_dim 3584). Both modules
use THE SAME weight tensors (dtgen's are assigned from diffusers' state dict: no copy), so one
H200 holds both (~41 GB). Modes: eager; `torch.compile` of the whole forward; regional
compilation (diffusers' `compile_repeated_blocks(fullgraph=True)`, dtgen's block region
`StepCompiler.region(run_block)`). Times: CUDA events, the median of `--iters` after
`--warmup` calls. The ratio dtgen / diffusers per mode is the figure (target <= 1.0); the
outputs' relative L2 difference says both computed the same thing (bf16 rounding: ~1e-2).
Floor: the forward's FLOPs at 694 TFLOP/s (the measured dense bf16 rate on an H200).
`--variants` adds dtgen's FP8 options, each timed against the same diffusers bf16 figure:
"dense-fp8" (the blocks' linears in e4m3, per-channel scales: `--dense-dtype fp8`), "attn-fp8"
(the joint attention in kernels/fp8_attention.py: `--attention-dtype fp8`), "fp8" (both); each
with its relative L2 against dtgen's bf16 output.

Needs diffusers 0.42.1 (a test extra; pure Python): on the GPU image add, with --no-deps,
diffusers==0.42.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
charset-normalizer==3.5.3 (py3-none-any wheels), as for bench/bench_wan_cache.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dtgen.requests import RequestError, parse_size

BF16_FLOPS = 694e12
VARIANTS = ("bf16", "dense-fp8", "attn-fp8", "fp8")
PUBLISHED = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=[16, 56, 56])
TINY = dict(PUBLISHED, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
            axes_dims_rope=[4, 6, 6])


def forward_flops(cfg: dict, image_rows: int, text_rows: int) -> float:
    """Both streams' projections (q, k, v, out) and MLPs (4x), the joint attention (QK^T, PV)."""
    D, S = cfg["num_attention_heads"] * cfg["attention_head_dim"], image_rows + text_rows
    return cfg["num_layers"] * (24 * S * D * D + 4 * S * S * D)


def build_pair(cfg: dict, device: str, dtype: torch.dtype):
    """diffusers' module with random weights and dtgen's sharing its tensors."""
    import diffusers

    from models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig
    torch.manual_seed(0)
    with torch.device(device):
        theirs = diffusers.QwenImageTransformer2DModel(**cfg).to(dtype).eval()
    with torch.device("meta"):
        ours = QwenImageTransformer(QwenImageTransformerConfig.from_dict(cfg))
    ours.load_state_dict(theirs.state_dict(), strict=True, assign=True)
    return theirs, ours.eval()


def dense_fp8_copy(ours):
    """dtgen's module with the blocks' linears in e4m3 (the `--dense-dtype fp8` set,
    models/qwen_image/model.py FP8_LINEARS), its other weights shared with `ours`."""
    import copy

    from dtgen.fp8 import quantize_linears_
    from models.qwen_image.model import FP8_LINEARS
    shell = copy.copy(ours)                       # new blocks, every other module shared
    shell._modules = dict(ours._modules)
    blocks = []
    for block in ours.transformer_blocks:         # one bf16 block copied at a time: the peak stays low
        holder = torch.nn.Module()                # under the names FP8_LINEARS matches
        holder.transformer = torch.nn.Module()
        holder.transformer.transformer_blocks = torch.nn.ModuleList([copy.deepcopy(block)])
        quantize_linears_(holder, FP8_LINEARS)
        blocks.append(holder.transformer.transformer_blocks[0])
    shell._modules["transformer_blocks"] = torch.nn.ModuleList(blocks)
    return shell


def set_joint_attention(module, fp8: bool) -> None:
    """The blocks' joint attention on SDPA, or on kernels/fp8_attention.py (`--attention-dtype fp8`)."""
    from dtgen.attention import LocalAttention
    from dtgen.fp8 import use_fp8_attention
    if fp8:
        use_fp8_attention(module.joint_attentions(), module.cfg.attention_head_dim)
    else:
        for attention in module.joint_attentions():
            attention.core = LocalAttention()


def timed(fn, warmup: int, iters: int, device: str) -> tuple[float, list[float], float]:
    """(median ms, every ms, the first call's seconds: compilation included)."""
    t0 = time.perf_counter()
    fn()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), times, first_s


def top_kernels(fn, n: int, calls: int = 2) -> dict:
    """GPU time per call by kernel over `calls` calls (torch.profiler): the total, the launches,
    and the top n kernels (name cut to 90 characters, us per call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key[:90], e.self_device_time_total / calls, e.count / calls) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    return {"device_us": sum(us for _, us, _ in rows), "launches": sum(k for _, _, k in rows),
            "top": [(name, round(us, 1), k) for name, us, k in rows[:n]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_qwen_peers", description=__doc__.split("\n")[0])
    p.add_argument("--image-size", default="1024x1024", help="WIDTHxHEIGHT in pixels")
    p.add_argument("--text-rows", type=int, default=256, help="prompt embedding rows (after the template drop)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: 60, the published count)")
    p.add_argument("--modes", default="eager,compiled,regions")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, float32, eager (a smoke run)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile 2 calls of each side per mode: GPU time by kernel, the top N (where the "
                        "two differ)")
    p.add_argument("--variants", default="bf16", help=f"dtgen's, comma-separated, of {VARIANTS} (bf16 always runs)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v != "bf16"]
    if [v for v in variants if v not in VARIANTS]:
        print(f"error: --variants {[v for v in variants if v not in VARIANTS]}: each must be one of {VARIANTS}",
              file=sys.stderr)
        return 2
    cfg = dict(TINY if args.tiny else PUBLISHED)
    if args.layers:
        cfg["num_layers"] = args.layers
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    modes = ["eager"] if args.tiny else args.modes.split(",")
    if not args.tiny and not torch.cuda.is_available():
        print("error: needs a CUDA GPU (or --tiny for a CPU smoke run)", file=sys.stderr)
        return 2
    bad = [m for m in modes if m not in ("eager", "compiled", "regions")]
    if bad:
        print(f"error: --modes {bad}: each must be eager, compiled or regions", file=sys.stderr)
        return 2
    try:
        width, height = parse_size(args.image_size, "--image-size", "1024x1024")
    except RequestError as e:
        print(f"error: {e.field} {e.message}", file=sys.stderr)
        return 2
    h, w = height // 16, width // 16
    theirs, ours = build_pair(cfg, device, dtype)
    g = torch.Generator(device).manual_seed(1)
    x = torch.randn(1, h * w, cfg["in_channels"], generator=g, device=device, dtype=dtype)
    text = torch.randn(1, args.text_rows, cfg["joint_attention_dim"], generator=g, device=device, dtype=dtype)
    t = torch.full((1,), 0.7, device=device, dtype=dtype)
    calls = {"dtgen": lambda: ours(x, t, text, h, w),
             "diffusers": lambda: theirs(hidden_states=x, encoder_hidden_states=text, timestep=t,
                                         img_shapes=[[(1, h, w)]], return_dict=False)[0]}
    results = {}
    from dtgen.compile import CompileOptions, StepCompiler
    from models.qwen_image.transformer import run_block
    ours_fp8 = dense_fp8_copy(ours) if any(v in ("dense-fp8", "fp8") for v in variants) else None
    with torch.no_grad():
        for mode in modes:
            torch._dynamo.reset()
            if mode == "compiled":
                fns = {"dtgen": torch.compile(calls["dtgen"]), "diffusers": torch.compile(calls["diffusers"])}
            elif mode == "regions":
                ours.run_block = StepCompiler(CompileOptions(enabled=True, regions=True)).region(run_block)
                theirs.compile_repeated_blocks(fullgraph=True)
                fns = calls
            else:
                fns = calls
            outs, row = {}, {}
            for name, fn in fns.items():
                ms, times, first_s = timed(fn, args.warmup, args.iters, device)
                outs[name] = fn().float()
                row[name] = {"ms": ms, "times_ms": times, "first_call_s": first_s}
            if args.kernels and device == "cuda":
                for name, fn in fns.items():
                    row[name]["kernels"] = top_kernels(fn, args.kernels)
            row["ratio_dtgen_over_diffusers"] = row["dtgen"]["ms"] / row["diffusers"]["ms"]
            row["rel_l2_outputs"] = float((outs["dtgen"] - outs["diffusers"]).norm() / outs["diffusers"].norm())
            for variant in variants:
                module = ours_fp8 if variant in ("dense-fp8", "fp8") else ours
                set_joint_attention(module, fp8=variant in ("attn-fp8", "fp8"))
                if mode == "regions":
                    module.run_block = StepCompiler(CompileOptions(enabled=True, regions=True)).region(run_block)
                call = (lambda m=module: m(x, t, text, h, w))
                fn = torch.compile(call) if mode == "compiled" else call
                ms, times, first_s = timed(fn, args.warmup, args.iters, device)
                out = fn().float()
                row.setdefault("variants", {})[variant] = {
                    "ms": ms, "times_ms": times, "first_call_s": first_s,
                    "ratio_over_diffusers": ms / row["diffusers"]["ms"],
                    "rel_l2_vs_dtgen_bf16": float((out - outs["dtgen"]).norm() / outs["dtgen"].norm())}
                set_joint_attention(module, fp8=False)
                module.run_block = run_block
            results[mode] = row
            if mode == "regions":
                ours.run_block = run_block
            print(f"{mode:9s} dtgen {row['dtgen']['ms']:9.2f} ms  diffusers {row['diffusers']['ms']:9.2f} ms  "
                  f"ratio {row['ratio_dtgen_over_diffusers']:.3f}  rel L2 {row['rel_l2_outputs']:.2e}")
            for variant, v in row.get("variants", {}).items():
                print(f"{mode:9s} dtgen {variant:9s} {v['ms']:9.2f} ms  ratio over diffusers bf16 "
                      f"{v['ratio_over_diffusers']:.3f}  rel L2 vs dtgen bf16 {v['rel_l2_vs_dtgen_bf16']:.2e}")
            for name in fns if args.kernels and device == "cuda" else ():
                k = row[name]["kernels"]
                print(f"  {name}: {k['device_us'] / 1e3:.2f} ms of kernels in {k['launches']:.0f} launches")
                for kname, us, count in k["top"]:
                    print(f"    {us:9.1f} us x{count:4.0f}  {kname}")
    flops = forward_flops(cfg, h * w, args.text_rows)
    report = {"what": "Qwen-Image MMDiT forward, one CFG branch, dtgen vs diffusers 0.42.1, same weights and inputs",
              "command": "python -m bench.bench_qwen_peers " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": cfg, "image_size": args.image_size, "image_rows": h * w, "text_rows": args.text_rows,
              "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "flops": flops, "floor_ms": flops / BF16_FLOPS * 1e3, "modes": results}
    print(f"floor {report['floor_ms']:.1f} ms ({flops / 1e12:.1f} TFLOP at {BF16_FLOPS / 1e12:.0f} TFLOP/s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
