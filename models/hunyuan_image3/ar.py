"""HunyuanImage-3's AR phase: the prompt's prefill, the CoT decode, the image head and the ratio choice.

`ARPhase` is the AR part of `HunyuanT2IPipeline` (pipeline.py). Its steps (the prefill, the
one-token decode step, the batched decode step) are compiled here, once per phase object,
through the pipeline's `CompiledSteps`; the decode loop around them (what is fed, when it
stops, the token read one step late) is the framework's (dtgen/ar.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dtgen.ar import BatchDecode, DecodeRule, TokenDecode
from dtgen.attention import AttentionMeta, KVCache, SlotRuns, decode_batch, decode_programs, slots_of_runs
from dtgen.batching import BatchMembers
from dtgen.buckets import pad_rows
from dtgen.compiled_steps import CompiledSteps
from dtgen.profiling import NullProfiler
from dtgen.sampling import Sampling, SamplingArgs, sample_token
from dtgen.timing import Timer

from .diffusion_sequence import build_diffusion_sequence, round_up
from .instruct import ConditionTokens, InstructPrefix, PromptCondition, prompt_condition, splice_rows
from .requests import RequestRun, T2IRequest
from .resolutions import resolution_table
from .stack import DecoderStack
from .tokenizer import SpecialTokens

# AR cache lengths are rounded up to a multiple of this (see `run_ar`).
AR_CACHE_ROUND = 256

# How the AR decode step attends: "sdpa" (masked SDPA over the whole cache, one request);
# "reference" / "triton" (the batched decode path: the fused prologue and split-KV attention
# over each request's own keys, as their torch references or the Triton kernels).
DECODE_IMPLS = ("sdpa", "reference", "triton")


@dataclass
class ARBatchResult:
    """One request's AR phase out of `run_ar_batch`: what `run_ar` gives, and its logits."""

    tokens: list[int]                 # AR tokens generated (CoT), without the ratio token
    ratio_index: int
    logits: list[torch.Tensor]        # [V] per kept step: the prefill's, each kept token's, the image head's


def decode_rule(req: T2IRequest, stops: set[int]) -> DecodeRule:
    """A request's CoT decode: up to max_new_tokens sampled tokens, or its forced ones replayed."""
    steps = req.max_new_tokens if req.forced_tokens is None else len(req.forced_tokens)
    return DecodeRule(steps, stops, req.forced_tokens, req.ignore_stop)


