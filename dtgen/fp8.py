"""FP8 as load options: dense linears (which modules, and the module that runs them) and
attention (the cores that run kernels/fp8_attention.py), for every model.

A model built on meta swaps the linears it wants in FP8 for `FP8Linear` (`swap_fp8_linears`)
before the build; the build then stores each one's weight in e4m3 with a float32 scale per
output channel (`weight_scale`, made at load from the weight: `dtgen.build.param_sources`),
and the storage quantizes it as it is read, one weight at a time, so no second copy in the
model dtype is ever resident. Parameter names stay the checkpoint's (`x.weight`, `x.bias`);
`x.weight_scale` is new and is not read.
"""
from __future__ import annotations

import fnmatch
from functools import partial
from typing import Iterable

import torch
from torch import nn

from kernels.fp8_attention import MAX_HEAD_DIM as FP8_MAX_HEAD_DIM, fp8_attention
from kernels.fp8_linear import IMPLS, fp8_linear
from kernels.fp8_quant import FP8_DTYPE, fp8_support_problem

from .attention import LocalAttention
from .refusal import DeviceRefusal
from .layers.linear import empty_param

DENSE_DTYPES = ("model", "fp8")
ATTENTION_DTYPES = ("model", "fp8")
# The SP kinds whose inner core attends the whole (gathered) sequence through the model's
# local core, so that FP8 attention is what runs; the others (ring, attn2d) merge partial
# attentions with their own kernels.
FP8_ATTENTION_KINDS = ("local", "ulysses", "ulysses-pipelined")


class FP8Linear(nn.Module):
    """y = x W^T + b, W [out, in] in e4m3 with weight_scale [out] float32 (kernels/fp8_linear.py).
    `impl` (kernels.fp8_linear.IMPLS): "auto" (on CUDA the decode GEMV at <= 16 rows, rowwise
    torch._scaled_mm above; the torch reference elsewhere), "scaled_mm" or "reference".
    `defer_bias`: as `dtgen.layers.linear.Linear`'s (the controller's, for a row split)."""

    defer_bias = False

    def __init__(self, in_features: int, out_features: int, bias: bool, impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"FP8Linear impl must be one of {IMPLS}, got {impl!r}")
        self.in_features, self.out_features, self.impl = in_features, out_features, impl
        self.weight = empty_param(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale = empty_param(out_features, dtype=torch.float32)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, None if self.defer_bias else self.bias, self.impl)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"


def swap_fp8_linears(model: nn.Module, patterns: Iterable[str], impl: str = "auto") -> list[str]:
    """Replace every module whose name matches one of the globs `patterns` and that has a
    2-D `weight` (and an optional 1-D `bias`) by an `FP8Linear` of the same shape, in place
    (on meta: nothing is allocated). Returns the names swapped; a pattern matching no
    linear is an error (a typo would otherwise leave the option silently unused)."""
    patterns = tuple(patterns)
    swapped, used = [], set()
    for name, module in list(model.named_modules()):
        hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        weight = getattr(module, "weight", None)
        if not hits or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, FP8Linear):
            continue
        bias = getattr(module, "bias", None)
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        new = FP8Linear(weight.shape[1], weight.shape[0], bias is not None, impl)
        if isinstance(parent, nn.ModuleList):
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
        swapped.append(name)
        used.update(hits)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ValueError(f"FP8 linears: the pattern(s) {unused} match no linear module of this model")
    return swapped


def fp8_linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, FP8Linear)]


def check_dense_dtype(dense_dtype: str, device: torch.device, flag: str = "--dense-dtype") -> None:
    """A bad value, or FP8 on a device without FP8 tensor cores: one line, before any weight is read."""
    if dense_dtype not in DENSE_DTYPES:
        raise ValueError(f"dense_dtype must be one of {DENSE_DTYPES}, got {dense_dtype!r}")
    if dense_dtype == "fp8":
        problem = fp8_support_problem(torch.device(device))
        if problem:
            raise DeviceRefusal(f"{flag} fp8: {problem}")


