"""Wan text-to-video (Wan 2.1, Wan 2.2-A14B) from a diffusers-format checkpoint.

    dtgen run --model wan                                      # tiny default, one process
    dtgen run --model wan --world-size 2 --plan ulysses2       # 2 gloo ranks spawned here (CPU)
    torchrun --nproc-per-node 2 -m dtgen run --model wan --world-size 2 --plan cfg2 \\
        --checkpoint /path/to/Wan2.1-T2V-14B-Diffusers --height 480 --width 832 --num-frames 81

With no --checkpoint, a tiny random model is written once (diffusers format) into the cache
folder and loaded through the real loader. Writes the MP4 (PyAV's own H.264 encoder), prints
a per-stage timing table and, with --report, a JSON report. Plans: placements/wan.py.

`python -m examples.wan_t2v` runs the same command.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from dtgen.compile import CompileOptions, unique_graphs
from dtgen.fp8 import add_fp8_flags, attention_head_problem
from dtgen.harness import (add_run_flags, compile_facts, compile_problem,
                           example_main,
                           finish_launch_args, gather_rank_facts, launch_problem, max_diff, parse_injections,
                           peak_memory, rank_device, reference_threads, rel_l2, table)
from dtgen.host import GcPauses, settle_heap
from dtgen.launch import RankContext
from dtgen.serve.errors import RequestError
from dtgen.profiling import PhaseProfiler
from dtgen import schema
from dtgen.requests import flag_line
from models.registry import checkpoint_problem
from models.wan.model import WanConfigs, load
from models.wan.pipeline import PROFILE_ROWS, T2VRequest, WanT2VPipeline
from models.wan.serving import FPS, encode_mp4
from models.wan.tiny import ensure_tiny_checkpoint
from placements.wan import PLANS, get_plan

DEFAULT_PROMPT = "A red fox runs through fresh snow at golden hour, cinematic"
RANK_PRELOAD = ("models.wan.cli",)


def build_parser(prog: str = "dtgen run --model wan", description: str = __doc__.split("\n")[0],
                 cli: bool = True) -> argparse.ArgumentParser:
    """The model, plan, compile and request flags; `cli=False` (a server, which adds its own):
    without the flags only the CLI reads (the prompt, --check, --profile, --output, --report)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--checkpoint", help="diffusers-format Wan folder (default: the embedded tiny model)")
    # the request's fields (models/wan/pipeline.py T2VRequest); a server's requests give their prompt
    schema.add_flags(p, T2VRequest, omit=() if cli else ("prompt",), defaults={"prompt": DEFAULT_PROMPT})
    add_fp8_flags(p, "the DiT blocks' linears", "the DiT self-attention")
    schema.add_flags(p, [FPS])
    p.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="with several ranks, split the VAE decode over all of them (halo exchange; default: on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run the request once with 2 steps first, so that compilation and first-call kernel JIT "
                        "stay out of the figures (default: on with --compile or on GPU)")
    server = add_run_flags(p, PLANS, "outputs/wan_t2v.mp4", cli, dict(prompt=DEFAULT_PROMPT), "Wan")
    if server is not None:
        server.add_argument("--inject-failure", default=None, metavar="RANK:denoise:STEP[:inside|:oom][,...]",
                            help="testing the error path: raise on RANK after STEP of PHASE (denoise) of the first "
                                 "job that gets there; ':inside' raises inside the next step (from the last block), "
                                 "':oom' an out-of-memory error")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    return finish_launch_args(args, lambda world: "single" if world == 1 else "ulysses2")


def parse_args(argv=None, prog: str = "dtgen run --model wan") -> argparse.Namespace:
    return finish_args(build_parser(prog).parse_args(argv))


# The request fields' flags (their declarations': dtgen/schema.py): `T2VRequest.check` names
# fields, the CLI names flags.
FLAG_OF_FIELD = schema.flag_names(T2VRequest)


