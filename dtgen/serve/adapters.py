"""What the serve adapters of encode -> denoise -> decode pipelines share (Wan, Qwen-Image),
and how an image answer is encoded (HunyuanImage-3's too).

Such a pipeline calls its progress hook after each denoise step only; `run` shows the text
encode before the first step and the VAE decode after the last, so a job's progress covers
every phase. Its requests batch (`BatchingAdapter`, dtgen/serve/engine.py): `batch_key` is
the pipeline's bucket as its spec declares it (`pipe.batch_key`), `generate_batch` runs jobs of
one key as one batch (`pipe.generate_batch`, dtgen/diffusion_run.py), each job keeping its
own progress, cancel and deadline.

A model subclasses `ImageAdapter` (OpenAI's image generation: the answer's pixels) or
`VideoAdapter` (async video jobs: an MP4, `seconds` and `fps` beside the request's
`num_frames`) and gives `fields` (its request's `FieldTable` with the route's own fields) and
`name`; a request is checked as the pipeline checks it (`pipe.check_args`: what the request's
`check` needs from the model's configs), its errors under the JSON names.
"""
from __future__ import annotations

import base64
import io
import math
import time
from dataclasses import dataclass, replace

import torch

from dtgen.batching import per_member
from dtgen.image_files import IMAGE_FORMATS, encode_image
from dtgen.media import FPS, encode_mp4
from dtgen.reference_images import ReferenceImage
from dtgen.requests import IMAGE_OUTPUT_FIELDS, check_image_fields, renamed
from dtgen.schema import MODEL_FIELD, check_value, extra_field

from .errors import RequestError
from .fields import FieldTable
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


# A server takes frames of at most this many times its default size's pixels (or 1024x1024).
PIXELS_OVER_DEFAULT = 4


