"""A pipeline's step functions, run the way its CompileOptions ask: named once, wired here.

Two modes. Whole steps (the default when compiling): each step is one graph
(`StepCompiler.wrap`), and a step that asks for a CUDA graph (the one-token decode step)
replays as inductor's ("reduce-overhead"). Regions (`CompileOptions.regions`): the model
compiles one region (a decoder layer) that every layer shares, each step runs eagerly around
it (`StepCompiler.timed`: its compile time still counted), and a CUDA-graph step is recorded
by hand around the regions (`GraphedStep`, dtgen/cuda_graph.py). Uncompiled, every step is
the function itself. A CUDA graph needs the options' `decode_cuda_graph` and a CUDA device.
"""
from __future__ import annotations

from typing import Callable

import torch

from .compile import CompileOptions, StepCompiler
from .cuda_graph import GraphedStep


class CompiledSteps:
    def __init__(self, options: CompileOptions | None, device: torch.device):
        self.compiler = StepCompiler(options or CompileOptions())
        options = self.compiler.options
        self.regions = options.enabled and options.regions
        self.cuda_graph = options.enabled and options.decode_cuda_graph and torch.device(device).type == "cuda"
        self._graphed: dict[Callable, GraphedStep] = {}
        # What the graphed steps read besides their arguments (`GraphedStep.state`): a pipeline
        # with resident LoRA adapters sets their `graph_key`; None: nothing.
        self.graph_state: Callable[[], object] | None = None

    def region(self, fn: Callable) -> Callable:
        """fn compiled as the region the steps run around (call it in regions mode only)."""
        return self.compiler.region(fn)

    def step(self, fn: Callable, cuda_graph: bool = False) -> Callable:
        """fn as a step of the current mode. `cuda_graph`: replayed as a CUDA graph where the
        options and the device allow (a step with static shapes and no host sync)."""
        graph = cuda_graph and self.cuda_graph
        if not self.regions:
            return self.compiler.wrap(fn, cuda_graph=graph)
        if graph:
            self._graphed[fn] = GraphedStep(fn, state=self._graph_state)
            return self.compiler.timed(self._graphed[fn])
        return self.compiler.timed(fn)

    def _graph_state(self):
        return self.graph_state() if self.graph_state is not None else None

    def whole(self, fn: Callable) -> Callable:
        """fn as one graph in both modes (a small step the regions do not cover: a head)."""
        return self.compiler.wrap(fn)

    def graphed_of(self, fn: Callable) -> GraphedStep | None:
        """The hand-recorded CUDA graph of step `fn` (regions mode), None where there is none."""
        return self._graphed.get(fn)

    def reset_graphs(self) -> None:
        """Drop every CUDA-graph recording (the buffers they captured were freed: the next call
        records again)."""
        for graphed in self._graphed.values():
            graphed.reset()
