"""One validation of a text-to-image request, for the CLI and the server.

`check_t2i_request` names the first bad field of a `T2IRequest` in a `RequestError`; the
CLI turns it into `error: --flag ...` and exit status 2, the server into a 422 naming the
JSON field. Limits that need the tokenizer (the prompt's length against the model's
positions) are checked here too, so a request is refused before it is queued.
"""
from __future__ import annotations

from dtgen.serve.errors import RequestError
from models.hunyuan_image3.pipeline import T2IRequest, parse_image_size

MAX_STEPS = 1000
MAX_SEED = 2**63 - 1


def check_t2i_request(req: T2IRequest, image_base_size: int, max_positions: int | None = None,
                      prompt_tokens: int | None = None) -> None:
    """Raise `RequestError(field, message)` for the first bad field of `req`.

    `prompt_tokens` (the prompt's ids without <bos>) and `max_positions` bound the AR
    sequence: <bos> + prompt + max_new_tokens + <boi><img_size>.
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
