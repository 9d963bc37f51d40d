"""torch.compile per phase, and what the compiler did (graphs, breaks, recompiles).

Each phase step is compiled with fullgraph=True, so a graph break is an error, not a
silent fallback. Collectives are functional collectives and kernels are custom ops, so
both stay inside the graph. The AR decode step can replay as a CUDA graph
("reduce-overhead"); its KV cache is marked as a static address so the in-place cache
write does not force a copy (or a skip) in the CUDA-graph tree.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from .caches import mentions_compile_cache, quarantine_compile_cache, use_compile_cache


@dataclass(frozen=True)
class CompileOptions:
    enabled: bool = False
    backend: str = "inductor"
    # CUDA-graph replay for the AR decode step (one token, static shapes).
    decode_cuda_graph: bool = True
    # Let inductor tune the GEMMs of the multi-token steps (prefill, denoise) against its
    # Triton templates (`max_autotune_gemm`): the MoE's grouped GEMMs gain 14-18% on an
    # H200; compiling takes longer. The decode step (GEMVs, the decode MoE) is not tuned.
    autotune: bool = False
    # Regional compilation: each decoder layer is one compiled region, shared by all layers,
    # and the code between the layers (embedding, sequence-parallel shard and gather, head,
    # sampling) runs eagerly, so compile time stays flat with depth. On CUDA the decode step
    # is then recorded as a CUDA graph around the regions (dtgen/cuda_graph.py).
    regions: bool = False


def _raise_recompile_limit(limit: int = 64) -> None:
    # One graph per (phase, shape); several plans or prompt lengths in one process can
    # exceed the default limit of 8 per function.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


class StepCompiler:
    """Wraps step functions; the same options and counters for every phase."""

    def __init__(self, options: CompileOptions):
        self.options = options
        self.compile_s = 0.0
        self.cache_dir = None
        self.quarantined: list[str] = []      # damaged compile-cache folders moved aside
        if options.enabled:
            _raise_recompile_limit()
            self.cache_dir = use_compile_cache()

    def wrap(self, fn: Callable, cuda_graph: bool = False) -> Callable:
        """A whole step compiled as one graph. cuda_graph: replay it as a CUDA graph (the
        decode step); otherwise GEMMs are tuned when the options ask for it."""
        if not self.options.enabled:
            return fn
        return self.timed(self._compile(fn, cuda_graph))

    def region(self, fn: Callable) -> Callable:
        """A region (one decoder layer) compiled once and reused wherever it runs with the
        same shapes: the layers share one graph, so compile time does not grow with depth.
        The steps around it run eagerly (on CUDA the decode step is recorded as a CUDA graph
        around them: dtgen/cuda_graph.py). Returned raw (not `timed`): the step that calls it
        counts the compile time."""
        if not self.options.enabled:
            return fn
        return self._compile(fn, cuda_graph=False)

    def _compile(self, fn: Callable, cuda_graph: bool) -> Callable:
        inductor = self.options.backend == "inductor"
        if cuda_graph and inductor:
            return torch.compile(fn, fullgraph=True, backend="inductor", mode="reduce-overhead")
        if self.options.autotune and inductor:
            return torch.compile(fn, fullgraph=True, backend="inductor", options={"max_autotune_gemm": True})
        return torch.compile(fn, fullgraph=True, backend=self.options.backend)

    def timed(self, fn: Callable) -> Callable:
        """fn (compiled, or eager code calling compiled regions) with the time of every call
        that compiled something added to `compile_s`, and a damaged compile cache set aside."""

        def run(*args, **kwargs):
            graphs = unique_graphs()
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except Exception as e:
                if not mentions_compile_cache(e):
                    raise
                # A damaged file in the compile cache (see dtgen/caches.py): set the folder
                # aside and compile again from nothing. A second failure is a real one.
                moved = quarantine_compile_cache()
                self.quarantined.append(str(moved))
                print(f"warning: the compile cache failed to load ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); moved it to {moved} and compiling again",
                      file=sys.stderr)
                out = fn(*args, **kwargs)
            if unique_graphs() != graphs:  # this call compiled something: count its time
                self.compile_s += time.perf_counter() - start
            return out

        return run


def unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> dict[str, int]:
    return {str(reason): int(n) for reason, n in counters["graph_break"].items()}


@dataclass
class CompileReport:
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: dict[str, int] = field(default_factory=dict)
    recompiles_after_warmup: int = 0
    compile_s: float = 0.0

    def as_dict(self) -> dict:
        return {"graphs": self.graphs, "graph_breaks": self.graph_breaks, "break_reasons": self.break_reasons,
                "recompiles_after_warmup": self.recompiles_after_warmup, "compile_s": round(self.compile_s, 3)}
