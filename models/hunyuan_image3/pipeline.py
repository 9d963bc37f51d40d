"""Text-to-image with HunyuanImage-3.0: AR stage, ratio choice, CFG denoising, VAE decode.

The pipeline runs inside phases that a controller activates ("ar", then "denoise"); what a
phase changes (weight views, collectives, attention core, sequence sharding) reaches this
code only through the `PhaseRuntime` it is handed. With the `single` plan every layout is
the identity and this is the plain single-process pipeline.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch
from tqdm import tqdm

from dtgen.attention import AttentionMeta, KVCache, KVCachePool, SlotRuns, decode_batch, decode_programs, slots_of_runs
from dtgen.batching import BatchHook, BatchMembers, MemberLeft, per_member
from dtgen.compile import CompileOptions, StepCompiler
from dtgen.cuda_graph import GraphedStep
from dtgen.profiling import NullProfiler
from dtgen.layers.flow_match import classifier_free_guidance, euler_step, flow_match_sigmas
from dtgen.sampling import Sampling, SamplingArgs, sample_token
from dtgen.sequence import SlotHole
from dtgen.step_cache import (DenoiserCall, TaylorConfig, make_step_cache, merged_report,
                              run_step_shared)

from .instruct import (ANSWER_SUFFIX, ConditionLayout, ConditionShape, ConditionTokens, InstructPrefix,
                       PromptCondition, cot_uncond, instruct_prefix, prompt_condition, special_ids, splice_rows)
from .cond_image import resize_and_crop, vae_bucket, vae_pixels
from .rope import image_rope_positions
from .requests import T2IRequest
from .resolutions import parse_image_size, resolution_table
from .model import HunyuanImage3ForCausalMM
from .transformer import run_layer
from .parallel_vae import parallel_decode
from .tokenizer import InstructTokens, SpecialTokens

# The profile table's rows for this pipeline's timings (dtgen.profiling.PhaseProfiler).
PROFILE_ROWS = (("ar_prefill", "AR prefill", "ms"), ("ar_decode_per_token", "AR decode", "ms/token"),
                ("phase_switch", "phase switch", "ms"), ("denoise_step", "denoise", "ms/step"),
                ("vae_decode", "VAE decode", "ms"), ("total", "total", "ms"))

# ----------------------------------------------------------------------------------------
# Resolutions and the diffusion sequence
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiffusionSequence:
    """The pretrain template: <bos> text <boi><img_size><img_ratio_k><timestep> <img>*h*w <eoi>.

    Bucketed (`build_diffusion_sequence(bucket=...)`), padding rows follow the text, so that
    the image head and the image sit at the same slots for every text length of a bucket;
    `hole` hides them from every query, and the RoPE positions skip them: the model sees the
    official sequence.
    """

    cond_ids: torch.Tensor       # [S], S counting padding rows
    uncond_ids: torch.Tensor     # [S], prompt and CoT ids replaced by <cfg>
    rope_pos: torch.Tensor       # [S, 2] (y, x)
    timestep_slot: int           # <timestep>; a distilled checkpoint's <guidance>, <timestep_r> follow it
    image_start: int
    height: int                  # latent grid
    width: int
    pad: int = 0                 # padding rows after the text (host only: no graph reads it)
    hole: SlotHole | None = None  # where they sit; None when not bucketed
    condition: ConditionLayout | None = None  # a reference image's section (image editing)

    @property
    def length(self) -> int:
        return self.cond_ids.shape[0]

    @property
    def real_length(self) -> int:
        """Rows of the official sequence (padding left out)."""
        return self.length - self.pad

    @property
    def image_slots(self) -> tuple[int, int]:
        return self.image_start, self.image_start + self.height * self.width

    @property
    def step_rows(self) -> int:
        """Rows between <timestep> and the image that carry the step (1, or 3 on a distilled
        checkpoint): with the image, the rows every KV-cached step feeds."""
        return self.image_start - self.timestep_slot

    @property
    def attention_blocks(self) -> tuple[tuple[int, int], ...]:
        """Every bidirectional block, in slot order: the condition's (if any), then the image."""
        return (self.condition.blocks if self.condition else ()) + (self.image_slots,)


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (bucket and cache lengths)."""
    return -(-n // multiple) * multiple


def build_diffusion_sequence(text_ids: list[int], special: SpecialTokens, base: int, ratio: int,
                             h: int, w: int, bucket: int = 0) -> DiffusionSequence:
    """The pretrain (T2I) template. `text_ids` = prompt (+ CoT) without <bos>. `bucket` > 0:
    <bos> + text pad to a multiple of that many rows (see `DiffusionSequence`), so that every
    text length of a bucket gives the same shapes and slots, and so the same compiled graphs."""
    return assemble_diffusion_sequence([special.bos] + list(text_ids), [special.bos] + [special.cfg] * len(text_ids),
                                       [special.boi, special.size[base], special.ratio[ratio]] + step_token_ids(special),
                                       [special.eoi], special, h, w, bucket)


def step_token_ids(special: SpecialTokens) -> list[int]:
    """<timestep>, then (Instruct-Distil) <guidance> and <timestep_r>: the rows right before
    the image that carry the step's t, guidance and end time."""
    return [special.timestep] + [i for i in (special.guidance, special.timestep_r) if i is not None]


