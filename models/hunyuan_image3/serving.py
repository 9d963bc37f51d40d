"""HunyuanImage-3 text-to-image behind `dtgen.serve`: the adapter a server plugs in.

Request fields (JSON), OpenAI's first:
- `prompt` (required), `n` (1), `size` ("auto" or OpenAI's "WIDTHxHEIGHT", one of the
  model's resolutions), `response_format` ("b64_json"), `model` (accepted, ignored);
- the model's own: `seed`, `num_inference_steps`, `guidance_scale`, `max_new_tokens`,
  `step_cache` (fewer full denoise steps: "taylor", "taylor:interval=5,order=2", or
  {"method": "taylor", "interval": 5, ...}; `taylorseer` too; null: every step in full).
Fields not given take the server's defaults (the T2I example's flags). Any other field is
refused by name. Validation is `check_t2i_request`, the CLI's own.
"""
from __future__ import annotations

import base64
import io
from dataclasses import replace

from dtgen.compile import unique_graphs
from dtgen.serve.errors import RequestError
from dtgen.step_cache import StepCacheError, parse_step_cache
from models.hunyuan_image3.pipeline import (HunyuanT2IPipeline, T2IRequest, filler_ids, resolution_table, to_uint8,
                                            warmup_request)
from models.hunyuan_image3.requests import check_t2i_request

# JSON field -> T2IRequest field (None: OpenAI's, handled here)
FIELDS = {"prompt": "prompt", "seed": "seed", "num_inference_steps": "steps", "guidance_scale": "guidance",
          "max_new_tokens": "max_new_tokens", "size": "image_size", "step_cache": "step_cache", "n": None,
          "response_format": None, "model": None}
_JSON_NAME = {t2i: name for name, t2i in FIELDS.items() if t2i is not None}


def png_b64(image) -> str:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image).numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class HunyuanServeAdapter:
    """`defaults`: the request every field not given comes from. `warmup_shapes`: (prompt
    tokens, "HxW") to compile ahead of traffic (`pipe.warm_up`); None warms up with one
    short request of the defaults' shape. `inject_failure` (tests): (rank, phase, step):
    raise there, once."""

    def __init__(self, pipe: HunyuanT2IPipeline, rank: int, defaults: T2IRequest,
                 warmup_shapes: list[tuple[int, str]] | None = None, warmup: bool = True,
                 inject_failure: tuple[int, str, int] | None = None):
        self.pipe, self.rank, self.defaults = pipe, rank, defaults
        self.warmup_shapes, self.warmup = warmup_shapes, warmup
        self.inject_failure = inject_failure

    # ---- rank 0: fields -> request ----------------------------------------------------
    def parse(self, fields: dict) -> T2IRequest:
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise RequestError(unknown[0], f"unknown field; accepted: {', '.join(FIELDS)}")
        if "prompt" not in fields:
            raise RequestError("prompt", "is required")
        if fields.get("n", 1) != 1:
            raise RequestError("n", f"must be 1 (one image per request), got {fields['n']!r}")
        if fields.get("response_format", "b64_json") != "b64_json":
            raise RequestError("response_format", f"must be 'b64_json', got {fields['response_format']!r}")
        values = {FIELDS[k]: v for k, v in fields.items() if FIELDS[k] is not None}
        if "image_size" in values:
            values["image_size"] = _height_by_width(values["image_size"])
        if "step_cache" in values:
            # "taylor:interval=5" or {"method": "taylor", "interval": 5}; null: no cache
            try:
                values["step_cache"] = parse_step_cache(values["step_cache"])
            except StepCacheError as e:
                raise RequestError(f"step_cache.{e.knob}", e.message) from None
        req = replace(self.defaults, **values)
        cfg = self.pipe.cfg
        try:
            tokens = len(self.pipe.tok.encode(req.prompt)) if isinstance(req.prompt, str) else None
            check_t2i_request(req, cfg.image_base_size, cfg.max_position_embeddings, tokens, cfg.cfg_distilled)
        except RequestError as e:
            if e.field == "image_size":  # in OpenAI's order: the pipeline's message is in HxW
                h, w = (req.image_size.split("x") + [""])[:2]
                sizes = sorted(resolution_table(cfg.image_base_size), key=lambda s: abs(s[1] / s[0] - _ratio(w, h)))
                raise RequestError("size", f"{w}x{h} is not one of the model's sizes (WIDTHxHEIGHT); nearest: "
                                           + ", ".join(f"{b}x{a}" for a, b in sizes[:3])) from None
            raise RequestError(_JSON_NAME.get(e.field, e.field), e.message) from None
        return req

    # ---- every rank -------------------------------------------------------------------
    def generate(self, req: T2IRequest, progress) -> dict | None:
        graphs = unique_graphs()
        result = self.pipe.generate(req, progress=progress)
        if self.rank != 0:
            return None
        h, w = result.image_size
        return {"image": {"b64_json": png_b64(result.image)}, "size": f"{w}x{h}", "seed": req.seed,
                "ar_tokens": len(result.tokens),
                # graphs this request compiled: 0 for every request of a warmed-up bucket
                "new_graphs": unique_graphs() - graphs,
                "timings_ms": {k: round(v, 3) for k, v in result.timings_ms.items()},
                # which denoise steps ran in full and which a step cache reused (None: no cache)
                "step_cache": (result.record.get("step_cache") or [None])[0]}

    def warm_up(self, progress) -> None:
        if self.warmup_shapes:
            self.pipe.warm_up(self.warmup_shapes, self.defaults, progress=progress)
        elif self.warmup:
            self.pipe.generate(replace(warmup_request(self.defaults, cached_step=True),
                                       forced_tokens=filler_ids(self.defaults.max_new_tokens)), progress=progress)

    def free_caches(self) -> None:
        self.pipe.release_caches()

    def on_step(self, phase: str, done: int, total: int) -> None:
        if self.inject_failure == (self.rank, phase, done):
            self.inject_failure = None  # once
            raise RuntimeError(f"injected failure on rank {self.rank} after {phase} step {done}")


def _height_by_width(size) -> str:
    """OpenAI's "WIDTHxHEIGHT" (or "auto") -> the pipeline's "HxW"."""
    if not isinstance(size, str):
        raise RequestError("size", f"must be 'auto' or 'WIDTHxHEIGHT', got {size!r}")
    if size == "auto":
        return size
    parts = size.lower().split("x")
    if len(parts) != 2:
        raise RequestError("size", f"{size!r} is not 'auto' or 'WIDTHxHEIGHT'")
    return f"{parts[1]}x{parts[0]}"


def _ratio(width: str, height: str) -> float:
    try:
        return int(width) / int(height)
    except (ValueError, ZeroDivisionError):
        return 1.0
