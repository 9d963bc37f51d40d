"""Requests through an encode -> denoise -> decode pipeline (Wan, Qwen-Image) as one batch:
what every such pipeline does alike, written once. `generate` is the batch of one.

A pipeline subclasses `DiffusionPipeline` and supplies what is its own: what the request's
check needs from the checkpoint's configs (`check_args`), the text encoder (`encode`), the latent layout
(`latent_shape`, `noise`), the sampler, the denoiser's segments, calls and guidance
(`BatchDenoiser`, dtgen/denoise_loop.py), the latents the VAE decodes (`vae_latents`) and the
result type (`result_type`); `buckets` (its spec's
`ShapeBuckets`: given by whoever builds the pipeline, else read from the registry by the
pipeline's `spec_name`) says what the requests of one batch share. Its DiTs' calls are
`self.calls` (dtgen/denoiser_calls.py: cut at the split points each DiT declares, compiled
as the pipeline's `CompileOptions` ask). `generate_batch` runs the phases once for the batch:
`encode` (each request's prompts alone: what it would encode alone), `denoise` (the loop,
dtgen/denoise_loop.py: every member's rows in each step), `decode` (the members' latents, small ones
through one VAE call: `decode_members`).
Each phase activates the controller's phase once, is profiled as one region and timed into
every member's `timings` (ms, the device waited for: every member waited for all of it).

`DiffusionRun` is one request's share: its clock, timings, record (`kept`), step times, its
step cache's config and report. A request whose check fails leaves the batch before any work
(one line naming its field); one that leaves at a step boundary gets its exception back; the
others their results.
"""
from __future__ import annotations

import dataclasses
import importlib
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from .batching import BatchHook, BatchMembers, per_member
from .buckets import ShapeBuckets
from .compile import CompileOptions
from .compiled_steps import CompiledSteps
from .denoise_loop import DenoiseMember, Segment, denoise
from .denoiser_calls import DenoiserCalls
from .layers.flow_match import GUIDANCE
from .layers.wan_vae_parallel import decode_uint8
from .profiling import NullProfiler
from .step_cache import StepCache, concat_reports, merged_report, parse_step_cache


# The most output pixels a frame (summed over the requests) one VAE decode runs on at once: one
# 1024x1024 frame, so batching the decode never raises its peak memory above that of a request of
# that size (a larger request still decodes alone).
DECODE_TOGETHER_PIXELS = 1024 * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quiet(phase: str, done: int, total: int) -> None:
    pass


def result_type(name: str, pixels: str, module: str) -> type:
    """A pipeline's result dataclass `name` (of `module`, so that it pickles): `pixels` (its
    field's name, "image" or "video": uint8 on the main rank, None elsewhere), `latents` (the
    denoised latents), `timings_ms` and `record`."""
    cls = dataclasses.make_dataclass(name, [(pixels, "torch.Tensor | None"), ("latents", "torch.Tensor"),
                                            ("timings_ms", dict, dataclasses.field(default_factory=dict)),
                                            ("record", dict, dataclasses.field(default_factory=dict))])
    cls.__module__ = module
    return cls


def denoiser_runs(dits: list) -> list[tuple[Any, int, int]]:
    """(denoiser, first step, steps) for each run of equal denoisers in the step order (a
    pipeline's `segments` where the timestep picks the denoiser: Wan2.2-A14B's experts)."""
    runs = []
    for i, d in enumerate(dits):
        if runs and runs[-1][0] is d:
            runs[-1] = (d, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, i, 1))
    return runs


def registered_buckets(spec_name: str) -> ShapeBuckets:
    """The buckets of the registered model `spec_name` (the registry is the command's module:
    dtgen's core imports no model)."""
    from .cli import MODEL_REGISTRY
    return importlib.import_module(MODEL_REGISTRY).spec(spec_name).buckets