def assemble_diffusion_sequence(head: list[int], uncond_head: list[int], image_head: list[int], post: list[int],
                                special: SpecialTokens, h: int, w: int, bucket: int = 0,
                                condition: ConditionLayout | None = None) -> DiffusionSequence:
    """head (the text; `uncond_head` its CFG row, same length) [padding] image_head (ends with
    the step tokens: `step_token_ids`) <img> x h*w post. Padding rows go between the head and the image head, so the
    image keeps its slots for every head length of a bucket. `condition` lies inside the head."""
    if len(uncond_head) != len(head):
        raise ValueError(f"the uncond row's text has {len(uncond_head)} ids, the cond row's {len(head)}")
    pad = round_up(len(head), bucket) - len(head) if bucket else 0
    image_start = len(head) + pad + len(image_head)
    image = [special.img] * (h * w) + list(post)
    ids = head + [special.eos] * pad + image_head + image
    uncond = uncond_head + [special.cfg] * pad + image_head + image
    S = len(ids)
    # Positions of the official sequence: the rows after the padding move back over it
    # (the padding rows keep their slot as position: nothing reads what they compute).
    official = torch.arange(S) - torch.where(torch.arange(S) >= len(head) + pad, pad, 0)
    pos = official.unsqueeze(-1).repeat(1, 2)
    pos[image_start:image_start + h * w] = image_rope_positions(image_start - pad, h, w)
    if condition is not None:
        pos = condition.apply_rope(pos)
    hole = SlotHole(torch.tensor(len(head)), len(head) + pad) if bucket else None
    timestep_slot = len(head) + pad + image_head.index(special.timestep)
    return DiffusionSequence(torch.tensor(ids), torch.tensor(uncond), pos, timestep_slot, image_start, h, w,
                             pad, hole, condition)


def build_instruct_diffusion_sequence(prefix: InstructPrefix, cot_ids: list[int], encode, special: SpecialTokens,
                                      extra: InstructTokens, base: int, ratio: int, h: int, w: int,
                                      bucket: int = 0) -> DiffusionSequence:
    """The diffusion sequence of an edit: `prefix` (through "Assistant: ") + CoT, then
    <answer> and the image, then </answer> "\n\n". Bucket padding goes before <answer>."""
    head = prefix.ids + list(cot_ids)
    uncond = prefix.uncond_ids + cot_uncond(list(cot_ids), special_ids(special, extra), special.cfg)
    image_head = [extra.answer, special.boi, special.size[base], special.ratio[ratio]] + step_token_ids(special)
    post = [special.eoi, extra.end_answer] + encode(ANSWER_SUFFIX)
    return assemble_diffusion_sequence(head, uncond, image_head, post, special, h, w, bucket, prefix.condition)


def diffusion_mask(seq: DiffusionSequence) -> torch.Tensor:
    """Dense [S, S] mask (for inspection and tests; the model builds it from slots)."""
    from dtgen.attention import structured_mask
    slots = torch.arange(seq.length)
    return structured_mask(slots, slots, seq.attention_blocks)


# ----------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------
# AR cache lengths are rounded up to a multiple of this (see `run_ar`).
AR_CACHE_ROUND = 256


# ----------------------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------------------
@dataclass
class T2IResult:
    image: torch.Tensor | None        # [H, W, 3] float32 in [0, 1] (main rank only)
    latents: torch.Tensor             # final latents [1, C, h, w] float32
    tokens: list[int]                 # AR tokens generated (CoT), without the ratio token
    ratio_index: int
    image_size: tuple[int, int]
    timings_ms: dict[str, float]
    record: dict[str, list] = field(default_factory=dict)


@dataclass
class ARBatchResult:
    """One request's AR phase out of `run_ar_batch`: what `run_ar` gives, and its logits."""

    tokens: list[int]                 # AR tokens generated (CoT), without the ratio token
    ratio_index: int
    logits: list[torch.Tensor]        # [V] per kept step: the prefill's, each kept token's, the image head's


# How the AR decode step attends: "sdpa" (masked SDPA over the whole cache, one request);
# "reference" / "triton" (the batched decode path: the fused prologue and split-KV attention
# over each request's own keys, as their torch references or the Triton kernels).
DECODE_IMPLS = ("sdpa", "reference", "triton")

Progress = Callable[[str, int, int], None]


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


@dataclass
class _Run:
    """What one request's phases share: its clock, timings, record, progress hook, profiler."""

    timer: "_Timer"
    timings: dict
    record: dict
    progress: Progress
    profiler: object


@dataclass
class DenoiseMember:
    """One request's share of a denoise batch (`run_denoise_batch`)."""

    req: T2IRequest
    seq: DiffusionSequence
    run: "_Run"
    condition: ConditionTokens | None = None
    noise: torch.Tensor | None = None   # initial latents [1, C, h, w]; None: drawn from the seed


@dataclass
class _Prepared:
    """What a request's AR phase leaves for its denoise."""

    seq: DiffusionSequence
    condition: ConditionTokens | None
    tokens: list[int]
    ratio: int
    image_size: tuple[int, int]


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


