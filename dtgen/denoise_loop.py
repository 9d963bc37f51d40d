"""The denoise loop of every model (Wan, Qwen-Image, HunyuanImage-3's denoise phase), written
once: several requests of one batch key as rows of one batch, the single request as the batch
of one.

The loop owns the steps. Each member (`DenoiseMember`) keeps its own latents, its own sampler
(a multistep sampler, Wan's UniPC, keeps a history of this request's predictions: one sampler
per member is what running alone does), its own step caches (one per member, denoiser segment
and call site, dtgen/step_cache.py), its record and its step times. A step runs the model's
calls on every member's rows (member after member, each member's CFG branches in order), takes
each member's rows of the predictions, guides them with the member's own guidance and steps
the member's sampler. After every step `BatchMembers.boundary("denoise", done, total, members)`
(dtgen/batching.py) says who leaves (a cancel, a deadline, its own error at that boundary);
their rows are not in the next step, and the others go on exactly as before.

How the CFG branches run is data (`cfg_calls`): with a CFG axis (`rt.cfg_size == 2`) each rank
runs one branch of every member and `rt.gather_cfg` brings the other half; otherwise both
branches are rows of one call (`cfg_together`, Wan's [cond, uncond] batch of 2) or one call
each (Qwen-Image's serial true CFG); a step without guidance runs the conditional branch alone.

What a model supplies (`BatchDenoiser`), and nothing of the loop:
- `segments(rt, timesteps, request)`: the runs of steps on one denoiser (`Segment`), each with
  the CFG branches its steps run (Wan2.2-A14B: two experts, the low-noise one maybe unguided;
  each expert's step caches count its own steps from 0);
- `denoise_call(rt, segment, t, rows)`: one evaluation of the denoiser on a call's rows
  (`CallRows`), cut at its split points (`DenoiserCall`), its own text layout included (a
  prompt padded to the call's longest, the padding masked per row);
- `guide(member, segment, branches)`: a member's guided prediction from its branches' rows;
- `cfg_together`: both branches as rows of one call, or one call each.
What a model may supply besides (each off when absent, as Wan and Qwen-Image leave it):
- `loras` (`dtgen.lora.ResidentLoras`): the resident adapters; before each call the loop sets
  which of them each row carries (its request's `loras`).
- `members_left(kept)`: members left at a boundary; `kept` are the positions, in the batch
  before, of those that stay. For state the model keeps per row across steps (HunyuanImage-3's
  KV cache of the text, filled by the first step and attended to by every later one).
- `head_per_member`: the call's head takes one member's rows, so a cached step runs it member
  after member (`run_step_shared`): the graph a request alone runs, whatever the batch.
A call's `CallRows.step` is the step's index in the schedule (a model whose first step feeds
more rows than the others, or whose step reads the next sigma, needs it; `t` alone does not say).

A member's `run` is whatever keeps that request's share (`MemberRun`: dtgen/diffusion_run.py's
`DiffusionRun`, HunyuanImage-3's `RequestRun`). How the steps are launched, timed and reported
is the `clock`'s: by default each step is waited for, timed and its boundary reported before
the next (`StepsInTurn`); `StepsAhead` launches step i before it waits for step i-1, so a
step's host work overlaps the device time of the one before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm

from .batching import BatchMembers
from .step_cache import DenoiserCall, StepCache, StepCacheConfig, make_step_cache, run_step_batch, run_step_shared


@dataclass(frozen=True)
class Segment:
    """A run of steps on one denoiser: `denoiser` (what the model's call runs), its first step
    and step count, the CFG branches its steps run (2: [conditional, unconditional]; 1: the
    conditional alone) and its name in a step-cache report (where a request has several)."""

    denoiser: Any
    first: int
    steps: int
    branches: int
    name: str | None = None


@dataclass(frozen=True)
class CfgCalls:
    """How a step's CFG branches run. `calls`: per call, the branches it runs (each member's
    rows of the call, in this order); `gathered`: the branches of the step's predictions, call
    after call (after the all-gather where the branches are `split` over a CFG axis)."""

    calls: tuple[tuple[int, ...], ...]
    gathered: tuple[tuple[int, ...], ...]
    split: bool


def cfg_calls(rt, branches: int, together: bool) -> CfgCalls:
    """The calls of a step of `branches` CFG branches on the phase runtime `rt`."""
    if branches == 1:
        return CfgCalls(((0,),), ((0,),), False)
    if branches != 2:
        raise ValueError(f"CFG runs 1 or 2 branches, not {branches}")
    if rt.cfg_size == 2:   # this rank's branch for every member; the other half by all-gather
        return CfgCalls(((rt.cfg_rank,),), ((0,), (1,)), True)
    if rt.cfg_size != 1:
        raise ValueError(f"a CFG axis of {rt.cfg_size} ranks: CFG has 2 branches")
    calls = ((0, 1),) if together else ((0,), (1,))
    return CfgCalls(calls, calls, False)


class MemberRun(Protocol):
    """What the loop reads and writes of one request's run: its step cache's config, its record
    of a step (`keep_step`: the latents the step started from, the member's branch rows of the
    prediction, the guided prediction), its step times (the loop appends them once, at the
    end) and its step caches' report (`DiffusionRun.report_caches` says the form)."""

    cache_config: StepCacheConfig | None
    step_ms: list[float]

    def keep_step(self, latents: torch.Tensor, branches: torch.Tensor, guided: torch.Tensor) -> None:
        ...

    def report_caches(self, segments: list[tuple[int, list[StepCache | None], str | None, Callable | None]]) -> None:
        ...