def request_from_args(args) -> T2VRequest:
    """The request the flags say (a server's: the defaults of the fields a request leaves out);
    `RequestError` naming a field for a step cache that does not parse."""
    return schema.from_args(T2VRequest, args)


def prepare(args) -> tuple[str | None, bool]:
    """Check the command line and fill the defaults that depend on the checkpoint: (the first
    problem as one line or None, whether the tiny default runs)."""
    tiny = args.checkpoint is None
    defaults = dict(height=48, width=64, num_frames=9, steps=4) if tiny else \
        dict(height=480, width=832, num_frames=81, steps=50)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        problem = launch_problem(args, get_plan(args.plan)) or compile_problem(args)
        if problem is None and args.vae_parallel is not None and args.world_size == 1:
            flag = "--vae-parallel" if args.vae_parallel else "--no-vae-parallel"
            problem = f"{flag} splits the VAE decode over several ranks; this run has --world-size 1"
        if problem is None and not tiny:
            problem = checkpoint_problem("wan", args.checkpoint,
                                         "no model_index.json there (expected a diffusers-format folder)")
        if problem is None:
            if tiny:
                args.checkpoint = str(ensure_tiny_checkpoint())
            if args.flow_shift is None:
                scheduler = Path(args.checkpoint) / "scheduler" / "scheduler_config.json"
                args.flow_shift = json.loads(scheduler.read_text()).get("flow_shift", 3.0) if scheduler.exists() else 3.0
            cfgs = WanConfigs.from_folder(args.checkpoint)
            problem = attention_head_problem(args.attention_dtype, cfgs.transformer.attention_head_dim)
            req = request_from_args(args)
            req.check(cfgs.vae.temporal_factor, cfgs.vae.spatial_factor * cfgs.transformer.patch_size[1],
                      cfgs.transformer_2 is not None)
            args.step_cache = req.step_cache    # parsed once, for the ranks and the report
            schema.check_value(FPS, args.fps, "--fps")
    except RequestError as e:
        problem = flag_line(e, FLAG_OF_FIELD)
    except (KeyError, ValueError, OSError) as e:
        problem = str(e.args[0]) if e.args else str(e)
    return problem, tiny


def build_pipeline(ctx: RankContext, args: argparse.Namespace):
    """This rank's share of the model, loaded, and its pipeline (the example's and the server's):
    (pipeline, loaded, device, dtype), as models.hunyuan_image3.cli.build_pipeline."""
    device, dtype = rank_device(ctx, args)
    ctx.progress("loading")
    loaded = load(args.checkpoint, get_plan(args.plan), ctx.rank, ctx.world_size, dtype, device,
                  dense_dtype=getattr(args, "dense_dtype", "model"),
                  attention_dtype=getattr(args, "attention_dtype", "model"))
    options = CompileOptions(enabled=args.compile, backend=args.compile_backend, regions=args.compile_mode == "regions")
    vae_group = dist.group.WORLD if args.vae_parallel is not False and ctx.world_size > 1 else None
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, device, is_main=ctx.rank == 0,
                          compile_options=options, vae_group=vae_group)
    return pipe, loaded, device, dtype


