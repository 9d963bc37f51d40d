"""Wan text-to-video: encode the prompt, denoise with CFG, decode the video (diffusers' WanPipeline).

Three phases over one resident copy of the weights (placements/wan.py): `encode` runs UMT5 on
the prompt and the negative prompt; `denoise` runs the DiT once per step on both CFG rows (as
a batch of 2, or one row per rank on a CFG axis) with the token rows spread over the phase's
SP ranks; `decode` runs the VAE, split over a spatial group when the caller gives one. Wan2.2-
A14B's two DiTs are both resident: the step's timestep picks one (`WanT2V.transformer_for`),
an expert switch with nothing moved.

Requests of one bucket (`SPEC.buckets`: size, schedule, step cache, CFG on or off) run their
denoise steps as rows of one batch, the loop the framework's (dtgen/denoise_loop.py): each
member's [cond, uncond] rows in the call, its own seed, prompts, guidance, UniPC history and
step caches; `generate` is the batch of one (`generate_batch`, dtgen/diffusion_run.py).

Sequence parallelism is data, declared by the DiT (`WanTransformer.seq_splits`) and applied by
the framework (dtgen/seq_split.py): the patch tokens are padded at the tail to a multiple of
the SP size and each rank keeps its chunk, RoPE rows alike; the attention meta marks the real
rows as ONE bidirectional block, so padding rows see and are seen by nothing real; after the
blocks and the per-row final layer, the rows are gathered back. 81 frames = 21 latent frames:
any SP degree works, the padding absorbs it.

Step caches (`T2VRequest.step_cache`, dtgen/step_cache.py): each DiT evaluation is cut into
embed (this rank's patch tokens), blocks lo..hi-1 and head (final layer, SP gather,
unpatchify), so first-block, TaylorSeer, MagCache and the official Taylor cache run on every
plan; what they keep is the last block's output rows. One cache per request, call site (the
CFG batch of 2 is one, with two rows; on a CFG axis each rank's branch is one) and expert,
made for the request and dropped with it. A request without one runs `dit_step` whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dtgen.compile import CompileOptions
from dtgen.compiled_steps import CompiledSteps
from dtgen.denoise_loop import CallRows, DenoiseMember, Segment
from dtgen.diffusion_run import DiffusionPipeline
from dtgen.layers.flow_match import SAMPLERS, classifier_free_guidance, make_sampler
from dtgen.layers.wan_vae_parallel import decode_uint8
from dtgen.requests import MAX_SEED, MAX_SIDE, MAX_STEPS, check_multiple, nearest_valid
from dtgen.schema import check_bounds, request_field, size_field
from dtgen.requests import RequestError
from dtgen.seq_split import LocalInputs, embed_split, final_gathered, split_input
from dtgen.step_cache import DenoiserCall, RowLayout, StepCacheConfig

from .model import WanT2V
from .spec import SPEC
from .transformer import WanTransformer, run_block

MAX_FRAMES = 1001
TEXT_LENGTH = 512   # WanPipeline's max_sequence_length: every prompt is padded (with zeros) to it
# The profile table's rows for this pipeline's timings (dtgen.profiling.PhaseProfiler).
PROFILE_ROWS = (("encode", "text encode", "ms"), ("denoise", "denoise (all steps)", "ms"),
                ("decode", "VAE decode", "ms"), ("total", "total", "ms"))


def encode_prompt_embeds(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         max_len: int = 512, dtype: torch.dtype | None = None) -> torch.Tensor:
    """diffusers `WanPipeline._get_t5_prompt_embeds` after tokenization: [B, max_len, d_model].

    The encoder runs on the padded ids WITH the mask; then each row keeps its first
    seq_len = mask.sum() positions and the rest is set to exactly zero (the pipeline trims to
    seq_len and re-pads with zeros to max_sequence_length). Rows shorter than max_len (input
    not padded to it) are zero-padded; no data-dependent shapes, so it compiles.
    `dtype`: cast the result (the pipeline casts to the text encoder's dtype before trimming).
    """
    B, L = input_ids.shape
    if L > max_len:
        raise ValueError(f"input_ids has {L} positions, more than max_len={max_len}")
    h = encoder(input_ids, attention_mask)
    if dtype is not None:
        h = h.to(dtype)
    seq_lens = (attention_mask > 0).sum(dim=1)
    keep = torch.arange(L, device=h.device)[None, :] < seq_lens[:, None]
    # where(), not a multiply: garbage (even inf/nan) in padded rows must become exact zeros.
    h = torch.where(keep[..., None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    if L < max_len:
        h = F.pad(h, (0, 0, 0, max_len - L))
    return h


@dataclass(frozen=True)
class T2VRequest:
    """What one video takes, each field declared once (dtgen/schema.py): the CLI's flags, the
    server's JSON fields and the docs' table come from these declarations."""
    prompt: str = request_field(help="what the video shows")
    negative_prompt: str = request_field("", help="what CFG steers away from")
    height: int = request_field(480, low=1, high=MAX_SIDE, unit="px", json=None, flag_default=None,
                                help="pixels (default: 480, or 48 on the tiny default)")
    width: int = request_field(832, low=1, high=MAX_SIDE, unit="px", json=None, flag_default=None,
                               help="pixels (default: 832, or 64 on the tiny default)")
    # the server's one field for width and height (the image servers' and the UI's convention)
    size = size_field(example="832x480", flag=None, help="WIDTHxHEIGHT, multiples of the model's 16 px")
    num_frames: int = request_field(81, low=1, high=MAX_FRAMES, flag_default=None,
                                    help="4k + 1 frames (default: 81, or 9 on the tiny default)")
    steps: int = request_field(50, low=1, high=MAX_STEPS, json="num_inference_steps", flag_default=None,
                               help="denoising steps (default: 50, or 4 on the tiny default)")
    guidance_scale: float = request_field(5.0, low=0.0, high=100.0, flag="--guidance", help="the CFG weight")
    # Wan2.2-A14B: the low-noise expert's guidance (None: the same as guidance_scale).
    guidance_scale_2: float | None = request_field(None, kind="number", low=0.0, high=100.0, flag="--guidance-2",
                                                   help="Wan2.2-A14B: the low-noise expert's guidance")
    # 3.0 at 480p, 5.0 at 720p (diffusers' WanPipeline docs)
    shift: float = request_field(3.0, low=0.0, high=100.0, flag="--flow-shift", json="flow_shift", flag_default=None,
                                 help="the sampler's shift (default: the checkpoint's scheduler config, else 3.0)")
    sampler: str = request_field("unipc", choices=sorted(SAMPLERS), help="the flow-matching sampler")
    seed: int = request_field(0, low=0, high=MAX_SEED, help="the initial noise's seed")
    # Fewer full DiT evaluations (dtgen/step_cache.py): a config, or its text ("first-block:
    # threshold=0.05") or dict form; None runs every step in full.
    step_cache: StepCacheConfig | str | dict | None = request_field(
        None, kind="step_cache",
        help="fewer full DiT evaluations (dtgen/step_cache.py): first-block[:threshold=0.05], "
             "taylorseer[:interval=5,disable_before=3,order=1,...], magcache:mag_ratios=R0/R1/... "
             "(or magcache:calibrate=true to measure them), taylor[:interval=5,order=2,...]; "
             "default: every step in full")

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
        """What a batch shares beyond its schedule (`SPEC.buckets.batch`): (the high-noise
        expert's steps run CFG, the low-noise expert's do); Wan 2.1's one DiT: the first."""
        low = self.guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        return self.guidance_scale > 1.0, low > 1.0


@dataclass
class T2VResult:
    video: torch.Tensor | None          # [F, H, W, 3] uint8 on the main rank (None elsewhere)
    latents: torch.Tensor               # [1, z, T, h, w] float32, the denoised latents
    timings_ms: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)


