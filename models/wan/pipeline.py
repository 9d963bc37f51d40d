"""Wan text-to-video: encode the prompt, denoise with CFG, decode the video (diffusers' WanPipeline).

Three phases over one resident copy of the weights (placements/wan.py): `encode` runs UMT5 on
the prompt and the negative prompt; `denoise` runs the DiT once per step on both CFG rows (as
a batch of 2, or one row per rank on a CFG axis) with the token rows spread over the phase's
SP ranks; `decode` runs the VAE, split over a spatial group when the caller gives one. Wan2.2-
A14B's two DiTs are both resident: the step's timestep picks one (`WanT2V.transformer_for`),
an expert switch with nothing moved.

Requests of one bucket (the spec's `buckets`: size, schedule, step cache, CFG on or off) run
their denoise steps as rows of one batch, the loop the framework's (dtgen/denoise_loop.py): each
member's [cond, uncond] rows in the call, its own seed, prompts, guidance, UniPC history and
step caches; `generate` is the batch of one (`generate_batch`, dtgen/diffusion_run.py).

The DiT declares where its rows split under sequence parallelism (`WanTransformer.seq_splits`:
the patch tokens and their RoPE rows, tail-padded, so any SP degree takes 81 frames = 21 latent
frames) and where one evaluation is cut for a step cache (its split points: the patch tokens
enter the blocks, the last block's rows are what a cache keeps, the final layer and unpatchify
make the prediction); the framework builds every call from them (dtgen/denoiser_calls.py).
One step cache per request, call site (the CFG batch of 2 is one, with two rows; on a CFG axis
each rank's branch is one) and expert, made for the request and dropped with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtgen.denoise_loop import CallRows, DenoiseMember, Segment
from dtgen.diffusion_run import DiffusionPipeline, denoiser_runs, result_type
from dtgen.layers.flow_match import SAMPLERS, classifier_free_guidance, make_sampler
from dtgen.layers.t5 import encode_prompt_embeds
from dtgen.requests import RequestError, check_multiple, nearest_valid
from dtgen.schema import (check_bounds, loras_field, negative_prompt_field, prompt_field, request_field, seed_field,
                          side_field, size_field, step_cache_field, steps_field)
from dtgen.step_cache import DenoiserCall, StepCacheConfig

from .transformer import WanTransformer

MAX_FRAMES = 1001
TEXT_LENGTH = 512   # WanPipeline's max_sequence_length: every prompt is padded (with zeros) to it


@dataclass(frozen=True)
class T2VRequest:
    """What one video takes, each field declared once (dtgen/schema.py): the CLI's flags, the
    server's JSON fields and the docs' table come from these declarations."""
    prompt: str = prompt_field("video")
    negative_prompt: str = negative_prompt_field()
    height: int = side_field(480, "pixels (default: 480, or 48 on the tiny default)", flag_default=None)
    width: int = side_field(832, "pixels (default: 832, or 64 on the tiny default)", flag_default=None)
    # the server's one field for width and height (the image servers' and the UI's convention)
    size = size_field(example="832x480", flag=None, help="WIDTHxHEIGHT, multiples of the model's 16 px")
    num_frames: int = request_field(81, low=1, high=MAX_FRAMES, flag_default=None,
                                    help="4k + 1 frames (default: 81, or 9 on the tiny default)")
    steps: int = steps_field()
    guidance_scale: float = request_field(5.0, low=0.0, high=100.0, flag="--guidance", help="the CFG weight")
    # Wan2.2-A14B: the low-noise expert's guidance (None: the same as guidance_scale).
    guidance_scale_2: float | None = request_field(None, kind="number", low=0.0, high=100.0, flag="--guidance-2",
                                                   help="Wan2.2-A14B: the low-noise expert's guidance")
    # 3.0 at 480p, 5.0 at 720p (diffusers' WanPipeline docs)
    shift: float = request_field(3.0, low=0.0, high=100.0, flag="--flow-shift", json="flow_shift", flag_default=None,
                                 help="the sampler's shift (default: the checkpoint's scheduler config, else 3.0)")
    sampler: str = request_field("unipc", choices=sorted(SAMPLERS), help="the flow-matching sampler")
    seed: int = seed_field()
    step_cache: StepCacheConfig | str | dict | None = step_cache_field()
    loras: tuple[tuple[str, float], ...] = loras_field()

    def check(self, temporal: int, spatial: int, two_experts: bool | None = None) -> None:
        """`RequestError(field, message)` for the first field the model cannot take, before
        any work: the CLI's and the server's one check. `temporal`, `spatial`: frames per
        latent frame, pixels per token side (VAE x patch); `two_experts`: whether the
        checkpoint has Wan2.2-A14B's second DiT (None: not known here)."""
        check_bounds(self)
        if (self.num_frames - 1) % temporal:
            lo, hi = nearest_valid(self.num_frames, temporal, 1)
            raise RequestError("num_frames", f"{self.num_frames} does not map to whole latent frames (it must be "
                                             f"{temporal}k + 1); nearest valid: {lo} or {hi}")
        for name in ("height", "width"):
            check_multiple(name, getattr(self, name), spatial)
        if two_experts is False and self.guidance_scale_2 is not None:
            raise RequestError("guidance_scale_2", "applies to Wan2.2-A14B's low-noise expert; this checkpoint has "
                                                   "one transformer (Wan 2.1)")

    @property
    def guided(self) -> tuple[bool, bool]:
        """What a batch shares beyond its schedule (the spec's `buckets.batch`): (the high-noise
        expert's steps run CFG, the low-noise expert's do); Wan 2.1's one DiT: the first."""
        low = self.guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        return self.guidance_scale > 1.0, low > 1.0


