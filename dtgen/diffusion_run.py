"""One request through an encode -> denoise -> decode pipeline (Wan, Qwen-Image): what every
such `generate` does alike, written once.

The pipeline makes a `DiffusionRun` for the request and runs its phases through it:
`phase(name)` activates the controller's phase, profiles it and times it into `timings` (ms,
the device waited for, so a phase's time holds its work); `initial_latents` draws the noise
on the CPU from the seed, or checks the caller's; `denoise` runs the sampler's steps on the
model's prediction (each step timed, recorded when asked, reported to `progress`);
`report_caches` merges what the request's step caches did; `decode` runs the VAE where an
image is wanted; `finish` adds the per-step figures and the total. What is the model's own
(its text encoder, its guidance, its latent layout, which call sites a step cache serves)
stays in its pipeline.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch

from .profiling import NullProfiler
from .step_cache import StepCache, concat_reports, merged_report, parse_step_cache


class DiffusionRun:
    def __init__(self, controller, device: torch.device, steps: int, step_cache=None, record: bool = False,
                 progress=None, profiler=None):
        """`step_cache`: the request's (a config, its text or dict form, None); `record`: keep
        every step's prediction in `kept["noise"]`; `progress(phase, done, total)`: called
        after every denoise step; `profiler`: a `PhaseProfiler`."""
        self.controller, self.device, self.steps = controller, torch.device(device), steps
        self.cache_config = parse_step_cache(step_cache)   # a bad setting: one line, before any work
        self.record, self.progress = record, progress
        self.profiler = profiler or NullProfiler()
        self.timings: dict = {}
        self.kept: dict = {"noise": []}
        self.step_ms: list[float] = []
        self._start = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str, region: str | None = None, units: int = 1, together: bool = True):
        """The controller's phase `name` (yields its runtime), profiled as one region (`region`,
        default the phase's name, of `units` steps) and timed into `timings[name]`.
        `together`: every rank runs the phase (False: some skip it, the profiler waits for none)."""
        start = time.perf_counter()
        with self.controller.phase(name) as rt, self.profiler.phase(name, together=together), \
                self.profiler.region(region or name, units=units):
            yield rt
            self._sync()
        self.timings[name] = (time.perf_counter() - start) * 1e3

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

    def denoise(self, sampler, latents: torch.Tensor,
                predict: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The sampler's steps from `latents`: `predict(i, t, latents)` is step i's (guided)
        prediction. Returns the denoised latents."""
        for i, t in enumerate(sampler.timesteps):
            start = time.perf_counter()
            noise = predict(i, t, latents)
            if self.record:
                self.kept["noise"].append(noise)
            latents = sampler.step(noise, latents)
            self._sync()
            self.step_ms.append((time.perf_counter() - start) * 1e3)
            if self.progress is not None:
                self.progress("denoise", i + 1, self.steps)
        return latents

    def report_caches(self, segments: list[tuple[int, list[StepCache], str | None]], gather=None) -> None:
        """`kept["step_cache"]`: which steps ran in full and which were reused, for the whole
        request (nothing without a step cache). `segments`: one per run of steps on one
        denoiser (Wan2.2-A14B's two experts), (its first step, this rank's caches of it, one
        per call site, its name or None); `gather`: the CFG group's all-gather where the
        branches run on separate ranks, so each cache reports every branch (a collective)."""
        if self.cache_config is None:
            return
        parts = []
        for first, caches, name in segments:
            for cache in caches if gather is not None else ():
                cache.gather_rows(gather, self.device)
            report = merged_report(caches)
            if name is not None:
                report["denoiser"] = name
            parts.append((first, report))
        self.kept["step_cache"] = concat_reports(parts, self.steps)

    def decode(self, vae_decode: Callable[[], torch.Tensor | None], is_main: bool, vae_group=None,
               wanted: bool = True) -> torch.Tensor | None:
        """The decode phase: `vae_decode()` on the main rank, or on every rank of `vae_group`
        (a split decode); None on the other ranks, and everywhere when not `wanted`."""
        if not wanted:
            self.timings["decode"] = 0.0
            return None
        with self.phase("decode", together=vae_group is not None):
            return vae_decode() if is_main or vae_group is not None else None

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
