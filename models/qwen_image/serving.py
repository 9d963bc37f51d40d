"""Qwen-Image text-to-image behind `dtgen.serve`: the adapter a server plugs in
(`POST /v1/images/generations`, and `/v1/jobs`; text to image only: no edits route).

Its fields are `T2IRequest`'s and OpenAI's image fields (`n`, `size` with "auto" for the
server's default, `response_format`, `model` and `user`; the answer's `output_format` and
`output_compression` are the server's), each declared once and listed in docs/requests.md.
Fields not given take the server's defaults (the CLI's flags); a request is checked as the CLI
checks it (`T2IRequest.check`) before its job is queued.
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
