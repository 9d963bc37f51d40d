"""A HunyuanImage-3 request: its type and its one check, its result, and what its phases share.

`T2IRequest` is what the pipeline runs, `T2IResult` what it gives back, `RequestRun` what a
request's phases share while it runs (its clock, timings, record, progress, profiler).
`T2IRequest.check(limits)` names the first bad field in a `RequestError` (dtgen/requests.py):
the CLI turns it into `error: --flag ...` and exit status 2, the server into a 422 naming
the JSON field; the pipeline runs it on every request it is given. With the tokenizer in
`limits`, the position budget of the whole request (its AR and denoise sequences) is checked
too, so a request is refused before it is queued.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dtgen.batching import Progress
from dtgen.profiling import NullProfiler
from dtgen.requests import MAX_SEED, MAX_STEPS, parse_size
from dtgen.schema import check_bounds, loras_field, request_field
from dtgen.requests import RequestError
from dtgen.step_cache import StepCacheError, TaylorConfig, merged_report, step_cache_config
from dtgen.timing import Timer
from models.hunyuan_image3.diffusion_sequence import build_diffusion_sequence, build_instruct_diffusion_sequence
from models.hunyuan_image3.resolutions import parse_image_size, resolution_table

if TYPE_CHECKING:
    import torch

    from dtgen.step_cache import StepCacheConfig

# The step caches this model's pipeline runs (dtgen/step_cache.py): both keep the decoder
# stack's output, which is all a KV-cached denoise step exposes.
STEP_CACHES = ("taylor", "taylorseer")
# The official command line's Taylor-cache flags (run_image_gen.py; `generate_image` takes
# them as keywords, `taylor_cache_*`) -> TaylorConfig's knobs.
OFFICIAL_TAYLOR_KNOBS = {"interval": "interval", "order": "order", "enable_first_enhance": "first_enhance",
                         "first_enhance_steps": "first_enhance_steps", "enable_tailing_enhance": "tailing_enhance",
                         "tailing_enhance_steps": "tailing_enhance_steps", "low_freqs_order": "low_freqs_order",
                         "high_freqs_order": "high_freqs_order"}


def taylor_from_official(kwargs: dict) -> TaylorConfig | None:
    """The official `generate_image` keywords (`use_taylor_cache`, `taylor_cache_<knob>`) as a
    TaylorConfig; None when the cache is off. Unknown keywords raise StepCacheError."""
    if not kwargs.get("use_taylor_cache"):
        return None
    knobs = {}
    for key, value in kwargs.items():
        if key == "use_taylor_cache":
            continue
        name = key.removeprefix("taylor_cache_")
        if name not in OFFICIAL_TAYLOR_KNOBS:
            raise StepCacheError(key, "is not an official Taylor-cache keyword; known: taylor_cache_"
                                      + ", taylor_cache_".join(OFFICIAL_TAYLOR_KNOBS))
        knobs[OFFICIAL_TAYLOR_KNOBS[name]] = value
    return step_cache_config("taylor", **knobs)


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's config, and with its tokenizer (`encode`,
    `special`, `instruct`) the position budget too."""

    image_base_size: int = 1024
    distilled: bool = False             # CFG-distilled: one row a step, the guidance embedded
    max_positions: int | None = None
    latent_down: tuple[int, int] = (16, 16)
    tokenizer: object = None

    @classmethod
    def of(cls, cfg, tokenizer=None) -> "Limits":
        """From a `HunyuanImage3Config` (and the tokenizer, for the budget)."""
        return cls(cfg.image_base_size, bool(cfg.cfg_distilled), cfg.max_position_embeddings,
                   tuple(cfg.vae_downsample_factor), tokenizer)


