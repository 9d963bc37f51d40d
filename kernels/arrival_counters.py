"""Zeroed int32 counters for kernels whose last-arriving program finishes the work ("last arrival").

A kernel split over many programs (split-KV attention, the MoE router's logits) used to need a
second launch to combine the programs' partial results. Instead, each program writes its
partial, then adds its share to a counter with an acq_rel atomic; the program whose add
completes the total reads every partial and combines them (in a fixed order: deterministic
whatever the arrival order), then stores 0 back into the counter. One launch fewer per call:
on an H200 under a CUDA graph a small launch costs ~3 us of launch and tail.

The counters must read 0 when a launch starts. Each launch leaves every counter it touched
at 0, so a buffer zeroed once stays valid for every later launch on the same stream, including
CUDA-graph replays (stream order: a launch starts after the previous one ended). Hence one
persistent buffer per (kernel, device), kept here:

- Allocated (torch.zeros) on the first call outside a CUDA-graph capture: dtgen's graphed
  steps warm up before they record (`dtgen/cuda_graph.py`), so the graph records the
  buffer's address and every replay reuses it.
- A call inside a capture that finds no buffer large enough gets a fresh torch.zeros instead:
  recorded into the graph (one fill node: correct, one launch more), nothing persistent is
  allocated from the graph's private pool.
- A larger request replaces the buffer, but old ones are never freed: a graph recorded with
  an old buffer still writes to it on replay.

Why not torch.zeros on every call: that is a fill kernel per call, the launch the fusion
removes. Why not inside the op's inputs: the callers (the decoder layers, `MoE.route`) would
have to own and pass the buffers; a module-level one needs no caller change and no extra
launch. Not covered: two launches of one kernel running at once on two streams of one
device would share counters (dtgen runs a device's decode ops on one stream).
"""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_EVER: list[torch.Tensor] = []   # every buffer handed out: a recorded graph may still point at it


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def arrival_counters(kernel: str, device: torch.device, count: int) -> torch.Tensor:
    """int32 [count] reading 0, for `kernel`'s launches on `device` (module docstring): the
    caller's kernel must leave each counter it touches at 0 again."""
    key = (kernel, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= count:
        return buf[:count]
    if _capturing(key[1]):
        return torch.zeros(count, dtype=torch.int32, device=device)
    size = max(count, 64, 2 * (buf.numel() if buf is not None else 0))
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _BUFFERS[key] = buf
    _EVER.append(buf)
    return buf[:count]


def all_counters_zero() -> bool:
    """Whether every buffer handed out reads 0 (tests: each launch resets what it used)."""
    return all(int(b.count_nonzero()) == 0 for b in _EVER)