@dataclass
class DenoiseMember:
    """One request's share of a denoise batch: its index in the batch, its request, its run
    (`DiffusionRun`: record, step times, step-cache config), its latents (the initial noise,
    then each step's), its sampler, and what the model's calls read of it (`context`: its
    text rows). `caches`: its step caches, per segment, per call of a step."""

    index: int
    request: Any
    run: MemberRun
    latents: torch.Tensor
    sampler: Any
    context: Any = None
    caches: list[list[StepCache | None]] = field(default_factory=list)


@dataclass(frozen=True)
class CallRows:
    """The rows of one denoiser call at step `step` (its index in the schedule): member after
    member, each member's `branches` in order. `latents`: each member's latents once per
    branch, float32."""

    latents: torch.Tensor
    members: list[DenoiseMember]
    branches: tuple[int, ...]
    step: int

    def take(self, per_member: list[torch.Tensor]) -> torch.Tensor:
        """The call's rows of per-member tensors [all branches, ...] (conditional first): each
        member's rows of this call's branches, member after member (a view for one member)."""
        lo, hi = self.branches[0], self.branches[-1] + 1   # a call's branches are consecutive
        parts = [x if (lo, hi) == (0, x.shape[0]) else x[lo:hi] for x in per_member]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class BatchDenoiser(Protocol):
    """What a model gives the loop (see the module docstring)."""

    cfg_together: bool

    def segments(self, rt, timesteps: torch.Tensor, request) -> list[Segment]:
        ...

    def denoise_call(self, rt, segment: Segment, t: torch.Tensor, rows: CallRows) -> DenoiserCall:
        ...

    def guide(self, member: DenoiseMember, segment: Segment, branches: torch.Tensor) -> torch.Tensor:
        ...


def _latent_rows(members: list[DenoiseMember], per: int) -> torch.Tensor:
    """Every member's latents, `per` rows each (an expanded view where one member repeats)."""
    rows = [m.latents if per == 1 else m.latents.expand(per, *m.latents.shape[1:]) for m in members]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _member_rows(out: torch.Tensor, calls: CfgCalls, j: int, n: int, branches: int) -> torch.Tensor:
    """Member j's rows (its branches, in order) of a step's predictions for n members."""
    if n == 1:
        return out   # one member: its branches are the rows, in order
    index = []
    for b in range(branches):
        gi = next(i for i, g in enumerate(calls.gathered) if b in g)
        group = calls.gathered[gi]
        index.append(n * sum(len(g) for g in calls.gathered[:gi]) + j * len(group) + group.index(b))
    return out[index[0]:index[0] + 1] if len(index) == 1 else out[index]


class StepsInTurn:
    """Each step launched, waited for (`time.perf_counter` after a device sync) and its boundary
    reported before the next one starts: what Wan and Qwen-Image run."""

    def __init__(self, device: torch.device):
        self.device = device

    def run(self, steps: int, step: Callable[[int], None], boundary: Callable[[int], bool]) -> list[float]:
        """Runs `step(i)` for i in order; `boundary(done)` is False once no member is left.
        Returns each step's time, ms."""
        step_ms = []
        for i in range(steps):
            start = time.perf_counter()
            step(i)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_ms.append((time.perf_counter() - start) * 1e3)
            if not boundary(i + 1):
                break
        return step_ms


