"""Text-to-image with HunyuanImage-3.0: AR stage, ratio choice, CFG denoising, VAE decode.

The pipeline runs inside phases that a controller activates ("ar", then "denoise"); what a
phase changes (weight views, collectives, attention core, sequence sharding) reaches this
code only through the `PhaseRuntime` it is handed. With the `single` plan every layout is
the identity and this is the plain single-process pipeline.

`HunyuanT2IPipeline` composes one part per job, each in its own file: the decoder stack and
its KV caches (stack.py), the AR phase (ar.py), the denoise phase (denoise.py), an edit's
condition (condition.py); the request types are requests.py's, the diffusion sequence
diffusion_sequence.py's. What is left here is the whole request: its phases in order, the
VAE decode and the warm-up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from dtgen.attention import KVCachePool
from dtgen.batching import BatchHook, BatchMembers, MemberLeft, Progress, per_member
from dtgen.compile import CompileOptions
from dtgen.compiled_steps import CompiledSteps
from dtgen.profiling import NullProfiler

from .ar import DECODE_IMPLS, ARPhase
from .condition import EditCondition
from .denoise import DenoiseMember, DenoisePhase, denoise_key
from .diffusion_sequence import DiffusionSequence, build_diffusion_sequence, build_instruct_diffusion_sequence
from .instruct import ConditionTokens
from .model import HunyuanImage3ForCausalMM
from .parallel_vae import parallel_decode
from .requests import Limits, RequestRun, T2IRequest, T2IResult, filler_ids, no_progress, warmup_request
from .resolutions import parse_image_size, resolution_table
from .spec import BUCKETS
from .stack import KV_CACHE_POLICIES, DecoderStack
from .tokenizer import SpecialTokens
from .transformer import run_layer

# The profile table's rows for this pipeline's timings (dtgen.profiling.PhaseProfiler).
PROFILE_ROWS = (("ar_prefill", "AR prefill", "ms"), ("ar_decode_per_token", "AR decode", "ms/token"),
                ("phase_switch", "phase switch", "ms"), ("denoise_step", "denoise", "ms/step"),
                ("vae_decode", "VAE decode", "ms"), ("total", "total", "ms"))


@dataclass
class _Prepared:
    """What a request's AR phase leaves for its denoise."""

    seq: DiffusionSequence
    condition: ConditionTokens | None
    tokens: list[int]
    ratio: int
    image_size: tuple[int, int]


VAE_LAYOUTS = ("auto", "channels-last", "ncdhw")


def _resolve_vae_layout(layout: str, vae, device: torch.device) -> str:
    """"auto": channels-last for a bf16 / fp16 VAE on CUDA (bench_vae --suite: bf16_cl_*
    against bf16_fast_*), else ncdhw (float32 stays on the golden-exact path)."""
    if vae is None:
        return "ncdhw"
    if layout != "auto":
        return layout
    dtype = next(vae.parameters()).dtype
    return "channels-last" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "ncdhw"


