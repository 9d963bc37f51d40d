"""Video output: the MP4 a video model's command writes and its server answers with.

A video's frame rate is no request field of the pipeline (the denoise loop never sees it): it
is the output's, declared here once as `FPS` (the CLI's `--fps`, the server's `fps`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .schema import extra_field

FPS = extra_field("fps", 16, low=1, high=120, flag="--fps", help="frames per second of the MP4")


def video_path_problem(path: str | Path | None, flag: str = "--output") -> str | None:
    """One line when `path` does not end in .mp4, the one container a video is written in
    (checked before a run: an MP4 written into `o.png` opens nowhere as a PNG)."""
    if path is None or Path(path).suffix.lower() == ".mp4":
        return None
    return f"{flag} {path}: a video is written as an MP4; name a .mp4 file"


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
