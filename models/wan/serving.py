"""Wan text-to-video behind `dtgen.serve`: async video jobs (`POST /v1/videos`, progress,
the MP4, DELETE) on the same job board, engine and metrics as the image server.

Its fields are `T2VRequest`'s and the video job's (OpenAI's `seconds`: num_frames = seconds *
fps + 1; the MP4's `fps`; `model`, accepted and ignored: dtgen/serve/adapters.py), each declared
once and listed in docs/requests.md; OpenAI's `input_reference` is refused (text to video only).
Fields not given take the server's defaults (the CLI's flags); a request is checked as the CLI
checks it (`T2VRequest.check`) before its job is queued.
"""
from __future__ import annotations

from dtgen.layers.t5 import T5PromptTokenizer, clean_prompt
from dtgen.requests import RequestError, renamed
from dtgen.serve.adapters import VIDEO_FIELDS, VideoAdapter
from dtgen.serve.fields import FieldTable
from models.wan.pipeline import TEXT_LENGTH, T2VRequest, WanT2VPipeline

# The request's declared fields (T2VRequest) and the video job's.
FIELDS = FieldTable(T2VRequest, VIDEO_FIELDS)


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
    refused = {"input_reference": "not supported: this server makes videos from text only"}

    def __init__(self, pipe: WanT2VPipeline, *args, **options):
        super().__init__(pipe, *args, **options)
        self.temporal = pipe.model.vae.cfg.temporal_factor
        self.name = "Wan 2.1" if pipe.model.transformer_2 is None else "Wan2.2-A14B"

    def checked(self, request):
        request = super().checked(request)
        try:
            check_prompt_lengths(self.pipe.tokenizer, request)
        except RequestError as e:
            raise renamed(e, self.fields.json_names()) from None
        return request
