"""The docs' tiny DiT as a pipeline: its request, each field declared once, and its pieces of
the framework's encode -> denoise -> decode phases (dtgen/diffusion_run.py), whose denoise
loop (dtgen/denoise_loop.py) batches requests, keeps each one's sampler and step caches, and
lays out the CFG branches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dtgen.buckets import ShapeBuckets
from dtgen.denoise_loop import CallRows, Segment
from dtgen.denoiser_calls import denoiser_call
from dtgen.diffusion_run import DiffusionPipeline
from dtgen.layers.flow_match import FlowEulerSampler
from dtgen.requests import MAX_SEED, MAX_STEPS
from dtgen.schema import check_bounds, request_field


@dataclass(frozen=True)
class TinyRequest:
    """The CLI's flags, the server's JSON fields and the bounds check come from these lines."""
    rows: int = request_field(16, low=1, high=4096, help="latent token rows")
    steps: int = request_field(4, low=1, high=MAX_STEPS, help="denoising steps")
    guidance: float = request_field(3.0, low=0.0, high=20.0, help="CFG scale; <= 1: no CFG")
    seed: int = request_field(0, low=0, high=MAX_SEED, help="the initial noise's seed")
    step_cache: object = request_field(None, kind="step_cache", help="dtgen/step_cache.py")

    def check(self) -> None:    # the CLI's and the server's one check: RequestError(field, message)
        check_bounds(self)

    @property
    def guided(self) -> bool:   # CFG on: two branches a step (what a batch must share)
        return self.guidance > 1


class TinyResult(NamedTuple):
    pixels: torch.Tensor        # its "decode" is the identity: the latents
    latents: torch.Tensor       # [1, rows, channels]
    timings_ms: dict
    record: dict


class TinyPipeline(DiffusionPipeline):
    cfg_together = True         # both CFG branches as rows of one call
    result_type = TinyResult

    def __init__(self, built, buckets: ShapeBuckets, device="cpu"):
        self.model, self.controller, self.buckets = built.model, built.controller, buckets
        self.device, self.is_main, self.vae_group = torch.device(device), True, None

    def check(self, req: TinyRequest) -> None:
        req.check()

    def encode(self, req: TinyRequest) -> None:   # no text: its condition is a learned vector
        return None

    def latent_shape(self, req: TinyRequest) -> tuple[int, ...]:
        return (1, req.rows, self.model.proj_in.in_features)

    def sampler(self, req: TinyRequest) -> FlowEulerSampler:
        return FlowEulerSampler(req.steps, shift=3.0)

    def decode_latents(self, req: TinyRequest, latents: torch.Tensor) -> torch.Tensor:
        return latents

    # ---- the denoise loop's model ----------------------------------------------------------
    def segments(self, rt, timesteps: torch.Tensor, req: TinyRequest) -> list[Segment]:
        return [Segment(self.model, 0, len(timesteps), 2 if req.guided else 1)]

    def denoise_call(self, rt, segment: Segment, t: torch.Tensor, rows: CallRows):
        x = rows.latents
        # each member's rows are its branches in order: 0 conditional, 1 the null condition
        cond = torch.tensor([float(b == 0) for _ in rows.members for b in rows.branches], device=x.device)
        return denoiser_call(rt, segment.denoiser, x, t.expand(x.shape[0]).to(x.device), cond)

    def guidance_scale(self, req: TinyRequest, segment: Segment) -> float:   # the "cfg" kind's weight
        return req.guidance