class DiffusionRun:
    def __init__(self, device: torch.device, steps: int, step_cache=None, record: bool = False):
        """`step_cache`: the request's (a config, its text or dict form, None); `record`: keep
        every step's guided prediction in `kept["noise"]`."""
        self.device, self.steps = torch.device(device), steps
        self.cache_config = parse_step_cache(step_cache)   # a bad setting: one line, before any work
        self.record = record
        self.timings: dict = {}
        self.kept: dict = {"noise": []}
        self.step_ms: list[float] = []
        self._start = time.perf_counter()

    def initial_latents(self, latents: torch.Tensor | None, shape: tuple[int, ...], seed: int,
                        draw: Callable[[torch.Generator], torch.Tensor] | None = None) -> torch.Tensor:
        """The initial noise, float32 on the device: `latents` (the caller's, of `shape`), or
        drawn on the CPU in float32 from `seed`, so every rank and every device starts from
        the same latents. `draw(generator)`: the reference pipeline's own draw (default:
        normals of `shape`)."""
        if latents is None:
            generator = torch.Generator().manual_seed(seed)
            latents = draw(generator) if draw is not None else torch.randn(shape, generator=generator)
        elif tuple(latents.shape) != tuple(shape):
            raise ValueError(f"latents of shape {tuple(latents.shape)} do not fit the request; expected {tuple(shape)}")
        return latents.float().to(self.device)

    def keep_step(self, latents: torch.Tensor, branches: torch.Tensor, guided: torch.Tensor) -> None:
        """A step's record (dtgen/denoise_loop.py `MemberRun`): with `record`, its guided prediction."""
        if self.record:
            self.kept["noise"].append(guided)

    def report_caches(self, segments: list[tuple[int, list[StepCache | None], str | None, Callable | None]]) -> None:
        """`kept["step_cache"]`: which steps ran in full and which were reused, for the whole
        request (nothing without a step cache). `segments`: one per run of steps on one
        denoiser (Wan2.2-A14B's two experts), (its first step, this rank's caches of it, one
        per call site, its name or None, `gather`): `gather` is the CFG group's all-gather
        where the branches run on separate ranks, so each cache reports every branch (a
        collective), else None."""
        if self.cache_config is None:
            return
        parts = []
        for first, caches, name, gather in segments:
            for cache in caches if gather is not None else ():
                cache.gather_rows(gather, self.device)
            report = merged_report(caches)
            if name is not None:
                report["denoiser"] = name
            parts.append((first, report))
        self.kept["step_cache"] = concat_reports(parts, self.steps)

    def finish(self) -> dict:
        """The timings, completed: every step's time, with a step cache the mean full step (the
        first left out: it holds the request's first-call work) and the mean cached step, and
        the total."""
        self.timings["denoise_step"] = self.step_ms
        if self.cache_config is not None:
            full = set(self.kept["step_cache"]["full_steps"])
            for name, pick in (("denoise_full_step", lambda i: i in full and i > 0),
                               ("denoise_cached_step", lambda i: i not in full)):
                picked = [ms for i, ms in enumerate(self.step_ms) if pick(i)]
                self.timings[name] = sum(picked) / len(picked) if picked else None
        self.timings["total"] = (time.perf_counter() - self._start) * 1e3
        return self.timings