def run_rank(ctx: RankContext, args: argparse.Namespace) -> dict:
    pipe, loaded, device, dtype = build_pipeline(ctx, args)
    req = request_from_args(args)

    def progress(phase, done, total):
        ctx.progress(f"{phase} {done}/{total}")

    warmup_ms = None
    if args.warmup if args.warmup is not None else (args.compile or device.type == "cuda"):
        t0 = time.perf_counter()
        pipe.generate(replace(req, steps=min(req.steps, 2)), progress=progress)
        warmup_ms = (time.perf_counter() - t0) * 1e3
    warm_graphs = unique_graphs()
    settle_heap()   # keep the collector off what loading and compiling made (dtgen/host.py)
    with GcPauses() as gc_pauses:
        result = pipe.generate(req, progress=progress, record=args.check)
    compile_report = compile_facts(pipe.compiler, warm_graphs) if args.compile else None
    profile_summary = None
    if args.profile:
        profiler = PhaseProfiler(args.profile, ctx.rank, group=loaded.controller.topology.control,
                                 table_rows=PROFILE_ROWS)
        profiled = pipe.generate(req, progress=progress, profiler=profiler)
        profile_summary = profiler.write(profiled.timings_ms, compile_report)
    out = {"rank": ctx.rank, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
           "timings_ms": result.timings_ms, "warmup_ms": warmup_ms, "compile": compile_report,
           "tokens_per_step": result.record["tokens_per_step"], "profile": profile_summary,
           "step_cache": result.record.get("step_cache")}
    facts = {"rank": ctx.rank, "switch": loaded.controller.last_switch.as_dict(), "storage_bytes": loaded.storage.nbytes,
             "peak_memory_bytes": peak_memory(device), "gc": gc_pauses.as_dict()}
    out["ranks"] = gather_rank_facts(ctx, facts, loaded.controller.topology.control)
    if ctx.rank == 0:
        out["video"] = result.video
        if args.check:
            with reference_threads(ctx, device):
                reference = load(args.checkpoint, get_plan("single"), 0, 1, dtype, device,
                                 dense_dtype=args.dense_dtype, attention_dtype=args.attention_dtype)
                ref = WanT2VPipeline(reference.model, reference.tokenizer, reference.controller, device).generate(
                    req, record=True)
            out["check"] = {"max_abs_diff_noise": max_diff(result.record["noise"], ref.record["noise"]),
                            "max_abs_diff_latents": max_diff([result.latents], [ref.latents]),
                            "max_abs_diff_video": max_diff([result.video], [ref.video]),
                            "rel_l2_noise": rel_l2(result.record["noise"], ref.record["noise"])}
            if args.step_cache is not None:   # the plan must take every decision one process takes
                out["check"]["same_cache_decisions"] = _decisions(result.record["step_cache"]) == \
                    _decisions(ref.record["step_cache"])
    return out


def _decisions(report: dict) -> list:
    """What a step cache decided: the full steps, and per row where rows decide (first-block)."""
    return [report["full_steps"], report.get("full_rows"),
            [s.get("full_rows") for s in report.get("segments", [])]]