@dataclass
class T2IRequest:
    """What one image (or edit) takes. The fields a user sets are declared once here
    (dtgen/schema.py): the CLI's flags, the server's JSON fields and the docs' table come
    from these declarations; the rest are set by code (benchmarks, warm-ups, an edit's image)."""
    # the CLI's own --prompt flags make several requests a run (models/hunyuan_image3/cli.py)
    prompt: str = request_field("A photo of a red fox in fresh snow", required=True, empty_ok=False,
                                help="what the image shows (or, with an image, what to change in it)")
    seed: int = request_field(0, low=0, high=MAX_SEED, help="the initial noise's seed")
    steps: int = request_field(50, low=1, high=MAX_STEPS, json="num_inference_steps", flag_default=None,
                               help="denoise steps (default: the checkpoint's generation_config.json diff_infer_steps, "
                                    "else 50)")
    guidance: float = request_field(5.0, low=0.0, high=100.0, json="guidance_scale", flag_default=None,
                                    help="guidance scale: the CFG weight, or on a CFG-distilled checkpoint the "
                                         "embedded guidance (default: generation_config.json diff_guidance_scale, "
                                         "else 5.0)")
    flow_shift: float = request_field(3.0, low=0.0, high=100.0, low_open=True, json=None, flag_default=None,
                                      help="the flow-matching shift (default: generation_config.json flow_shift, "
                                           "else 3.0)")
    # "auto" or the pipeline's "HxW"; what a user gives (--image-size, `size`) is WIDTHxHEIGHT,
    # which the front ends turn into it with the model's table at hand (`size_to_hw`)
    image_size: str = request_field("auto", json="size",
                                    help="'auto' (the model picks the ratio among the sizes that fit) or "
                                         "WIDTHxHEIGHT from the table")
    max_new_tokens: int = request_field(0, low=0, flag_default=None,
                                        help="AR tokens before the image (default: 16 on the tiny model, 0 on a "
                                             "checkpoint)")
    temperature: float = request_field(0.6, low=0.0, high=100.0, json=None, help="the AR tokens' sampling temperature")
    top_k: int = request_field(1024, low=0, note="0: off", json=None, help="the AR tokens: sample among the k likeliest")
    top_p: float = request_field(0.95, low=0.0, high=1.0, low_open=True, json=None,
                                 help="the AR tokens: sample within this probability mass")
    stop_ids: tuple[int, ...] = ()  # besides <eos>
    # "serial": one branch at a time; "batch": [cond, uncond] as B=2
    cfg_mode: str = request_field("serial", choices=("serial", "batch"), json=None, flag_default=None,
                                  help="the two CFG branches one at a time ('serial', the default) or as a batch of "
                                       "2; a CFG-distilled checkpoint runs one row and takes neither")
    forced_tokens: tuple[int, ...] | None = None  # replay these AR tokens instead of sampling
    prompt_ids: tuple[int, ...] | None = None     # token ids to use instead of encoding `prompt`
    # always decode max_new_tokens (fixed-length benchmarks)
    ignore_stop: bool = request_field(False, flag="--ignore-eos", json=None, help="always decode --max-new-tokens tokens")
    forced_ratio: int | None = None               # skip the ratio choice
    # Image editing (the Instruct template): a reference image, uint8 [H, W, 3] RGB (see
    # cond_image.load_reference_image), and the system prompt written before the user turn.
    reference: torch.Tensor | None = None
    system_prompt: str = request_field("", routes=("edits",), help="with --image: the system prompt before the user turn")
    # Fewer full denoise steps (dtgen/step_cache.py): HunyuanImage-3 takes "taylor" (the
    # official Taylor cache) and "taylorseer"; None computes every step.
    step_cache: StepCacheConfig | None = request_field(
        None, kind="step_cache", methods=STEP_CACHES, model="HunyuanImage-3",
        help="compute fewer full denoise steps: 'taylor' (the official Taylor cache; knobs interval, order, "
             "first_enhance, first_enhance_steps, tailing_enhance, tailing_enhance_steps, low_freqs_order, "
             "high_freqs_order) or 'taylorseer' (diffusers'; interval, disable_before, disable_after, order, "
             "factors_dtype); e.g. taylor:interval=5,order=2")
    # LoRA adapters (dtgen/lora), applied in both phases (AR and denoise)
    # The command's adapters only: a CUDA-graph decode step replays the adapter set it was
    # recorded with, so a server's requests cannot switch sets (yet).
    loras: tuple[tuple[str, float], ...] = loras_field()

    def check(self, limits: Limits, edit_prefix=None) -> None:
        """Raise `RequestError(field, message)` for the first bad field; then, with the
        tokenizer in `limits`, for a request whose sequences the model's positions cannot
        hold (`check_positions`; `edit_prefix(prompt_ids)`: an edit's InstructPrefix)."""
        # token ids given: the prompt's text is not read
        check_bounds(self, skip=("prompt",) if self.prompt_ids is not None else ())
        if limits.distilled and self.cfg_mode != "serial":
            raise RequestError("cfg_mode", "does not apply: this checkpoint is CFG-distilled (one row a step, "
                                           "the guidance embedded as a token)")
        try:
            parse_image_size(self.image_size, limits.image_base_size)
        except ValueError as e:
            raise RequestError("image_size", str(e).removeprefix("image size ")) from None
        tok = limits.tokenizer
        if tok is not None and limits.max_positions:
            ids = list(self.prompt_ids) if self.prompt_ids is not None else tok.encode(self.prompt)
            check_positions(self, ids, tok.special, limits.image_base_size, limits.latent_down,
                            limits.max_positions, condition_prefix=edit_prefix(ids) if edit_prefix else None,
                            encode=tok.encode, instruct=tok.instruct)


@dataclass
class T2IResult:
    image: torch.Tensor | None        # [H, W, 3] float32 in [0, 1] (main rank only)
    latents: torch.Tensor             # final latents [1, C, h, w] float32
    tokens: list[int]                 # AR tokens generated (CoT), without the ratio token
    ratio_index: int
    image_size: tuple[int, int]
    timings_ms: dict[str, float]
    record: dict[str, list] = field(default_factory=dict)


def no_progress(phase: str, done: int, total: int) -> None:
    pass


