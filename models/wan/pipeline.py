"""Wan text-to-video: encode the prompt, denoise with CFG, decode the video (diffusers' WanPipeline).

Three phases over one resident copy of the weights (placements/wan.py): `encode` runs UMT5 on
the prompt and the negative prompt; `denoise` runs the DiT once per step on both CFG rows (as
a batch of 2, or one row per rank on a CFG axis) with the token rows spread over the phase's
SP ranks; `decode` runs the VAE, split over a spatial group when the caller gives one. Wan2.2-
A14B's two DiTs are both resident: the step's timestep picks one (`WanT2V.transformer_for`),
an expert switch with nothing moved.

Sequence parallelism is data here, not code in the model: the patch tokens are padded at the
tail to a multiple of the SP size and each rank keeps its chunk (`SequenceLayout`), RoPE rows
alike; the attention meta marks the real rows as ONE bidirectional block, so padding rows see
and are seen by nothing real; after the blocks and the per-row final layer, the rows are
gathered back. 81 frames = 21 latent frames: any SP degree works, the padding absorbs it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from dtgen.attention import AttentionMeta
from dtgen.compile import CompileOptions, StepCompiler
from dtgen.profiling import NullProfiler
from dtgen.samplers import make_sampler

from .model import WanT2V
from .parallel_vae import parallel_decode
from .text_encoder import encode_prompt_embeds
from .transformer import WanTransformer, run_block

TEXT_LENGTH = 512   # WanPipeline's max_sequence_length: every prompt is padded (with zeros) to it
# The profile table's rows for this pipeline's timings (dtgen.profiling.PhaseProfiler).
PROFILE_ROWS = (("encode", "text encode", "ms"), ("denoise", "denoise (all steps)", "ms"),
                ("decode", "VAE decode", "ms"), ("total", "total", "ms"))


@dataclass(frozen=True)
class T2VRequest:
    prompt: str
    negative_prompt: str = ""
    height: int = 480
    width: int = 832
    num_frames: int = 81
    steps: int = 50
    guidance_scale: float = 5.0
    # Wan2.2-A14B: the low-noise expert's guidance (None: the same as guidance_scale).
    guidance_scale_2: float | None = None
    shift: float = 3.0      # 3.0 at 480p, 5.0 at 720p (diffusers' WanPipeline docs)
    sampler: str = "unipc"
    seed: int = 0


@dataclass
class T2VResult:
    video: torch.Tensor | None          # [F, H, W, 3] uint8 on the main rank (None elsewhere)
    latents: torch.Tensor               # [1, z, T, h, w] float32, the denoised latents
    timings_ms: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)


def nearest_valid(n: int, step: int, offset: int = 0) -> tuple[int, int]:
    """The valid values (offset + k * step, k >= 1) just below and just above n."""
    below = max(offset + step, offset + (n - offset) // step * step)
    return below, below + step


def check_request(req: T2VRequest, temporal: int, spatial: int) -> None:
    """One-line refusals for shapes the model cannot take (before any work)."""
    if req.num_frames < 1 or (req.num_frames - 1) % temporal:
        lo, hi = nearest_valid(req.num_frames, temporal, 1)
        raise ValueError(f"num_frames={req.num_frames} does not map to whole latent frames (it must be "
                         f"{temporal}k + 1); nearest valid: {lo} or {hi}")
    for name in ("height", "width"):
        v = getattr(req, name)
        if v < spatial or v % spatial:
            lo, hi = nearest_valid(v, spatial)
            raise ValueError(f"{name}={v} must be a multiple of {spatial} (VAE x patch size); nearest valid: "
                             f"{lo} or {hi}")
    if req.steps < 1:
        raise ValueError(f"steps must be >= 1, got {req.steps}")


def sequence_meta(rt, rows: int, device) -> AttentionMeta:
    """The padded video sequence of this phase: one bidirectional block over the real rows."""
    seq = rt.seq
    return AttentionMeta(slots=seq.pad_slots(torch.arange(rows, device=device), rows), image_blocks=((0, rows),),
                         slot_runs=seq.pad_runs(((0, rows),), rows))


def dit_step(rt, dit: WanTransformer, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The DiT's prediction [B, C, F, H, W] for the rows of this rank's CFG branch, with the
    token rows spread over the phase's SP ranks (identity without SP)."""
    e = dit.embed(x, timestep, text)
    rows = e.tokens.shape[1]
    seq = rt.seq
    per_token = e.temb_proj.shape[1] > 1       # per-token timesteps: their rows travel with the tokens
    temb_proj = seq.shard(e.temb_proj, 1) if per_token else e.temb_proj
    temb = seq.shard(e.temb, 1) if per_token else e.temb
    rope = tuple(seq.shard(t, 0) for t in e.rope)
    tokens = dit.blocks_forward(seq.shard(e.tokens, 1), temb_proj, e.text, rope, sequence_meta(rt, rows, x.device))
    out = seq.gather(dit.final_layer(tokens, temb), 1, rows)
    return dit.unpatchify(out, e.grid)


