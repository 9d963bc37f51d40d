"""Random weights for the tiny default checkpoints that models write (and benchmarks, at larger shapes)."""
from __future__ import annotations

import math

import torch
from torch import nn


def random_weight(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every path contributes, nothing explodes (the Hunyuan tiny default's recipe; at the tiny
    shapes every scale is the 0.05 cap, at the published ones 1 / sqrt(fan-in))."""
    randn = torch.randn(shape, generator=g, device=g.device)
    if key.endswith("weight") and len(shape) == 1:   # norm scales
        return 1 + 0.1 * randn
    if key.endswith("bias"):
        return 0.02 * randn
    return min(0.05, 1 / math.sqrt(math.prod(shape[1:]))) * randn   # linears, convolutions, modulation tables


def component_tensors(model: nn.Module, g: torch.Generator, dtype: torch.dtype,
                      scales: dict[str, float] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """`random_weight` for every parameter of `model` (a tree whose top-level modules are a
    diffusers folder's components), on the CPU in `dtype`, grouped by component under the
    component's own keys. `scales`: factors for the parameters whose full names begin with a key."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        component, _, key = name.partition(".")
        value = random_weight(key, tuple(p.shape), g)
        for prefix, factor in (scales or {}).items():
            if name.startswith(prefix):
                value = value * factor
        tensors.setdefault(component, {})[key] = value.to("cpu", dtype).contiguous()
    return tensors
