"""Qwen-Image text-to-image behind `dtgen.serve`: the adapter a server plugs in
(`POST /v1/images/generations`, and `/v1/jobs`; text to image only: no edits route).

Request fields (JSON, or form text), OpenAI's first:
- `prompt` (required), `n` (1), `size` ("WIDTHxHEIGHT", multiples of 16 px; "auto": the
  server's default size), `response_format` ("b64_json"), `model` and `user` (accepted, ignored);
  `output_format` and `output_compression` are the server's (dtgen.serve.adapters.take_image_output);
- the model's own: `negative_prompt`, `seed`, `num_inference_steps`, `true_cfg_scale`
  (QwenImagePipeline's; <= 1: no CFG), `step_cache` (text, an object, or null for none).
Each is declared once, in `T2IRequest` (OpenAI's in dtgen/schema.py); docs/requests.md lists
them. Fields not given take the server's defaults (the CLI's flags). Checked by
`T2IRequest.check`, the CLI's own, before the job is queued.
"""
from __future__ import annotations

from dtgen.schema import OPENAI_IMAGE_FIELDS
from dtgen.serve.adapters import ImageAdapter
from dtgen.serve.fields import FieldTable
from models.qwen_image.pipeline import T2IRequest

# The request's declared fields (T2IRequest) and OpenAI's that the adapter reads itself.
FIELDS = FieldTable(T2IRequest, OPENAI_IMAGE_FIELDS)


class QwenServeAdapter(ImageAdapter):
    name = "Qwen-Image"
    fields = FIELDS
    can_edit = False
    edit_problem = "Qwen-Image is served for text to image only"
