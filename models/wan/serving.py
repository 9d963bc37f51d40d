"""Wan text-to-video and image-to-video behind `dtgen.serve`: async video jobs (`POST /v1/videos`,
progress, the MP4, DELETE) on the same job board, engine and metrics as the image server.

Its fields are `T2VRequest`'s and the video job's (OpenAI's `seconds`: num_frames = seconds *
fps + 1; the MP4's `fps`; `model`, accepted and ignored: dtgen/serve/adapters.py), each declared
once and listed in docs/requests.md. On an image-to-video checkpoint a job needs OpenAI's
`input_reference`, the first frame as a multipart file (opened and checked by the video adapter
through the pipeline's `REFERENCE`: one 4xx naming it before the job is queued); the video keeps
its aspect ratio unless `size` is given. A text-to-video checkpoint refuses it. Fields not given
take the server's defaults (the CLI's flags); a request is checked as the CLI checks it
(`T2VRequest.check`, and the prompts' lengths) before its job is queued.
"""
from __future__ import annotations

from dtgen.serve.adapters import VIDEO_FIELDS, VideoAdapter
from dtgen.serve.fields import FieldTable
from models.wan.pipeline import REFERENCE, T2VRequest, WanT2VPipeline

# The request's declared fields (T2VRequest) and the video job's.
FIELDS = FieldTable(T2VRequest, VIDEO_FIELDS)


class WanServeAdapter(VideoAdapter):
    name = "Wan"
    fields = FIELDS

    def __init__(self, pipe: WanT2VPipeline, *args, **options):
        super().__init__(pipe, *args, **options)
        cfgs = pipe.model.cfgs
        self.temporal = cfgs.vae.temporal_factor
        self.image_to_video = cfgs.image_to_video
        kind = "Wan2.2-A14B" if pipe.model.transformer_2 is not None else "Wan 2.1"
        self.name = f"{kind} image-to-video" if self.image_to_video else kind
        self.refused = {} if self.image_to_video else {
            REFERENCE.upload: "not supported: this server's checkpoint makes videos from text only (WanPipeline); "
                              "image to video needs a WanImageToVideoPipeline checkpoint"}