def quantize_linears_(model: nn.Module, patterns: Iterable[str], impl: str = "auto") -> list[str]:
    """`swap_fp8_linears` on a model whose weights are already real (a benchmark's random
    DiT, or one built outside `dtgen.build`): each matching linear becomes an `FP8Linear`
    holding its weight quantized per channel; the model-dtype weight is dropped with its
    module. Returns the names swapped."""
    from kernels.fp8_quant import quantize_weight_channels
    old = dict(model.named_modules())
    names = swap_fp8_linears(model, patterns, impl)
    for name in names:
        new, was = model.get_submodule(name), old[name]
        q, scale = quantize_weight_channels(was.weight.detach())
        new.weight = nn.Parameter(q, requires_grad=False)
        new.weight_scale = nn.Parameter(scale, requires_grad=False)
        if was.bias is not None:
            new.bias = nn.Parameter(was.bias.detach(), requires_grad=False)
    return names


def add_fp8_flags(parser, linears: str, attention: str) -> None:
    """`--dense-dtype` and `--attention-dtype` on a model's command line; `linears` and
    `attention` name what each one moves to FP8 (e.g. "the DiT blocks' linears")."""
    parser.add_argument("--dense-dtype", default="model", choices=DENSE_DTYPES,
                        help=f"{linears}: the model dtype, or fp8 (e4m3 weights, one scale per output channel, "
                             "quantized at load; activations per token; GPU: compute capability 8.9+)")
    parser.add_argument("--attention-dtype", default="model", choices=ATTENTION_DTYPES,
                        help=f"{attention}: the model dtype (SDPA), or fp8 (INT8 QK, FP8 PV: "
                             "kernels/fp8_attention.py; head_dim up to 128)")


def check_attention_dtype(attention_dtype: str, device: torch.device, attention_kinds: tuple[str, ...] = ()) -> None:
    """A bad value, FP8 on a GPU without it, or FP8 under an SP kind that would not run it:
    one line, before any weight is read. (The head size is checked by `use_fp8_attention`.)"""
    if attention_dtype not in ATTENTION_DTYPES:
        raise ValueError(f"attention_dtype must be one of {ATTENTION_DTYPES}, got {attention_dtype!r}")
    if attention_dtype == "fp8":
        problem = fp8_support_problem(device)
        if problem:
            raise DeviceRefusal(f"--attention-dtype fp8: {problem}")
        other = sorted(set(attention_kinds) - set(FP8_ATTENTION_KINDS))
        if other:
            raise ValueError(f"--attention-dtype fp8 runs under the attention kinds {FP8_ATTENTION_KINDS}; this plan "
                             f"uses {other}")


def attention_head_problem(attention_dtype: str, head_dim: int) -> str | None:
    """The one line refusing FP8 attention for a head size the kernel does not take (a CLI
    asks it from the checkpoint's config, before any rank starts), or None."""
    if attention_dtype == "fp8" and head_dim > FP8_MAX_HEAD_DIM:
        return (f"--attention-dtype fp8: the FP8 attention kernel handles head_dim up to {FP8_MAX_HEAD_DIM}; this model has "
                f"{head_dim}")
    return None


def use_fp8_attention(attentions: Iterable[nn.Module], head_dim: int, pv: str = "fp8") -> None:
    """Each attention module's core (the dtgen contract: `core(q, k, v, meta, cache)`) attends
    its dense pieces with kernels/fp8_attention.py (INT8 QK, FP8 or FP16 PV); masked pieces
    (padding rows) stay on SDPA. Set on the model built on meta, before the build: the SP
    kinds then wrap this core. Refuses a head size the kernel does not take."""
    problem = attention_head_problem("fp8", head_dim)
    if problem:
        raise ValueError(problem)
    for attention in attentions:
        attention.core = LocalAttention(dense=partial(fp8_attention, pv=pv))
