"""Wan text-to-video (Wan 2.1, Wan 2.2-A14B) and image-to-video (Wan2.1-I2V, Wan2.2-I2V-A14B)
from a diffusers-format checkpoint.

    dtgen run --model wan                                      # tiny default, one process
    dtgen run --model wan --world-size 2 --plan ulysses2       # 2 gloo ranks spawned here (CPU)
    torchrun --nproc-per-node 2 -m dtgen run --model wan --world-size 2 --plan cfg2 \\
        --checkpoint /path/to/Wan2.1-T2V-14B-Diffusers --height 480 --width 832 --num-frames 81
    dtgen run --model wan --image ref.png                      # image to video, the tiny I2V default
    dtgen run --model wan --image ref.png --checkpoint /path/to/Wan2.1-I2V-14B-480P-Diffusers

With no --checkpoint, a tiny random model is written once (diffusers format) into the cache
folder and loaded through the real loader (with --image, Wan2.1-I2V's layout). With --image and
no --height / --width, the video keeps the image's aspect ratio at about the default area
(480 x 832 on a checkpoint), each side a multiple of 16. Writes the MP4 (PyAV's own H.264 encoder), prints
a per-stage timing table and, with --report, a JSON report. Plans: placements/wan.py.

`python -m examples.wan_t2v` runs the same command.
"""
from __future__ import annotations

from dtgen.diffusion_command import DiffusionCommand
from models.registry import checkpoint_problem
from models.wan.model import LORA_PREFIXES, WanConfigs, load
from models.wan.pipeline import T2VRequest, WanT2VPipeline
from models.wan.tiny import ensure_tiny_checkpoint, ensure_tiny_i2v_checkpoint
from placements.wan import PLANS, get_plan


COMMAND = DiffusionCommand(
    name="wan", title="Wan", module=__name__, description=__doc__.split("\n")[0], request=T2VRequest,
    default_prompt="A red fox runs through fresh snow at golden hour, cinematic", output="outputs/wan_t2v.mp4",
    fp8_reach=("the DiT blocks' linears", "the DiT self-attention"), plans=PLANS, get_plan=get_plan,
    multi_rank_plan="ulysses2", tiny_defaults=dict(height=48, width=64, num_frames=9, steps=4),
    checkpoint_defaults=dict(height=480, width=832, num_frames=81, steps=50), scheduler_defaults={"flow_shift": 3.0},
    ensure_tiny=ensure_tiny_checkpoint, checkpoint_problem=checkpoint_problem, configs=WanConfigs.from_folder,
    loader=load, pipeline=WanT2VPipeline, adapter="models.wan.serving:WanServeAdapter",
    lora_prefixes=LORA_PREFIXES, ensure_tiny_from_image=ensure_tiny_i2v_checkpoint)

# `python -m examples.wan_t2v` runs it (the registry's spec names COMMAND itself).
main = COMMAND.main