@dataclass
class RequestRun:
    """What one request's phases share: its clock, timings, record, progress hook, profiler;
    for the denoise loop (dtgen/denoise_loop.py `MemberRun`) its step cache's config, set by
    the denoise phase from the request, and the steps' times."""

    timer: Timer
    timings: dict
    record: dict
    progress: Progress
    profiler: object
    cache_config: StepCacheConfig | None = None
    step_ms: list[float] = field(default_factory=list)

    def keep_step(self, latents: torch.Tensor, branches: torch.Tensor, guided: torch.Tensor) -> None:
        """A denoise step's record: the latents it started from and this request's rows of the
        velocity, conditional branch first (the official pipeline's tensors)."""
        self.record.setdefault("velocity", []).append(branches)
        self.record.setdefault("step_latents", []).append(latents)

    def report_caches(self, segments: list[tuple]) -> None:
        """`record["step_cache"]`: the step caches' decisions (one denoiser: one segment). This
        model's caches (STEP_CACHES) decide ahead, the same on every rank of a CFG axis: there is
        nothing to gather."""
        report = merged_report([cache for _, caches, _, _ in segments for cache in caches])
        if report is not None:
            self.record["step_cache"] = [report]

    @classmethod
    def fresh(cls, device, progress: Progress = no_progress, profiler=None) -> "RequestRun":
        """A run starting now on `device`: a new clock, no timings or record yet; without a
        hook or a profiler (a test's, a bench's), nothing reports progress and nothing traces."""
        return cls(Timer(device), {}, {}, progress, profiler or NullProfiler())


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


# ---- sizes: what a user types is WIDTHxHEIGHT (OpenAI's `size`), everywhere -----------------
# The CLI's --image-size and --warmup-shapes, the server's `size` and the UI all read
# WIDTHxHEIGHT; only `T2IRequest.image_size` (the pipeline's, internal) is "HxW".
def size_to_hw(size, field: str, base: int) -> str:
    """"auto" or "WIDTHxHEIGHT" from the model's table -> the pipeline's "auto" / "HxW";
    `RequestError(field, ...)` in the user's order otherwise, with the nearest sizes."""
    parsed = parse_size(size, field, f"{base}x{base}", auto=True)
    if parsed is None:
        return "auto"
    w, h = parsed
    table = resolution_table(base)
    if (h, w) not in table:
        near = sorted(table, key=lambda s: abs(s[1] / s[0] - w / max(h, 1)))[:3]
        raise RequestError(field, f"{w}x{h} is not one of the model's sizes (WIDTHxHEIGHT); nearest: "
                                  + ", ".join(f"{b}x{a}" for a, b in near))
    return f"{h}x{w}"


def hw_to_size(hw: str) -> str:
    """The pipeline's "HxW" (or "auto") -> "WIDTHxHEIGHT"."""
    if hw == "auto":
        return hw
    h, w = hw.split("x")
    return f"{w}x{h}"


def check_positions(req: T2IRequest, prompt_ids: list[int], special, base: int, latent_down: tuple[int, int],
                    max_positions: int, field: str = "image_size", condition_prefix=None,
                    encode=None, instruct=None) -> None:
    """Refuse, before any work, a request whose AR or denoise sequence would not fit the
    model's positions: `RequestError(field, ...)` naming the image size, or the prompt when
    even the AR part does not fit. With size "auto" the model picks among the sizes that
    fit (the pipeline), so only the smallest needs to. `condition_prefix`: an edit's
    Instruct prefix (the InstructPrefix), whose rows replace <bos> + prompt."""
    cot = list(filler_ids(req.max_new_tokens))
    head = 1 + len(prompt_ids) if condition_prefix is None else len(condition_prefix.ids) + 1
    ar = head + req.max_new_tokens + 2
    if ar > max_positions:
        # the new tokens are at fault when the prompt alone would fit: name the field to lower
        room = max_positions - head - 2
        field_at_fault = "max_new_tokens" if req.max_new_tokens > 0 and room >= 0 else "prompt"
        raise RequestError(field_at_fault, f"{head} prompt rows + {req.max_new_tokens} new tokens + 2 image-head "
                                           f"tokens need {ar} positions; the model has {max_positions}"
                                           + (f" (at most {room} new tokens with this prompt)"
                                              if field_at_fault == "max_new_tokens" else ""))
    table = resolution_table(base)
    forced = parse_image_size(req.image_size, base)
    if forced is None and condition_prefix is not None:
        forced = condition_prefix.condition.shape.ratio     # an edit keeps the reference's bucket
    candidates = [forced] if forced is not None else range(len(table))

    def length(ratio: int) -> int:
        height, width = table[ratio]
        h, w = height // latent_down[0], width // latent_down[1]
        if condition_prefix is None:
            return build_diffusion_sequence(prompt_ids + cot, special, base, ratio, h, w).real_length
        return build_instruct_diffusion_sequence(condition_prefix, cot, encode, special, instruct, base, ratio,
                                                 h, w).real_length

    need = {ratio: length(ratio) for ratio in candidates}
    if min(need.values()) > max_positions:
        ratio = min(need, key=need.get)
        height, width = table[ratio]
        what = f"a {width}x{height} image" if forced is not None else f"even the smallest size, {width}x{height},"
        raise RequestError(field, f"{what} with this prompt and {req.max_new_tokens} new tokens needs "
                                  f"{need[ratio]} positions; the model has {max_positions} (max_position_embeddings)")