class DiffusionPipeline:
    """The phases of an encode -> denoise -> decode pipeline for a batch of requests (see the
    module docstring). A subclass sets `spec_name` (or is given its `buckets`), `cfg_together`,
    `makes`, `result_type` and `guidance_kind`, and gives the methods below that raise
    NotImplementedError, and `segments` and `denoise_call` (dtgen/denoise_loop.py
    `BatchDenoiser`; its `guide` is this class's, from `guidance_scale`). One with
    a constructor of its own sets `controller`, `device`, `is_main`, `vae_group` and `buckets`."""

    spec_name: str = ""   # the registered model (`ModelSpec.name`) whose buckets the batches follow
    buckets: ShapeBuckets
    cfg_together: bool = False
    makes: str = "image"   # or "video": what `decode_latents` gives
    result_type: type   # built as result_type(pixels, latents, timings, record)
    # How a step's [cond; uncond] predictions combine (dtgen/layers/flow_match.py GUIDANCE): "cfg", or
    # "renormed-cfg" (QwenImagePipeline's true CFG)
    guidance_kind: str = "cfg"
    # How a model that starts from a reference image takes one (dtgen/reference_images.py): the
    # command's --image and the server's upload open it; None: the model takes none.
    reference = None
    _loras = None

    def __init__(self, model, tokenizer, controller, device: torch.device, is_main: bool = True,
                 compile_options: CompileOptions | None = None, vae_group=None, buckets: ShapeBuckets | None = None):
        """`vae_group`: a process group to split the VAE decode over (None: the main rank
        decodes); `buckets`: what one batch shares (None: the registered spec's)."""
        self.model, self.tokenizer, self.controller = model, tokenizer, controller
        self.device, self.is_main, self.vae_group = torch.device(device), is_main, vae_group
        self.buckets = buckets if buckets is not None else registered_buckets(self.spec_name)
        # The DiT's pieces (dtgen/compiled_steps.py): a step without a step cache runs the whole
        # prediction as one step; one with a cache runs the pieces its call is cut into.
        self.steps = CompiledSteps(compile_options, self.device)
        self.compiler = self.steps.compiler
        self.calls = DenoiserCalls(self.steps, self.denoisers())

    @property
    def loras(self):
        """dtgen.lora.ResidentLoras: the adapters a request's rows may carry (its `loras`), or None."""
        return self._loras

    @loras.setter
    def loras(self, loras) -> None:
        self._loras = loras
        if loras is not None:   # blocks run on some rows only carry those rows' adapters
            self.calls.picked_rows = loras.picked_rows
        else:
            self.calls.__dict__.pop("picked_rows", None)

    # ---- what the model supplies -------------------------------------------------------
    def denoisers(self) -> list:
        """The DiTs the denoise steps run (each declaring its split points, dtgen/denoiser_calls.py):
        the model's `transformer`, and its `transformer_2` where it has a second (diffusers' names)."""
        return [d for d in (self.model.transformer, getattr(self.model, "transformer_2", None)) if d is not None]

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype: the first denoiser's."""
        return self.denoisers()[0].dtype

    @staticmethod
    def check_args(cfgs) -> tuple:
        """What the request's `check` needs from the checkpoint's configs (the model's `cfgs`: its
        VAE's and patch's factors, its schedule's fewest steps): the command checks a request with
        them before loading, the pipeline and the server after."""
        raise NotImplementedError

    def check(self, request) -> None:
        """`RequestError(field, message)` for the first field the model cannot take."""
        request.check(*self.check_args(self.model.cfgs))

    @staticmethod
    def takes_reference(cfgs) -> bool:
        """Whether a checkpoint of these configs starts from a reference image (`reference`)."""
        return False

    @staticmethod
    def folder_tokenizer(folder: Path):
        """The tokenizer of a checkpoint folder, for `check_prompts` before any rank loads (None:
        the model checks no prompt length)."""
        return None

    @staticmethod
    def check_prompts(tokenizer, request) -> None:
        """`RequestError` naming a prompt the text encoder would cut short (the command's check
        before loading, with `folder_tokenizer`'s, and the server's): none by default."""

    def encode(self, request) -> Any:
        """The request's text rows (a member's `context` in the denoise loop)."""
        raise NotImplementedError

    def latent_shape(self, request) -> tuple[int, ...]:
        raise NotImplementedError

    def noise(self, request, generator: torch.Generator) -> torch.Tensor:
        """The initial noise drawn from `generator` (the reference pipeline's draw)."""
        return torch.randn(self.latent_shape(request), generator=generator)

    def sampler(self, request):
        """A fresh sampler for the request (its own multistep history)."""
        raise NotImplementedError

    def vae_latents(self, request, latents: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them, [1, z, T, h, w] (default: as they are)."""
        return latents

    def decode_latents(self, request, latents: torch.Tensor) -> torch.Tensor | None:
        """The denoised latents as uint8 pixels on the main rank (None on the others): the Wan
        VAE's decode (both models' VAE; split over `vae_group` when given), a video's frames
        [F, H, W, 3] or an image's one frame [H, W, 3]."""
        return self._vae_decode([request], [latents])[0]

    def decode_members(self, requests: list, latents: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each request's pixels (`decode_latents`'), the VAE run once on the stacked latents of
        requests whose VAE latents share a shape, at most DECODE_TOGETHER_PIXELS output pixels a
        frame together (a larger one alone): a small frame's decode is mostly per-call work, and
        the cap keeps the decode's peak memory that of one frame of that size. A pipeline whose
        `decode_latents` is its own (a model's, a test's wrapper) decodes each request with it."""
        if "decode_latents" in vars(self) or type(self).decode_latents is not DiffusionPipeline.decode_latents:
            return [self.decode_latents(r, x) for r, x in zip(requests, latents)]
        return self._vae_decode(requests, latents)

    def _vae_decode(self, requests: list, latents: list[torch.Tensor]) -> list[torch.Tensor | None]:
        vae_latents = [self.vae_latents(r, x) for r, x in zip(requests, latents)]
        factor = self.model.vae.cfg.spatial_factor
        groups: list[list[int]] = []
        for k, z in enumerate(vae_latents):
            group = next((g for g in groups if vae_latents[g[0]].shape == z.shape
                          and (len(g) + 1) * z.shape[-2] * z.shape[-1] * factor ** 2 <= DECODE_TOGETHER_PIXELS), None)
            if group is None:
                groups.append([k])
            else:
                group.append(k)
        pixels: list[torch.Tensor | None] = [None] * len(requests)
        for group in groups:
            frames = decode_uint8(self.model.vae, torch.cat([vae_latents[k] for k in group]), self.vae_group,
                                  self.is_main)
            if frames is not None:
                for k, video in zip(group, frames):
                    pixels[k] = video if self.makes == "video" else video[0]
        return pixels

    def guidance_scale(self, request, segment: Segment) -> float:
        """The request's guidance weight on `segment`'s steps."""
        raise NotImplementedError

    def guide(self, member: DenoiseMember, segment: Segment, branches: torch.Tensor) -> torch.Tensor:
        """A member's guided prediction from its rows [cond; uncond] of a step, combined as the
        pipeline's `guidance_kind` says (a segment of one branch: the conditional row as it is)."""
        if segment.branches == 1:
            return branches
        return GUIDANCE[self.guidance_kind](branches[0:1], branches[1:2], self.guidance_scale(member.request, segment))

    def result(self, request, pixels: torch.Tensor | None, latents: torch.Tensor, timings: dict, record: dict):
        return self.result_type(pixels, latents, timings, record)

    # ---- the framework's ---------------------------------------------------------------
    def batch_key(self, request) -> tuple:
        """What requests must share to run as one batch: the spec's bucket (`buckets.key`), the
        step cache compared as its config (the same one however it is written)."""
        return self.buckets.key(dataclasses.replace(request, step_cache=parse_step_cache(request.step_cache)))

    def generate(self, request, progress=None, *, decode: bool = True, latents: torch.Tensor | None = None,
                 record: bool = False, profiler=None):
        """One request: the batch of one (`generate_batch`). A `progress(phase, done, total)`
        that raises at a step ends it with that exception. `decode=False` stops at the
        denoised latents (diffusers' output_type="latent"); `latents`: the initial noise
        (default: drawn from the request's seed); `record`: keep every step's guided
        prediction in `result.record["noise"]`; `profiler`: a `PhaseProfiler`."""
        (result,) = self.generate_batch([request], per_member([progress or _quiet]), decode=decode,
                                        latents=None if latents is None else [latents], record=record,
                                        profiler=profiler)
        if isinstance(result, BaseException):
            raise result
        return result

    @torch.no_grad()
    def generate_batch(self, requests: list, hook: BatchHook, decode: bool = True,
                       latents: list[torch.Tensor | None] | None = None, record: bool = False,
                       profiler=None) -> list:
        """`requests` of one batch key (`buckets.key`) as one batch: per request its result, or
        the exception it left the batch with. `hook(phase, done, total, members)` at every
        denoise step boundary (dtgen/batching.py); `decode=False` stops at the denoised
        latents; `latents`: each request's initial noise (None: drawn from its seed);
        `record`: keep every step's guided prediction; `profiler`: a `PhaseProfiler`."""
        if latents is not None and len(latents) != len(requests):
            raise ValueError(f"latents for {len(latents)} requests, {len(requests)} requests given")
        batch = BatchMembers(len(requests), hook)
        runs: dict[int, DiffusionRun] = {}
        for k, req in enumerate(requests):
            try:
                self.check(req)
                runs[k] = DiffusionRun(self.device, req.steps, req.step_cache, record)
            except Exception as e:   # a bad request fails alone, before any work
                batch.fail(k, e)
        if not batch.active:
            return [batch.left[k] for k in range(len(requests))]
        self._check_one_key([requests[k] for k in batch.active])
        profiler = profiler or NullProfiler()
        with self._phase(profiler, runs, batch, "encode"):
            contexts = {k: self.encode(requests[k]) for k in batch.active}
        members = []
        for k in batch.active:
            req = requests[k]
            start = runs[k].initial_latents(None if latents is None else latents[k], self.latent_shape(req), req.seed,
                                            lambda g, req=req: self.noise(req, g))
            members.append(DenoiseMember(k, req, runs[k], start, self.sampler(req), contexts[k]))
        steps = members[0].request.steps
        with self._phase(profiler, runs, batch, "denoise", "denoise_step", steps) as rt:
            members = denoise(members, rt, self, batch, self.device)
        pixels: dict[int, torch.Tensor | None] = {}
        if not decode:
            for m in members:
                m.run.timings["decode"] = 0.0
        else:
            with self._phase(profiler, runs, batch, "decode", together=self.vae_group is not None):
                if self.is_main or self.vae_group is not None:
                    decoded = self.decode_members([m.request for m in members], [m.latents for m in members])
                    pixels = {m.index: p for m, p in zip(members, decoded)}
        results: list = [batch.left.get(k) for k in range(len(requests))]
        for m in members:
            results[m.index] = self.result(m.request, pixels.get(m.index), m.latents, m.run.finish(), m.run.kept)
        return results

    def _check_one_key(self, requests: list) -> None:
        """One line naming the first field the requests of a batch do not share."""
        keys = [self.batch_key(r) for r in requests]
        for key in keys[1:]:
            if key != keys[0]:
                name = self.buckets.fields()[next(i for i, (a, b) in enumerate(zip(keys[0], key)) if a != b)]
                raise ValueError(f"{name}: the requests of one batch must share it (batch key: "
                                 f"{', '.join(self.buckets.fields())})")

    @contextmanager
    def _phase(self, profiler, runs: dict[int, DiffusionRun], batch: BatchMembers, name: str,
               region: str | None = None, units: int = 1, together: bool = True):
        """The controller's phase `name` (yields its runtime), profiled as one region (`region`,
        default the phase's name, of `units` steps) and timed into the timings of every member
        still in the batch. `together`: every rank runs the phase (False: some skip it, the
        profiler waits for none)."""
        start = time.perf_counter()
        with self.controller.phase(name) as rt, profiler.phase(name, together=together), \
                profiler.region(region or name, units=units):
            yield rt
            _sync(self.device)
        ms = (time.perf_counter() - start) * 1e3
        for k in batch.active:
            runs[k].timings[name] = ms
