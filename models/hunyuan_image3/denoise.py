"""HunyuanImage-3's denoise phase: CFG flow-matching steps over the diffusion sequence, requests batched as rows.

`DenoisePhase` is the denoise part of `HunyuanT2IPipeline` (pipeline.py). Its full step and a
step cache's head are compiled here, once per phase object, through the pipeline's
`CompiledSteps`. Requests of one denoise shape (`denoise_key`) run as rows of one batch
through the shared denoise loop (dtgen/denoise_loop.py), whose calls `DenoiseRows` gives;
`run_denoise` is the batch of one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from dtgen import denoise_loop
from dtgen.attention import KVCache
from dtgen.batching import BatchMembers, per_member
from dtgen.compiled_steps import CompiledSteps
from dtgen.layers.flow_match import classifier_free_guidance, euler_step, flow_match_sigmas
from dtgen.step_cache import DenoiserCall

from .diffusion_sequence import DiffusionSequence
from .instruct import ConditionTokens, splice_rows
from .requests import RequestRun, T2IRequest
from .stack import DecoderStack


@dataclass
class DenoiseMember:
    """One request's share of a denoise batch (`run_denoise_batch`)."""

    req: T2IRequest
    seq: DiffusionSequence
    run: RequestRun
    condition: ConditionTokens | None = None
    noise: torch.Tensor | None = None   # initial latents [1, C, h, w]; None: drawn from the seed


def denoise_key(req: T2IRequest, seq: DiffusionSequence) -> tuple:
    """What requests must share for their denoise steps to run as rows of one batch: every
    shape and slot of the sequence (its length, the image's place and size, the bucket's hole
    end, an edit's condition layout), the step count, the schedule, the CFG mode and the step
    cache (whose schedule every request of a batch then shares). Not the text itself, the
    seed, the guidance or the positions: those are per row."""
    return (seq.length, seq.image_start, seq.timestep_slot, seq.height, seq.width,
            None if seq.hole is None else seq.hole.end, seq.condition,
            req.steps, req.flow_shift, req.cfg_mode, req.step_cache)


def batched_sequence(seqs: list[DiffusionSequence], device) -> DiffusionSequence:
    """The sequence of a call's rows (one per row, all of one `denoise_key`), on `device`:
    the first row's, with RoPE positions [B, S, 2] and a per-row hole start [B] where the
    rows' text lengths differ; one [S, 2] and a 0-d start where they agree (the batch of
    one: a single request's graphs)."""
    first = seqs[0]
    same = all(s is first or (s.pad == first.pad and torch.equal(s.rope_pos, first.rope_pos)) for s in seqs[1:])
    rope = first.rope_pos if same else torch.stack([s.rope_pos for s in seqs])
    hole = first.hole
    if hole is not None:
        start = hole.start if same else torch.stack([s.hole.start for s in seqs])
        hole = hole._replace(start=start.to(device))
    return replace(first, rope_pos=rope.to(device), hole=hole)


def batched_condition(conds: list[ConditionTokens | None]) -> ConditionTokens | None:
    """The condition rows of a call's rows (one per row; None: a T2I batch)."""
    first = conds[0]
    if first is None or all(c is first for c in conds[1:]):
        return first
    return replace(first, timestep=torch.cat([c.timestep for c in conds]), vae=torch.cat([c.vae for c in conds]),
                   vit=torch.cat([c.vit for c in conds]), latent=None)