def step_time(rt, dit: WanTransformer, timestep: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """temb alone (what the head needs), for a cached step that runs no block."""
    return split_input(rt.seq, dit.seq_splits, "temb", dit.time_embedding(timestep, batch, dtype)[0])


def step_blocks(rt, dit: WanTransformer, local: LocalInputs, tokens: torch.Tensor, start: int = 0,
                stop: int | None = None) -> torch.Tensor:
    """Blocks start..stop-1 on this rank's token rows."""
    e = local.inputs
    return dit.blocks_forward(tokens, e.temb_proj, e.text, e.rope, local.meta, start, stop)


def step_head(rt, dit: WanTransformer, tokens: torch.Tensor, temb: torch.Tensor,
              grid: tuple[int, int, int]) -> torch.Tensor:
    """The final layer on this rank's rows, every rank's rows gathered, unpatchified: [B, C, F, H, W]."""
    return dit.unpatchify(final_gathered(rt, dit, tokens, temb, math.prod(grid)), grid)


def dit_step(rt, dit: WanTransformer, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The DiT's prediction [B, C, F, H, W] for the rows of this rank's CFG branch, with the
    token rows spread over the phase's SP ranks (identity without SP)."""
    local = embed_split(rt, dit, x, timestep, text)
    tokens = step_blocks(rt, dit, local, local.inputs.tokens)
    return step_head(rt, dit, tokens, local.inputs.temb, local.inputs.grid)


def expert_segments(dits: list) -> list[tuple[object, int, int]]:
    """(denoiser, first step, steps) for each run of equal denoisers in the step order."""
    segments = []
    for i, d in enumerate(dits):
        if segments and segments[-1][0] is d:
            segments[-1] = (d, segments[-1][1], segments[-1][2] + 1)
        else:
            segments.append((d, i, 1))
    return segments


class WanT2VPipeline(DiffusionPipeline):
    """Wan's pieces of the phases (dtgen/diffusion_run.py) and of the denoise loop
    (dtgen/denoise_loop.py): requests of one bucket (`SPEC.buckets`) run as rows of one batch,
    each member's [cond, uncond] rows together in one call."""

    buckets = SPEC.buckets
    cfg_together = True
    result_type = T2VResult

    def __init__(self, model: WanT2V, tokenizer, controller, device: torch.device, is_main: bool = True,
                 compile_options: CompileOptions | None = None, vae_group=None):
        """`vae_group`: a process group to split the VAE decode over (None: the main rank decodes)."""
        self.model = model
        self.tokenizer = tokenizer
        self.controller = controller
        self.device = torch.device(device)
        self.is_main = is_main
        self.vae_group = vae_group
        # The step's pieces for a step cache: each compiled as one graph (--compile), or eager
        # around the compiled block region (--compile-regions); a request without a cache
        # runs `dit_step` whole (dtgen/compiled_steps.py).
        self.steps = CompiledSteps(compile_options, self.device)
        self.compiler = self.steps.compiler
        if self.steps.regions:
            region = self.steps.region(run_block)
            for dit in self._dits():
                dit.run_block = region
        pieces = (dit_step, embed_split, step_time, step_blocks, step_head)
        self._step, self._inputs, self._time, self._blocks, self._head = map(self.steps.step, pieces)

    def _dits(self) -> list[WanTransformer]:
        return [d for d in (self.model.transformer, self.model.transformer_2) if d is not None]

    @property
    def dtype(self) -> torch.dtype:
        # (a norm's weight: the linears' may be e4m3, --dense-dtype fp8)
        return self.model.transformer.blocks[0].attn1.norm_q.weight.dtype

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
                for dit, first, n in expert_segments([self.model.transformer_for(float(t)) for t in timesteps])]

    def denoise_call(self, rt, segment: Segment, t: torch.Tensor, rows: CallRows) -> DenoiserCall:
        """One DiT evaluation on a call's rows: each member's latents and text rows, its CFG
        branches as rows of the batch (Wan's text is always TEXT_LENGTH rows: nothing to pad)."""
        x = rows.latents.to(self.dtype)
        text = rows.take([m.context for m in rows.members])
        return self.denoiser_call(rt, segment.denoiser, x, t.expand(x.shape[0]).to(self.device), text)

    def guide(self, member: DenoiseMember, segment: Segment, branches: torch.Tensor) -> torch.Tensor:
        """The guided prediction in the DiT's dtype (as WanPipeline combines it)."""
        if segment.branches == 1:
            return branches
        return classifier_free_guidance(branches[0:1], branches[1:2], self.guidance(member.request, segment.denoiser))

    def denoiser_call(self, rt, dit: WanTransformer, x: torch.Tensor, t: torch.Tensor,
                      text: torch.Tensor) -> DenoiserCall:
        """One DiT evaluation cut where a step cache may reuse it (dtgen/step_cache.py): embed =
        this rank's patch tokens entering block 0, blocks = blocks lo..hi-1 with this step's
        modulation, text, RoPE and meta, head = final layer + SP gather + unpatchify. What the
        caches keep is the last block's output rows (this rank's chunk: `DenoiserCall.rows`)."""
        grid = dit.patch_grid(x)
        made: dict[str, LocalInputs] = {}

        def embed() -> torch.Tensor:
            made["inputs"] = self._inputs(rt, dit, x, t, text)
            return made["inputs"].inputs.tokens

        def blocks(h: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return self._blocks(rt, dit, made["inputs"], h, lo, hi)

        def row_blocks(h: torch.Tensor, lo: int, hi: int, picked: list[int]) -> torch.Tensor:
            # Some CFG rows only (first-block, rows that disagree): their modulation and text.
            local = made["inputs"]
            index = torch.tensor(picked, device=h.device)
            some = local.inputs._replace(temb_proj=local.inputs.temb_proj.index_select(0, index),
                                         text=local.inputs.text.index_select(0, index))
            return self._blocks(rt, dit, local._replace(inputs=some), h, lo, hi)

        def head(h: torch.Tensor) -> torch.Tensor:
            # A Taylor-cached step runs no block: it needs the time embedding alone.
            temb = made["inputs"].inputs.temb if "inputs" in made else self._time(rt, dit, t, x.shape[0], text.dtype)
            return self._head(rt, dit, h, temb, grid)

        return DenoiserCall(head=head, embed=embed, blocks=blocks, num_blocks=len(dit.blocks),
                            rows=RowLayout(rt.seq, 1, math.prod(grid)), row_blocks=row_blocks,
                            predict=lambda: self._step(rt, dit, x, t, text))

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """[F, H, W, 3] uint8 on the main rank (None on the others)."""
        video = decode_uint8(self.model.vae, latents, self.vae_group, self.is_main)
        return None if video is None else video[0]

    # ---- the rest of what the phases need (dtgen/diffusion_run.py) ------------------------
    def check(self, req: T2VRequest) -> None:
        vae = self.model.vae.cfg
        req.check(vae.temporal_factor, vae.spatial_factor * self.model.transformer.patch_size[1])

    def sampler(self, req: T2VRequest):
        return make_sampler(req.sampler, req.steps, req.shift)

    def decode_latents(self, req: T2VRequest, latents: torch.Tensor) -> torch.Tensor | None:
        return self.decode(latents)

    def result(self, req: T2VRequest, video, latents: torch.Tensor, timings: dict, record: dict) -> T2VResult:
        tokens = math.prod(self.latent_shape(req)[2:]) // math.prod(self.model.transformer.patch_size)
        record["tokens_per_step"] = tokens
        return super().result(req, video, latents, timings, record)
