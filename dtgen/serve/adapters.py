"""What the serve adapters of encode -> denoise -> decode pipelines share (Wan, Qwen-Image),
and how an image answer is encoded (HunyuanImage-3's too).

Such a pipeline calls its progress hook after each denoise step only; `run` shows the text
encode before the first step and the VAE decode after the last, so a job's progress covers
every phase. Its requests batch (`BatchingAdapter`, dtgen/serve/engine.py): `batch_key` is
the pipeline's bucket as its spec declares it (`pipe.batch_key`), `generate_batch` runs jobs of
one key as one batch (`pipe.generate_batch`, dtgen/diffusion_run.py), each job keeping its
own progress, cancel and deadline. A subclass gives `pipe` (a `DiffusionPipeline`),
`defaults` (a request with `steps`), `warmup`, its own `parse`, and `respond` (rank 0's
answer of a job from the pipeline's result); `request_of` when its jobs wrap the request.
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass, replace

import torch

from dtgen.image_files import IMAGE_FORMATS, encode_image
from dtgen.requests import IMAGE_OUTPUT_FIELDS

from .errors import RequestError
from .forms import coerce


# OpenAI's fields for how the answer's image is encoded are read by the HTTP side, never by a
# model's adapter, whose answer holds the image's uint8 pixels under "pixels".


@dataclass(frozen=True)
class ImageOutput:
    format: str = "png"
    quality: int | None = None      # JPEG / WebP only (OpenAI's `output_compression`)


def take_image_output(fields: dict, form: bool) -> tuple[ImageOutput, dict]:
    """(how to encode the answer's image, the other fields): `output_format` one of
    png/jpeg/webp (png by default), `output_compression` 0-100 for jpeg/webp; one
    RequestError naming the field otherwise."""
    rest = {k: v for k, v in fields.items() if k not in IMAGE_OUTPUT_FIELDS}
    given = coerce({k: fields[k] for k in IMAGE_OUTPUT_FIELDS if k in fields},
                   {"output_format": str, "output_compression": int}) if form else fields
    fmt = given.get("output_format", "png")
    if not isinstance(fmt, str) or fmt.lower() not in IMAGE_FORMATS:
        raise RequestError("output_format", f"must be one of {', '.join(IMAGE_FORMATS)}, got {fmt!r}")
    fmt, quality = fmt.lower(), given.get("output_compression")
    if quality is not None:
        if isinstance(quality, bool) or not isinstance(quality, int) or not 0 <= quality <= 100:
            raise RequestError("output_compression", f"must be an integer from 0 to 100, got {quality!r}")
        if fmt == "png":
            raise RequestError("output_compression", "applies to jpeg and webp; a png is lossless")
    return ImageOutput(fmt, quality), rest


def encode_answer(result: dict, output: ImageOutput | None) -> dict:
    """A finished image job's answer with its pixels encoded: "image" ({"b64_json"}), the
    format, and the ms the encoding took (`image_encode_ms`: what bench_serve subtracts).
    Runs once a job, off the engine's thread and the event loop."""
    output = output or ImageOutput()
    start = time.perf_counter()
    data = encode_image(result["pixels"], output.format, output.quality)
    b64 = base64.b64encode(data).decode("ascii")
    encoded = {k: v for k, v in result.items() if k != "pixels"}
    encoded.update(image={"b64_json": b64}, output_format=output.format,
                   image_encode_ms=round((time.perf_counter() - start) * 1e3, 3))
    return encoded


class DiffusionAdapter:
    PHASES = ("encode", "denoise", "decode")

    def phases(self, request) -> tuple[str, ...]:
        return self.PHASES

    def on_step(self, phase: str, done: int, total: int) -> None:
        """Nothing of its own to do at a step boundary (`ServeAdapter.on_step`)."""

    def request_of(self, job):
        """The pipeline's request of a job (the job itself, unless a subclass wraps it)."""
        return job

    def respond(self, job, result, batch: int) -> dict | None:
        """Rank 0's answer of a job from the pipeline's result (None on the other ranks);
        `batch`: the jobs whose denoise steps it shared, itself included."""
        raise NotImplementedError

    def run(self, request, progress):
        """The pipeline's result for `request` on this rank, reporting every phase."""
        progress.show("encode", 0, 1)

        def hook(phase: str, done: int, total: int) -> None:
            progress(phase, done, total)
            if phase == "denoise" and done == total:
                progress.show("decode", 0, 1)

        return self.pipe.generate(request, progress=hook)

    def generate(self, job, progress) -> dict | None:
        return self.respond(job, self.run(self.request_of(job), progress), 1)

    # ---- batches: jobs whose denoise steps run as rows of one batch ------------------------
    def batch_key(self, job) -> tuple:
        """What jobs must share to run as one batch: the pipeline's bucket (its spec's
        `ShapeBuckets`: the output's size, the schedule, the step cache, CFG on or off)."""
        return self.pipe.batch_key(self.request_of(job))

    def generate_batch(self, jobs: list, progress) -> list:
        """The jobs on this rank as one batch: per job its answer (rank 0; None elsewhere) or
        the exception it left the batch with (its cancel, its deadline, its error at a step)."""
        for k in range(len(jobs)):
            progress.show("encode", 0, 1, [k])

        def hook(phase: str, done: int, total: int, members: list[int]) -> dict:
            left = progress(phase, done, total, members)
            if phase == "denoise" and done == total:
                progress.show("decode", 0, 1, [m for m in members if m not in left])
            return left

        results = self.pipe.generate_batch([self.request_of(job) for job in jobs], hook)
        return [r if isinstance(r, BaseException) else self.respond(job, r, len(jobs))
                for job, r in zip(jobs, results)]

    def answer(self, result, batch: int = 1, **fields) -> dict:
        """Rank 0's answer: the model's own `fields`, the requests whose rows shared its denoise
        steps (`denoise_batch`, itself included), which denoise steps ran in full and which
        the step cache reused (None: no cache), and each phase's time and the total (ms)."""
        return {**fields, "denoise_batch": batch, "step_cache": result.record.get("step_cache"),
                "timings_ms": {k: round(result.timings_ms[k], 3) for k in (*self.PHASES, "total")}}

    def warm_up(self, progress) -> None:
        """The defaults once, with 2 steps at most: first-call work (compiling, kernel JIT) out of requests."""
        if self.warmup:
            self.pipe.generate(replace(self.defaults, steps=min(self.defaults.steps, 2)), progress=progress)

    def free_caches(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