class DenoisePhase:
    """Takes the decoder stack (stack.py: the model, its KV caches, `forward_rows`), the phase
    controller (it activates the "denoise" phase; its runtime says the CFG split), the
    pipeline's compiled steps (the full step is compiled once here, `step_fn`, and a cached
    step's head, `head_fn`) and `is_main` (the rank that shows progress).

    In: the prepared members of one denoise shape (`DenoiseMember`: a request, its diffusion
    sequence, its run, an edit's condition rows, optional initial noise) and the batch they
    are in. Out: each member's final latents [1, C, h, w] (None for one that left the
    batch); each run gets its timings and record (velocity, step_inputs, latents, ...)."""

    def __init__(self, stack: DecoderStack, controller, steps: CompiledSteps, is_main: bool = True):
        self.loras = None   # the pipeline's resident LoRA adapters (dtgen.lora.ResidentLoras), if any
        self.stack = stack
        self.model, self.cfg, self.device = stack.model, stack.cfg, stack.device
        self.controller = controller
        self.is_main = is_main
        self.step_fn = steps.step(self.denoise_step)
        # A cached step's head (final_layer alone) is a graph of its own in both modes.
        self.head_fn = steps.whole(self.head_velocity)

    def denoise_cache(self, rt, batch: int, seq: DiffusionSequence, reuse: str | None = None) -> KVCache:
        return self.stack.cache(rt, batch, seq.length, reuse)

    def denoise_step(self, rt, seq: DiffusionSequence, ids: torch.Tensor | None, latents: torch.Tensor,
                     t: torch.Tensor, cache: KVCache, first_step: bool, condition: ConditionTokens | None = None,
                     guidance: torch.Tensor | None = None,
                     t_end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One model evaluation of the denoiser for latents at timesteps t [B]: (hidden, velocity).

        hidden [B, seq.step_rows + h*w, H]: the decoder stack's output (no ln_f) at the rows
        every KV-cached step feeds (<timestep>, on a distilled checkpoint <guidance> and
        <timestep_r>, then the image), what a step cache keeps (dtgen/step_cache.py);
        velocity [B, C, h, w] float32 = `head_velocity(hidden)`.

        The first step feeds the whole sequence (ids [B, S]; a reference image's `condition`
        rows spliced in at `seq.condition`) and fills the cache with the text and condition
        K/V; later steps feed only the step rows + image rows at their own slots and reuse it
        (exact: no row before them attends to them). `guidance` / `t_end` [B]: a distilled
        checkpoint's embedded guidance value and meanflow end time.
        """
        m = self.model
        S, (img0, img1) = seq.length, seq.image_slots
        first = seq.timestep_slot
        img = m.image_tokens(latents, t)
        step = m.step_tokens(t, guidance, t_end)
        rope = seq.rope_pos.to(self.device)   # [S, 2], or [B, S, 2]: each row its own (a batch of requests)
        if first_step:
            pieces = condition.splices(seq.condition) if condition is not None else []
            embeds = splice_rows(m.embed_tokens(ids), pieces + [(first, step), (img0, img)])
            h = self.stack.forward_rows(rt, embeds, rope, ((0, S),), S, seq.attention_blocks, cache, seq.hole)
            h = h[:, first:img1]
        else:
            # The step rows sit right before the image: the rows fed are one run of slots.
            h = self.stack.forward_rows(rt, torch.cat([step, img], dim=1), rope[..., first:img1, :],
                                        ((first, img1),), S, seq.attention_blocks, cache, seq.hole)
        return h, self.head_velocity(h, t, seq.step_rows, seq.height, seq.width)

    def head_velocity(self, hidden: torch.Tensor, t: torch.Tensor, step_rows: int, height: int,
                      width: int) -> torch.Tensor:
        """final_layer(image rows of `hidden`, time_embed_2(t)) -> [B, C, h, w] float32: the part
        of a step that always runs, at a cached step on the cache's extrapolated `hidden`. Plain
        ints, not the sequence: its compiled graph is then one per image size, whatever the
        text's bucket."""
        return self.model.velocity(hidden[:, step_rows:], t, height, width).float()

    def predict_velocity(self, rt, seq: DiffusionSequence, ids: torch.Tensor | None, latents: torch.Tensor,
                         t: torch.Tensor, cache: KVCache, first_step: bool, condition: ConditionTokens | None = None,
                         guidance: torch.Tensor | None = None, t_end: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity alone (`denoise_step`'s second half), [B, C, h, w] float32."""
        return self.denoise_step(rt, seq, ids, latents, t, cache, first_step, condition, guidance, t_end)[1]

    def run_denoise(self, req: T2IRequest, seq: DiffusionSequence, run: RequestRun,
                    condition: ConditionTokens | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The denoise loop of one request: the batch of one (`run_denoise_batch`). `noise`: the
        initial latents [1, C, h, w] (default: drawn from the request's seed, as the official
        pipeline draws them). A step's `run.progress` that raises ends it with that error."""
        batch = BatchMembers(1, per_member([run.progress]))
        (latents,) = self.run_denoise_batch([DenoiseMember(req, seq, run, condition, noise)], batch)
        if latents is None:
            raise batch.left[0]
        return latents

    def run_denoise_batch(self, members: list[DenoiseMember], batch: BatchMembers,
                          in_batch: list[int] | None = None) -> list[torch.Tensor | None]:
        """Requests of one denoise shape (`denoise_key`) as rows of one batch, through the shared
        denoise loop (dtgen/denoise_loop.py, with this phase's calls: `DenoiseRows`): final
        latents [1, C, h, w] per member, None for one that left the batch. Each keeps its own
        initial noise (its seed), guidance, step caches, record and timings. At every step
        boundary `batch.boundary("denoise", done, steps, members)` says who leaves (`in_batch`:
        the members' indices in `batch`, default 0..n-1); the others go on exactly as before.
        The host runs one step ahead of the device (`StepsAhead`)."""
        index = list(range(len(members))) if in_batch is None else list(in_batch)
        keys = {denoise_key(m.req, m.seq) for m in members}
        if len(keys) != 1:
            raise ValueError(f"a denoise batch needs one denoise shape; these members have {len(keys)}")
        rt = self.controller.activate("denoise")
        if self.cfg.cfg_distilled and rt.cfg_size > 1:   # the guidance is embedded: one row, no unconditional branch
            raise ValueError(f"plan '{self.controller.topology.resolved.plan.name}' splits the CFG branches, but "
                             "this checkpoint is CFG-distilled (one row a step): choose a plan without a cfg axis")
        req0, seq0 = members[0].req, members[0].seq
        sigmas = flow_match_sigmas(req0.steps, req0.flow_shift)   # float32, as the official scheduler
        # The official initial noise: drawn in bfloat16 from a CPU generator seeded by the
        # request, upcast; both CFG branches start from it.
        shape = (1, self.cfg.vae.latent_channels, seq0.height, seq0.width)
        loop_members = []
        for k, m in zip(index, members):
            m.run.timings["phase_switch"] = self.controller.last_switch.ms
            m.run.cache_config, m.run.step_ms = m.req.step_cache, []   # this denoise's share of the run
            noise = m.noise
            if noise is None:
                noise = torch.randn(shape, generator=torch.Generator().manual_seed(m.req.seed), dtype=torch.bfloat16)
            elif tuple(noise.shape) != shape:
                raise ValueError(f"initial noise of shape {tuple(noise.shape)} does not fit the sequence; "
                                 f"expected {shape}")
            loop_members.append(denoise_loop.DenoiseMember(k, m.req, m.run, noise.float().to(self.device),
                                                           EulerSteps(sigmas), m))
        first_run = members[0].run
        clock = denoise_loop.StepsAhead(first_run.timer, first_run.profiler, self.is_main)
        done = denoise_loop.denoise(loop_members, rt, DenoiseRows(self, rt, members, sigmas), batch, self.device, clock)
        for m in done:
            run, step_ms = m.run, m.run.step_ms
            run.timings["denoise_step"] = sum(step_ms) / len(step_ms)
            run.timings["denoise_first_step"] = step_ms[0]
            # Later steps apart: in full (the first, whole-sequence one left out) and cached.
            report = (run.record.get("step_cache") or [None])[0]
            full = set(range(len(step_ms)) if report is None else report["full_steps"])
            full_ms = [ms for i, ms in enumerate(step_ms) if i in full and i > 0]
            cached_ms = [ms for i, ms in enumerate(step_ms) if i not in full]
            if full_ms:
                run.timings["denoise_full_step"] = sum(full_ms) / len(full_ms)
            if cached_ms:
                run.timings["denoise_cached_step"] = sum(cached_ms) / len(cached_ms)
            run.record["denoise_step_ms"] = [step_ms]
            run.record["latents"] = [m.latents]
            run.record["denoise_length"] = [m.context.seq.real_length]
            run.record["denoise_batch"] = [len(members)]   # requests whose rows shared these steps (at the start)
        latents = {m.index: m.latents for m in done}
        return [latents.get(k) for k in index]


class EulerSteps:
    """The official scheduler's steps, one request's (the shared loop's sampler): Euler on
    `flow_match_sigmas`, in float32."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas, self.index = sigmas, 0
        self.timesteps = 1000 * sigmas[:-1]   # what the batch's members must share

    def step(self, velocity: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        i, self.index = self.index, self.index + 1
        return euler_step(latents, velocity, float(self.sigmas[i]), float(self.sigmas[i + 1]))


class DenoiseRows:
    """This phase's side of the shared denoise loop for one batch (dtgen/denoise_loop.py
    `BatchDenoiser`): its calls' rows (each member's token ids, sequence, edit condition and
    embedded guidance, request-major), one KV cache per call site, and what each member's
    branches guide to.

    The KV caches hold the text and condition rows the first step fills and every later step
    attends to: a member that leaves takes its rows out of them (`members_left`). Everything a
    step reads from the host goes to the device once, here (and again only when members leave):
    a copy from pageable memory inside the loop waits for the device to drain, and the device
    then idles while the host checks the next call's guards (1-2 ms per branch; more on a rank
    whose host is slower, which the other rank then waits for in a collective)."""

    # A cached step's head runs on one member's rows: the graph of one request's call.
    head_per_member = True

    def __init__(self, phase: DenoisePhase, rt, members: list[DenoiseMember], sigmas: torch.Tensor):
        self.phase, self.sigmas, self.members = phase, sigmas, members
        self.loras = phase.loras   # the loop sets each call's rows from its members' requests
        self.distilled = bool(phase.cfg.cfg_distilled)   # the guidance is embedded: one row, no unconditional one
        self.cfg_together = members[0].req.cfg_mode == "batch"
        self.calls = denoise_loop.cfg_calls(rt, 1 if self.distilled else 2, self.cfg_together).calls
        self.now = list(range(len(members)))   # positions in `members` of those still in the batch
        self.caches = [phase.denoise_cache(rt, len(g) * len(members), members[0].seq, reuse=f"denoise{i}")
                       for i, g in enumerate(self.calls)]
        self.inputs = self._inputs()

    def _inputs(self) -> list[tuple]:
        """Per call: (ids [rows, S], the sequence of those rows, their condition, guidance)."""
        out, dev = [], self.phase.device
        for g in self.calls:
            rows = [p for p in self.now for _ in g]   # the member of each row
            ids = torch.stack([(self.members[p].seq.cond_ids, self.members[p].seq.uncond_ids)[b]
                               for p in self.now for b in g]).to(dev)
            seq = batched_sequence([self.members[p].seq for p in rows], dev)
            cond = batched_condition([self.members[p].condition for p in rows])
            values = [self.embedded(self.members[p].req) for p in rows]
            guidance = None if not self.distilled else (torch.full((len(rows),), values[0], device=dev)
                                                        if len(set(values)) == 1 else torch.tensor(values, device=dev))
            out.append((ids, seq, cond, guidance))
        return out

    def embedded(self, req: T2IRequest) -> float | None:
        """A distilled checkpoint's embedded guidance: 1000 * guidance rounded to bf16, as the official code."""
        return float(torch.tensor([1000.0 * req.guidance], dtype=torch.bfloat16)) if self.distilled else None

    def members_left(self, kept: list[int]) -> None:
        self.now = [self.now[k] for k in kept]
        dev = self.phase.device
        self.caches = [self.phase.stack.cache_rows(cache, torch.tensor([k * len(g) + j for k in kept
                                                                        for j in range(len(g))], device=dev))
                       for g, cache in zip(self.calls, self.caches)]
        self.inputs = self._inputs()

    def segments(self, rt, timesteps: torch.Tensor, request: T2IRequest) -> list[denoise_loop.Segment]:
        return [denoise_loop.Segment(self.phase, 0, len(timesteps), 1 if self.distilled else 2)]

    def denoise_call(self, rt, segment, t, rows: denoise_loop.CallRows) -> DenoiserCall:
        """The call of `rows` at step `rows.step`: its timesteps from the official sigmas (and
        the next one, a meanflow checkpoint's end time); the first step feeds the whole sequence."""
        c, i, dev = self.calls.index(rows.branches), rows.step, self.phase.device
        ids, seq, cond, guidance = self.inputs[c]
        n = ids.shape[0]
        t_value, t_end_value = 1000.0 * float(self.sigmas[i]), 1000.0 * float(self.sigmas[i + 1])
        t = torch.full((n,), t_value, device=dev)
        t_end = torch.full((n,), t_end_value, device=dev) if self.phase.cfg.use_meanflow else None
        if c == 0:   # what the model is fed (float32 values, kept on the host)
            f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
            for m in rows.members:
                m.run.record.setdefault("step_inputs", []).append(
                    {"t": f32(t_value), "guidance": self.embedded(m.request),
                     "t_end": f32(t_end_value) if t_end is not None else None})
        head = partial(self.phase.head_fn, t=t[:len(rows.branches)], step_rows=seq.step_rows, height=seq.height,
                       width=seq.width)
        full = partial(self.phase.step_fn, rt, seq, ids, rows.latents, t, self.caches[c], i == 0, cond, guidance,
                       t_end)
        return DenoiserCall(head=head, full=full)

    def guide(self, member: denoise_loop.DenoiseMember, segment, branches: torch.Tensor) -> torch.Tensor:
        if self.distilled:
            return branches
        return classifier_free_guidance(branches[0:1], branches[1:2], member.request.guidance)
