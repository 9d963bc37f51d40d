"""Wan text-to-video and image-to-video: encode the prompt (and the reference image), denoise with
CFG, decode the video (diffusers' WanPipeline and WanImageToVideoPipeline).

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

Image to video (an I2V checkpoint, `WanConfigs.image_to_video`) starts from a reference image
(`T2VRequest.image`); its `encode` also makes, as WanImageToVideoPipeline does, the condition:
the image resized to the video (Lanczos), then the video of that first frame and zero frames
VAE-encoded (`WanVAE.encode`, normalized), behind the frame mask (4 channels per latent frame:
1 where a video frame is the reference, the first latent frame's 4 from the one first frame);
[mask, latents] is concatenated to the noise on the channel axis at every step (16 + 4 + 16 =
the DiT's 36 input channels). Wan2.1-I2V also attends to the image's CLIP features (the folder's
image processor's resize and crop, the tower's penultimate hidden state) in every cross-attention,
the same rows for both CFG branches. The image does not change the schedule or the shapes, so
image-to-video requests batch as text-to-video ones do; each member keeps its own condition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dtgen.denoise_loop import CallRows, Segment
from dtgen.diffusion_run import DiffusionPipeline, denoiser_runs, result_type
from dtgen.layers.flow_match import SAMPLERS, make_sampler
from dtgen.layers.t5 import check_prompt_tokens, encode_prompt_embeds, load_tokenizer
from dtgen.layers.wan_vae_parallel import parallel_encode
from dtgen.reference_images import ReferenceImage, ReferenceInput, vae_pixels
from dtgen.requests import RequestError, check_frame_count, check_multiple
from dtgen.schema import (check_bounds, loras_field, negative_prompt_field, prompt_field, reference_image_field,
                          request_field, seed_field, side_field, size_field, step_cache_field, steps_field)
from dtgen.step_cache import DenoiserCall, StepCacheConfig

from .transformer import WanTransformer

MAX_FRAMES = 1001
TEXT_LENGTH = 512   # WanPipeline's max_sequence_length: every prompt is padded (with zeros) to it
# The side every Wan video's height and width are a multiple of: the Wan 2.1 VAE's 8 x the 2 x 2 patches.
SIZE_MULTIPLE = 16
# A reference image's sides: below one 16-px token there is nothing to start from; the upper
# bound keeps the decode under Pillow's decompression-bomb size (the video is resized anyway).
# The command's --image and the server's `input_reference` open it through this declaration.
REFERENCE = ReferenceInput(min_side=16, max_side=8192, multiple=SIZE_MULTIPLE)


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
    # Image to video: the first frame (a path is opened and checked here, once per process).
    image: ReferenceImage | None = reference_image_field(
        "image to video (an I2V checkpoint): the image file the video starts from (the server: a multipart file); "
        "its aspect ratio sizes the video unless a size is given")

    def __post_init__(self):
        if isinstance(self.image, (str, Path)):
            object.__setattr__(self, "image", REFERENCE.open_file(self.image))

    def check(self, temporal: int, spatial: int, two_experts: bool | None = None,
              image_to_video: bool | None = None) -> None:
        """`RequestError(field, message)` for the first field the model cannot take, before
        any work: the CLI's and the server's one check. `temporal`, `spatial`: frames per
        latent frame, pixels per token side (VAE x patch); `two_experts`: whether the
        checkpoint has Wan2.2-A14B's second DiT; `image_to_video`: whether it starts from a
        reference image (None: either not known here)."""
        if self.image is not None and not isinstance(self.image, ReferenceImage):
            raise RequestError("image", f"must be an image file, got {type(self.image).__name__}")
        check_bounds(self, skip=("image",))
        if image_to_video is False and self.image is not None:
            raise RequestError("image", "this checkpoint makes video from text (WanPipeline); image to video needs "
                                        "an image-to-video checkpoint (WanImageToVideoPipeline)")
        if image_to_video and self.image is None:
            raise RequestError("image", "is required: this checkpoint makes video from an image "
                                        "(WanImageToVideoPipeline); give the first frame")
        check_frame_count("num_frames", self.num_frames, temporal)
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


class I2VContext(NamedTuple):
    """What an image-to-video request's denoise calls read (a member's `context`)."""
    text: torch.Tensor              # [2, TEXT_LENGTH, text_dim]: the prompt's and the negative prompt's
    image: torch.Tensor | None      # [1, N, image_dim] CLIP features (Wan2.1-I2V), else None
    condition: torch.Tensor         # [1, 4 + z, T, h, w] float32: the frame mask, then the reference's latents


def frame_mask(num_frames: int, temporal: int, latent_hw: tuple[int, int]) -> torch.Tensor:
    """WanImageToVideoPipeline's mask [1, temporal, T, h, w]: 1 on the reference frame, 0 on the
    others; the first video frame stands for the first latent frame's `temporal` frames."""
    mask = torch.zeros(1, 1, num_frames, *latent_hw)
    mask[:, :, 0] = 1
    mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(1, -1, temporal, *latent_hw).transpose(1, 2)


