"""HunyuanImage-3's denoise phase: CFG flow-matching steps over the diffusion sequence, requests batched as rows.

`DenoisePhase` is the denoise part of `HunyuanT2IPipeline` (pipeline.py). Its full step and a
step cache's head are compiled here, once per phase object, through the pipeline's
`CompiledSteps`. Requests of one denoise shape (`denoise_key`) run as rows of one batch;
`run_denoise` is the batch of one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from tqdm import tqdm

from dtgen.attention import KVCache
from dtgen.batching import BatchMembers, per_member
from dtgen.compiled_steps import CompiledSteps
from dtgen.layers.flow_match import classifier_free_guidance, euler_step, flow_match_sigmas
from dtgen.step_cache import DenoiserCall, make_step_cache, merged_report, run_step_shared

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
        """The denoise loop, for requests of one denoise shape (`denoise_key`) as rows of one
        batch: final latents [1, C, h, w] per member, None for one that left the batch.

        Each member keeps its own initial noise (its seed), guidance, step caches (one per call
        site), record and timings; the rows of a call are request-major (member 0's CFG
        branches, then member 1's, ...), each with its own RoPE positions and padding hole
        (`batched_sequence`). At every step boundary `batch.boundary("denoise", done, steps,
        members)` says who leaves (`in_batch`: the members' indices in `batch`, default
        0..n-1); their rows are dropped before the next step (the latents, the KV caches'
        rows), and the others go on exactly as before. The batch of one is the plain loop."""
        index = list(range(len(members))) if in_batch is None else list(in_batch)
        keys = {denoise_key(m.req, m.seq) for m in members}
        if len(keys) != 1:
            raise ValueError(f"a denoise batch needs one denoise shape; these members have {len(keys)}")
        rt = self.controller.activate("denoise")
        for m in members:
            m.run.timings["phase_switch"] = self.controller.last_switch.ms
        first_run = members[0].run
        timer = first_run.timer
        dev = self.device
        req0, seq0 = members[0].req, members[0].seq
        steps = req0.steps
        distilled = self.cfg.cfg_distilled
        if distilled:     # the guidance is embedded: one row, no unconditional branch
            if rt.cfg_size > 1:
                raise ValueError(f"plan '{self.controller.topology.resolved.plan.name}' splits the CFG branches, but "
                                 "this checkpoint is CFG-distilled (one row a step): choose a plan without a cfg axis")
            groups = [[0]]
        elif rt.cfg_size > 1:   # CFG-parallel: this half of the ranks runs one branch
            groups = [[rt.cfg_rank]]
        else:
            groups = [[0, 1]] if req0.cfg_mode == "batch" else [[0], [1]]
        # The velocity's rows after the CFG gather: each group's rows (request-major), group after group.
        gathered = [[0], [1]] if rt.cfg_size > 1 else groups
        branches = [[m.seq.cond_ids] if distilled else [m.seq.cond_ids, m.seq.uncond_ids] for m in members]
        # One step cache per request and call site (a CFG branch run on its own is one), new
        # for every request: nothing carries over to the next (dtgen/step_cache.py).
        step_caches = [[make_step_cache(m.req.step_cache, steps) for _ in groups] for m in members]
        # The official initial noise: drawn in bfloat16 from a CPU generator seeded by the
        # request, upcast; both CFG branches start from it.
        shape = (1, self.cfg.vae.latent_channels, seq0.height, seq0.width)
        starts = []
        for m in members:
            noise = m.noise
            if noise is None:
                noise = torch.randn(shape, generator=torch.Generator().manual_seed(m.req.seed), dtype=torch.bfloat16)
            elif tuple(noise.shape) != shape:
                raise ValueError(f"initial noise of shape {tuple(noise.shape)} does not fit the sequence; "
                                 f"expected {shape}")
            starts.append(noise.float().to(dev))
        latents = starts[0] if len(starts) == 1 else torch.cat(starts)
        sigmas = flow_match_sigmas(steps, req0.flow_shift)   # float32, as the official scheduler
        # A distilled checkpoint embeds 1000 * guidance, rounded to bf16 as the official code does.
        embedded = [float(torch.tensor([1000.0 * m.req.guidance], dtype=torch.bfloat16)) if distilled else None
                    for m in members]
        # Everything a step reads from the host goes to the device once, here (and again only
        # when members leave): a copy from pageable memory inside the loop waits for the device
        # to drain, and the device then idles while the host checks the next call's guards
        # (1-2 ms per branch; more on a rank whose host is slower, which the other rank then
        # waits for in a collective).
        caches = [self.denoise_cache(rt, len(g) * len(members), seq0, reuse=f"denoise{i}")
                  for i, g in enumerate(groups)]
        now = list(range(len(members)))   # positions in `members` of those still in the batch

        def inputs(now: list[int]) -> list[tuple]:
            """Per group: (ids [rows, S], the sequence of those rows, their condition, guidance)."""
            out = []
            for g in groups:
                rows = [p for p in now for _ in g]   # the member of each row
                ids = torch.stack([branches[p][b] for p in now for b in g]).to(dev)
                seq = batched_sequence([members[p].seq for p in rows], dev)
                cond = batched_condition([members[p].condition for p in rows])
                values = [embedded[p] for p in rows]
                guidance = None if not distilled else (torch.full((len(rows),), values[0], device=dev)
                                                       if len(set(values)) == 1 else torch.tensor(values, device=dev))
                out.append((ids, seq, cond, guidance))
            return out

        batch_in = inputs(now)

        def call(i: int, g: list[int], ids, seq, cond, guidance, cache: KVCache, latents: torch.Tensor) -> torch.Tensor:
            n = ids.shape[0]
            t_value, t_end_value = 1000.0 * float(sigmas[i]), 1000.0 * float(sigmas[i + 1])
            t = torch.full((n,), t_value, device=dev)
            t_end = torch.full((n,), t_end_value, device=dev) if self.cfg.use_meanflow else None
            if g is groups[0]:   # what the model is fed (float32 values, kept on the host)
                f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
                for p in now:
                    members[p].run.record.setdefault("step_inputs", []).append(
                        {"t": f32(t_value), "guidance": embedded[p],
                         "t_end": f32(t_end_value) if t_end is not None else None})
            rows = latents if len(g) == 1 else (latents.expand(len(g), -1, -1, -1) if latents.shape[0] == 1
                                                else latents.repeat_interleave(len(g), 0))
            # A member's head runs on its own rows (a cached step): the graph of one request's call.
            heads = [partial(self.head_fn, t=t[:len(g)], step_rows=seq.step_rows, height=seq.height,
                             width=seq.width) for _ in now]
            full = partial(self.step_fn, rt, seq, ids, rows, t, cache, i == 0, cond, guidance, t_end)
            return run_step_shared([step_caches[p][groups.index(g)] for p in now], i,
                                   DenoiserCall(head=heads[0], full=full), [len(g)] * len(now), heads)

        def step(i: int, latents: torch.Tensor) -> torch.Tensor:
            v = rt.gather_cfg(torch.cat([call(i, g, *inp, cache, latents)
                                         for g, inp, cache in zip(groups, batch_in, caches)]))
            n, out = len(now), []
            for k, p in enumerate(now):
                if n == 1:
                    mine = v
                else:   # member k's rows, in branch order (cond, uncond)
                    mine = torch.stack([v[n * sum(len(G) for G in gathered[:gi]) + k * len(G) + G.index(b)]
                                        for b in range(len(branches[p])) for gi, G in enumerate(gathered) if b in G])
                record = members[p].run.record
                record.setdefault("velocity", []).append(mine)
                record.setdefault("step_latents", []).append(latents if n == 1 else latents[k:k + 1])
                out.append(mine if distilled
                           else classifier_free_guidance(mine[0:1], mine[1:2], members[p].req.guidance))
            return euler_step(latents, out[0] if n == 1 else torch.cat(out), float(sigmas[i]), float(sigmas[i + 1]))

        bar = tqdm(total=steps, desc="denoise", disable=not self.is_main, leave=False)
        finished: dict[int, torch.Tensor] = {}

        def done(n: int, latents: torch.Tensor) -> torch.Tensor:
            """Step boundary `n`: report, then drop the rows of the members that left."""
            nonlocal now, caches, batch_in
            bar.update(n - bar.n)
            gone = set(batch.boundary("denoise", n, steps, [index[p] for p in now]))
            if not gone:
                return latents
            keep = [k for k, p in enumerate(now) if index[p] not in gone]
            now = [now[k] for k in keep]
            if not now:
                return latents
            positions = torch.tensor(keep, device=dev)
            latents = latents.index_select(0, positions)
            caches = [self.stack.cache_rows(cache, torch.tensor([k * len(g) + j for k in keep for j in range(len(g))],
                                                                device=dev)) for g, cache in zip(groups, caches)]
            batch_in = inputs(now)
            return latents

        # The first step feeds the whole sequence (and fills the text K/V); the later ones only
        # the image rows. Each profiled region begins and ends on a wait (dtgen/profiling.py).
        marks = [timer.mark()]
        with first_run.profiler.region("denoise_first_step"):
            latents = step(0, latents)
            marks.append(timer.mark())
            timer.wait(marks[-1])
        latents = done(1, latents)
        if steps > 1 and now:
            # The host runs one step ahead: step i is launched, then step i-1 is waited for
            # (and reported), so a step's host work overlaps the device time of the one before.
            with first_run.profiler.region("denoise_step", units=steps - 1):
                for i in range(1, steps):
                    latents = step(i, latents)
                    marks.append(timer.mark())
                    timer.wait(marks[-2])
                    if i > 1:
                        latents = done(i, latents)
                        if not now:
                            break
                timer.wait(marks[-1])
            if now:
                latents = done(steps, latents)
        bar.close()
        step_ms = [timer.ms(a, b) for a, b in zip(marks, marks[1:])]
        for k, p in enumerate(now):
            finished[p] = latents if len(now) == 1 else latents[k:k + 1]
        for p in finished:
            m = members[p]
            timings, record = m.run.timings, m.run.record
            timings["denoise_step"] = sum(step_ms) / len(step_ms)
            timings["denoise_first_step"] = step_ms[0]
            # Later steps apart: in full (the first, whole-sequence one left out) and cached.
            report = merged_report(step_caches[p])
            full = set(range(steps) if report is None else report["full_steps"])
            full_ms = [ms for i, ms in enumerate(step_ms) if i in full and i > 0]
            cached_ms = [ms for i, ms in enumerate(step_ms) if i not in full]
            if full_ms:
                timings["denoise_full_step"] = sum(full_ms) / len(full_ms)
            if cached_ms:
                timings["denoise_cached_step"] = sum(cached_ms) / len(cached_ms)
            if report is not None:
                record["step_cache"] = [report]
            record["denoise_step_ms"] = [step_ms]
            record["latents"] = [finished[p]]
            record["denoise_length"] = [m.seq.real_length]
            record["denoise_batch"] = [len(members)]   # requests whose rows shared these steps (at the start)
        return [finished.get(p) for p in range(len(members))]
