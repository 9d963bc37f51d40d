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
from pathlib import Path

import torch

from dtgen.diffusion_command import DiffusionCommand, add_diffusion_flags, vae_parallel_problem
from dtgen.fp8 import add_fp8_flags, attention_head_problem
from dtgen.harness import add_run_flags, compile_problem, example_main, finish_launch_args, launch_problem
from dtgen.launch import RankContext
from dtgen.requests import RequestError
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
    add_diffusion_flags(p)
    add_run_flags(p, PLANS, "outputs/wan_t2v.mp4", cli, dict(prompt=DEFAULT_PROMPT), "Wan")
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
        problem = launch_problem(args, get_plan(args.plan)) or compile_problem(args) or vae_parallel_problem(args)
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


def _describe(args, main: dict) -> str:
    return f"{args.num_frames} frames, {args.height}x{args.width}, {main['tokens_per_step']} tokens/step"


def _save(frames: torch.Tensor, path: Path, args) -> None:
    """[F, H, W, 3] uint8 -> H.264 MP4 (PyAV ships its own FFmpeg)."""
    encode_mp4(frames, str(path), args.fps)


COMMAND = DiffusionCommand(makes="video", loader=load, pipeline=WanT2VPipeline, get_plan=get_plan,
                           request_from_args=request_from_args, describe=_describe, save=_save,
                           profile_rows=PROFILE_ROWS)

# this rank's pipeline (the command's and the server's), one request on every rank, rank 0's report
build_pipeline, run_rank, write_report = COMMAND.build_pipeline, COMMAND.run_rank, COMMAND.write_report


def main(argv=None, prog: str = "dtgen run --model wan") -> int:
    return example_main(parse_args(argv, prog), prepare, run_rank, write_report, RANK_PRELOAD)


# ---- served (`dtgen serve`, the registry's contract: dtgen/registry.py) ----------
def serve_adapter(ctx: RankContext, args: argparse.Namespace, max_batch: int):
    """This rank's pipeline behind the server (requests of one bucket batch: --max-batch); the flags' request
    holds the defaults."""
    from models.wan.serving import WanServeAdapter
    pipe = build_pipeline(ctx, args)[0]
    return WanServeAdapter(pipe, ctx.rank, request_from_args(args), fps=args.fps, warmup=args.warmup is not False)