class WanT2VPipeline(DiffusionPipeline):
    """Wan's pieces of the phases (dtgen/diffusion_run.py) and of the denoise loop
    (dtgen/denoise_loop.py): requests of one bucket run as rows of one batch, each member's
    [cond, uncond] rows together in one call."""

    spec_name = "wan"
    cfg_together = True
    makes = "video"
    result_type = T2VResult
    reference = REFERENCE

    def latent_shape(self, req: T2VRequest) -> tuple[int, ...]:
        vae = self.model.vae.cfg
        frames = (req.num_frames - 1) // vae.temporal_factor + 1
        return (1, vae.z_dim, frames, req.height // vae.spatial_factor, req.width // vae.spatial_factor)

    def encode(self, req: T2VRequest) -> torch.Tensor | I2VContext:
        """[2, TEXT_LENGTH, text_dim]: the prompt's and the negative prompt's embeddings; image to
        video: those with the reference's CLIP features and condition (`I2VContext`)."""
        ids, mask = self.tokenizer([req.prompt, req.negative_prompt], max_length=TEXT_LENGTH)
        text = encode_prompt_embeds(self.model.text_encoder, ids.to(self.device), mask.to(self.device), TEXT_LENGTH,
                                    dtype=self.dtype)
        if not self.model.cfgs.image_to_video:
            return text
        return I2VContext(text, self.image_features(req), self.condition(req))

    def image_features(self, req: T2VRequest) -> torch.Tensor | None:
        """Wan2.1-I2V: the reference's CLIP features [1, N, image_dim] (WanImageToVideoPipeline's
        `encode_image`: the image processor's pixels, the penultimate hidden state); None without
        an image encoder (Wan2.2-I2V-A14B)."""
        if self.model.image_encoder is None:
            return None
        pixels = self.model.cfgs.image_processor(req.image.pil()).to(self.device)
        return self.model.image_encoder(pixels)

    def condition(self, req: T2VRequest) -> torch.Tensor:
        """[1, 4 + z, T, h, w] float32: the frame mask, then the normalized latents of the video
        whose first frame is the reference (resized to the request's size) and the rest zeros
        (encoded split over `vae_group` when the pipeline has one, as its decode)."""
        vae = self.model.vae
        first = vae_pixels(req.image.pil(), req.height, req.width).to(self.device).unsqueeze(2)
        video = torch.cat([first, first.new_zeros(1, 3, req.num_frames - 1, req.height, req.width)], dim=2)
        # split by rows over the VAE's group where there is one, as the decode (every rank takes part)
        latents = (vae.encode(video) if self.vae_group is None else parallel_encode(vae, video, self.vae_group)).float()
        mask = frame_mask(req.num_frames, vae.cfg.temporal_factor, tuple(latents.shape[3:])).to(latents.device)
        return torch.cat([mask, latents], dim=1)

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
        branches as rows of the batch (Wan's text is always TEXT_LENGTH rows: nothing to pad).
        Image to video: each member's condition beside its latents on the channel axis, and its
        image features (the same rows for every branch) where the DiT attends to them."""
        contexts = [m.context for m in rows.members]
        timestep = t.expand(rows.latents.shape[0]).to(self.device)
        if not isinstance(contexts[0], I2VContext):
            x = rows.latents.to(self.dtype)
            return self.calls(rt, segment.denoiser, x, timestep, rows.take(contexts))
        per = len(rows.branches)
        condition = torch.cat([c.condition.expand(per, *c.condition.shape[1:]) for c in contexts])
        x = torch.cat([rows.latents, condition], dim=1).to(self.dtype)   # as the reference casts it
        args = (x, timestep, rows.take([c.text for c in contexts]))
        if segment.denoiser.cfg.image_tokens:
            args += (torch.cat([c.image.expand(per, *c.image.shape[1:]) for c in contexts]).to(self.dtype),)
        return self.calls(rt, segment.denoiser, *args)

    def guidance_scale(self, req: T2VRequest, segment: Segment) -> float:
        return self.guidance(req, segment.denoiser)

    # ---- the rest of what the phases need (dtgen/diffusion_run.py) ------------------------
    @staticmethod
    def check_args(cfgs) -> tuple[int, int, bool, bool]:
        """`T2VRequest.check`'s: frames per latent frame, pixels per token side, whether the
        checkpoint has Wan2.2-A14B's second expert, whether it makes video from an image."""
        return (cfgs.vae.temporal_factor, cfgs.vae.spatial_factor * cfgs.transformer.patch_size[1],
                cfgs.transformer_2 is not None, cfgs.image_to_video)

    @staticmethod
    def takes_reference(cfgs) -> bool:
        return cfgs.image_to_video

    @staticmethod
    def folder_tokenizer(folder: Path):
        return load_tokenizer(Path(folder) / "tokenizer")

    @staticmethod
    def check_prompts(tokenizer, request: T2VRequest) -> None:
        """The prompt and the negative prompt within UMT5's TEXT_LENGTH tokens."""
        check_prompt_tokens(tokenizer, request, TEXT_LENGTH, "Wan")

    def sampler(self, req: T2VRequest):
        return make_sampler(req.sampler, req.steps, req.shift)

    def result(self, req: T2VRequest, video, latents: torch.Tensor, timings: dict, record: dict) -> T2VResult:
        tokens = math.prod(self.latent_shape(req)[2:]) // math.prod(self.model.transformer.patch_size)
        record["tokens_per_step"] = tokens
        return super().result(req, video, latents, timings, record)
