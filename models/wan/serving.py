"""Wan text-to-video behind `dtgen.serve`: async video jobs (`POST /v1/videos`, progress,
the MP4, DELETE) on the same job board, engine and metrics as the image server.

Request fields (JSON or form text), OpenAI's videos API first:
- `prompt` (required), `size` ("WIDTHxHEIGHT", multiples of the model's 16 px; the same
  convention as the image server and the UI), `seconds` (OpenAI's; with `fps`, num_frames =
  seconds * fps + 1), `model` (accepted, ignored); `input_reference` is refused (text to
  video only);
- the model's own: `num_frames` (4k + 1), `fps` (of the MP4), `negative_prompt`,
  `num_inference_steps`, `guidance_scale`, `guidance_scale_2` (Wan2.2-A14B's low-noise
  expert only), `flow_shift`, `sampler`, `seed`, `step_cache` (fewer full DiT evaluations,
  dtgen/step_cache.py: "first-block:threshold=0.05", {"method": "magcache", ...}, or null for
  none; default: the server's `--step-cache`).
Each is declared once, in `T2VRequest` (the job's own, `seconds` and `fps`: dtgen/serve/adapters.py);
docs/requests.md lists them. Fields not given take the server's defaults (the T2V example's
flags). Checked before the job is queued by `T2VRequest.check`, the CLI's own.
"""
from __future__ import annotations

from dtgen.serve.adapters import VIDEO_FIELDS, VideoAdapter
from dtgen.serve.fields import FieldTable
from models.wan.pipeline import T2VRequest, WanT2VPipeline

# The request's declared fields (T2VRequest) and the video job's.
FIELDS = FieldTable(T2VRequest, VIDEO_FIELDS)


class WanServeAdapter(VideoAdapter):
    name = "Wan"
    fields = FIELDS
    refused = {"input_reference": "not supported: this server makes videos from text only"}

    def __init__(self, pipe: WanT2VPipeline, *args, **options):
        super().__init__(pipe, *args, **options)
        self.temporal = pipe.model.vae.cfg.temporal_factor
        self.name = "Wan 2.1" if pipe.model.transformer_2 is None else "Wan2.2-A14B"
