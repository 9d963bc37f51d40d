"""The host side of a warm process: Python's garbage collector after compilation, the C
heap handed back when a server goes idle, and the process's age (how long a start took).

Compiling the phase steps leaves about a million long-lived Python objects per process
(FX graphs, guards, inductor's caches, CUDA-graph trees; more with depth). Python's
oldest-generation collection walks all of them: measured on the CPU, a full collection
after compiling the tiny model takes 0.45 s at 4 layers and 1.1 s at 16. Such a pause
lands at a random point of a request, on one rank at a time, and every other rank waits
for it in the next collective (it showed up as a 2 s phase switch at 32 layers on two
GPUs). Servers built on torch.compile freeze the heap once warm for the same reason.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

_LIBC = None
_UNFREEZE_AT_EXIT = False
_LOADED_AT = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere: since this module loaded)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.perf_counter() - _LOADED_AT


def settle_heap() -> None:
    """Collect once, then move every surviving object to the permanent generation, which
    later collections skip. Call it after warm-up (compilation, CUDA-graph capture, model
    load): the objects made by then live as long as the process. At exit they are handed back
    to the collector: frozen objects are never freed at shutdown, and extension modules that
    check for leaks then (triton's nanobind bindings) would report every one they own."""
    global _UNFREEZE_AT_EXIT
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's malloc_trim(0)); False where there is
    no glibc. A request's host tensors (latents, images, PNG bytes, request bodies) are freed
    but glibc keeps their pages mapped, fragmented among live blocks: measured on the tiny
    CPU model, a server's resident memory after 100 requests sat 23% above where it started
    with nothing live. Call it when the process goes idle (an engine with no job waiting):
    it walks the heap, so not between steps."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
        if _LIBC is not False and not hasattr(_LIBC, "malloc_trim"):
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


@dataclass
class GcPauses:
    """Garbage-collector pauses inside a `with` block, by generation (for reports)."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_ms: float = 0.0
    max_ms: float = 0.0
    _start: float = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._start) * 1e3
        self.count[info["generation"]] += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict:
        return {"collections_by_generation": list(self.count), "total_ms": round(self.total_ms, 3),
                "max_ms": round(self.max_ms, 3), "frozen_objects": gc.get_freeze_count()}
