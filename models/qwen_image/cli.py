"""Qwen-Image text-to-image from a diffusers-format checkpoint.

    dtgen run --model qwen-image                                     # tiny default, one process (CPU)
    dtgen run --model qwen-image --world-size 2 --plan cfg2 --check  # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m dtgen run --model qwen-image --world-size 2 --plan tp2 --checkpoint /path/to/Qwen-Image

With no --checkpoint, a tiny random model is written once (diffusers layout) into the cache
folder and loaded through the real loader. Writes the PNG, prints a timing table and, with
--report, a JSON report. Plans: placements/qwen_image.py.

`python -m examples.qwen_t2i` runs the same command.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dtgen.diffusion_command import DiffusionCommand, add_diffusion_flags, vae_parallel_problem
from dtgen.image_files import image_path_problem, save_image
from dtgen.fp8 import add_fp8_flags, attention_head_problem
from dtgen.harness import add_run_flags, compile_problem, example_main, finish_launch_args, launch_problem
from dtgen.launch import RankContext
from dtgen.layers.config import read_json
from dtgen import schema
from dtgen.requests import flag_line
from dtgen.requests import RequestError
from models.qwen_image.model import load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest, fewest_steps
from models.qwen_image.tiny import ensure_tiny_checkpoint
from models.registry import checkpoint_problem
from placements.qwen_image import PLANS, get_plan


DEFAULT_PROMPT = "A red fox in fresh snow at golden hour, a sign that says 'dtgen'"
RANK_PRELOAD = ("models.qwen_image.cli",)
# The request fields' flags (their declarations': dtgen/schema.py): `T2IRequest.check` names
# fields, the CLI names flags.
FLAG_OF_FIELD = schema.flag_names(T2IRequest)


def build_parser(prog: str = "dtgen run --model qwen-image", description: str = __doc__.split("\n")[0],
                 cli: bool = True) -> argparse.ArgumentParser:
    """Every flag of a run; a server's (`cli=False`) has no prompt and no report flags."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--checkpoint", help="diffusers-format Qwen-Image folder (default: the embedded tiny model)")
    # the request's fields (models/qwen_image/pipeline.py T2IRequest); a server's requests give their prompt
    schema.add_flags(p, T2IRequest, omit=() if cli else ("prompt",), defaults={"prompt": DEFAULT_PROMPT})
    add_diffusion_flags(p)
    add_fp8_flags(p, "the MMDiT blocks' linears", "the MMDiT's joint attention")
    add_run_flags(p, PLANS, "outputs/qwen_t2i.png", cli, dict(prompt=DEFAULT_PROMPT), "Qwen-Image")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    return finish_launch_args(args, lambda world: "single" if world == 1 else "cfg2")


def parse_args(argv=None, prog: str = "dtgen run --model qwen-image") -> argparse.Namespace:
    return finish_args(build_parser(prog).parse_args(argv))


def request_from_args(args) -> T2IRequest:
    """The request the flags say (a server's: the defaults of the fields a request leaves out);
    `RequestError` naming a field for a size or step cache that does not parse."""
    return schema.from_args(T2IRequest, args)


def prepare(args) -> tuple[str | None, bool]:
    tiny = args.checkpoint is None
    if args.image_size is None:
        args.image_size = "64x48" if tiny else "1024x1024"
    if args.steps is None:
        args.steps = 4 if tiny else 50
    try:
        req = request_from_args(args)
        req.check()
        args.width, args.height, args.step_cache = req.width, req.height, req.step_cache   # parsed, for the report
        problem = launch_problem(args, get_plan(args.plan)) or compile_problem(args) or vae_parallel_problem(args) \
            or image_path_problem(args.output)
    except RequestError as e:
        return flag_line(e, FLAG_OF_FIELD), tiny
    except ValueError as e:
        return str(e), tiny
    if problem is None and not tiny:
        problem = checkpoint_problem("qwen-image", args.checkpoint,
                                     "no model_index.json there (expected a diffusers-format folder)")
    if problem is None and tiny:
        args.checkpoint = str(ensure_tiny_checkpoint())
    if problem is None:
        folder = Path(args.checkpoint)
        head_dim = read_json(folder / "transformer" / "config.json").get("attention_head_dim", 128)
        problem = attention_head_problem(args.attention_dtype, head_dim)
        scheduler = folder / "scheduler" / "scheduler_config.json"
        try:   # what only the checkpoint can say: the fewest steps its schedule takes
            req.check(min_steps=fewest_steps(read_json(scheduler) if scheduler.is_file() else {}))
        except RequestError as e:
            problem = problem or flag_line(e, FLAG_OF_FIELD)
    return problem, tiny


def _describe(args, main: dict) -> str:
    return f"{args.width}x{args.height}, {args.steps} steps, true CFG {args.true_cfg_scale}"


def _save(image, path: Path, args) -> None:
    save_image(path, image)


COMMAND = DiffusionCommand(makes="image", loader=load, pipeline=QwenImagePipeline, get_plan=get_plan,
                           request_from_args=request_from_args, describe=_describe, save=_save)

# this rank's pipeline (the command's and the server's), one request on every rank, rank 0's report
build_pipeline, run_rank, write_report = COMMAND.build_pipeline, COMMAND.run_rank, COMMAND.write_report


def main(argv=None, prog: str = "dtgen run --model qwen-image") -> int:
    return example_main(parse_args(argv, prog), prepare, run_rank, write_report, RANK_PRELOAD)


# ---- served (`dtgen serve`, the registry's contract: dtgen/registry.py) ----------
def serve_adapter(ctx: RankContext, args: argparse.Namespace, max_batch: int):
    """This rank's pipeline behind the server (requests of one bucket batch: --max-batch); the flags' request
    holds the defaults."""
    from models.qwen_image.serving import QwenServeAdapter
    pipe = build_pipeline(ctx, args)[0]
    return QwenServeAdapter(pipe, ctx.rank, request_from_args(args), warmup=args.warmup is not False)