def _steps_text(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def write_video(frames: torch.Tensor, path: Path, fps: int) -> None:
    """[F, H, W, 3] uint8 -> H.264 MP4 (PyAV ships its own FFmpeg)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    encode_mp4(frames, str(path), fps)


def _cache_rows(report: dict) -> list[tuple[str, str]]:
    cache = report.get("step_cache")
    if cache is None:
        return []
    r = report["timings_ms"]
    knobs = ", ".join(f"{k}={v}" for k, v in cache["config"].items() if k not in ("method", "mag_ratios"))
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    rows = [("step cache", f"{cache['method']} ({knobs})"),
            ("full steps", f"{len(cache['full_steps'])} of {cache['steps']}: {_steps_text(cache['full_steps'])}"),
            ("reused steps", _steps_text(cache["cached_steps"])),
            ("full / reused step", f"{ms(r['denoise_full_step'])} / {ms(r['denoise_cached_step'])}")]
    rows_full = cache.get("full_rows")
    if rows_full and any(len(set(row)) > 1 for row in rows_full):
        rows.append(("rows differ", ", ".join(f"step {i}: " + "".join("F" if f else "c" for f in row)
                                              for i, row in enumerate(rows_full) if len(set(row)) > 1)))
    if "mag_ratios" in cache:
        rows.append(("mag_ratios", "/".join(f"{x:.5f}" for x in cache["mag_ratios"])))
    return rows


def write_report(args, main: dict, tiny: bool) -> dict:
    out = Path(args.output)
    write_video(main["video"], out, args.fps)
    t, ranks = main["timings_ms"], main["ranks"]
    steps = t["denoise_step"]
    switch = max((r["switch"] for r in ranks), key=lambda s: s["ms"])
    report = {"plan": args.plan, "world_size": args.world_size, "device": main["device"], "dtype": main["dtype"],
              "torch": torch.__version__, "checkpoint": "tiny-default" if tiny else args.checkpoint,
              "dense_dtype": args.dense_dtype, "attention_dtype": args.attention_dtype,
              "request": {"height": args.height, "width": args.width, "num_frames": args.num_frames,
                          "steps": args.steps, "sampler": args.sampler, "shift": args.flow_shift},
              "tokens_per_step": main["tokens_per_step"],
              "timings_ms": {"encode": t["encode"], "denoise_step": sum(steps[1:]) / max(len(steps) - 1, 1),
                             "denoise_first_step": steps[0], "decode": t["decode"], "total": t["total"],
                             "denoise_steps": steps},
              "warmup_ms": main["warmup_ms"], "phase_switch": switch,
              "storage_bytes_per_rank": [r["storage_bytes"] for r in ranks],
              "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks]}
    cache = main.get("step_cache")
    if cache is not None:
        report["step_cache"] = cache
        report["timings_ms"]["denoise_full_step"] = t["denoise_full_step"]      # steps after the first
        report["timings_ms"]["denoise_cached_step"] = t["denoise_cached_step"]
    for key in ("check", "compile"):
        if main.get(key) is not None:
            report[key] = main[key]
    r = report["timings_ms"]
    rows = [("plan", f"{args.plan} on {args.world_size} rank(s), {main['device']}, {main['dtype']}"),
            ("video", f"{args.num_frames} frames, {args.height}x{args.width}, {main['tokens_per_step']} tokens/step"),
            ("warm-up run", "off" if main["warmup_ms"] is None else f"{main['warmup_ms']:9.1f} ms (not in the figures)"),
            ("text encode", f"{r['encode']:9.1f} ms"),
            ("denoise", f"{r['denoise_step']:9.1f} ms/step ({args.steps} steps; the first {r['denoise_first_step']:.1f} ms)"),
            ("phase switch", f"{switch['ms']:9.2f} ms, weights copied {switch['weights_copied']}"),
            *_cache_rows(report),
            ("VAE decode", f"{r['decode']:9.1f} ms"),
            ("total", f"{r['total']:9.1f} ms")]
    if all(p is not None for p in report["peak_memory_bytes_per_rank"]):
        rows.append(("memory / rank", ", ".join(f"{x['storage_bytes'] / 1e9:.1f} GB weights, "
                                                f"{x['peak_memory_bytes'] / 1e9:.1f} GB peak" for x in ranks)))
    if "compile" in report:
        c = report["compile"]
        rows.append(("compile", f"{c['graphs']} graphs, {c['graph_breaks']} breaks, "
                                f"{c['recompiles_after_warmup']} recompiles after warm-up, {c['compile_s']:.1f} s"))
    rows += [(f"check {k}", str(v) if isinstance(v, bool) else f"{v:.3e}") for k, v in report.get("check", {}).items()]
    print(table(rows))
    print(f"wrote {out}")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.report}")
    return report


def main(argv=None, prog: str = "dtgen run --model wan") -> int:
    return example_main(parse_args(argv, prog), prepare, run_rank, write_report, RANK_PRELOAD)


# ---- served (`dtgen serve`, the registry's contract: dtgen/registry.py) ----------
def serve_problem(args) -> str | None:
    try:
        parse_injections(args.inject_failure, ("denoise",))
    except ValueError as e:
        return str(e)
    return None


def serve_adapter(ctx: RankContext, args: argparse.Namespace, max_batch: int):
    """This rank's pipeline behind the server (one request at a time); the flags' request holds the defaults."""
    from models.wan.serving import WanServeAdapter
    pipe = build_pipeline(ctx, args)[0]
    return WanServeAdapter(pipe, ctx.rank, request_from_args(args), fps=args.fps, warmup=args.warmup is not False,
                           inject_failure=parse_injections(args.inject_failure, ("denoise",)))

