"""Timing the microbenchmarks share: a list of calls recorded as one CUDA graph and replayed.

A decode-step kernel takes a few microseconds; launched one by one from Python its time is
the launch's. Recorded as a CUDA graph (after a warm-up on a side stream, as graph capture
wants) and replayed, the calls run back to back as in the decode step's own graph.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def graph_time_us(calls: Sequence[Callable[[], object]], repeats: int, cuda: bool, warm: int = 2) -> dict:
    """Per-call microseconds of the no-argument `calls`: on CUDA one graph of all of them,
    replayed `repeats` times (its first `warm` calls run once before the capture); on the CPU
    (smoke runs) wall time of the calls, `repeats` times."""
    if not cuda:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for c in calls:
                c()
            times.append((time.perf_counter() - t0) * 1e6 / len(calls))
        return summary(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:warm]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return summary(times)