class HunyuanT2IPipeline(DecoderStack, ARPhase, DenoisePhase, EditCondition):
    def __init__(self, model: HunyuanImage3ForCausalMM, tokenizer, controller, device: torch.device,
                 is_main: bool = True, compile_options: CompileOptions | None = None, vae_group=None,
                 prompt_bucket: int | None = None, decode_impl: str | None = None,
                 kv_caches: str = "keep", vae_row_chunks: int = 1, vae_layout: str = "auto"):
        """`vae_group`: a process group to split the VAE decode over (every member decodes its
        rows; the main rank gets the image); None decodes on the main rank alone.
        `prompt_bucket`: the AR prompt and the denoise text pad to a multiple of this many
        rows, so that prompts of similar length share every compiled graph (0: exact
        lengths; default: the spec's `BUCKETS.text_rows`, 256, when compiling, else 0, since
        padding only pays where shapes key graphs).
        `decode_impl` (DECODE_IMPLS): how the one-request AR decode step attends; default
        "triton" on CUDA, "sdpa" elsewhere. A phase with sequence parallelism keeps "sdpa"
        for it (the batched path attends over local heads); `decode_batch` always takes the
        batched path ("reference" where this is "sdpa").
        `kv_caches`: "keep" (the AR and denoise KV caches stay allocated between requests, at
        the same addresses, so a CUDA-graph decode step is recorded once) or "release" (the AR
        cache is freed when AR ends, the denoise caches when denoise ends, before the VAE
        decode: less memory at each phase's peak; the decode step records again every request)
        or "keep-ar" (the denoise caches released as by "release", the AR cache kept: its
        CUDA-graph decode records once, for the AR cache's bytes at the denoise and VAE peaks).
        `vae_row_chunks` > 1: a decode on one rank, and an edit's reference encode, run their
        big maps' convolutions over that many slabs of rows (exact; fewer whole maps at once:
        `HunyuanVAE.decode`, `HunyuanVAE.encode`).
        `vae_layout` (VAE_LAYOUTS): "channels-last" runs the VAE's maps channels_last_3d from
        its first conv to its last (`HunyuanVAE.set_channels_last`: cuDNN's bf16 convs without
        layout conversions), "ncdhw" the plain layout (the float32 golden path); "auto" picks
        channels-last for a bf16 / fp16 VAE on CUDA, else ncdhw. A split decode (`vae_group`)
        keeps its decoder on ncdhw (its halo convs); an edit's encode still follows the choice."""
        if vae_layout not in VAE_LAYOUTS:
            raise ValueError(f"vae_layout must be one of {VAE_LAYOUTS}, got {vae_layout!r}")
        if vae_layout == "channels-last" and vae_group is not None:
            raise ValueError("vae_layout='channels-last' applies to a decode on one rank; the split decode "
                             "(vae_group) runs its halo convs NCDHW: pass vae_layout='auto' or no vae_group")
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
        vae = getattr(model, "vae", None)
        self.vae_layout = _resolve_vae_layout(vae_layout, vae, torch.device(device))
        if vae is not None:   # set both ways: the model may have served another pipeline's choice
            cl = self.vae_layout == "channels-last"
            vae.set_channels_last(cl and vae_group is None, decoder=True, encoder=False)
            vae.set_channels_last(cl, decoder=False, encoder=True)
        self.tok = tokenizer
        self.special: SpecialTokens = tokenizer.special
        self.controller = controller
        self.device = torch.device(device)
        self.is_main = is_main
        self.cfg = model.cfg
        # One compiled callable per step kind: each gets its own graphs (one per phase and
        # shape), and the decode steps may replay as CUDA graphs (dtgen/compiled_steps.py).
        self.steps = CompiledSteps(compile_options, self.device)
        self.compiler = self.steps.compiler
        self.decode_cuda_graph = self.steps.cuda_graph
        if self.steps.regions:
            # One compiled region per decoder layer, shared by all of them; every step runs
            # eagerly around it, so dynamo traces one layer whatever the depth. The decode
            # step's eager code costs more host time than one token's GPU work, so on CUDA it
            # is recorded as a CUDA graph around the regions (dtgen/cuda_graph.py).
            self.model.model.run_layer = self.steps.region(run_layer)
        self._prefill_fn = self.steps.step(self._ar_prefill)
        self._decode_fn = self.steps.step(self._ar_decode, cuda_graph=True)
        self._decode_batch_fn = self.steps.step(self._decode_batch_step, cuda_graph=True)
        self._denoise_fn = self.steps.step(self.denoise_step)
        self._graphed_decode = self.steps.graphed_of(self._ar_decode)   # its recordings, for tests
        # A cached step's head (final_layer alone) is a graph of its own in both modes.
        self._head_fn = self.steps.whole(self.head_velocity)
        self._caches = KVCachePool(static_addresses=self.compiler.options.enabled)
        if prompt_bucket is not None and prompt_bucket < 0:
            raise ValueError(f"prompt_bucket must be 0 (off) or a positive row count, got {prompt_bucket}")
        self.prompt_bucket = prompt_bucket if prompt_bucket is not None else (
            BUCKETS.text_rows if self.compiler.options.enabled else 0)

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
        (result,) = self.generate_batch([req], per_member([progress or no_progress]), profiler)
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
        # Without the tokenizer: the positions are checked per member as its sequences are built.
        limits = Limits.of(self.cfg)
        for req in reqs:
            req.check(limits)   # the request's one check (the CLI's and the server's): a bad field, before any work
        batch = BatchMembers(len(reqs), progress)
        profiler = profiler or NullProfiler()
        runs = [RequestRun.fresh(self.device, batch.progress_of(j), profiler) for j in range(len(reqs))]
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

    def run_ar_phases(self, reqs: list[T2IRequest], runs: list[RequestRun],
                      batch: BatchMembers) -> dict[int, _Prepared]:
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

    def _prepare_denoise(self, req: T2IRequest, run: RequestRun, fail,
                         ar: tuple[list[int], int] | None = None) -> _Prepared | None:
        """One request's condition (an edit's), AR phase and diffusion sequence (`ar`: its AR
        tokens and ratio, when a batched AR phase made them). A sequence the model's positions
        cannot hold fails that request alone (`fail(error)`): every rank finds the same, from
        the same tokens, without a collective."""
        table = resolution_table(self.cfg.image_base_size)
        forced = parse_image_size(req.image_size, self.cfg.image_base_size)
        edit = self.prepare_edit(req, run) if req.reference is not None else None
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
            self._check_budget(seq.real_length, f"diffusion sequence for a {width}x{height} (WIDTHxHEIGHT) image")
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


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    return (image * 255).round().to(torch.uint8)
