"""What every model's request check shares: the size string, number ranges, step caches, and
the names a front end gives a field. A request's fields are declared with dtgen/schema.py,
which checks their bounds with these.

A model's request dataclass validates itself (`req.check(...)`, one per request type) and
raises `RequestError(field, message)`: `field` is the request's attribute, `message` reads
after it ("must be >= 1, got 0"). The CLI prints `--flag message`, the server answers 422
with `json_name: message`; both rename the field with `renamed`. Sizes are WIDTHxHEIGHT
wherever a user types one (the CLI, the server's `size`, the UI).
"""
from __future__ import annotations

from dtgen.step_cache import StepCacheError, parse_step_cache

MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
MAX_SIDE = 4096   # px: the largest image or video side a request may ask for


class RequestError(ValueError):
    """A user error in one field of a request: the CLI exits 2 with it, the server answers
    422. `field` is the request's own name for it (the CLI maps it to its flag)."""

    one_line = True   # raised on ranks alike: printed once, without a traceback (dtgen.launch)

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def split_size(text) -> tuple[int, int] | None:
    """"AxB" (any case, spaces around the numbers allowed) -> (A, B); None when it is not two
    whole numbers joined by an x."""
    parts = text.lower().split("x") if isinstance(text, str) else ()
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def parse_size(text, field: str, example: str, auto: bool = False) -> tuple[int, int] | None:
    """A user's "WIDTHxHEIGHT" -> (width, height); "auto" -> None when `auto` allows it;
    `RequestError(field, ...)` otherwise (`example`: a size of this model, for the message)."""
    if auto and text == "auto":
        return None
    size = split_size(text)
    if size is None:
        wanted = "'auto' or 'WIDTHxHEIGHT'" if auto else "'WIDTHxHEIGHT'"
        raise RequestError(field, f"{text!r} is not {wanted} (e.g. {example})")
    return size


def check_text(field: str, value, empty_ok: bool = False) -> None:
    """A string: a prompt's not empty nor blank, unless `empty_ok` (a negative prompt may be)."""
    if not isinstance(value, str):
        raise RequestError(field, "must be a non-empty string" if not empty_ok else f"must be a string, got {value!r}")
    if not empty_ok and not value.strip():
        raise RequestError(field, "must be a non-empty string")


def check_int(field: str, value, low: int, high: int | None = None, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(field, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise RequestError(field, f"must be {bound}{note}, got {value}")


def check_number(field: str, value, low: float, high: float, low_ok: bool = True) -> None:
    """A real number (not NaN, not a bool) in [low, high], or (low, high] without `low_ok`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise RequestError(field, f"must be a number, got {value!r}")
    if value < low or (value == low and not low_ok) or value > high:
        raise RequestError(field, f"must be {'>=' if low_ok else '>'} {low:g} and <= {high:g}, got {value:g}")


def nearest_valid(n: int, step: int, offset: int = 0) -> tuple[int, int]:
    """The valid values (offset + k * step, k >= 1) just below and just above n."""
    below = max(offset + step, offset + (n - offset) // step * step)
    return below, below + step


def check_side(field: str, value, multiple: int, high: int = MAX_SIDE) -> None:
    """An image side in px: an integer in [1, high] and a multiple of `multiple` (the VAE's
    factor x the patch size: whole tokens); the nearest valid sides named otherwise."""
    check_int(field, value, 1, high, note=" px")
    check_multiple(field, value, multiple)


def check_multiple(field: str, value: int, multiple: int) -> None:
    """An image side (an integer, checked) that is a multiple of `multiple` px, the nearest
    valid sides named otherwise."""
    if value < multiple or value % multiple:
        lo, hi = nearest_valid(value, multiple)
        raise RequestError(field, f"{value} must be a multiple of {multiple} (VAE x patch size); nearest valid: "
                                  f"{lo} or {hi}")


def check_frame_count(field: str, frames: int, temporal: int) -> None:
    """A video's frame count that maps to whole latent frames: `temporal` k + 1 (the first
    latent frame holds one video frame, each other `temporal`), the nearest valid named otherwise."""
    if (frames - 1) % temporal:
        lo, hi = nearest_valid(frames, temporal, 1)
        raise RequestError(field, f"{frames} does not map to whole latent frames (it must be {temporal}k + 1); "
                                  f"nearest valid: {lo} or {hi}")


def check_step_cache(spec, model: str | None = None, methods: tuple[str, ...] | None = None) -> None:
    """`RequestError("step_cache", ...)` unless `spec` (a config, its text or dict form) is None
    or a valid config (of one of `methods`, the ones `model`'s pipeline runs, when it runs
    only some)."""
    try:
        config = parse_step_cache(spec)
        if config is None:
            return
        if methods is not None and config.method not in methods:
            raise RequestError("step_cache", f"{model} runs the step caches {', '.join(methods)}; "
                                             f"got {config.method!r}")
        config.check()
    except StepCacheError as e:
        raise RequestError("step_cache", f"{e.knob}: {e.message}") from None


def renamed(error: RequestError, names: dict[str, str]) -> RequestError:
    """`error` under a front end's name for its field (a JSON field, a CLI flag). Where one
    name stands for several fields (width and height: `size`), the message says which."""
    if error.field not in names:
        return error
    name = names[error.field]
    shared = sum(1 for v in names.values() if v == name) > 1
    return RequestError(name, f"{error.field} {error.message}" if shared else error.message)


def flag_line(error: RequestError, flags: dict[str, str]) -> str:
    """A request error as the CLI's one line: `--flag message`."""
    e = renamed(error, flags)
    return f"{e.field} {e.message}"


# OpenAI's fields for the answer's encoding, which the server reads before a model's adapter
# sees the rest (dtgen.serve.adapters.take_image_output): named among the accepted ones.
IMAGE_OUTPUT_FIELDS = ("output_format", "output_compression")


def check_image_fields(fields: dict, accepted) -> None:
    """OpenAI's image-generation fields every image adapter takes alike: no field outside
    `accepted`, a `prompt`, `n` 1 (one image a request) and `response_format` "b64_json"."""
    accepted = list(accepted)
    unknown = sorted(k for k in fields if k not in accepted)
    if unknown:
        raise RequestError(unknown[0], f"unknown field; accepted: {', '.join(accepted + list(IMAGE_OUTPUT_FIELDS))}")
    if "prompt" not in fields:
        raise RequestError("prompt", "is required")
    if fields.get("n", 1) != 1:
        raise RequestError("n", f"must be 1 (one image per request), got {fields['n']!r}")
    if fields.get("response_format", "b64_json") != "b64_json":
        raise RequestError("response_format", f"must be 'b64_json', got {fields['response_format']!r}")
