"""A step recorded as a CUDA graph by hand, around eager code that calls compiled regions.

With regional compilation the decode step is eager code (embedding, the sequence-parallel
shard and gather, the head, sampling) around the compiled decoder layer. One token's eager
code costs more host time than its GPU work, so the step replays as one CUDA graph; but
compiling the whole step for inductor's CUDA graphs would make dynamo trace every layer's
call of the region again (torch 2.11 traces each call of a nested compile region before it
dedupes them), so its trace, and a warm start, would grow with depth. Recording the eager
step keeps the trace at one layer.

`GraphedStep(fn)` records one graph per key: the shapes and dtypes of the tensor arguments,
the identity of every other argument (the phase runtime, the KV cache, static numbers), and
`state()`: what the step reads besides its arguments and a recording bakes in (the set of
resident LoRA adapters the rows carry, whose tensors a recording reads where it found them).
Each call copies the tensor arguments into that graph's input buffers and replays it; the
outputs are the graph's own buffers, valid until its next replay (callers clone them).

What the step may do: run on the current device with no host sync (no `.item()`, no
data-dependent shapes), allocate nothing it returns across calls, and keep every buffer it
writes in place (the KV cache) at a fixed address. Collectives are fine: NCCL kernels are
recorded like any other, so every rank must record and replay the same steps in the same
order, which the phase controller's lock-step already guarantees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# Leaves keyed by value; every other non-tensor leaf is keyed by identity (and kept alive by
# its graph, so that an id is never reused while a graph records it).
_VALUE_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]     # per leaf: the static buffer a tensor is copied into
    output: Any
    keep_alive: list[Any]


def step_key(flat_args: list[Any]) -> tuple:
    """What makes two calls replay the same graph: tensor shapes, dtypes and devices; the
    values of plain numbers; the identity of other objects."""
    key = []
    for leaf in flat_args:
        if isinstance(leaf, torch.Tensor):
            key.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
        elif isinstance(leaf, _VALUE_LEAVES):
            key.append(("value", type(leaf), leaf))
        else:
            key.append(("object", id(leaf)))
    return tuple(key)


class GraphedStep:
    """fn(*args) replayed as a CUDA graph, one recording per `step_key` of its arguments.

    `warmup`: eager calls before a recording, on a side stream (they compile the regions for
    the new shapes and let every lazy allocation happen outside the graph). They run the
    step for real, so the step must be idempotent for the same inputs: the decode step
    writes the same K and V at the same slot each time.
    """

    def __init__(self, fn: Callable, warmup: int = 2, state: Callable[[], Any] | None = None):
        self.fn = fn
        self.warmup = warmup
        self.state = state
        self._recordings: dict[tuple, _Recording] = {}
        self.recorded = 0          # recordings made so far (a counter for reports and tests)

    def reset(self) -> None:
        """Drop every recording and its memory pool (after the caches it wrote were freed)."""
        self._recordings.clear()

    def __call__(self, *args):
        flat, spec = tree_flatten(args)
        key = (spec, step_key(flat), self.state() if self.state is not None else None)
        rec = self._recordings.get(key)
        if rec is None:
            rec = self._record(flat, spec)
            self._recordings[key] = rec
        else:
            for buffer, leaf in zip(rec.inputs, flat):
                if buffer is not None:
                    buffer.copy_(leaf, non_blocking=True)
        rec.graph.replay()
        return rec.output

    def _record(self, flat: list[Any], spec) -> _Recording:
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        if not tensors or any(not t.is_cuda for t in tensors):
            raise ValueError("a CUDA-graphed step takes CUDA tensors only; run it uncompiled on other devices")
        # Static input buffers: the graph reads these addresses at every replay.
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else None for leaf in flat]
        static_args = tree_unflatten([b if b is not None else leaf for b, leaf in zip(inputs, flat)], spec)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread polls its events during the recording; in the
        # default (global) mode that call would invalidate the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = self.fn(*static_args)
        self.recorded += 1
        keep_alive = [leaf for leaf in flat if not isinstance(leaf, (torch.Tensor, *_VALUE_LEAVES))]
        return _Recording(graph, inputs, output, keep_alive)
