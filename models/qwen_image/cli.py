"""Qwen-Image text-to-image from a diffusers-format checkpoint.

    dtgen run --model qwen-image                                     # tiny default, one process (CPU)
    dtgen run --model qwen-image --world-size 2 --plan cfg2 --check  # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m dtgen run --model qwen-image --world-size 2 --plan tp2 \\
        --checkpoint /path/to/Qwen-Image

With no --checkpoint, a tiny random model is written once (diffusers layout) into the cache
folder and loaded through the real loader. Writes the PNG, prints a timing table and, with
--report, a JSON report. Plans: placements/qwen_image.py.

`python -m examples.qwen_t2i` runs the same command.
"""
from __future__ import annotations

from dtgen.diffusion_command import DiffusionCommand
from models.qwen_image.model import LORA_PREFIXES, QwenImageConfigs, load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest
from models.qwen_image.tiny import ensure_tiny_checkpoint
from models.registry import checkpoint_problem
from placements.qwen_image import PLANS, get_plan


def describe(args, main: dict) -> str:
    r = main["request"]
    return f"{r['width']}x{r['height']}, {args.steps} steps, true CFG {args.true_cfg_scale}"


COMMAND = DiffusionCommand(
    name="qwen-image", title="Qwen-Image", module=__name__, description=__doc__.split("\n")[0], request=T2IRequest,
    default_prompt="A red fox in fresh snow at golden hour, a sign that says 'dtgen'", output="outputs/qwen_t2i.png",
    fp8_reach=("the MMDiT blocks' linears", "the MMDiT's joint attention"), plans=PLANS, get_plan=get_plan,
    multi_rank_plan="cfg2", tiny_defaults=dict(image_size="64x48", steps=4),
    checkpoint_defaults=dict(image_size="1024x1024", steps=50), ensure_tiny=ensure_tiny_checkpoint,
    checkpoint_problem=checkpoint_problem, configs=QwenImageConfigs.from_folder, loader=load,
    pipeline=QwenImagePipeline, describe=describe, adapter="models.qwen_image.serving:QwenServeAdapter",
    lora_prefixes=LORA_PREFIXES)

# `python -m examples.qwen_t2i` runs it (the registry's spec names COMMAND itself).
main = COMMAND.main