class _TokenReader:
    """Sampled token ids to the host, one step late, without stalling the device.

    `push(t)` queues a copy of the 0-d device tensor `t` into pinned memory behind the work
    that makes it; `pop()` returns the oldest queued id, waiting (on CUDA, for an event) only
    until that copy is done, not for work launched after the push. On the CPU both are plain.
    """

    def __init__(self, device: torch.device, slots: int = 4):
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(slots, dtype=torch.int64, pin_memory=self.cuda)
        self.pending: deque = deque()
        self.count = 0

    def push(self, token: torch.Tensor) -> None:
        if not self.cuda:
            self.pending.append(int(token))
            return
        slot = self.count % self.buffer.shape[0]
        self.count += 1
        self.buffer[slot:slot + 1].copy_(token.view(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((slot, done))

    def pop(self) -> int:
        item = self.pending.popleft()
        if not self.cuda:
            return item
        slot, done = item
        done.synchronize()
        return int(self.buffer[slot])


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self):
        """A point in the stream, without waiting for it: a CUDA event (a time on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark) -> None:
        if self.cuda:
            mark.synchronize()

    def ms(self, start, end) -> float:
        """Between two marks (both waited for)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


# What the pipeline does with its KV caches between phases and requests (`kv_caches`).
KV_CACHE_POLICIES = ("keep", "release")


class HunyuanT2IPipeline:
    def __init__(self, model: HunyuanImage3ForCausalMM, tokenizer, controller, device: torch.device,
                 is_main: bool = True, compile_options: CompileOptions | None = None, vae_group=None,
                 prompt_bucket: int | None = None, decode_impl: str | None = None,
                 kv_caches: str = "keep", vae_row_chunks: int = 1):
        """`vae_group`: a process group to split the VAE decode over (every member decodes its
        rows; the main rank gets the image); None decodes on the main rank alone.
        `prompt_bucket`: the AR prompt and the denoise text pad to a multiple of this many
        rows, so that prompts of similar length share every compiled graph (0: exact
        lengths; default: 256 when compiling, else 0, since padding only pays where shapes
        key graphs).
        `decode_impl` (DECODE_IMPLS): how the one-request AR decode step attends; default
        "triton" on CUDA, "sdpa" elsewhere. A phase with sequence parallelism keeps "sdpa"
        for it (the batched path attends over local heads); `decode_batch` always takes the
        batched path ("reference" where this is "sdpa").
        `kv_caches`: "keep" (the AR and denoise KV caches stay allocated between requests, at
        the same addresses, so a CUDA-graph decode step is recorded once) or "release" (the AR
        cache is freed when AR ends, the denoise caches when denoise ends, before the VAE
        decode: less memory at each phase's peak; the decode step records again every request).
        `vae_row_chunks` > 1: a decode on one rank runs its big maps' convolutions over that many
        slabs of rows (exact; fewer whole maps at once: `HunyuanVAE.decode`)."""
        if decode_impl is not None and decode_impl not in DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {DECODE_IMPLS}, got {decode_impl!r}")
        self.decode_impl = decode_impl or ("triton" if torch.device(device).type == "cuda" else "sdpa")
        self._programs: dict[int, int] = {}
        if vae_row_chunks < 1:
            raise ValueError(f"vae_row_chunks must be at least 1, got {vae_row_chunks}")
        self.vae_row_chunks = vae_row_chunks
        if kv_caches not in KV_CACHE_POLICIES:
            raise ValueError(f"kv_caches must be one of {KV_CACHE_POLICIES}, got {kv_caches!r}")
        self.kv_caches = kv_caches
        self.model = model
        self.vae_group = vae_group
        self.tok = tokenizer
        self.special: SpecialTokens = tokenizer.special
        self.controller = controller
        self.device = torch.device(device)
        self.is_main = is_main
        self.cfg = model.cfg
        # One compiled callable per step kind: each gets its own graphs (one per phase and
        # shape), and the decode step may replay as a CUDA graph.
        self.compiler = StepCompiler(compile_options or CompileOptions())
        options = self.compiler.options
        self.decode_cuda_graph = options.enabled and options.decode_cuda_graph and self.device.type == "cuda"
        self._graphed_decode: GraphedStep | None = None
        self._graphed_decode_batch: GraphedStep | None = None
        if options.enabled and options.regions:
            # One compiled region per decoder layer, shared by all of them; every step runs
            # eagerly around it, so dynamo traces one layer whatever the depth. The decode
            # step's eager code costs more host time than one token's GPU work, so on CUDA it
            # is recorded as a CUDA graph around the regions (dtgen/cuda_graph.py).
            self.model.model.run_layer = self.compiler.region(run_layer)
            self._prefill_fn = self.compiler.timed(self._ar_prefill)
            self._denoise_fn = self.compiler.timed(self.denoise_step)
            if self.decode_cuda_graph:
                self._graphed_decode = GraphedStep(self._ar_decode)
                self._decode_fn = self.compiler.timed(self._graphed_decode)
                self._graphed_decode_batch = GraphedStep(self._decode_batch_step)
                self._decode_batch_fn = self.compiler.timed(self._graphed_decode_batch)
            else:
                self._decode_fn = self.compiler.timed(self._ar_decode)
                self._decode_batch_fn = self.compiler.timed(self._decode_batch_step)
        else:
            self._prefill_fn = self.compiler.wrap(self._ar_prefill)
            self._decode_fn = self.compiler.wrap(self._ar_decode, cuda_graph=self.decode_cuda_graph)
            self._decode_batch_fn = self.compiler.wrap(self._decode_batch_step, cuda_graph=self.decode_cuda_graph)
            self._denoise_fn = self.compiler.wrap(self.denoise_step)
        # A cached step's head (final_layer alone) is a graph of its own in both modes.
        self._head_fn = self.compiler.wrap(self.head_velocity)
        self._caches = KVCachePool(static_addresses=self.compiler.options.enabled)
        if prompt_bucket is not None and prompt_bucket < 0:
            raise ValueError(f"prompt_bucket must be 0 (off) or a positive row count, got {prompt_bucket}")
        self.prompt_bucket = prompt_bucket if prompt_bucket is not None else (
            AR_CACHE_ROUND if self.compiler.options.enabled else 0)

    def _release_phase_caches(self, roles: str) -> None:
        """kv_caches="release": drop the kept caches whose role starts with `roles` ("ar",
        "denoise") and what was recorded over them, and hand the memory back."""
        if self.kv_caches != "release":
            return
        self._caches.drop(roles)
        for graphed in (self._graphed_decode, self._graphed_decode_batch) if roles == "ar" else ():
            if graphed is not None:  # its recordings hold the dropped cache's addresses
                graphed.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_caches(self) -> None:
        """Drop the KV caches kept between requests (after an out-of-memory error: the next
        request allocates them again; a CUDA-graph decode step then records again)."""
        self._caches.clear()
        for graphed in (self._graphed_decode, self._graphed_decode_batch):
            if graphed is not None:  # its recordings hold the old caches' addresses
                graphed.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- shared step: run rows at given slots through the stack, gather them back -------
    def _cache(self, rt, batch: int, length: int, reuse: str | None = None) -> KVCache:
        """A zeroed static KV cache. `reuse`: a role ("ar", "denoise0", ...) whose buffers are
        kept and zeroed again by the next request of the same shape: compiled graphs see the
        same addresses every request, so a CUDA-graph step is recorded once, not per request."""
        cfg = self.cfg
        attn = self.model.model.layers[0].self_attn
        kv_local = attn.qkv_proj.weight.shape[0] // ((attn.group + 2) * attn.head_dim)
        kv = rt.cache_kv_heads(kv_local * attn.group, kv_local)
        length = length + rt.seq.spare_slots()
        return self._caches.get(cfg.num_hidden_layers, batch, kv, length, cfg.head_dim,
                                self.model.lm_head.weight.dtype, self.device, role=reuse)

    def forward_rows(self, rt, embeds: torch.Tensor, rope_pos: torch.Tensor, slots: torch.Tensor | SlotRuns,
                     first_spare: int, image_blocks, cache: KVCache, hole: SlotHole | None = None) -> torch.Tensor:
        """embeds [B, n, H] at `slots` -> last hidden [B, n, H] (no ln_f), full rows on every rank.

        `slots`: a tensor [n] where they move every call (AR decode: one graph for all steps),
        or static runs ((start, end), ...) where they are fixed for the graph: then the
        attention runs mask-free pieces (`plan_segments`) on the fast kernels.
        `hole`: bucket padding inside the rows, hidden from every query (`DiffusionSequence`).
        `rope_pos` [n, 2], or [B, n, 2] with a per-row `hole`: batched requests of one bucket.
        """
        n = embeds.shape[1]
        runs = None
        if isinstance(slots, tuple):
            runs = rt.seq.pad_runs(slots, first_spare)
            slots = slots_of_runs(slots, self.device)
            if slots.shape[0] != n:
                raise ValueError(f"slot runs {runs} hold {slots.shape[0]} rows, but {n} rows are fed")
        meta = AttentionMeta(rt.seq.pad_slots(slots, first_spare), tuple(image_blocks), slot_runs=runs, hole=hole)
        h = self.model.model(rt.seq.shard(embeds, 1), rt.seq.shard(rope_pos, -2), meta, cache)
        return rt.seq.gather(h, 1, n)

    # ---- AR ---------------------------------------------------------------------------
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
        h = self.forward_rows(rt, embeds, rope, slots, total, blocks, cache)
        if all_rows:
            return self.model.logits(h[0])
        return self.model.logits(h[0, -1] if last is None else h[0].index_select(0, last)[0])

    def _ar_step(self, rt, ids, slots, cache, total, uniform, sampling: SamplingArgs, last=None, cond=None):
        """Logits [V] of the last row (or row `last`) and the token sampled from them (0-d, on the device)."""
        logits = self.ar_logits(rt, ids, slots, cache, total, last=last, cond=cond)
        return logits, sample_token(logits, uniform, sampling.temperature, sampling.top_k, sampling.top_p,
                                    sampling.candidates)

    # Two functions (two code objects), two compiled callables: the prompt and the one-token
    # step get separate graph caches, and only the decode step replays as a CUDA graph.
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
        logits, tokens = self._decode_batch_fn(rt, ids, positions, cache, tuple(uniforms), tuple(samplings))
        return logits.clone(), tokens.clone()   # a CUDA-graph replay reuses its buffers

    def run_ar_batch(self, reqs: list[T2IRequest], runs: list["_Run"] | None = None,
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
        prompts = [[sp.bos] + self._prompt_ids(r) for r in reqs]
        steps = [r.max_new_tokens if r.forced_tokens is None else len(r.forced_tokens) for r in reqs]
        padded = [ids + [sp.eos] * (self._bucket(len(ids)) - len(ids)) for ids in prompts]
        budget = 0
        for i, (ids, n, pad) in enumerate(zip(prompts, steps, padded)):
            self._check_budget(len(ids) + n + 2, f"request {i}'s AR sequence (prompt + max_new_tokens + "
                               "<boi><img_size>)")
            budget = max(budget, len(ids) + n + 2, len(pad))
        length = min(round_up(budget, AR_CACHE_ROUND), self.cfg.max_position_embeddings)
        N = len(reqs)
        cache = self._cache(rt, N, length, reuse=f"ar-batch{N}")
        gens = [torch.Generator(device=dev).manual_seed(r.seed) for r in reqs]
        samplings = tuple(Sampling(r.temperature, r.top_k, r.top_p).step_args(V, dev) for r in reqs)
        stops = [{sp.eos, *r.stop_ids} for r in reqs]
        logs: list[list[torch.Tensor]] = []
        current = []
        profiler = runs[0].profiler if runs is not None else NullProfiler()
        timer = runs[0].timer if runs is not None else _Timer(dev)
        for b in range(N):   # prefill, one request at a time, into its own row
            with profiler.region("ar_prefill"):
                t0 = timer.now()
                logits, token = self._feed(self._prefill_fn, rt, padded[b], 0, cache.rows(b, b + 1), length,
                                           samplings[b], gens[b], static_slots=True,
                                           rows=len(prompts[b]) if self.prompt_bucket else None)
                if runs is not None:
                    runs[b].timings["ar_prefill"] = (timer.now() - t0) * 1e3
            logs.append([logits])
            current.append(int(token))
        generated: list[list[int]] = [[] for _ in reqs]
        positions = [len(ids) for ids in prompts]
        active = [n > 0 for n in steps]
        gone = [False] * N   # left the batch at a boundary (cancelled, failed): no result
        dummy = torch.full((V,), 0.5, device=dev)   # draws of a row that sits out (never read)

        def boundary(done: int, decoding: list[int]) -> None:
            """Step boundary `done` of the requests in `decoding` (rows); those that leave sit out."""
            if batch is None:
                return
            for n in sorted({steps[b] for b in decoding}):   # one agreement per total: the progress says it
                for m in batch.boundary("ar", done, n, [index[b] for b in decoding if steps[b] == n]):
                    if m in index:
                        b = index.index(m)
                        gone[b], active[b] = True, False

        def step(fed: list[int], live: list[bool]):
            uniforms = tuple((torch.rand(V, generator=g, device=dev) if on else dummy) if s.draws else None
                             for g, s, on in zip(gens, samplings, live))
            return self.decode_batch(rt, torch.tensor(fed, device=dev).view(N, 1), torch.tensor(positions, device=dev),
                                     cache, uniforms, samplings)

        boundary(0, [b for b in range(N)])
        decode_s = [0.0] * N
        i = 0
        with profiler.region("ar_decode") as counted:
            t0 = timer.now()
            while any(active):
                fed = [(reqs[b].forced_tokens[i] if reqs[b].forced_tokens is not None else current[b]) if active[b]
                       else sp.eos for b in range(N)]
                logits, tokens = step(fed, active)
                tokens = tokens.tolist()
                reported = []
                for b in range(N):
                    if not active[b]:
                        continue
                    if fed[b] in stops[b] and not reqs[b].ignore_stop:
                        active[b] = False          # dropped: its slot is the image head's
                        decode_s[b] = timer.now() - t0
                        continue
                    generated[b].append(fed[b])
                    logs[b].append(logits[b])
                    current[b] = tokens[b]
                    positions[b] += 1
                    active[b] = len(generated[b]) < steps[b]
                    reported.append(b)
                    if not active[b]:
                        decode_s[b] = timer.now() - t0
                i += 1
                boundary(i, reported)
            if counted is not None:
                counted[1] = i
        # <boi><img_size_N> at each request's own next slots; the ratio from the last logits.
        with profiler.region("ar_image_head", units=2):
            for token in (sp.boi, sp.size[self.cfg.image_base_size]):
                logits, _ = step([token] * N, [True] * N)
                positions = [p + 1 for p in positions]
        results: list[ARBatchResult | None] = []
        for b, r in enumerate(reqs):
            too_long = self._sizes_too_long(len(prompts[b]) + len(generated[b]), logits.device)
            chosen = int(torch.argmax(logits[b][list(sp.ratio)].masked_fill(too_long, float("-inf"))))
            ratio = chosen if r.forced_ratio is None else r.forced_ratio
            if gone[b]:     # every rank agreed it left: no agreement on its tokens
                results.append(None)
                continue
            self._check_ranks_agree(generated[b], ratio)
            results.append(ARBatchResult(generated[b], ratio, logs[b] + [logits[b]]))
            if runs is not None:
                runs[b].record.setdefault("ar_logits", []).extend(logs[b] + [logits[b]])
                if generated[b]:
                    runs[b].timings["ar_decode_per_token"] = decode_s[b] * 1e3 / len(generated[b])
        return results

    def _feed(self, fn, rt, ids: list[int] | torch.Tensor, start: int, cache: KVCache, total: int,
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
        if not self.prompt_bucket:
            return n
        return max(n, min(round_up(n, self.prompt_bucket), self.cfg.max_position_embeddings))

    def run_ar(self, req: T2IRequest, run: "_Run",
               edit: tuple[InstructPrefix, ConditionTokens] | None = None) -> tuple[list[int], int | None]:
        """The AR phase: prefill, CoT decode, then (T2I) the ratio choice. `edit`: the Instruct
        prompt of an image edit and its condition rows; it ends with <think>, and the image's
        size comes from the request or the reference (ratio None here)."""
        rt = self.controller.activate("ar")
        record, timer, timings = run.record, run.timer, run.timings
        sp = self.special
        ids = [sp.bos] + self._prompt_ids(req) if edit is None else edit[0].ids + [self.tok.instruct.think]
        steps = req.max_new_tokens if req.forced_tokens is None else len(req.forced_tokens)
        budget = len(ids) + steps + 2
        self._check_budget(budget, "AR sequence (prompt + max_new_tokens + <boi><img_size>)")
        # The prefill's graph is keyed by the prompt length: pad it to its bucket. Exact: the
        # padding rows sit at the slots right after the prompt, which no real row sees
        # (causal), and each decode step rewrites the next of them before any query can see
        # it (a query at slot q sees slots <= q, and slot q is written by that same step).
        padded = ids + [sp.eos] * (self._bucket(len(ids)) - len(ids))
        budget = max(budget, len(padded))
        # The decode step's graph is keyed by the cache length: round it up so that prompts of
        # similar length share one graph (the mask hides the unused slots).
        length = min(round_up(budget, AR_CACHE_ROUND), self.cfg.max_position_embeddings)
        cache = self._cache(rt, 1, length, reuse="ar")
        # Every rank holds the same logits and the same generator state, so every rank draws
        # the same token; the draw stays on the device (`sample_token`).
        generator = torch.Generator(device=self.device).manual_seed(req.seed)
        # Tensors in the compiled steps: another temperature, top-k or top-p reuses their graphs.
        sampling = Sampling(req.temperature, req.top_k, req.top_p).step_args(self.cfg.vocab_size, self.device)
        stops = {sp.eos, *req.stop_ids}
        cond = None
        if edit is not None:
            stops.add(self.tok.instruct.answer)   # the model would start the image there
            cond = prompt_condition(edit[0].condition, edit[1], len(padded), self.device)

        with run.profiler.region("ar_prefill"):
            t0 = timer.now()
            logits, next_token = self._feed(self._prefill_fn, rt, padded, 0, cache, length, sampling, generator,
                                            static_slots=True, rows=len(ids) if self.prompt_bucket else None,
                                            cond=cond)
            timings["ar_prefill"] = (timer.now() - t0) * 1e3
        record.setdefault("ar_logits", []).append(logits)
        run.progress("ar", 0, steps)

        generated = []
        forced = req.forced_tokens is not None
        forced_ids = torch.tensor(req.forced_tokens or [0], device=self.device) if forced else None
        reader = _TokenReader(self.device)
        if not forced:
            reader.push(next_token)
        with run.profiler.region("ar_decode") as counted:
            t0 = timer.now()
            for i in tqdm(range(steps), desc="AR", disable=not self.is_main, leave=False):
                # Token i is fed before the host has read it: the step is launched first, and
                # only then does the host wait for token i (made by the previous step), so the
                # next step's host work overlaps this step's device time. If token i is a stop,
                # the step is dropped: the image head below rewrites its cache slot.
                fed = forced_ids[i].view(1, 1) if forced else next_token.view(1, 1)
                logits, next_token = self._feed(self._decode_fn, rt, fed, len(ids) + i, cache, length, sampling,
                                                generator)
                token = req.forced_tokens[i] if forced else reader.pop()
                if not forced:
                    reader.push(next_token)
                if token in stops and not req.ignore_stop:
                    break
                generated.append(token)
                record["ar_logits"].append(logits)
                run.progress("ar", i + 1, steps)
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
                logits, _ = self._feed(self._decode_fn, rt, [token], start + j, cache, length, sampling, generator)
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
        if not hasattr(self, "_size_rows"):  # <bos> + image head + image + <eoi>, per size
            base, down = self.cfg.image_base_size, self.cfg.vae_downsample_factor
            self._size_rows = [build_diffusion_sequence([], self.special, base, k, h // down[0], w // down[1]).real_length
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

    # ---- denoise ------------------------------------------------------------------------
    def denoise_cache(self, rt, batch: int, seq: DiffusionSequence, reuse: str | None = None) -> KVCache:
        return self._cache(rt, batch, seq.length, reuse)

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
            h = self.forward_rows(rt, embeds, rope, ((0, S),), S, seq.attention_blocks, cache, seq.hole)
            h = h[:, first:img1]
        else:
            # The step rows sit right before the image: the rows fed are one run of slots.
            h = self.forward_rows(rt, torch.cat([step, img], dim=1), rope[..., first:img1, :], ((first, img1),), S,
                                  seq.attention_blocks, cache, seq.hole)
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

    def run_denoise(self, req: T2IRequest, seq: DiffusionSequence, run: "_Run",
                    condition: ConditionTokens | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The denoise loop of one request: the batch of one (`run_denoise_batch`). `noise`: the
        initial latents [1, C, h, w] (default: drawn from the request's seed, as the official
        pipeline draws them). A step's `run.progress` that raises ends it with that error."""
        batch = BatchMembers(1, per_member([run.progress]))
        (latents,) = self.run_denoise_batch([DenoiseMember(req, seq, run, condition, noise)], batch)
        if latents is None:
            raise batch.left[0]
        return latents

    def run_denoise_batch(self, members: list["DenoiseMember"], batch: BatchMembers,
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
            heads = [partial(self._head_fn, t=t[:len(g)], step_rows=seq.step_rows, height=seq.height,
                             width=seq.width) for _ in now]
            full = partial(self._denoise_fn, rt, seq, ids, rows, t, cache, i == 0, cond, guidance, t_end)
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
                out.append(mine if distilled else classifier_free_guidance(mine[0:1], mine[1:2], members[p].req.guidance))
            return euler_step(latents, out[0] if n == 1 else torch.cat(out), float(sigmas[i]), float(sigmas[i + 1]))

        bar = tqdm(total=steps, desc="denoise", disable=not self.is_main, leave=False)
        finished: dict[int, torch.Tensor] = {}
        step_ms_of: dict[int, list[float]] = {}

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
            caches = [self._cache_rows(cache, torch.tensor([k * len(g) + j for k in keep for j in range(len(g))],
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

    def _cache_rows(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        """The batch rows `rows` of a KV cache, as a new one (members left a batch)."""
        kept = cache.select_rows(rows)
        if self._caches.static_addresses:
            for layer in kept.layers:
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
        return kept

    # ---- image editing: the reference image's condition --------------------------------
    def _instruct_tokens(self) -> InstructTokens:
        if self.tok.instruct is None:
            raise ValueError("image editing needs the Instruct template's special tokens (<think>, <recaption>, "
                             "<answer>, ...); this checkpoint's tokenizer has none")
        return self.tok.instruct

    def encode_condition(self, reference: torch.Tensor, seed: int) -> ConditionTokens:
        """uint8 [H, W, 3] -> the condition's rows: the VAE half (the image resized and cropped
        to its resolution bucket, encoded, a posterior SAMPLE drawn from a CPU generator seeded
        by `seed`, then patch-embedded at t = 0) and the ViT half (the original image in
        patches, the vision tower, the aligner; all rows, padding included)."""
        m, cfg, dev = self.model, self.cfg, self.device
        if m.vision_model is None or m.vae.encoder is None:
            raise ValueError("image editing needs the vision tower and the VAE encoder: load the model with "
                             "image_editing=True (--image does)")
        from PIL import Image
        bucket = vae_bucket(reference.shape[0], reference.shape[1], cfg.image_base_size)
        pixels = vae_pixels(resize_and_crop(Image.fromarray(reference.cpu().numpy()), bucket))
        latent = m.vae.encode(pixels.to(dev), torch.Generator().manual_seed(seed)).latent
        dtype = m.lm_head.weight.dtype
        values, attention, spatial = m.vision_processor(reference.cpu())
        rows = m.vision_aligner(m.vision_model(values.to(dev, m.vision_dtype), attention.to(dev), spatial.to(dev)))
        grid_rows, grid_cols = (int(v) for v in spatial[0])
        shape = ConditionShape(resolution_table(cfg.image_base_size).index(bucket), latent.shape[-2],
                               latent.shape[-1], grid_rows, grid_cols, values.shape[1])
        zero = torch.zeros(1, device=dev)
        return ConditionTokens(shape, m.timestep_token(zero).unsqueeze(1).to(dtype),
                               m.image_tokens(latent.to(dtype), zero).to(dtype), rows.to(dtype), latent)

    # ---- whole request -----------------------------------------------------------------
    def _prompt_ids(self, req: T2IRequest) -> list[int]:
        return list(req.prompt_ids) if req.prompt_ids is not None else self.tok.encode(req.prompt)

    def _check_budget(self, length: int, what: str) -> None:
        if length > self.cfg.max_position_embeddings:
            raise ValueError(f"{what} needs {length} positions; the model's max_position_embeddings is "
                             f"{self.cfg.max_position_embeddings}")

    def decode_image(self, latents: torch.Tensor) -> torch.Tensor | None:
        """VAE decode -> [H, W, 3] float32 in [0, 1] on the main rank (None on the others)."""
        vae = self.model.vae
        z = latents.to(next(vae.parameters()).dtype)
        if self.vae_group is not None:
            # Split along the longer latent side; group rank 0 receives the image.
            dim = "height" if z.shape[-2] >= z.shape[-1] else "width"
            x = parallel_decode(vae, z, self.vae_group, dim=dim, output=0)
        else:
            x = vae.decode(z, row_chunks=self.vae_row_chunks) if self.is_main else None
        if x is None:
            return None
        return (x[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).cpu()

    @torch.no_grad()
    def generate(self, req: T2IRequest, profiler=None, progress: Progress | None = None) -> T2IResult:
        """The whole request: the batch of one (`generate_batch`). `profiler`
        (dtgen.profiling.PhaseProfiler) traces each phase; `progress(phase, done, total)` is
        called after every AR token and denoise step (a stall watch, a progress bar, a fault
        injected for tests); what it raises ends the request."""
        (result,) = self.generate_batch([req], per_member([progress or _no_progress]), profiler)
        if isinstance(result, BaseException):
            raise result
        return result

    @torch.no_grad()
    def generate_batch(self, reqs: list[T2IRequest], progress: BatchHook,
                       profiler=None) -> list[T2IResult | BaseException]:
        """Several requests whose denoise steps run as rows of one batch: each request's
        condition and AR phase in turn (`run_ar_phases`), then one denoise batch per denoise
        shape among them (`denoise_key`; `run_denoise_batch`), then each VAE decode. Every
        step boundary goes through `progress(phase, done, total, members)` (dtgen/batching.py),
        which says who leaves the batch there (a cancel, a deadline, that request's own error);
        the others go on as if it had never been there. Returns, per request, its result or
        the exception it left with. An error inside a shared step raises: it ends them all."""
        for req in reqs:
            if req.cfg_mode not in ("serial", "batch"):
                raise ValueError(f"cfg_mode must be 'serial' or 'batch', got {req.cfg_mode!r}")
        batch = BatchMembers(len(reqs), progress)
        profiler = profiler or NullProfiler()
        runs = [_Run(_Timer(self.device), {}, {}, batch.progress_of(j), profiler) for j in range(len(reqs))]
        t_start = runs[0].timer.now()
        prepared = self.run_ar_phases(reqs, runs, batch)
        parts: dict[tuple, list[int]] = {}
        for j in batch.active:
            parts.setdefault(denoise_key(reqs[j], prepared[j].seq), []).append(j)
        latents: dict[int, torch.Tensor] = {}
        for part in parts.values():
            members = [DenoiseMember(reqs[j], prepared[j].seq, runs[j], prepared[j].condition) for j in part]
            with profiler.phase("denoise"):
                for j, out in zip(part, self.run_denoise_batch(members, batch, part)):
                    if out is not None:
                        latents[j] = out
        self._release_phase_caches("denoise")   # kv_caches="release": the VAE decode gets their memory
        results: list[T2IResult | BaseException] = []
        for j, (req, run) in enumerate(zip(reqs, runs)):
            if j not in latents or j not in batch.active:
                results.append(batch.left[j])
                continue
            image = None
            if self.is_main or self.vae_group is not None:
                with profiler.phase("vae", together=self.vae_group is not None), profiler.region("vae_decode"):
                    t0 = run.timer.now()
                    image = self.decode_image(latents[j])
                    run.timings["vae_decode"] = (run.timer.now() - t0) * 1e3
                try:
                    run.progress("vae", 1, 1)
                except MemberLeft:
                    results.append(batch.left[j])
                    continue
            p = prepared[j]
            run.timings["total"] = (run.timer.now() - t_start) * 1e3
            run.timings.setdefault("ar_decode_per_token", 0.0)
            results.append(T2IResult(image, latents[j], p.tokens, p.ratio, p.image_size, run.timings, run.record))
        return results

    def run_ar_phases(self, reqs: list[T2IRequest], runs: list["_Run"],
                      batch: BatchMembers) -> dict[int, "_Prepared"]:
        """The phases before the denoise, for the members still in the batch. Two or more
        text-to-image requests on a TP-only AR phase decode together (`run_ar_batch`: one step
        boundary per decode step for all of them); an edit, a lone request, or an SP AR phase
        runs its condition and AR alone (`run_ar`), every AR token a boundary of its own."""
        prepared = {}
        together = [j for j in batch.active if reqs[j].reference is None]
        if len(together) < 2 or self.controller.activate("ar").seq.size > 1:
            together = []
        ar = {}
        if together:
            with runs[together[0]].profiler.phase("ar"):
                results = self.run_ar_batch([reqs[j] for j in together], [runs[j] for j in together], batch, together)
            self._release_phase_caches("ar")
            ar = {j: r for j, r in zip(together, results) if r is not None}
        for j, (req, run) in enumerate(zip(reqs, runs)):
            if j not in batch.active or (j in together and j not in ar):
                continue
            try:
                prepared[j] = self._prepare_denoise(req, run, lambda e, j=j: batch.fail(j, e),
                                                    (ar[j].tokens, ar[j].ratio_index) if j in ar else None)
            except MemberLeft:
                continue
        return prepared

    def _prepare_denoise(self, req: T2IRequest, run: "_Run", fail,
                         ar: tuple[list[int], int] | None = None) -> "_Prepared | None":
        """One request's condition (an edit's), AR phase and diffusion sequence (`ar`: its AR
        tokens and ratio, when a batched AR phase made them). A sequence the model's positions
        cannot hold fails that request alone (`fail(error)`): every rank finds the same, from
        the same tokens, without a collective."""
        table = resolution_table(self.cfg.image_base_size)
        forced = parse_image_size(req.image_size, self.cfg.image_base_size)
        timer, timings = run.timer, run.timings
        edit = None
        if req.reference is not None:
            # The condition is computed once, here, on every rank (its modules are replicated,
            # so every rank gets the same rows), and kept for the AR prompt and the denoise
            # sequence: neither recomputed nor moved after the phase switch.
            with run.profiler.phase("condition"), run.profiler.region("condition_encode"):
                t0 = timer.now()
                condition = self.encode_condition(req.reference, req.seed)
                timings["condition_encode"] = (timer.now() - t0) * 1e3
            edit = (instruct_prefix(self.tok.encode, self.special, self._instruct_tokens(), self.cfg.image_base_size,
                                    condition.layout_shape, self._prompt_ids(req), req.system_prompt), condition)
        if ar is not None:
            tokens, ratio = ar
        else:
            with run.profiler.phase("ar"):
                tokens, ratio = self.run_ar(req, run, edit)
            self._release_phase_caches("ar")
        if forced is not None:
            ratio = forced
        elif ratio is None:   # an edit keeps the reference's shape
            ratio = edit[1].layout_shape.ratio
        height, width = table[ratio]
        down = self.cfg.vae_downsample_factor
        h, w = height // down[0], width // down[1]
        if edit is None:
            seq = build_diffusion_sequence(self._prompt_ids(req) + tokens, self.special,
                                           self.cfg.image_base_size, ratio, h, w, bucket=self.prompt_bucket)
        else:
            seq = build_instruct_diffusion_sequence(edit[0], tokens, self.tok.encode, self.special,
                                                    self.tok.instruct, self.cfg.image_base_size, ratio, h, w,
                                                    bucket=self.prompt_bucket)
        try:
            self._check_budget(seq.real_length, f"diffusion sequence for a {height}x{width} image")
        except ValueError as e:
            fail(e)
            raise MemberLeft(-1) from None
        return _Prepared(seq, None if edit is None else edit[1], tokens, ratio, (height, width))

    def warm_up(self, shapes: list[tuple[int, str]], template: T2IRequest,
                progress: Progress | None = None, cached_step: bool = True) -> list[float]:
        """Compile ahead of traffic: one short request (`warmup_request`: 2 denoise steps, 3
        with `cached_step`, so a step-cache request finds its head's graph too) per (prompt
        tokens, image size) in `shapes`, with `template`'s other settings. Every prompt whose AR
        prompt, AR cache and denoise text land in the same buckets then runs on graphs made
        here. The AR phase replays `template.max_new_tokens` filler tokens, so the denoise
        text is prompt + max_new_tokens long: requests that stop earlier may fall into a
        smaller denoise bucket (warm that one up too, as a shorter prompt). Returns the
        seconds each shape took."""
        base = self.cfg.image_base_size
        for tokens, size in shapes:   # all checked before any compiles
            if size == "auto" or parse_image_size(size, base) is None:
                raise ValueError(f"warm-up shape {tokens}:{size}: give the image size as HxW from the table "
                                 "(with 'auto' the model picks it, so the shape is not known ahead)")
            if tokens < 1:
                raise ValueError(f"warm-up shape {tokens}:{size}: the prompt needs at least 1 token (<bos>)")
            self._check_budget(tokens + template.max_new_tokens + 2,
                               f"warm-up shape {tokens}:{size} (prompt + max_new_tokens + <boi><img_size>)")
        seconds = []
        for tokens, size in shapes:
            t0 = time.perf_counter()
            self.generate(replace(warmup_request(template, cached_step), prompt_ids=filler_ids(tokens - 1), image_size=size,
                                  forced_tokens=filler_ids(template.max_new_tokens)), progress=progress)
            seconds.append(time.perf_counter() - t0)
        return seconds


def warmup_request(req: T2IRequest, cached_step: bool = False) -> T2IRequest:
    """A short request of `req`'s shapes that compiles every graph `req` runs: the whole-
    sequence first step and a KV-cached one (2 steps), and with a step cache (or
    `cached_step`: a server, whose requests may ask for one) a cached step too (3 steps: two
    full, then one cached: the head's own graph). The cache's knobs change no shape, so any
    config that reaches a cached step does."""
    if req.step_cache is None and not cached_step:
        return replace(req, steps=min(req.steps, 2))
    return replace(req, steps=3, step_cache=TaylorConfig(interval=3, first_enhance=True, first_enhance_steps=2))


def filler_ids(n: int) -> tuple[int, ...]:
    """n fixed token ids, for benchmarks and warm-ups, where only the length matters."""
    return tuple(1 + (i * 37) % 200 for i in range(n))


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    return (image * 255).round().to(torch.uint8)
