"""Qwen-Image text-to-image behind `dtgen.serve`: the adapter a server plugs in
(`POST /v1/images/generations`, and `/v1/jobs`; text to image only: no edits route).

Request fields (JSON, or form text), OpenAI's first:
- `prompt` (required), `n` (1), `size` ("WIDTHxHEIGHT", multiples of 16 px; "auto": the
  server's default size), `response_format` ("b64_json"), `model` and `user` (accepted, ignored);
- the model's own: `negative_prompt`, `seed`, `num_inference_steps`, `true_cfg_scale`
  (QwenImagePipeline's; <= 1: no CFG), `step_cache` (text, an object, or null for none).
Fields not given take the server's defaults (the CLI's flags). Checked by `T2IRequest.check`,
the CLI's own, before the job is queued.
"""
from __future__ import annotations

import base64
import io
from dataclasses import replace

import torch

from dtgen.requests import check_image_fields, parse_size, renamed
from dtgen.serve.adapters import DiffusionAdapter
from dtgen.serve.errors import RequestError
from dtgen.step_cache import StepCacheError, parse_step_cache
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest

# JSON name -> (T2IRequest attribute or None: OpenAI's, handled here; what form text becomes)
FIELDS = {"prompt": ("prompt", str), "negative_prompt": ("negative_prompt", str), "size": (None, str),
          "seed": ("seed", int), "num_inference_steps": ("steps", int), "true_cfg_scale": ("true_cfg_scale", float),
          "step_cache": ("step_cache", str), "n": (None, int), "response_format": (None, str), "model": (None, str),
          "user": (None, str)}
_JSON_NAME = {attr: name for name, (attr, _) in FIELDS.items() if attr} | {"width": "size", "height": "size"}
FORM_TYPES = {name: kind for name, (_, kind) in FIELDS.items()}


def png_b64(image: torch.Tensor) -> str:
    """[H, W, 3] uint8 -> a base64 PNG."""
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class QwenServeAdapter(DiffusionAdapter):
    """`defaults`: the request every field not given comes from; `warmup`: run it once (2
    steps) before /ready."""

    kind = "image"
    name = "Qwen-Image"
    can_edit = False
    edit_problem = "Qwen-Image is served for text to image only"

    def __init__(self, pipe: QwenImagePipeline, rank: int, defaults: T2IRequest, warmup: bool = True):
        self.pipe, self.rank, self.defaults, self.warmup = pipe, rank, defaults, warmup
        m = pipe.model
        self.multiple = m.vae.cfg.spatial_factor * m.transformer.cfg.patch_size

    def defaults_dict(self) -> dict:
        d = self.defaults
        return {"size": f"{d.width}x{d.height}", "num_inference_steps": d.steps, "seed": d.seed,
                "true_cfg_scale": d.true_cfg_scale}

    # ---- rank 0: fields -> request ----------------------------------------------------
    def parse(self, fields: dict, form: bool = False) -> T2IRequest:
        if form:
            from dtgen.serve.forms import coerce
            fields = coerce(fields, FORM_TYPES)
        check_image_fields(fields, FIELDS)
        values = {FIELDS[k][0]: v for k, v in fields.items() if FIELDS[k][0] is not None}
        if fields.get("size", "auto") != "auto":
            values["width"], values["height"] = parse_size(fields["size"], "size", "1024x1024")
        if "step_cache" in values:
            try:
                values["step_cache"] = parse_step_cache(values["step_cache"])
            except StepCacheError as e:
                raise RequestError(f"step_cache.{e.knob}", e.message) from None
        req = replace(self.defaults, **values)
        try:
            req.check(self.multiple)
        except RequestError as e:
            raise renamed(e, _JSON_NAME) from None
        return req

    # ---- every rank -------------------------------------------------------------------
    def generate(self, req: T2IRequest, progress) -> dict | None:
        result = self.run(req, progress)
        if self.rank != 0:
            return None
        return self.answer(result, image={"b64_json": png_b64(result.image)}, size=f"{req.width}x{req.height}",
                           seed=req.seed)

    def on_step(self, phase: str, done: int, total: int) -> None:
        """No failures to inject here (the Wan and HunyuanImage-3 servers test that path)."""