class ARPhase:
    """Takes the decoder stack (stack.py: the model, its KV caches, `forward_rows`), the
    tokenizer, the phase controller (it activates the "ar" phase and has the ranks agree on
    the tokens), the pipeline's compiled steps (each step here is compiled once, as its own
    callable: `prefill_fn`, `decode_fn`, `decode_batch_fn`; `graphed_decode` is the decode
    step's hand-recorded CUDA graph in regions mode), `prompt_bucket` (the prefill pads the
    prompt to a multiple of it; 0: exact), `decode_impl` (DECODE_IMPLS) and `is_main` (the
    rank that shows progress).

    In: a request and its `RequestRun` (`run_ar`; an edit's Instruct prompt and condition
    rows too), or several text-to-image requests with their runs and batch (`run_ar_batch`).
    Out: the CoT tokens and the ratio index (`run_ar`), one `ARBatchResult` per request
    (`run_ar_batch`); the runs get their timings and record (ar_logits)."""

    def __init__(self, stack: DecoderStack, tokenizer, controller, steps: CompiledSteps, prompt_bucket: int,
                 decode_impl: str, is_main: bool = True):
        if decode_impl not in DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {DECODE_IMPLS}, got {decode_impl!r}")
        self.stack = stack
        self.model, self.cfg, self.device = stack.model, stack.cfg, stack.device
        self.tok = tokenizer
        self.special: SpecialTokens = tokenizer.special
        self.controller = controller
        self.prompt_bucket = prompt_bucket
        self.decode_impl = decode_impl
        self.is_main = is_main
        self._programs: dict[int, int] = {}   # the split-KV schedule's program count per KV-head count
        self._size_rows: list[int] | None = None
        # Two functions (two code objects), two compiled callables: the prompt and the one-token
        # step get separate graph caches, and only the decode steps replay as CUDA graphs.
        self.prefill_fn = steps.step(self._ar_prefill)
        self.decode_fn = steps.step(self._ar_decode, cuda_graph=True)
        self.decode_batch_fn = steps.step(self._decode_batch_step, cuda_graph=True)
        self.graphed_decode = steps.graphed_of(self._ar_decode)   # its recordings, for tests

    def prompt_ids(self, req: T2IRequest) -> list[int]:
        """The request's prompt as token ids (its own `prompt_ids`, or its text encoded)."""
        return list(req.prompt_ids) if req.prompt_ids is not None else self.tok.encode(req.prompt)

    def ar_logits(self, rt, ids: torch.Tensor, slots: torch.Tensor | SlotRuns, cache: KVCache, total: int,
                  all_rows: bool = False, last: torch.Tensor | None = None,
                  cond: PromptCondition | None = None) -> torch.Tensor:
        """Feed ids [1, n] at `slots` through the cache; logits [V] of the last row ([n, V] with all_rows).

        Token ids are a tensor, and so are the slots of a decode step, so that one compiled
        graph serves every step; a prompt's slots are static runs (see `forward_rows`).
        `last` ([1] int64): the row whose logits are wanted, when rows after it are padding.
        `cond`: a prompt (at slots 0..n-1) holding a reference image's condition section.
        """
        embeds = self.model.embed_tokens(ids)
        slot_vec = slots_of_runs(slots, self.device) if isinstance(slots, tuple) else slots
        rope, blocks = slot_vec.unsqueeze(-1).repeat(1, 2), ()
        if cond is not None:
            embeds, rope, blocks = splice_rows(embeds, cond.pieces), cond.rope_pos, cond.blocks
        h = self.stack.forward_rows(rt, embeds, rope, slots, total, blocks, cache)
        if all_rows:
            return self.model.logits(h[0])
        return self.model.logits(h[0, -1] if last is None else h[0].index_select(0, last)[0])

    def _ar_step(self, rt, ids, slots, cache, total, uniform, sampling: SamplingArgs, last=None, cond=None):
        """Logits [V] of the last row (or row `last`) and the token sampled from them (0-d, on the device)."""
        logits = self.ar_logits(rt, ids, slots, cache, total, last=last, cond=cond)
        return logits, sample_token(logits, uniform, sampling.temperature, sampling.top_k, sampling.top_p,
                                    sampling.candidates)

    def _ar_prefill(self, rt, ids, slots, cache, total, uniform, sampling: SamplingArgs, last=None, cond=None):
        return self._ar_step(rt, ids, slots, cache, total, uniform, sampling, last, cond)

    def _ar_decode(self, rt, ids, slots, cache, total, uniform, sampling: SamplingArgs):
        if self.decode_impl != "sdpa" and rt.seq.size == 1:   # the batched path, a batch of one
            logits = self.decode_logits(rt, ids, slots, cache)[0]
            return logits, sample_token(logits, uniform, sampling.temperature, sampling.top_k, sampling.top_p,
                                        sampling.candidates)
        return self._ar_step(rt, ids, slots, cache, total, uniform, sampling)

    # ---- batched AR decode --------------------------------------------------------------
    def _decode_programs(self, cache: KVCache) -> int:
        kv_heads = cache.layers[0].k.shape[1]
        if kv_heads not in self._programs:
            self._programs[kv_heads] = decode_programs(self.device, kv_heads)
        return self._programs[kv_heads]

    def decode_logits(self, rt, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step for B requests: ids [B, 1], positions [B] (each request's new slot
        in its own cache row b; it sees that row's slots 0..position) -> logits [B, V] float32.
        The split-KV schedule is built here, once for every layer. No host sync."""
        if rt.seq.size > 1:
            raise ValueError("a batched decode step attends over local heads; this AR phase is sequence parallel "
                             f"(SP {rt.seq.size}): choose a plan whose AR phase is TP only")
        if ids.shape != (positions.shape[0], 1) or cache.layers[0].k.shape[0] != positions.shape[0]:
            raise ValueError(f"decode step: ids must be [B, 1] and the cache B rows for B = {positions.shape[0]} "
                             f"positions, got ids {tuple(ids.shape)} and a cache of {cache.layers[0].k.shape[0]} rows")
        impl = "reference" if self.decode_impl == "sdpa" else self.decode_impl
        step = decode_batch(positions, cache.length, self._decode_programs(cache), impl)
        rope = positions.view(-1, 1, 1).expand(-1, 1, 2)          # text rows: y = x = position
        h = self.model.model(self.model.embed_tokens(ids), rope, AttentionMeta(positions, decode=step), cache)
        return self.model.logits(h[:, 0])

    def _decode_batch_step(self, rt, ids, positions, cache, uniforms, samplings):
        """decode_logits, then each request's token from its own uniforms and settings."""
        logits = self.decode_logits(rt, ids, positions, cache)
        tokens = [sample_token(logits[b], u, s.temperature, s.top_k, s.top_p, s.candidates)
                  for b, (u, s) in enumerate(zip(uniforms, samplings))]
        return logits, torch.stack(tokens)

    def decode_batch(self, rt, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     uniforms: tuple[torch.Tensor | None, ...], samplings: tuple[SamplingArgs, ...]):
        """Advance B requests one token each (compiled, and on CUDA replayed as a graph, as the
        one-request step): ids [B, 1] at positions [B] of cache rows 0..B-1; uniforms[b]: request
        b's draws [V] (None: greedy); samplings[b]: its settings. -> (logits [B, V], tokens [B])."""
        if len(uniforms) != ids.shape[0] or len(samplings) != ids.shape[0]:
            raise ValueError(f"decode_batch: {ids.shape[0]} requests but {len(uniforms)} uniforms and "
                             f"{len(samplings)} sampling settings")
        logits, tokens = self.decode_batch_fn(rt, ids, positions, cache, tuple(uniforms), tuple(samplings))
        return logits.clone(), tokens.clone()   # a CUDA-graph replay reuses its buffers

    def run_ar_batch(self, reqs: list[T2IRequest], runs: list[RequestRun] | None = None,
                     batch: BatchMembers | None = None, index: list[int] | None = None) -> list[ARBatchResult | None]:
        """The AR phase of several text-to-image requests together: each prompt is prefilled
        alone into its own row of one KV cache, then every decode step advances all of them
        one token (`decode_batch`), each at its own length; a request that stops sits out the
        remaining steps (its row rewrites one slot that its image head overwrites later), then
        all feed their image head and choose their ratio. Per request, the same tokens and
        logits as `run_ar` alone (the same draws from its own generator).

        With `batch` (and `runs`, `index`: the requests' runs and their indices in it), every
        decode step is a step boundary of the requests still decoding (`batch.boundary`, one
        per distinct max_new_tokens), after the prefills one at token 0; a request that leaves
        there sits out the remaining steps and gets None. `runs` also take each request's
        timings (ar_prefill, ar_decode_per_token), record (ar_logits) and profiled regions."""
        if not reqs:
            raise ValueError("run_ar_batch: no requests")
        if runs is not None and len(runs) != len(reqs):
            raise ValueError(f"run_ar_batch: {len(reqs)} requests but {len(runs)} runs")
        index = list(range(len(reqs))) if index is None else list(index)
        for i, r in enumerate(reqs):
            if r.reference is not None:
                raise ValueError(f"run_ar_batch: request {i} is an image edit; batched AR takes text-to-image only")
        rt = self.controller.activate("ar")
        sp, dev, V = self.special, self.device, self.cfg.vocab_size
        prompts = [[sp.bos] + self.prompt_ids(r) for r in reqs]
        rules = [decode_rule(r, {sp.eos, *r.stop_ids}) for r in reqs]
        steps = [rule.steps for rule in rules]
        padded = [ids + [sp.eos] * (self._bucket(len(ids)) - len(ids)) for ids in prompts]
        budget = 0
        for i, (ids, n, pad) in enumerate(zip(prompts, steps, padded)):
            self.stack.check_budget(len(ids) + n + 2, f"request {i}'s AR sequence (prompt + max_new_tokens + "
                                    "<boi><img_size>)", "max_new_tokens")
            budget = max(budget, len(ids) + n + 2, len(pad))
        length = min(round_up(budget, AR_CACHE_ROUND), self.cfg.max_position_embeddings)
        N = len(reqs)
        cache = self.stack.cache(rt, N, length, reuse=f"ar-batch{N}")
        gens = [torch.Generator(device=dev).manual_seed(r.seed) for r in reqs]
        samplings = tuple(Sampling(r.temperature, r.top_k, r.top_p).step_args(V, dev) for r in reqs)
        prefill_logits: list[torch.Tensor] = []
        current = []
        profiler = runs[0].profiler if runs is not None else NullProfiler()
        timer = runs[0].timer if runs is not None else Timer(dev)
        for b in range(N):   # prefill, one request at a time, into its own row
            with profiler.region("ar_prefill"):
                t0 = timer.now()
                logits, token = self.feed(self.prefill_fn, rt, padded[b], 0, cache.rows(b, b + 1), length,
                                          samplings[b], gens[b], static_slots=True,
                                          rows=len(prompts[b]) if self.prompt_bucket else None)
                if runs is not None:
                    runs[b].timings["ar_prefill"] = (timer.now() - t0) * 1e3
            prefill_logits.append(logits)
            current.append(int(token))
        # A row that stops sits out the remaining steps, fed <eos>: its image head overwrites that slot.
        rows = BatchDecode(current, rules, [len(ids) for ids in prompts], filler=sp.eos)
        gone = [False] * N   # left the batch at a boundary (cancelled, failed): no result
        dummy = torch.full((V,), 0.5, device=dev)   # draws of a row that sits out (never read)

        def boundary(done: int, decoding: list[int]) -> list[int]:
            """Step boundary `done` of the requests in `decoding` (rows): the rows that leave."""
            leaving = []
            if batch is None:
                return leaving
            for n in sorted({steps[b] for b in decoding}):   # one agreement per total: the progress says it
                for m in batch.boundary("ar", done, n, [index[b] for b in decoding if steps[b] == n]):
                    if m in index:
                        b = index.index(m)
                        gone[b] = True
                        leaving.append(b)
            return leaving

        def step(fed: list[int], live: list[bool]):
            uniforms = tuple((torch.rand(V, generator=g, device=dev) if on else dummy) if s.draws else None
                             for g, s, on in zip(gens, samplings, live))
            return self.decode_batch(rt, torch.tensor(fed, device=dev).view(N, 1),
                                     torch.tensor(rows.positions, device=dev), cache, uniforms, samplings)

        rows.leave(boundary(0, [b for b in range(N)]))
        with profiler.region("ar_decode") as counted:
            t0 = timer.now()
            decoded = rows.run(step, boundary, lambda: timer.now() - t0)
            if counted is not None:
                counted[1] = decoded
        # <boi><img_size_N> at each request's own next slots; the ratio from the last logits.
        with profiler.region("ar_image_head", units=2):
            for token in (sp.boi, sp.size[self.cfg.image_base_size]):
                logits, _ = step([token] * N, [True] * N)
                rows.positions = [p + 1 for p in rows.positions]
        results: list[ARBatchResult | None] = []
        for b, r in enumerate(reqs):
            generated = rows.generated[b]
            too_long = self._sizes_too_long(len(prompts[b]) + len(generated), logits.device)
            chosen = int(torch.argmax(logits[b][list(sp.ratio)].masked_fill(too_long, float("-inf"))))
            ratio = chosen if r.forced_ratio is None else r.forced_ratio
            if gone[b]:     # every rank agreed it left: no agreement on its tokens
                results.append(None)
                continue
            self._check_ranks_agree(generated, ratio)
            kept = [prefill_logits[b]] + rows.logits[b] + [logits[b]]
            results.append(ARBatchResult(generated, ratio, kept))
            if runs is not None:
                runs[b].record.setdefault("ar_logits", []).extend(kept)
                if generated:
                    runs[b].timings["ar_decode_per_token"] = rows.ended_s[b] * 1e3 / len(generated)
        return results

    def feed(self, fn, rt, ids: list[int] | torch.Tensor, start: int, cache: KVCache, total: int,
             sampling: SamplingArgs, generator: torch.Generator | None,
             static_slots: bool = False, rows: int | None = None,
             cond: PromptCondition | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed token ids (a list, or a device tensor [1, n]) at slots start.. -> (logits, next token).

        static_slots: the slots are part of the graph (the prompt, always at 0); otherwise a
        tensor, so that feeds at moving positions share one graph. rows: how many of the ids
        are real (the rest pad the prompt to its bucket); the logits are row rows - 1's.
        """
        dev = self.device
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=dev)
        n = ids.shape[1]
        slots = ((start, start + n),) if static_slots else torch.arange(start, start + n, device=dev)
        uniform = (torch.rand(self.cfg.vocab_size, generator=generator, device=dev)
                   if sampling.draws else None)
        last = None if rows is None else torch.tensor([rows - 1], device=dev)
        # Only the prefill takes `last` and `cond` (the decode step takes neither).
        extra = (last, cond) if cond is not None else (last,) if last is not None else ()
        logits, token = fn(rt, ids, slots, cache, total, uniform, sampling, *extra)
        # clone: a CUDA-graph replay reuses its output buffers on the next call.
        return logits.clone(), token.clone()

    def _bucket(self, n: int) -> int:
        """Rows the prefill runs for an n-row prompt: n rounded up to its bucket, within the
        model's positions."""
        return pad_rows(n, self.prompt_bucket, self.cfg.max_position_embeddings)

    def run_ar(self, req: T2IRequest, run: RequestRun,
               edit: tuple[InstructPrefix, ConditionTokens] | None = None) -> tuple[list[int], int | None]:
        """The AR phase: prefill, CoT decode, then (T2I) the ratio choice. `edit`: the Instruct
        prompt of an image edit and its condition rows; it ends with <think>, and the image's
        size comes from the request or the reference (ratio None here)."""
        rt = self.controller.activate("ar")
        record, timer, timings = run.record, run.timer, run.timings
        sp = self.special
        ids = [sp.bos] + self.prompt_ids(req) if edit is None else edit[0].ids + [self.tok.instruct.think]
        stops = {sp.eos, *req.stop_ids}
        if edit is not None:
            stops.add(self.tok.instruct.answer)   # the model would start the image there
        rule = decode_rule(req, stops)
        budget = len(ids) + rule.steps + 2
        what = "prompt" if edit is None else "the reference image's tokens + prompt"
        self.stack.check_budget(budget, f"AR sequence ({what} + max_new_tokens + <boi><img_size>)",
                                "max_new_tokens" if edit is None else "image")
        # The prefill's graph is keyed by the prompt length: pad it to its bucket. Exact: the
        # padding rows sit at the slots right after the prompt, which no real row sees
        # (causal), and each decode step rewrites the next of them before any query can see
        # it (a query at slot q sees slots <= q, and slot q is written by that same step).
        padded = ids + [sp.eos] * (self._bucket(len(ids)) - len(ids))
        budget = max(budget, len(padded))
        # The decode step's graph is keyed by the cache length: round it up so that prompts of
        # similar length share one graph (the mask hides the unused slots).
        length = min(round_up(budget, AR_CACHE_ROUND), self.cfg.max_position_embeddings)
        cache = self.stack.cache(rt, 1, length, reuse="ar")
        # Every rank holds the same logits and the same generator state, so every rank draws
        # the same token; the draw stays on the device (`sample_token`).
        generator = torch.Generator(device=self.device).manual_seed(req.seed)
        # Tensors in the compiled steps: another temperature, top-k or top-p reuses their graphs.
        sampling = Sampling(req.temperature, req.top_k, req.top_p).step_args(self.cfg.vocab_size, self.device)
        cond = None
        if edit is not None:
            cond = prompt_condition(edit[0].condition, edit[1], len(padded), self.device)

        with run.profiler.region("ar_prefill"):
            t0 = timer.now()
            logits, next_token = self.feed(self.prefill_fn, rt, padded, 0, cache, length, sampling, generator,
                                           static_slots=True, rows=len(ids) if self.prompt_bucket else None,
                                           cond=cond)
            timings["ar_prefill"] = (timer.now() - t0) * 1e3
        record.setdefault("ar_logits", []).append(logits)
        run.progress("ar", 0, rule.steps)

        decode = TokenDecode(next_token, rule, self.device)

        def step(i: int, fed: torch.Tensor):   # token i sits at slot len(ids) + i
            return self.feed(self.decode_fn, rt, fed, len(ids) + i, cache, length, sampling, generator)

        def kept(i: int, logits: torch.Tensor) -> None:
            record["ar_logits"].append(logits)
            run.progress("ar", i + 1, rule.steps)

        with run.profiler.region("ar_decode") as counted:
            t0 = timer.now()
            # A stop token's step is dropped: the image head below rewrites its cache slot.
            generated = decode.run(step, kept, show=self.is_main)
            decode_s = timer.now() - t0
            if counted is not None:
                counted[1] = len(generated)
        if generated:
            timings["ar_decode_per_token"] = decode_s * 1e3 / len(generated)

        if edit is not None:   # the edit's image size is the request's or the reference's
            self._check_ranks_agree(generated, -1)
            return generated, None
        # <boi><img_size_N>, then the ratio token, restricted to the ratio vocabulary.
        # They go through the decode step one at a time: its graph (a CUDA graph on GPU) is
        # there already, where a 2-token feed would cost one more full-depth compile. The
        # step's sampled token is ignored; the ratio is the argmax over the ratio ids.
        head = [sp.boi, sp.size[self.cfg.image_base_size]]
        start = len(ids) + len(generated)
        with run.profiler.region("ar_image_head", units=len(head)):
            for j, token in enumerate(head):
                logits, _ = self.feed(self.decode_fn, rt, [token], start + j, cache, length, sampling, generator)
            # 'auto' picks among the sizes whose denoise sequence fits the model's positions
            # (a small model's table holds sizes it cannot): the others never win.
            too_long = self._sizes_too_long(len(ids) + len(generated), logits.device)
            chosen = int(torch.argmax(logits[list(sp.ratio)].masked_fill(too_long, float("-inf"))))
        record["ar_logits"].append(logits)
        ratio = chosen if req.forced_ratio is None else req.forced_ratio
        self._check_ranks_agree(generated, ratio)
        return generated, ratio

    def _sizes_too_long(self, text_rows: int, device) -> torch.Tensor:
        """[sizes] bool: the T2I sizes whose denoise sequence, after `text_rows` rows of text
        (<bos> included), would not fit max_position_embeddings."""
        if self._size_rows is None:  # <bos> + image head + image + <eoi>, per size
            base, down = self.cfg.image_base_size, self.cfg.vae_downsample_factor
            self._size_rows = [
                build_diffusion_sequence([], self.special, base, k, h // down[0], w // down[1]).real_length
                for k, (h, w) in enumerate(resolution_table(base))]
        limit = self.cfg.max_position_embeddings
        return torch.tensor([text_rows - 1 + n > limit for n in self._size_rows], device=device)

    def _check_ranks_agree(self, tokens: list[int], ratio: int) -> None:
        """Every rank must leave AR with the same tokens: the denoise sequence (and so every
        collective's shape) is built from them. Ranks draw from identical logits with
        identical generators, so this holds unless a replicated computation differs between
        ranks; then fail loudly here instead of hanging in the next collective."""
        digest = 0
        for i, t in enumerate(tokens):
            digest = (digest * 1000003 + t + i) % (1 << 61)
        rows = self.controller.agree("AR tokens", [len(tokens), digest, ratio])
        if any(row != rows[0] for row in rows):
            raise RuntimeError("ranks left the AR phase with different tokens (count, digest, ratio by rank: "
                               f"{rows}); a replicated computation is not bitwise identical across ranks")