class WanT2VPipeline:
    def __init__(self, model: WanT2V, tokenizer, controller, device: torch.device, is_main: bool = True,
                 compile_options: CompileOptions | None = None, vae_group=None):
        """`vae_group`: a process group to split the VAE decode over (None: the main rank decodes)."""
        self.model = model
        self.tokenizer = tokenizer
        self.controller = controller
        self.device = torch.device(device)
        self.is_main = is_main
        self.vae_group = vae_group
        self.compile_options = compile_options or CompileOptions()
        self.compiler = StepCompiler(self.compile_options)
        if self.compile_options.regions:
            region = self.compiler.region(run_block)
            for dit in self._dits():
                dit.run_block = region
            self._step = self.compiler.timed(dit_step)
        else:
            self._step = self.compiler.wrap(dit_step)

    def _dits(self) -> list[WanTransformer]:
        return [d for d in (self.model.transformer, self.model.transformer_2) if d is not None]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.transformer.blocks[0].attn1.to_q.weight.dtype

    def latent_shape(self, req: T2VRequest) -> tuple[int, ...]:
        vae = self.model.vae.cfg
        frames = (req.num_frames - 1) // vae.temporal_factor + 1
        return (1, vae.z_dim, frames, req.height // vae.spatial_factor, req.width // vae.spatial_factor)

    def encode(self, req: T2VRequest) -> torch.Tensor:
        """[2, TEXT_LENGTH, text_dim]: the prompt's and the negative prompt's embeddings."""
        ids, mask = self.tokenizer([req.prompt, req.negative_prompt], max_length=TEXT_LENGTH)
        return encode_prompt_embeds(self.model.text_encoder, ids.to(self.device), mask.to(self.device), TEXT_LENGTH,
                                    dtype=self.dtype)

    def predict(self, rt, dit: WanTransformer, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                guidance: float) -> torch.Tensor:
        """The guided prediction for one step, in the DiT's dtype (as WanPipeline combines it)."""
        x = latents.to(self.dtype)
        if rt.cfg_size == 2:   # this rank runs one branch; the other half arrives by all-gather
            rows = text[rt.cfg_rank:rt.cfg_rank + 1]
        elif guidance <= 1.0:  # no guidance: the conditional row alone (as WanPipeline)
            return self._step(rt, dit, x, t.expand(1).to(self.device), text[0:1])
        else:
            rows, x = text, x.expand(2, *x.shape[1:])
        out = rt.gather_cfg(self._step(rt, dit, x, t.expand(x.shape[0]).to(self.device), rows))
        cond, uncond = out[0:1], out[1:2]
        return uncond + guidance * (cond - uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """[F, H, W, 3] uint8 on the main rank (None on the others)."""
        vae = self.model.vae
        if self.vae_group is not None:
            dim = "height" if latents.shape[-2] >= latents.shape[-1] else "width"
            video = parallel_decode(vae, latents, self.vae_group, dim=dim, output=0)
        else:
            video = vae.decode(latents) if self.is_main else None
        if video is None:
            return None
        return ((video[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).cpu()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def generate(self, req: T2VRequest, progress=None, decode: bool = True, latents: torch.Tensor | None = None,
                 record: bool = False, profiler=None) -> T2VResult:
        """`decode=False` stops at the denoised latents (diffusers' output_type="latent");
        `latents`: the initial noise (default: drawn from `req.seed`); `record`: keep every
        step's guided prediction in `result.record["noise"]`; `profiler`: a `PhaseProfiler`."""
        profiler = profiler or NullProfiler()
        vae = self.model.vae.cfg
        check_request(req, vae.temporal_factor, vae.spatial_factor * self.model.transformer.patch_size[1])
        timings, kept = {}, {"noise": []}
        t0 = time.perf_counter()
        with self.controller.phase("encode"), profiler.phase("encode"), profiler.region("encode"):
            text = self.encode(req)
            self._sync()
        timings["encode"] = (time.perf_counter() - t0) * 1e3
        # The initial noise is drawn on the CPU in float32 from the seed, so every rank and
        # every device starts from the same latents.
        if latents is None:
            latents = torch.randn(self.latent_shape(req), generator=torch.Generator().manual_seed(req.seed))
        elif tuple(latents.shape) != self.latent_shape(req):
            raise ValueError(f"latents of shape {tuple(latents.shape)} do not fit the request; expected "
                             f"{self.latent_shape(req)}")
        latents = latents.float().to(self.device)
        sampler = make_sampler(req.sampler, req.steps, req.shift)
        t1 = time.perf_counter()
        step_ms = []
        with self.controller.phase("denoise") as rt, profiler.phase("denoise"), \
                profiler.region("denoise_step", units=req.steps):
            for i, t in enumerate(sampler.timesteps):
                s0 = time.perf_counter()
                dit = self.model.transformer_for(float(t))
                guidance = req.guidance_scale if dit is self.model.transformer or req.guidance_scale_2 is None \
                    else req.guidance_scale_2
                noise = self.predict(rt, dit, latents, t, text, guidance)
                if record:
                    kept["noise"].append(noise)
                latents = sampler.step(noise, latents)
                self._sync()
                step_ms.append((time.perf_counter() - s0) * 1e3)
                if progress is not None:
                    progress("denoise", i + 1, req.steps)
        timings["denoise"] = (time.perf_counter() - t1) * 1e3
        timings["denoise_step"] = step_ms
        t2 = time.perf_counter()
        video = None
        if decode:
            with self.controller.phase("decode"), profiler.phase("decode", together=self.vae_group is not None), \
                    profiler.region("decode"):
                video = self.decode(latents) if (self.is_main or self.vae_group is not None) else None
                self._sync()
        timings["decode"] = (time.perf_counter() - t2) * 1e3
        timings["total"] = (time.perf_counter() - t0) * 1e3
        kept["tokens_per_step"] = math.prod(self.latent_shape(req)[2:]) // math.prod(
            self.model.transformer.patch_size)
        return T2VResult(video, latents, timings, kept)
