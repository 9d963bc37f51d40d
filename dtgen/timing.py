"""Wall-clock time of work on a device: a clock that waits for the device, and marks that do not.

`Timer.now()` is for spans the host waits out anyway (a prefill, an AR decode loop, a VAE
decode): it synchronizes first, so the span holds the device's work. `mark()` / `wait()` /
`ms()` time steps the host runs ahead of (the denoise loop launches step i before it waits
for step i-1): a mark is a CUDA event recorded in the stream, and nothing waits until the
caller does. On the CPU both are `time.perf_counter()`.
"""
from __future__ import annotations

import time

import torch


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self):
        """A point in the stream, without waiting for it: a CUDA event (a time on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark) -> None:
        if self.cuda:
            mark.synchronize()

    def ms(self, start, end) -> float:
        """Between two marks (both waited for)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3
