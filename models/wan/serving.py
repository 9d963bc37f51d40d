"""Wan text-to-video behind `dtgen.serve`: async video jobs (`POST /v1/videos`, progress,
the MP4, DELETE) on the same job board, engine and metrics as the image server.

Its fields are `T2VRequest`'s and the video job's (OpenAI's `seconds`: num_frames = seconds *
fps + 1; the MP4's `fps`; `model`, accepted and ignored: dtgen/serve/adapters.py), each declared
once and listed in docs/requests.md; OpenAI's `input_reference` is refused (text to video only).
Fields not given take the server's defaults (the CLI's flags); a request is checked as the CLI
checks it (`T2VRequest.check`) before its job is queued.
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
