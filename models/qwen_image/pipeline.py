"""Qwen-Image text-to-image: encode the prompts, denoise with true CFG, decode (diffusers' QwenImagePipeline).

Three phases over one resident copy of the weights (placements/qwen_image.py): `encode` runs
the text encoder on the prompt (and the negative prompt when CFG is on), each alone;
`denoise` runs the MMDiT once per branch and step (serially, or one branch per rank on a CFG
axis), with the text and image rows spread over the phase's SP ranks; `decode` runs the VAE,
split over a spatial group when the caller gives one.

Requests of one bucket (the spec's `buckets`: size, steps, step cache, CFG on or off) run
their denoise steps as rows of one batch, the loop the framework's (dtgen/denoise_loop.py): a call
holds one branch of every member, each prompt encoded alone (its own length), the call's text
zero-padded at the tail to its longest and each row's padding hidden from the joint attention
by a per-row hole in the meta (dtgen/seq_split.py `padded_rows`), so every row attends as its
prompt alone would; `generate` is the batch of one (`generate_batch`, dtgen/diffusion_run.py).

True CFG is QwenImagePipeline's: comb = uncond + s (cond - uncond), rescaled per row to the
conditional prediction's norm over channels. The sampler is its FlowMatchEulerDiscreteScheduler:
sigmas linspace(1, 1/steps), shifted by mu, which grows linearly with the image's token
count (dynamic shift), stretched to end at `shift_terminal`.

Under sequence parallelism each rank holds a chunk of the text rows and a chunk of the image
rows (each tail-padded to a multiple of the SP size), as the MMDiT declares
(`QwenImageTransformer.seq_splits`, applied by dtgen/seq_split.py; diffusers' `_cp_plan`
splits the same); the attention meta gives every row its slot (text 0..L-1, image
L..L+N-1, padding past them), so the joint attention sees one bidirectional block and no
padding. The blocks' output a step cache keeps is the image stream; the text stream travels
inside the call, the blocks' carried stream (the split points the MMDiT declares,
dtgen/denoiser_calls.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtgen.denoise_loop import CallRows, Segment
from dtgen.diffusion_run import DiffusionPipeline, result_type
from dtgen.layers.flow_match import DynamicShiftSampler
from dtgen.layers.latent_packing import pack_latents as pack
from dtgen.layers.latent_packing import unpack_latents as unpack
from dtgen.requests import RequestError, check_multiple
from dtgen.schema import (check_bounds, loras_field, negative_prompt_field, prompt_field, request_field, seed_field,
                          side_field, size_field, step_cache_field, steps_field)
from dtgen.seq_split import padded_rows
from dtgen.step_cache import DenoiserCall, StepCacheConfig

from .text_encoder import encode_prompt


@dataclass(frozen=True)
class T2IRequest:
    """What one image takes, each field declared once (dtgen/schema.py): the CLI's flags, the
    server's JSON fields and the docs' table come from these declarations."""
    prompt: str = prompt_field("image")
    # the model card's; CFG needs one (QwenImagePipeline: none -> no CFG)
    negative_prompt: str = negative_prompt_field(" ", help="what CFG steers away from (default: one space, the "
                                                           "model card's: CFG needs a negative prompt)")
    height: int = side_field(1024, "pixels, a multiple of 16 (VAE x patch size)", flag=None)
    width: int = side_field(1024, "pixels, a multiple of 16 (VAE x patch size)", flag=None)
    # one user field for width and height: --image-size, the server's `size` ("auto": its default)
    size = size_field(example="1024x1024", auto=True, help="WIDTHxHEIGHT (default: 1024x1024, or 64x48 on the "
                                                           "tiny default)")
    steps: int = steps_field()
    true_cfg_scale: float = request_field(4.0, low=0.0, high=100.0,
                                          help="<= 1: no CFG (the conditional branch alone)")
    seed: int = seed_field()
    max_sequence_length: int = request_field(512, low=1, high=1024, flag=None, json=None,
                                             help="the prompt's text tokens at most")
    step_cache: StepCacheConfig | str | dict | None = step_cache_field()
    loras: tuple[tuple[str, float], ...] = loras_field()

    def check(self, multiple: int = 16, min_steps: int = 1) -> None:
        """`RequestError(field, message)` for the first field the model cannot take, before any
        work: the CLI's and the server's one check. `multiple`: pixels per token side (VAE x
        patch); `min_steps`: the fewest steps the checkpoint's schedule takes
        (`QwenImagePipeline.check_args`)."""
        check_bounds(self)
        for name in ("height", "width"):
            check_multiple(name, getattr(self, name), multiple)
        if self.steps < min_steps:
            raise RequestError("steps", f"must be >= {min_steps} with this checkpoint's scheduler (its shift_terminal "
                                        "stretch divides 0 by 0 at one step: diffusers' schedule is NaN)")

    @property
    def guided(self) -> bool:
        """CFG on (two call sites a step): what a batch shares beyond its size and steps."""
        return self.true_cfg_scale > 1


# image: [H, W, 3] uint8 on the main rank; latents: [1, h*w, C*4] packed, the denoised latents
T2IResult = result_type("T2IResult", "image", __name__)


class QwenImagePipeline(DiffusionPipeline):
    """Qwen-Image's pieces of the phases (dtgen/diffusion_run.py) and of the denoise loop
    (dtgen/denoise_loop.py): requests of one bucket run as rows of one batch, one call per
    CFG branch (true CFG as QwenImagePipeline runs it), each row's prompt padded to the
    call's longest and its padding masked (`padded_rows`)."""

    spec_name = "qwen-image"
    cfg_together = False
    result_type = T2IResult
    guidance_kind = "renormed-cfg"   # true CFG as QwenImagePipeline runs it

    def grid(self, req: T2IRequest) -> tuple[int, int]:
        """The (h, w) patch grid of the packed latents."""
        f = self.model.vae.cfg.spatial_factor * 2
        return req.height // f, req.width // f

    def latent_shape(self, req: T2IRequest) -> tuple[int, ...]:
        """The packed latents [1, h*w, C*4] (what QwenImagePipeline takes as `latents`)."""
        return (1, math.prod(self.grid(req)), self.model.transformer.cfg.in_channels)

    def noise(self, req: T2IRequest, generator: torch.Generator) -> torch.Tensor:
        """diffusers' draw: [1, 1, C, H/8, W/8] normals, then packed (the same memory, as diffusers views it)."""
        grid = self.grid(req)
        C, h, w = self.model.transformer.cfg.in_channels // 4, grid[0] * 2, grid[1] * 2
        return pack(torch.randn((1, 1, C, h, w), generator=generator).reshape(1, C, 1, h, w))

    def encode(self, req: T2IRequest) -> list[torch.Tensor]:
        """Each branch's prompt [1, L, hidden], encoded alone: the prompt, and the negative
        prompt when CFG is on."""
        prompts = [req.prompt, req.negative_prompt] if req.guided else [req.prompt]
        return [encode_prompt(self.model.text_encoder, self.tokenizer, p, self.device, self.dtype,
                              req.max_sequence_length) for p in prompts]

    def vae_latents(self, req: T2IRequest, latents: torch.Tensor) -> torch.Tensor:
        """The packed latents unpacked: one latent frame [1, z, 1, h, w] (the Wan VAE's image)."""
        return unpack(latents, *self.grid(req))

    # ---- the denoise loop's model (dtgen/denoise_loop.py) ---------------------------------
    def segments(self, rt, timesteps: torch.Tensor, req: T2IRequest) -> list[Segment]:
        """One MMDiT for every step; CFG on: both branches (no CFG: the conditional one alone,
        on every rank of a CFG axis too)."""
        return [Segment(self.model.transformer, 0, len(timesteps), 2 if req.guided else 1)]

    def denoise_call(self, rt, segment: Segment, t: torch.Tensor, rows: CallRows) -> DenoiserCall:
        x = rows.latents.to(self.dtype)
        timestep = (t.to(self.dtype) / 1000).expand(x.shape[0]).to(self.device)   # as diffusers: t / 1000
        # each row's prompt encoded alone: of its own length, padded to the call's longest, and
        # compiled, up to the spec's text bucket (graphs are specialised to the text rows)
        bucket = self.buckets.text_rows if self.compiler.options.enabled else 1
        text, hole = padded_rows([m.context[b] for m in rows.members for b in rows.branches], max(bucket, 1))
        return self.calls(rt, segment.denoiser, x, timestep, text, *self.grid(rows.members[0].request), hole=hole)

    def guidance_scale(self, req: T2IRequest, segment: Segment) -> float:
        return req.true_cfg_scale

    # ---- the rest of what the phases need (dtgen/diffusion_run.py) ------------------------
    @staticmethod
    def check_args(cfgs) -> tuple[int, int]:
        """`T2IRequest.check`'s: pixels per token side, the fewest steps the schedule takes (2 with a
        `shift_terminal` stretch: `DynamicShiftSampler`'s rule)."""
        return cfgs.vae.spatial_factor * cfgs.transformer.patch_size, 2 if cfgs.scheduler.get("shift_terminal") else 1

    def sampler(self, req: T2IRequest) -> DynamicShiftSampler:
        return DynamicShiftSampler(req.steps, math.prod(self.grid(req)), self.model.cfgs.scheduler)

