"""Wan text-to-video and image-to-video behind `dtgen.serve`: async video jobs (`POST /v1/videos`,
progress, the MP4, DELETE) on the same job board, engine and metrics as the image server.

Its fields are `T2VRequest`'s and the video job's (OpenAI's `seconds`: num_frames = seconds *
fps + 1; the MP4's `fps`; `model`, accepted and ignored: dtgen/serve/adapters.py), each declared
once and listed in docs/requests.md. On an image-to-video checkpoint a job needs OpenAI's
`input_reference`, the first frame as a multipart file (opened and checked here: one 4xx naming
it before the job is queued); the video keeps its aspect ratio unless `size` is given. A
text-to-video checkpoint refuses it. Fields not given take the server's defaults (the CLI's
flags); a request is checked as the CLI checks it (`T2VRequest.check`) before its job is queued.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dtgen.layers.t5 import T5PromptTokenizer, clean_prompt
from dtgen.reference_images import ReferenceImage, open_image_bytes
from dtgen.requests import renamed
from dtgen.serve.adapters import VIDEO_FIELDS, VideoAdapter
from dtgen.serve.errors import RequestError
from dtgen.serve.fields import FieldTable
from models.wan.pipeline import (REFERENCE_MAX_SIDE, REFERENCE_MIN_SIDE, SIZE_MULTIPLE, TEXT_LENGTH, T2VRequest,
                                 WanT2VPipeline, reference_size)

# The request's declared fields (T2VRequest) and the video job's.
FIELDS = FieldTable(T2VRequest, VIDEO_FIELDS)
REFERENCE = "input_reference"   # OpenAI's videos API name of the first frame


def check_prompt_lengths(tokenizer: T5PromptTokenizer, request: T2VRequest) -> None:
    """`RequestError` naming the prompt (or the negative prompt) longer than the text encoder
    reads: the model would cut it at TEXT_LENGTH tokens (diffusers' WanPipeline does so
    silently), and a user would never learn that the end of the prompt was not seen."""
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        # as the pipeline tokenizes it: cleaned, and an end-of-text token after it
        count = len(tokenizer.tokenizer.encode(clean_prompt(text) if tokenizer.clean else text,
                                               add_special_tokens=False).ids) + 1
        if count > TEXT_LENGTH:
            raise RequestError(name, f"is {count} tokens; Wan's text encoder reads at most {TEXT_LENGTH}: "
                                     "shorten it (it is not cut short silently)")


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
            REFERENCE: "not supported: this server's checkpoint makes videos from text only (WanPipeline); "
                       "image to video needs a WanImageToVideoPipeline checkpoint"}

    def parse(self, fields: dict, form: bool = False, files: dict | None = None):
        if REFERENCE in fields and REFERENCE not in self.refused:   # text where the image belongs
            raise RequestError(REFERENCE, "must be an image file: send multipart/form-data with the file")
        return super().parse(fields, form, files)

    def file_values(self, files: dict, values: dict) -> dict:
        """`input_reference`'s one image, opened and checked, and the size it gives the video
        where `size` is not given (about the default area, the image's aspect ratio)."""
        other = sorted(set(files) - {REFERENCE})
        if other:
            raise RequestError(other[0], f"unknown file field; a video takes one {REFERENCE} file")
        given = files.get(REFERENCE, [])
        if not given:
            return {}
        if len(given) > 1:
            raise RequestError(REFERENCE, f"one image per video, got {len(given)}")
        filename, data = given[0]
        try:
            image = open_image_bytes(data, filename or REFERENCE, REFERENCE_MIN_SIDE, REFERENCE_MAX_SIDE)
        except ValueError as e:
            raise RequestError(REFERENCE, str(e)) from None
        reference = ReferenceImage.from_pil(image, filename or REFERENCE)
        if "height" in values or "width" in values:
            return {"image": reference}
        area = self.defaults.height * self.defaults.width
        height, width = reference_size(reference, area, SIZE_MULTIPLE)
        return {"image": reference, "height": height, "width": width}

    def warmup_request(self):
        """Image to video: the defaults from a grey first frame of the default size."""
        request = super().warmup_request()
        if not self.image_to_video or request.image is not None:
            return request
        grey = torch.full((request.height, request.width, 3), 128, dtype=torch.uint8)
        return replace(request, image=ReferenceImage(grey, "warm-up"))

    def checked(self, request):
        request = super().checked(request)
        try:
            check_prompt_lengths(self.pipe.tokenizer, request)
        except RequestError as e:
            raise renamed(e, self.fields.json_names()) from None
        return request