class StepsAhead:
    """The host one step ahead of the device (HunyuanImage-3's): step i is launched, then step i-1
    waited for and its boundary reported, so a step's host work overlaps the device time of the
    one before; a member that leaves there was in step i's rows, which the others do not read.
    The first step (HunyuanImage-3's feeds the whole sequence) is waited for and reported before
    the next launches. `timer` (dtgen/timing.py) marks the steps without waiting (CUDA events);
    each `profiler` region begins and ends on a wait (dtgen/profiling.py); `show`: a progress
    bar (the main rank's)."""

    def __init__(self, timer, profiler, show: bool):
        self.timer, self.profiler, self.show = timer, profiler, show

    def run(self, steps: int, step: Callable[[int], None], boundary: Callable[[int], bool]) -> list[float]:
        timer = self.timer
        bar = tqdm(total=steps, desc="denoise", disable=not self.show, leave=False)

        def report(done: int) -> bool:
            bar.update(done - bar.n)
            return boundary(done)

        marks = [timer.mark()]
        with self.profiler.region("denoise_first_step"):
            step(0)
            marks.append(timer.mark())
            timer.wait(marks[-1])
        going = report(1)
        if steps > 1 and going:
            with self.profiler.region("denoise_step", units=steps - 1):
                for i in range(1, steps):
                    step(i)
                    marks.append(timer.mark())
                    timer.wait(marks[-2])
                    if i > 1 and not report(i):
                        going = False
                        break
                timer.wait(marks[-1])
            if going:
                report(steps)
        bar.close()
        return [timer.ms(a, b) for a, b in zip(marks, marks[1:])]


def denoise(members: list[DenoiseMember], rt, model: BatchDenoiser, batch: BatchMembers,
            device: torch.device, clock: StepsInTurn | StepsAhead | None = None) -> list[DenoiseMember]:
    """The denoise loop of `members` (requests of one batch key) on the phase runtime `rt`.
    Each member's `latents` end denoised; returns the members still in the batch (the others
    left at a step boundary: `batch.left` says why). Every member's sampler must give the
    same timesteps and `model.segments` the same segments (what the batch key guarantees).
    `clock`: how the steps are launched, timed and reported (default `StepsInTurn`)."""
    if not members:
        return []
    first = members[0]
    timesteps = first.sampler.timesteps
    segments = model.segments(rt, timesteps, first.request)
    for m in members[1:]:
        if not torch.equal(m.sampler.timesteps, timesteps):
            raise ValueError("the requests of a denoise batch must share one schedule (steps, sampler, shift)")
        if model.segments(rt, m.sampler.timesteps, m.request) != segments:
            raise ValueError("the requests of a denoise batch must share their denoisers and CFG branches "
                             "(guidance on or off)")
    layouts = [cfg_calls(rt, s.branches, model.cfg_together) for s in segments]
    for m in members:
        # New for every request: nothing carries over to the next (dtgen/step_cache.py).
        m.caches = [[make_step_cache(m.run.cache_config, s.steps) for _ in layout.calls]
                    for s, layout in zip(segments, layouts)]
    steps = len(timesteps)
    segment_of = [k for k, s in enumerate(segments) for _ in range(s.steps)]
    if len(segment_of) != steps:
        raise ValueError(f"the segments cover {len(segment_of)} steps, the schedule has {steps}")
    adapters = getattr(model, "loras", None)
    if adapters is None and any(getattr(m.request, "loras", ()) for m in members):
        raise ValueError("loras: a request names LoRA adapters, but this pipeline has none resident")
    head_per_member = getattr(model, "head_per_member", False)
    members_left = getattr(model, "members_left", None)
    active = list(members)

    def step(i: int) -> None:
        k = segment_of[i]
        segment, layout = segments[k], layouts[k]
        n = len(active)
        outs = []
        for c, branches in enumerate(layout.calls):
            rows = CallRows(_latent_rows(active, len(branches)), active, branches, i)
            if adapters is not None:   # each row carries its request's LoRA adapters (dtgen/lora)
                adapters.set_rows([getattr(m.request, "loras", ()) for m in active for _ in branches])
            call = model.denoise_call(rt, segment, timesteps[i], rows)
            caches, counts = [m.caches[k][c] for m in active], [len(branches)] * n
            outs.append(run_step_shared(caches, i - segment.first, call, counts, [call.head] * n) if head_per_member
                        else run_step_batch(caches, i - segment.first, call, counts))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if layout.split:
            out = rt.gather_cfg(out)
        for j, m in enumerate(active):
            mine = _member_rows(out, layout, j, n, segment.branches)
            noise = model.guide(m, segment, mine)
            m.run.keep_step(m.latents, mine, noise)
            m.latents = m.sampler.step(noise, m.latents)

    def boundary(done: int) -> bool:
        nonlocal active
        gone = set(batch.boundary("denoise", done, steps, [m.index for m in active]))
        if gone:
            kept = [j for j, m in enumerate(active) if m.index not in gone]
            active = [active[j] for j in kept]
            if active and members_left is not None:
                members_left(kept)
        return bool(active)

    step_ms = (clock or StepsInTurn(device)).run(steps, step, boundary)
    if not active:
        return []
    # One report a request: with the branches on separate ranks, every branch's decisions (a
    # collective over the CFG group, which every rank reaches with the same members).
    for m in active:
        m.run.step_ms.extend(step_ms)
        m.run.report_caches([(s.first, m.caches[k], s.name if len(segments) > 1 else None,
                              rt.gather_cfg if layout.split else None)
                             for k, (s, layout) in enumerate(zip(segments, layouts))])
    return active
