"""One validation of a text-to-image request, for the CLI and the server.

`check_t2i_request` names the first bad field of a `T2IRequest` in a `RequestError`; the
CLI turns it into `error: --flag ...` and exit status 2, the server into a 422 naming the
JSON field. Limits that need the tokenizer (the prompt's length against the model's
positions) are checked here too, so a request is refused before it is queued.
"""
from __future__ import annotations

from dtgen.serve.errors import RequestError
from dtgen.step_cache import StepCacheError, TaylorConfig, step_cache_config
from models.hunyuan_image3.pipeline import T2IRequest, parse_image_size
from models.hunyuan_image3.resolutions import resolution_table

MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
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
            raise StepCacheError(key, f"is not an official Taylor-cache keyword; known: taylor_cache_"
                                      + ", taylor_cache_".join(OFFICIAL_TAYLOR_KNOBS))
        knobs[OFFICIAL_TAYLOR_KNOBS[name]] = value
    return step_cache_config("taylor", **knobs)


def check_t2i_request(req: T2IRequest, image_base_size: int, max_positions: int | None = None,
                      prompt_tokens: int | None = None, distilled: bool = False) -> None:
    """Raise `RequestError(field, message)` for the first bad field of `req`.

    `prompt_tokens` (the prompt's ids without <bos>) and `max_positions` bound the AR
    sequence: <bos> + prompt + max_new_tokens + <boi><img_size>. `distilled`: the checkpoint
    is CFG-distilled (one row a step; the guidance is embedded).
    """
    if req.prompt_ids is None and (not isinstance(req.prompt, str) or not req.prompt.strip()):
        raise RequestError("prompt", "must be a non-empty string")
    _int_at_least("steps", req.steps, 1, MAX_STEPS)
    _int_at_least("seed", req.seed, 0, MAX_SEED)
    _int_at_least("max_new_tokens", req.max_new_tokens, 0)
    _int_at_least("top_k", req.top_k, 0, note=" (0: off)")
    for name, value, low, low_ok, high in (("guidance", req.guidance, 0.0, True, 100.0),
                                           ("flow_shift", req.flow_shift, 0.0, False, 100.0),
                                           ("temperature", req.temperature, 0.0, True, 100.0),
                                           ("top_p", req.top_p, 0.0, False, 1.0)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise RequestError(name, f"must be a number, got {value!r}")
        if value < low or (value == low and not low_ok) or value > high:
            bound = f"{'>=' if low_ok else '>'} {low:g} and <= {high:g}"
            raise RequestError(name, f"must be {bound}, got {value:g}")
    if req.cfg_mode not in ("serial", "batch"):
        raise RequestError("cfg_mode", f"must be 'serial' or 'batch', got {req.cfg_mode!r}")
    if distilled and req.cfg_mode != "serial":
        raise RequestError("cfg_mode", "does not apply: this checkpoint is CFG-distilled (one row a step, "
                                       "the guidance embedded as a token)")
    check_step_cache(req.step_cache)
    try:
        parse_image_size(req.image_size, image_base_size)
    except (ValueError, AttributeError) as e:
        text = str(e).removeprefix("image size ") if isinstance(e, ValueError) else "must be 'auto' or 'HxW'"
        raise RequestError("image_size", text) from None
    if max_positions and prompt_tokens is not None:
        need = 1 + prompt_tokens + req.max_new_tokens + 2
        if need > max_positions:
            raise RequestError("prompt", f"{prompt_tokens} prompt tokens + {req.max_new_tokens} new tokens + 3 "
                                         f"special tokens need {need} positions; the model has {max_positions}")


def _int_at_least(name: str, value, low: int, high: int | None = None, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise RequestError(name, f"must be {bound}{note}, got {value}")


def check_step_cache(config) -> None:
    """RequestError("step_cache", ...) unless `config` is None or a valid config of a method
    this pipeline runs."""
    if config is None:
        return
    method = getattr(config, "method", None)
    if method not in STEP_CACHES:
        raise RequestError("step_cache", f"HunyuanImage-3 runs the step caches {', '.join(STEP_CACHES)}; "
                                         f"got {method or type(config).__name__!r}")
    try:
        config.check()
    except StepCacheError as e:
        raise RequestError("step_cache", f"{e.knob}: {e.message}") from None


# ---- sizes: what a user types is WIDTHxHEIGHT (OpenAI's `size`), everywhere -----------------
# The CLI's --image-size and --warmup-shapes, the server's `size` and the UI all read
# WIDTHxHEIGHT; only `T2IRequest.image_size` (the pipeline's, internal) is "HxW".
def size_to_hw(size, field: str, base: int) -> str:
    """"auto" or "WIDTHxHEIGHT" from the model's table -> the pipeline's "auto" / "HxW";
    `RequestError(field, ...)` in the user's order otherwise, with the nearest sizes."""
    if not isinstance(size, str):
        raise RequestError(field, f"must be 'auto' or 'WIDTHxHEIGHT', got {size!r}")
    if size == "auto":
        return size
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise RequestError(field, f"{size!r} is not 'auto' or 'WIDTHxHEIGHT' (e.g. {base}x{base})")
    w, h = (int(p) for p in parts)
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
                    max_positions: int, field: str = "size", condition_prefix: int | None = None,
                    encode=None, instruct=None) -> None:
    """Refuse, before any work, a request whose AR or denoise sequence would not fit the
    model's positions: `RequestError(field, ...)` naming the image size, or the prompt when
    even the AR part does not fit. With size "auto" the model picks among the sizes that
    fit (the pipeline), so only the smallest needs to. `condition_prefix`: an edit's
    Instruct prefix (the InstructPrefix), whose rows replace <bos> + prompt."""
    from models.hunyuan_image3.pipeline import build_diffusion_sequence, build_instruct_diffusion_sequence
    from models.hunyuan_image3.pipeline import filler_ids
    cot = list(filler_ids(req.max_new_tokens))
    head = 1 + len(prompt_ids) if condition_prefix is None else len(condition_prefix.ids) + 1
    ar = head + req.max_new_tokens + 2
    if ar > max_positions:
        raise RequestError("prompt", f"{head} prompt rows + {req.max_new_tokens} new tokens + 2 image-head tokens "
                                     f"need {ar} positions; the model has {max_positions}")
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
