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

from pathlib import Path

from dtgen.diffusion_command import DiffusionCommand
from dtgen.harness import example_main
from dtgen.layers.t5 import load_tokenizer
from dtgen.requests import RequestError, flag_line
from models.registry import checkpoint_problem
from models.wan.model import LORA_PREFIXES, WanConfigs, load
from models.wan.pipeline import T2VRequest, WanT2VPipeline
from models.wan.tiny import ensure_tiny_checkpoint
from placements.wan import PLANS, get_plan


def describe(args, main: dict) -> str:
    return f"{args.num_frames} frames, {args.height}x{args.width}, {main['tokens_per_step']} tokens/step"


COMMAND = DiffusionCommand(
    name="wan", title="Wan", module=__name__, description=__doc__.split("\n")[0], request=T2VRequest,
    default_prompt="A red fox runs through fresh snow at golden hour, cinematic", output="outputs/wan_t2v.mp4",
    fp8_reach=("the DiT blocks' linears", "the DiT self-attention"), plans=PLANS, get_plan=get_plan,
    multi_rank_plan="ulysses2", tiny_defaults=dict(height=48, width=64, num_frames=9, steps=4),
    checkpoint_defaults=dict(height=480, width=832, num_frames=81, steps=50), scheduler_defaults={"flow_shift": 3.0},
    ensure_tiny=ensure_tiny_checkpoint, checkpoint_problem=checkpoint_problem, configs=WanConfigs.from_folder,
    loader=load, pipeline=WanT2VPipeline, describe=describe, adapter="models.wan.serving:WanServeAdapter",
    lora_prefixes=LORA_PREFIXES)



def prepare(args) -> tuple[str | None, bool]:
    """The command's checks, then the prompts' lengths against what the text encoder reads
    (models.wan.serving.check_prompt_lengths, the server's check too)."""
    from models.wan.serving import check_prompt_lengths
    problem, tiny = COMMAND.prepare(args)
    if problem is None and getattr(args, "prompt", None) is not None:
        try:
            check_prompt_lengths(load_tokenizer(Path(args.checkpoint) / "tokenizer"), COMMAND.request_from_args(args))
        except RequestError as e:
            problem = flag_line(e, COMMAND.flag_of_field)
    return problem, tiny


# The registry's command pieces (dtgen/registry.py): the command's, bound to Wan.
build_parser, finish_args, parse_args, request_from_args = (
    COMMAND.build_parser, COMMAND.finish_args, COMMAND.parse_args, COMMAND.request_from_args)
build_pipeline, run_rank, write_report, serve_adapter = (
    COMMAND.build_pipeline, COMMAND.run_rank, COMMAND.write_report, COMMAND.serve_adapter)


def main(argv=None, prog: str | None = None) -> int:
    return example_main(parse_args(argv, prog), prepare, run_rank, write_report, (__name__,))