class DiffusionAdapter:
    """`pipe`: a `DiffusionPipeline`; `defaults`: the request every field not given comes from
    (the CLI's flags); `warmup`: run it once (2 steps) before /ready; `warmup_batch`: the
    server's --max-batch (a compiled pipeline warms up batches of 2..warmup_batch too)."""

    PHASES = ("encode", "denoise", "decode")
    fields: FieldTable   # the request's fields and the route's own (a subclass's)

    def __init__(self, pipe, rank: int, defaults, warmup: bool = True, warmup_batch: int = 1):
        self.pipe, self.rank, self.defaults, self.warmup = pipe, rank, defaults, warmup
        self.warmup_batch = warmup_batch

    @property
    def loras(self):
        """The pipeline's resident LoRA adapters (`dtgen.lora.ResidentLoras`; POST /v1/loras loads
        into it on every rank), or None where the model takes none."""
        return getattr(self.pipe, "loras", None)

    def checked(self, request):
        """`request` once the pipeline's check passes (`RequestError` under the JSON name), its
        size is within what this server takes (`max_pixels`) and its prompts within what the text
        encoder reads (`pipe.check_prompts`)."""
        request = self.fields.checked(request, *self.pipe.check_args(self.pipe.model.cfgs))
        most = self.max_pixels
        if request.width * request.height > most:
            d = self.defaults
            raise RequestError("size", f"{request.width}x{request.height} is {request.width * request.height} pixels; "
                                       f"this server takes at most {most} (the larger of {PIXELS_OVER_DEFAULT} times "
                                       f"its default {d.width}x{d.height} and 1024x1024)")
        try:
            self.pipe.check_prompts(self.pipe.tokenizer, request)
        except RequestError as e:
            raise renamed(e, self.fields.json_names()) from None
        return request

    @property
    def max_pixels(self) -> int:
        """The largest frame a request may ask for, in pixels: the schema's sides alone (4096 px
        each) let one tiny-model request hold a CPU server for minutes in its VAE decode, which
        no cancel or deadline stops."""
        return max(PIXELS_OVER_DEFAULT * self.defaults.width * self.defaults.height, 1024 * 1024)

    def defaults_dict(self) -> dict:
        return self.fields.defaults(self.defaults)

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
        """The defaults once, with 2 steps at most: first-call work (compiling, kernel JIT) out of
        requests. A compiled pipeline then runs batches of 2..warmup_batch of them: each batch
        size has graphs of its own, and a batch shrinks as its members leave, so every size it
        can have compiles before /ready. (Qwen-Image's graphs are also specialised to the call's
        text rows: a prompt of a length not seen yet still compiles in its request.)"""
        if not self.warmup:
            return
        request = self.warmup_request()
        self.pipe.generate(request, progress=progress)
        if self.pipe.compiler.options.enabled:
            for n in range(2, self.warmup_batch + 1):
                self.pipe.generate_batch([replace(request, seed=request.seed + k) for k in range(n)],
                                         per_member([progress] * n))

    def warmup_request(self):
        """What the warm-up runs: the defaults with 2 steps at most."""
        return replace(self.defaults, steps=min(self.defaults.steps, 2))

    def free_caches(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class ImageAdapter(DiffusionAdapter):
    """Text to image (`POST /v1/images/generations`, and `/v1/jobs`): OpenAI's fields beside the
    request's; the answer holds the pixels, which the HTTP side encodes as the request asked
    (`encode_answer`)."""

    kind = "image"

    def parse(self, fields: dict, form: bool = False):
        fields = self.fields.read(fields, form)
        check_image_fields(fields, self.fields.names())
        self.fields.check_types(fields)
        return self.checked(replace(self.defaults, **self.fields.values(fields)))

    def respond(self, req, result, batch: int) -> dict | None:
        if self.rank != 0:
            return None
        return self.answer(result, batch, pixels=result.image, size=f"{req.width}x{req.height}", seed=req.seed)


# A video job's own fields (a VideoJob's, not the pipeline request's): OpenAI's length in
# seconds, which with the MP4's frame rate makes num_frames.
SECONDS = extra_field("seconds", None, kind="number",
                      help="OpenAI's video length: num_frames = seconds * fps + 1 (give it or num_frames)")
VIDEO_FIELDS = (SECONDS, FPS, MODEL_FIELD)


def seconds_number(text: str) -> float:
    """A video's `seconds` written as a string, as a number (its range is `num_frames`'s check)."""
    try:
        return float(text)
    except ValueError:
        raise RequestError("seconds", f'must be a number of seconds (4 or "4"), got {text!r}') from None


@dataclass(frozen=True)
class VideoJob:
    """What a video job runs: the pipeline's request and the MP4's frame rate."""
    request: object
    fps: int


class VideoAdapter(DiffusionAdapter):
    """Async video jobs (`POST /v1/videos`, progress, the MP4, DELETE): a request with
    `num_frames`, `width`, `height` and `seed`, and the job's `fps` (default: the server's
    `--fps`) and `seconds`. `temporal`: frames per latent frame (a subclass's); `refused`:
    fields OpenAI's API has that the model does not take, each with its one line (as text or
    as a file); `file_values`: the request attributes a form's files set: the reference image of
    a pipeline that takes one (`pipe.reference`, dtgen/reference_images.py), none otherwise."""

    kind = "video"
    temporal: int
    refused: dict[str, str] = {}

    def __init__(self, pipe, rank: int, defaults, fps: int = 16, warmup: bool = True, warmup_batch: int = 1):
        super().__init__(pipe, rank, defaults, warmup, warmup_batch)
        self.default_fps = fps

    def defaults_dict(self) -> dict:
        return self.fields.defaults(self.defaults, fps=self.default_fps)

    def describe(self, job: VideoJob) -> dict:
        r = job.request
        return {"size": f"{r.width}x{r.height}", "num_frames": r.num_frames, "fps": job.fps,
                "seconds": str(round((r.num_frames - 1) / job.fps, 2))}

    # ---- rank 0: fields -> request ----------------------------------------------------
    @property
    def reference(self):
        """How the pipeline takes a reference image (`ReferenceInput`), or None where it takes none."""
        return getattr(self.pipe, "reference", None)

    @property
    def takes_reference(self) -> bool:
        """Whether this server's requests may bring a reference image (its checkpoint takes one)."""
        return self.reference is not None and self.reference.upload not in self.refused

    def parse(self, fields: dict, form: bool = False, files: dict | None = None) -> VideoJob:
        """A job from the body's fields and, in a multipart body, its files (field -> [(filename, bytes)])."""
        if self.takes_reference and self.reference.upload in fields:   # text where the image belongs
            raise RequestError(self.reference.upload, "must be an image file: send multipart/form-data with the file")
        fields, files = self.fields.read(fields, form), files or {}
        if isinstance(fields.get("seconds"), str):   # OpenAI's spelling (and this server's answers): "4"
            fields = {**fields, "seconds": seconds_number(fields["seconds"])}
        for name, problem in self.refused.items():
            if name in fields or name in files:
                raise RequestError(name, problem)
        self.fields.check_names(fields)
        self.fields.check_types(fields)
        values = self.fields.values(fields)
        fps = fields.get("fps", self.default_fps)
        check_value(FPS, fps)
        if "seconds" in fields:
            if "num_frames" in fields:
                raise RequestError("seconds", "give seconds or num_frames, not both")
            values["num_frames"] = self.num_frames(fields["seconds"], fps)
        values.update(self.file_values(files, values))
        return VideoJob(self.checked(replace(self.defaults, **values)), fps)

    def file_values(self, files: dict, values: dict) -> dict:
        """The request attributes the form's files set, given the fields' `values`: the reference
        image, opened and checked, and the size it gives the video where `size` is not given
        (about the default area, the image's aspect ratio); a model that takes no file refuses
        the first one."""
        reference = self.reference
        if reference is None:
            if files:
                raise RequestError(sorted(files)[0], "a file is not taken here")
            return {}
        other = sorted(set(files) - {reference.upload})
        if other:
            raise RequestError(other[0], f"unknown file field; a video takes one {reference.upload} file")
        if not files.get(reference.upload):
            return {}
        image = reference.open_upload(files[reference.upload], per="video")
        if "height" in values or "width" in values:
            return {reference.field: image}
        height, width = reference.output_size(image, self.defaults.height * self.defaults.width)
        return {reference.field: image, "height": height, "width": width}

    def warmup_request(self):
        """The defaults with 2 steps at most; where requests bring a reference image, a grey one
        of the default size."""
        request = super().warmup_request()
        if not self.takes_reference or getattr(request, self.reference.field) is not None:
            return request
        grey = torch.full((request.height, request.width, 3), 128, dtype=torch.uint8)
        return replace(request, **{self.reference.field: ReferenceImage(grey, "warm-up")})

    def num_frames(self, seconds: float, fps: int) -> int:
        """OpenAI's length as frames (seconds * fps + 1): whole latent frames, within the
        request's `num_frames` bounds; a RequestError naming `seconds` otherwise (Infinity
        and huge numbers too: they would make no frame count)."""
        frames, most = seconds * fps + 1, self.fields.fields["num_frames"].high
        if not math.isfinite(frames) or not 1 <= frames <= most:
            raise RequestError("seconds", f"must make from 1 to {most} frames at {fps} fps "
                                          f"(num_frames = seconds * fps + 1), got {seconds:g}")
        if frames != int(frames) or (int(frames) - 1) % self.temporal:
            raise RequestError("seconds", f"{seconds:g} s at {fps} fps is {frames:g} frames; it must make "
                                          f"{self.temporal}k + 1 frames")
        return int(frames)

    # ---- every rank (`generate`, `batch_key`, `generate_batch`: DiffusionAdapter's) --------
    def request_of(self, job: VideoJob):
        return job.request

    def respond(self, job: VideoJob, result, batch: int) -> dict | None:
        if self.rank != 0:
            return None
        buffer = io.BytesIO()
        encode_mp4(result.video, buffer, job.fps)
        r = job.request
        return self.answer(result, batch, video=buffer.getvalue(), size=f"{r.width}x{r.height}",
                           num_frames=r.num_frames, fps=job.fps, seed=r.seed)
