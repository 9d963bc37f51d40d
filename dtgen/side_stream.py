"""A step's small independent branch on a second CUDA stream, joined back before its result is read.

At AR decode every kernel reads a few megabytes, so each one spends a good part of its time
starting up and draining, and a chain of them leaves the GPU's bandwidth unused in between.
A branch that does not depend on the chain (HunyuanImage-3's shared expert beside the routing
and the routed experts) can run on a side stream at the same time: its kernels fill the gaps.

    out = run_beside(fn, *tensors)     # in a custom op's implementation: fn(*tensors) on the side stream
    ...                                # the step's own stream goes on meanwhile
    join_side_stream_(out)             # the step's stream waits for the side stream; out is readable

`join_side_stream_` is a custom op that declares `out` mutated (it is not: it only orders the
streams), so that under torch.compile every later read of `out` comes after it and inductor
still fuses those reads (the residual add) as usual.

Rules that keep it safe with the caching allocator and inside a CUDA graph recording:
- the side stream first waits for the step's stream (fn's inputs are ready), and the join makes
  the step's stream wait for all of the side stream's work (a fork and a join: what a CUDA
  graph recording needs; the recording's memory pool serves both streams);
- fn's input tensors are kept alive until the join, so that the step's stream cannot reuse
  their memory while the side stream still reads it; fn's output is allocated on the side
  stream, and the side stream only touches memory again after its next fork, which orders it
  after every read of that output.

One side stream per (device, stream of the step); on the CPU `run_beside` is just fn(*tensors)
and the join does nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_KEPT: dict[tuple[int, int], list[torch.Tensor]] = {}     # per side stream: inputs alive until the join


def _key(device: torch.device) -> tuple[int, int]:
    main = torch.cuda.current_stream(device)
    return main.device.index, main.cuda_stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream paired with `device`'s current stream (created once)."""
    key = _key(device)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return stream


def run_beside(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor | None) -> torch.Tensor:
    """fn(*tensors) on the side stream of the current one, after the work queued so far."""
    first = next(t for t in tensors if t is not None)
    if not first.is_cuda:
        return fn(*tensors)
    main = torch.cuda.current_stream(first.device)
    side = side_stream(first.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*tensors)
    _KEPT.setdefault(_key(first.device), []).extend(t for t in tensors if t is not None)
    return out


@torch.library.custom_op("dtgen::join_side_stream_", mutates_args=("out",))
def join_side_stream_(out: torch.Tensor, after: torch.Tensor | None = None) -> None:
    """The current stream waits for everything queued on its side stream (`run_beside`'s work,
    `out` among it). Changes no value. `after`: a tensor of the step's own stream that must
    be computed first (read by nothing here: under torch.compile it keeps the join from being
    scheduled right after the fork, which would serialize the streams)."""
    if not out.is_cuda:
        return
    torch.cuda.current_stream(out.device).wait_stream(side_stream(out.device))
    _KEPT.pop(_key(out.device), None)


@join_side_stream_.register_fake
def _(out, after=None):
    return None
