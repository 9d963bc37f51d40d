"""What the serve adapters of encode -> denoise -> decode pipelines share (Wan, Qwen-Image),
and the image answer's PNG (HunyuanImage-3's too).

Such a pipeline calls its progress hook after each denoise step only; `run` shows the text
encode before the first step and the VAE decode after the last, so a job's progress covers
every phase. A subclass gives `pipe` (with `generate(request, progress=...)`), `defaults`
(a request with `steps`), `warmup`, and its own `parse` and answer.
"""
from __future__ import annotations

import base64
import time
from dataclasses import replace

import torch

from dtgen.image_files import encode_png


def png_b64(image: torch.Tensor) -> str:
    """[H, W, 3] uint8 -> a base64 PNG (an image answer's `b64_json`; the CLI's writer)."""
    return base64.b64encode(encode_png(image)).decode("ascii")


def image_answer(image: torch.Tensor) -> tuple[dict, float]:
    """({"b64_json": the PNG}, the ms its encoding took): the answer's image, and the time the
    server spends on it after the pipeline's total (bench_serve reads it as `image_encode_ms`)."""
    start = time.perf_counter()
    b64 = png_b64(image)
    return {"b64_json": b64}, round((time.perf_counter() - start) * 1e3, 3)


class DiffusionAdapter:
    PHASES = ("encode", "denoise", "decode")

    def phases(self, request) -> tuple[str, ...]:
        return self.PHASES

    def run(self, request, progress):
        """The pipeline's result for `request` on this rank, reporting every phase."""
        progress.show("encode", 0, 1)

        def hook(phase: str, done: int, total: int) -> None:
            progress(phase, done, total)
            if phase == "denoise" and done == total:
                progress.show("decode", 0, 1)

        return self.pipe.generate(request, progress=hook)

    def answer(self, result, **fields) -> dict:
        """Rank 0's answer: the model's own `fields`, which denoise steps ran in full and which
        the step cache reused (None: no cache), and each phase's time and the total (ms)."""
        return {**fields, "step_cache": result.record.get("step_cache"),
                "timings_ms": {k: round(result.timings_ms[k], 3) for k in (*self.PHASES, "total")}}

    def warm_up(self, progress) -> None:
        """The defaults once, with 2 steps at most: first-call work (compiling, kernel JIT) out of requests."""
        if self.warmup:
            self.pipe.generate(replace(self.defaults, steps=min(self.defaults.steps, 2)), progress=progress)

    def free_caches(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
