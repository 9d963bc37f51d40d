"""Text-to-image with HunyuanImage-3.0: AR stage, ratio choice, CFG denoising, VAE decode.

The pipeline runs inside phases that a controller activates ("ar", then "denoise"); what a
phase changes (weight views, collectives, attention core, sequence sharding) reaches this
code only through the `PhaseRuntime` it is handed. With the `single` plan every layout is
the identity and this is the plain single-process pipeline.

`HunyuanT2IPipeline` composes one part per job, each an object in its own file, built with
what it uses and nothing of the others': the decoder stack and its KV caches (`DecoderStack`,
stack.py), the AR phase (`ARPhase`, ar.py), the denoise phase (`DenoisePhase`, denoise.py),
an edit's condition (`EditCondition`, condition.py); the request types are requests.py's, the
diffusion sequence diffusion_sequence.py's. What is left here is the whole request: its
phases in order, what the AR phase leaves for the denoise, the VAE decode and the warm-up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from dtgen.batching import BatchHook, BatchMembers, MemberLeft, Progress, per_member
from dtgen.compile import CompileOptions
from dtgen.compiled_steps import CompiledSteps
from dtgen.profiling import NullProfiler
from dtgen.requests import RequestError

from .ar import ARBatchResult, ARPhase
from .condition import EditCondition
from .denoise import DenoiseMember, DenoisePhase, denoise_key
from .diffusion_sequence import DiffusionSequence, build_diffusion_sequence, build_instruct_diffusion_sequence
from .instruct import ConditionTokens, InstructPrefix
from .model import HunyuanImage3ForCausalMM
from .parallel_vae import parallel_decode
from .requests import Limits, RequestRun, T2IRequest, T2IResult, filler_ids, no_progress, warmup_request
from .resolutions import parse_image_size, resolution_table
from .spec import BUCKETS
from .stack import DecoderStack
from .tokenizer import SpecialTokens

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
    """"auto": channels-last for a bf16 / fp16 VAE on CUDA (`python -m bench vae decode`: bf16_cl_*
    against bf16_fast_*), else ncdhw (float32 stays on the golden-exact path)."""
    if vae is None:
        return "ncdhw"
    if layout != "auto":
        return layout
    dtype = next(vae.parameters()).dtype
    return "channels-last" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "ncdhw"


def _part(part: str, name: str, settable: bool = False) -> property:
    """`name` of the pipeline's part `part`, read (and with `settable`, replaced) through the
    pipeline: what tests, benchmarks and the CLI read off the pipeline stays where they read it."""
    def get(self):
        return getattr(getattr(self, part), name)

    def set_(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, set_ if settable else None, doc=f"`{part}.{name}`")


class HunyuanT2IPipeline:
    """The whole request through its parts: `stack` (DecoderStack), `ar_phase` (ARPhase),
    `denoise_phase` (DenoisePhase), `edit_condition` (EditCondition). Each part is built here
    with exactly what it uses; they share the pipeline's `CompiledSteps` (`steps`), which
    holds one compiled callable per step kind."""

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
        if vae_row_chunks < 1:
            raise ValueError(f"vae_row_chunks must be at least 1, got {vae_row_chunks}")
        if prompt_bucket is not None and prompt_bucket < 0:
            raise ValueError(f"prompt_bucket must be 0 (off) or a positive row count, got {prompt_bucket}")
        self.model = model
        self.cfg = model.cfg
        self.tok = tokenizer
        self.special: SpecialTokens = tokenizer.special
        self.controller = controller
        self.device = torch.device(device)
        self.is_main = is_main
        self.vae_group = vae_group
        # One compiled callable per step kind, made by the part that owns the step: each gets
        # its own graphs (one per phase and shape), and the decode steps may replay as CUDA
        # graphs (dtgen/compiled_steps.py).
        self.steps = CompiledSteps(compile_options, self.device)
        self.compiler = self.steps.compiler
        self.decode_cuda_graph = self.steps.cuda_graph
        self.prompt_bucket = prompt_bucket if prompt_bucket is not None else (
            BUCKETS.text_rows if self.compiler.options.enabled else 0)
        self.stack = DecoderStack(model, self.device, self.steps, kv_caches)
        self.ar_phase = ARPhase(self.stack, tokenizer, controller, self.steps, self.prompt_bucket,
                                decode_impl or ("triton" if self.device.type == "cuda" else "sdpa"), is_main)
        self.denoise_phase = DenoisePhase(self.stack, controller, self.steps, is_main)
        self.edit_condition = EditCondition(model, tokenizer, self.device, vae_row_chunks)
        self.loras = None
        vae = getattr(model, "vae", None)
        self.vae_layout = _resolve_vae_layout(vae_layout, vae, self.device)
        if vae is not None:   # set both ways: the model may have served another pipeline's choice
            cl = self.vae_layout == "channels-last"
            vae.set_channels_last(cl and vae_group is None, decoder=True, encoder=False)
            vae.set_channels_last(cl, decoder=False, encoder=True)

    # What tests, benchmarks and the CLI read off the pipeline, each from the part that owns it.
    kv_caches = _part("stack", "kv_caches", settable=True)   # a benchmark switches the policy between runs
    # One setting for both VAE directions: the edit's encode holds it, the decode here reads it.
    vae_row_chunks = _part("edit_condition", "vae_row_chunks", settable=True)
    _caches = _part("stack", "cache_pool")
    _cache = _part("stack", "cache")
    forward_rows = _part("stack", "forward_rows")
    decode_impl = _part("ar_phase", "decode_impl")
    ar_logits = _part("ar_phase", "ar_logits")
    decode_batch = _part("ar_phase", "decode_batch")
    _feed = _part("ar_phase", "feed")
    _prefill_fn = _part("ar_phase", "prefill_fn")
    _decode_fn = _part("ar_phase", "decode_fn")
    _decode_batch_fn = _part("ar_phase", "decode_batch_fn")
    _graphed_decode = _part("ar_phase", "graphed_decode")
    denoise_cache = _part("denoise_phase", "denoise_cache")
    denoise_step = _part("denoise_phase", "denoise_step")
    predict_velocity = _part("denoise_phase", "predict_velocity")
    head_velocity = _part("denoise_phase", "head_velocity")
    _denoise_fn = _part("denoise_phase", "step_fn", settable=True)   # a test records the full step's hidden rows
    encode_condition = _part("edit_condition", "encode_condition")

    def run_ar(self, req: T2IRequest, run: RequestRun,
               edit: tuple[InstructPrefix, ConditionTokens] | None = None) -> tuple[list[int], int | None]:
        """One request's AR phase (`ARPhase.run_ar`)."""
        return self.ar_phase.run_ar(req, run, edit)

    def run_ar_batch(self, reqs: list[T2IRequest], runs: list[RequestRun] | None = None,
                     batch: BatchMembers | None = None, index: list[int] | None = None) -> list[ARBatchResult | None]:
        """Several text-to-image requests' AR phase together (`ARPhase.run_ar_batch`)."""
        return self.ar_phase.run_ar_batch(reqs, runs, batch, index)

    def run_denoise(self, req: T2IRequest, seq: DiffusionSequence, run: RequestRun,
                    condition: ConditionTokens | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """One request's denoise loop (`DenoisePhase.run_denoise`)."""
        return self.denoise_phase.run_denoise(req, seq, run, condition, noise)

    @property
    def loras(self):
        """dtgen.lora.ResidentLoras: the adapters a request's `loras` may name (None: no adapters).
        The denoise phase reads them too: the shared loop sets each call's rows from them."""
        return self.denoise_phase.loras

    @loras.setter
    def loras(self, loras) -> None:
        self.denoise_phase.loras = loras
        # the CUDA-graphed decode steps bake in the adapters their rows carry: one recording
        # per adapter set, all dropped when an adapter is loaded or unloaded
        self.steps.graph_state = None if loras is None else loras.graph_key
        if loras is not None:
            loras.on_change.append(self.steps.reset_graphs)

    def run_denoise_batch(self, members: list[DenoiseMember], batch: BatchMembers,
                          in_batch: list[int] | None = None) -> list[torch.Tensor | None]:
        """The denoise loop of one denoise shape's members (`DenoisePhase.run_denoise_batch`)."""
        return self.denoise_phase.run_denoise_batch(members, batch, in_batch)

    def release_caches(self) -> None:
        """Drop the KV caches kept between requests (`DecoderStack.release`)."""
        self.stack.release()

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
        self._set_loras(reqs)
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
        self.stack.release_phase("denoise")   # kv_caches="release": the VAE decode gets their memory
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

    def _set_loras(self, reqs: list[T2IRequest]) -> None:
        """Every row of every phase carries the requests' adapters (their `loras`), in the AR
        and the denoise phase alike. The requests of one batch carry the same adapters here:
        a `RequestError` naming `loras` otherwise, and for a name that is not resident."""
        adapters = {tuple(req.loras) for req in reqs}
        if self.loras is None:
            if any(adapters):
                raise RequestError("loras", "this pipeline has no LoRA adapters resident (the CLI's --lora)")
            return
        if len(adapters) > 1:
            raise RequestError("loras", f"the requests of one batch carry different adapters ({sorted(adapters)}): "
                                        "HunyuanImage-3 runs one adapter set a batch")
        (rows,) = adapters
        try:
            self.loras.check(rows)
        except ValueError as e:
            raise RequestError("loras", str(e)) from None
        self.loras.set_rows([rows])

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
            self.stack.release_phase("ar")
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
        edit = None
        if req.reference is not None:
            edit = self.edit_condition.prepare_edit(req, run, self.ar_phase.prompt_ids(req))
        if ar is not None:
            tokens, ratio = ar
        else:
            with run.profiler.phase("ar"):
                tokens, ratio = self.run_ar(req, run, edit)
            self.stack.release_phase("ar")
        if forced is not None:
            ratio = forced
        elif ratio is None:   # an edit keeps the reference's shape
            ratio = edit[1].layout_shape.ratio
        height, width = table[ratio]
        down = self.cfg.vae_downsample_factor
        h, w = height // down[0], width // down[1]
        if edit is None:
            seq = build_diffusion_sequence(self.ar_phase.prompt_ids(req) + tokens, self.special,
                                           self.cfg.image_base_size, ratio, h, w, bucket=self.prompt_bucket)
        else:
            seq = build_instruct_diffusion_sequence(edit[0], tokens, self.tok.encode, self.special,
                                                    self.tok.instruct, self.cfg.image_base_size, ratio, h, w,
                                                    bucket=self.prompt_bucket)
        try:
            self.stack.check_budget(seq.real_length, f"diffusion sequence for a {width}x{height} (WIDTHxHEIGHT) image")
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
            self.stack.check_budget(tokens + template.max_new_tokens + 2,
                               f"warm-up shape {tokens}:{size} (prompt + max_new_tokens + <boi><img_size>)")
        seconds = []
        for tokens, size in shapes:
            t0 = time.perf_counter()
            warm = replace(warmup_request(template, cached_step), prompt_ids=filler_ids(tokens - 1), image_size=size,
                           forced_tokens=filler_ids(template.max_new_tokens))
            self.generate(warm, progress=progress)
            seconds.append(time.perf_counter() - t0)
        return seconds


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    return (image * 255).round().to(torch.uint8)
