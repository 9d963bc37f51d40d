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
Each is declared once, in `T2VRequest` (the job's own, `seconds` and `fps`, below);
docs/requests.md lists them. Fields not given take the server's defaults (the T2V example's
flags). Checked before the job is queued by `T2VRequest.check`, the CLI's own.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, replace

import torch

from dtgen.schema import MODEL_FIELD, check_value, extra_field
from dtgen.serve.adapters import DiffusionAdapter
from dtgen.requests import RequestError
from dtgen.serve.fields import FieldTable
from models.wan.pipeline import T2VRequest, WanT2VPipeline


@dataclass(frozen=True)
class VideoJob:
    """What a video job runs: the pipeline's request and the MP4's frame rate."""
    request: T2VRequest
    fps: int


# A video job's own fields (a VideoJob's, not the pipeline request's): the MP4's frame rate
# (the CLI's --fps too), and OpenAI's length in seconds, which with it makes num_frames.
FPS = extra_field("fps", 16, low=1, high=120, flag="--fps", help="frames per second of the MP4")
SECONDS = extra_field("seconds", None, kind="number",
                      help="OpenAI's video length: num_frames = seconds * fps + 1 (give it or num_frames)")
# The request's declared fields (T2VRequest) and the job's.
FIELDS = FieldTable(T2VRequest, (SECONDS, FPS, MODEL_FIELD))


def encode_mp4(frames: torch.Tensor, target, fps: int) -> None:
    """[F, H, W, 3] uint8 -> H.264 MP4 at `target` (a path or a binary file object; PyAV
    ships its own FFmpeg)."""
    import av
    with av.open(target, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


class WanServeAdapter(DiffusionAdapter):
    kind = "video"
    name = "Wan"

    def __init__(self, pipe: WanT2VPipeline, rank: int, defaults: T2VRequest, fps: int = 16, warmup: bool = True):
        self.pipe, self.rank, self.defaults, self.default_fps = pipe, rank, defaults, fps
        self.warmup = warmup
        vae = pipe.model.vae.cfg
        self.temporal, self.spatial = vae.temporal_factor, vae.spatial_factor * pipe.model.transformer.patch_size[1]
        self.two_experts = pipe.model.transformer_2 is not None
        self.name = "Wan2.2-A14B" if self.two_experts else "Wan 2.1"

    def defaults_dict(self) -> dict:
        return FIELDS.defaults(self.defaults, fps=self.default_fps)

    def describe(self, job: VideoJob) -> dict:
        r = job.request
        return {"size": f"{r.width}x{r.height}", "num_frames": r.num_frames, "fps": job.fps,
                "seconds": str(round((r.num_frames - 1) / job.fps, 2))}

    # ---- rank 0: fields -> request ----------------------------------------------------
    def parse(self, fields: dict, form: bool = False) -> VideoJob:
        fields = FIELDS.read(fields, form)
        if "input_reference" in fields:
            raise RequestError("input_reference", "not supported: this server makes videos from text only")
        FIELDS.check_names(fields)
        FIELDS.check_types(fields)
        values = FIELDS.values(fields)
        fps = fields.get("fps", self.default_fps)
        check_value(FPS, fps)
        if "seconds" in fields:
            if "num_frames" in fields:
                raise RequestError("seconds", "give seconds or num_frames, not both")
            frames = fields["seconds"] * fps + 1
            if frames != int(frames) or (int(frames) - 1) % self.temporal:
                raise RequestError("seconds", f"{fields['seconds']:g} s at {fps} fps is {frames:g} frames; it must "
                                              f"make {self.temporal}k + 1 frames")
            values["num_frames"] = int(frames)
        req = FIELDS.checked(replace(self.defaults, **values), self.temporal, self.spatial, self.two_experts)
        return VideoJob(req, fps)

    # ---- every rank (`generate`, `batch_key`, `generate_batch`: DiffusionAdapter's) --------
    def request_of(self, job: VideoJob) -> T2VRequest:
        return job.request

    def respond(self, job: VideoJob, result, batch: int) -> dict | None:
        if self.rank != 0:
            return None
        buffer = io.BytesIO()
        encode_mp4(result.video, buffer, job.fps)
        r = job.request
        return self.answer(result, batch, video=buffer.getvalue(), size=f"{r.width}x{r.height}",
                           num_frames=r.num_frames, fps=job.fps, seed=r.seed)

