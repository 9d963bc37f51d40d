"""Qwen-Image text-to-image from a diffusers-format checkpoint.

    python -m examples.qwen_t2i                                     # tiny default, one process (CPU)
    python -m examples.qwen_t2i --world-size 2 --plan cfg2 --check  # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m examples.qwen_t2i --world-size 2 --plan tp2 --checkpoint /path/to/Qwen-Image

With no --checkpoint, a tiny random model is written once (diffusers layout) into the cache
folder and loaded through the real loader. Writes the PNG, prints a timing table and, with
--report, a JSON report. Plans: placements/qwen_image.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from dtgen.compile import CompileOptions
from dtgen.harness import (add_compile_flags, add_launch_flags, add_report_flags, example_main, finish_launch_args,
                           launch_problem, max_diff, rank_device, reference_threads, table)
from dtgen.launch import RankContext, exit_process
from dtgen.step_cache import StepCacheError, parse_step_cache
from models.qwen_image.model import load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest, check_request
from models.qwen_image.tiny import ensure_tiny_checkpoint
from placements.qwen_image import PLANS, get_plan


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.qwen_t2i", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="diffusers-format Qwen-Image folder (default: the embedded tiny model)")
    p.add_argument("--prompt", default="A red fox in fresh snow at golden hour, a sign that says 'dtgen'")
    p.add_argument("--negative-prompt", default=" ")
    p.add_argument("--image-size", default=None, help="WIDTHxHEIGHT (default: 1024x1024, or 64x48 on the tiny default)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 50, or 4 on the tiny default)")
    p.add_argument("--true-cfg-scale", type=float, default=4.0, help="<= 1: no CFG (the conditional branch alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-cache", default=None, metavar="METHOD[:KNOB=VALUE,...]", help="dtgen/step_cache.py")
    p.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="with several ranks, split the VAE decode over all of them")
    add_launch_flags(p, PLANS)
    add_compile_flags(p)
    add_report_flags(p, "outputs/qwen_t2i.png")
    return finish_launch_args(p.parse_args(argv), lambda world: "single" if world == 1 else "cfg2")


def _request(args) -> T2IRequest:
    return T2IRequest(prompt=args.prompt, negative_prompt=args.negative_prompt, width=args.width, height=args.height,
                      steps=args.steps, true_cfg_scale=args.true_cfg_scale, seed=args.seed, step_cache=args.step_cache)


def prepare(args) -> tuple[str | None, bool]:
    tiny = args.checkpoint is None
    args.image_size = args.image_size or ("64x48" if tiny else "1024x1024")
    args.steps = args.steps or (4 if tiny else 50)
    try:
        args.width, args.height = (int(v) for v in args.image_size.lower().split("x"))
    except ValueError:
        return f"--image-size {args.image_size!r}: expected WIDTHxHEIGHT, e.g. 1024x1024", tiny
    try:
        args.step_cache = parse_step_cache(args.step_cache)
        check_request(_request(args))
        problem = launch_problem(args, get_plan(args.plan))
    except StepCacheError as e:
        return "--step-cache " + str(e).removeprefix("step cache "), tiny
    except ValueError as e:
        return str(e), tiny
    if problem is None and not tiny and not (Path(args.checkpoint) / "model_index.json").is_file():
        problem = f"--checkpoint {args.checkpoint}: no model_index.json there (expected a diffusers-format folder)"
    if problem is None and tiny:
        args.checkpoint = str(ensure_tiny_checkpoint())
    return problem, tiny


def run_rank(ctx: RankContext, args: argparse.Namespace) -> dict:
    device, dtype = rank_device(ctx, args)
    loaded = load(args.checkpoint, get_plan(args.plan), ctx.rank, ctx.world_size, dtype, device)
    group = dist.group.WORLD if args.vae_parallel and ctx.world_size > 1 else None
    options = CompileOptions(enabled=args.compile, backend=args.compile_backend, regions=args.compile_regions)
    pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, device, ctx.rank == 0, options, group)
    result = pipe.generate(_request(args), record=args.check)
    out = {"rank": ctx.rank, "timings_ms": result.timings_ms, "image": result.image, "device": str(device),
           "dtype": str(dtype).replace("torch.", ""), "step_cache": result.record.get("step_cache"),
           "weights_copied": loaded.controller.last_switch.weights_copied}
    if ctx.rank == 0 and args.check:
        with reference_threads(ctx, device):
            ref_loaded = load(args.checkpoint, get_plan("single"), 0, 1, dtype, device)
            ref = QwenImagePipeline(ref_loaded.model, ref_loaded.tokenizer, ref_loaded.controller, device).generate(
                _request(args), record=True)
        out["check"] = {"max_abs_diff_noise": max_diff(result.record["noise"], ref.record["noise"]),
                        "max_abs_diff_latents": max_diff([result.latents], [ref.latents]),
                        "max_abs_diff_image": max_diff([result.image], [ref.image])}
    return out


def write_report(args, main: dict, tiny: bool) -> dict:
    from PIL import Image
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(main["image"].numpy()).save(out)
    t = main["timings_ms"]
    report = {"plan": args.plan, "world_size": args.world_size, "device": main["device"], "dtype": main["dtype"],
              "torch": torch.__version__, "checkpoint": "tiny-default" if tiny else args.checkpoint,
              "request": {"width": args.width, "height": args.height, "steps": args.steps,
                          "true_cfg_scale": args.true_cfg_scale, "seed": args.seed},
              "timings_ms": t, "weights_copied": main["weights_copied"]}
    for key in ("check", "step_cache"):
        if main.get(key) is not None:
            report[key] = main[key]
    rows = [("plan", f"{args.plan} on {args.world_size} rank(s), {main['device']}, {main['dtype']}"),
            ("image", f"{args.width}x{args.height}, {args.steps} steps, true CFG {args.true_cfg_scale}"),
            ("text encode", f"{t['encode']:9.1f} ms"), ("denoise", f"{t['denoise']:9.1f} ms"),
            ("VAE decode", f"{t['decode']:9.1f} ms"), ("total", f"{t['total']:9.1f} ms")]
    if "step_cache" in report:
        rows.append(("full steps", str(report["step_cache"]["full_steps"])))
    rows += [(f"check {k}", f"{v:.3e}") for k, v in report.get("check", {}).items()]
    print(table(rows))
    print(f"wrote {out}")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
    return report


def main(argv=None) -> int:
    return example_main(parse_args(argv), prepare, run_rank, write_report, ("examples.qwen_t2i",))


if __name__ == "__main__":
    exit_process(main())
