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