# video: [F, H, W, 3] uint8 on the main rank; latents: [1, z, T, h, w] float32, the denoised latents
T2VResult = result_type("T2VResult", "video", __name__)


class WanT2VPipeline(DiffusionPipeline):
    """Wan's pieces of the phases (dtgen/diffusion_run.py) and of the denoise loop
    (dtgen/denoise_loop.py): requests of one bucket run as rows of one batch, each member's
    [cond, uncond] rows together in one call."""

    spec_name = "wan"
    cfg_together = True
    makes = "video"
    result_type = T2VResult

    def latent_shape(self, req: T2VRequest) -> tuple[int, ...]:
        vae = self.model.vae.cfg
        frames = (req.num_frames - 1) // vae.temporal_factor + 1
        return (1, vae.z_dim, frames, req.height // vae.spatial_factor, req.width // vae.spatial_factor)

    def encode(self, req: T2VRequest) -> torch.Tensor:
        """[2, TEXT_LENGTH, text_dim]: the prompt's and the negative prompt's embeddings."""
        ids, mask = self.tokenizer([req.prompt, req.negative_prompt], max_length=TEXT_LENGTH)
        return encode_prompt_embeds(self.model.text_encoder, ids.to(self.device), mask.to(self.device), TEXT_LENGTH,
                                    dtype=self.dtype)

    # ---- the denoise loop's model (dtgen/denoise_loop.py) ---------------------------------
    def guidance(self, req: T2VRequest, dit: WanTransformer) -> float:
        """The request's guidance on `dit`'s steps (Wan2.2-A14B's low-noise expert: guidance_scale_2)."""
        if dit is self.model.transformer or req.guidance_scale_2 is None:
            return req.guidance_scale
        return req.guidance_scale_2

    def segments(self, rt, timesteps: torch.Tensor, req: T2VRequest) -> list[Segment]:
        """Wan2.2-A14B: the high-noise expert's steps, then the low-noise one's, each expert
        with its own step caches counting its own steps from 0 (as diffusers' hooks on each
        transformer do): a residual or a derivative of one expert's blocks says nothing about
        the other's, so the first step after the switch runs in full. A step without guidance
        runs the conditional row alone (as WanPipeline), except on a CFG axis, where each rank
        runs its branch and the guidance combines them."""
        names = {id(self.model.transformer): "transformer", id(self.model.transformer_2): "transformer_2"}
        return [Segment(dit, first, n, 2 if rt.cfg_size == 2 or self.guidance(req, dit) > 1.0 else 1, names[id(dit)])
                for dit, first, n in denoiser_runs([self.model.transformer_for(float(t)) for t in timesteps])]

    def denoise_call(self, rt, segment: Segment, t: torch.Tensor, rows: CallRows) -> DenoiserCall:
        """One DiT evaluation on a call's rows: each member's latents and text rows, its CFG
        branches as rows of the batch (Wan's text is always TEXT_LENGTH rows: nothing to pad)."""
        x = rows.latents.to(self.dtype)
        text = rows.take([m.context for m in rows.members])
        return self.calls(rt, segment.denoiser, x, t.expand(x.shape[0]).to(self.device), text)

    def guide(self, member: DenoiseMember, segment: Segment, branches: torch.Tensor) -> torch.Tensor:
        """The guided prediction in the DiT's dtype (as WanPipeline combines it)."""
        if segment.branches == 1:
            return branches
        return classifier_free_guidance(branches[0:1], branches[1:2], self.guidance(member.request, segment.denoiser))

    # ---- the rest of what the phases need (dtgen/diffusion_run.py) ------------------------
    @staticmethod
    def check_args(cfgs) -> tuple[int, int, bool]:
        """`T2VRequest.check`'s: frames per latent frame, pixels per token side, whether the
        checkpoint has Wan2.2-A14B's second expert."""
        return (cfgs.vae.temporal_factor, cfgs.vae.spatial_factor * cfgs.transformer.patch_size[1],
                cfgs.transformer_2 is not None)

    def sampler(self, req: T2VRequest):
        return make_sampler(req.sampler, req.steps, req.shift)

    def result(self, req: T2VRequest, video, latents: torch.Tensor, timings: dict, record: dict) -> T2VResult:
        tokens = math.prod(self.latent_shape(req)[2:]) // math.prod(self.model.transformer.patch_size)
        record["tokens_per_step"] = tokens
        return super().result(req, video, latents, timings, record)
