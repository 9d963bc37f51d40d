"""Routed experts' dispatch: which MoE op runs a call, from the implementation asked and the rows.

Not an op of its own: the choice among the ops beside it, kept here once so that a model
only binds it (HunyuanImage-3: `models.hunyuan_image3.model.set_moe_impl`). Every op takes
the multi-micro conventions (`kernels/moe_multi_micro.py`: weights [M, E, 2I, H] and
[M, E, H, I], the output summed over micros) and the signature of `experts_op`:
- up to DECODE_MOE_MAX_TOKENS rows on a GPU, the decode MoE (`kernels/moe_decode.py`: it
  reads only the chosen experts' weights);
- above, the multi-micro op (`kernels/moe_multi_micro.py`: routing once, fused grouped
  GEMMs, one finalize), or its torch-level form under torch.compile for "graph";
- FP8 experts: `moe_decode_fp8` / `moe_multi_micro_fp8` by the same row count, on every device.

impl (MOE_IMPLS): "eager": the model's own plain loop (it passes it in: HunyuanImage-3's is
`experts_eager` in its transformer.py); "auto": the kernel ops (CPU: their torch reference;
CUDA: decode MoE for <= 16 tokens, the fused grouped GEMMs above); "graph": "auto", but
compiled steps trace torch._grouped_mm for inductor to tune; "reference", "fused",
"grouped_mm", "triton", "two_dispatch", "flashinfer": forced variants of the multi-micro op.
FP8 experts always run `experts_op_fp8` ("reference" forces its torch emulation).
FP8_ONLY_IMPLS, for FP8 experts only: "scaled_grouped_mm" runs their GEMMs above
DECODE_MOE_MAX_TOKENS rows in torch._scaled_grouped_mm (`kernels/moe_scaled_grouped_mm.py`:
channel scales, sm90) instead of the fused Triton kernels; "gluon" the same pipeline with our
Gluon kernel (`kernels/moe_grouped_gemm_gluon.py`, sm90); `moe_impl_problem` says where they cannot.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from kernels.fp8_quant import fp8_support_problem
from kernels.moe_decode import moe_decode, moe_decode_fp8
from kernels.moe_grouped_gemm_gluon import gluon_problem
from kernels.moe_multi_micro import (
    MULTI_MICRO_IMPLS,
    graph_path_usable,
    moe_multi_micro,
    moe_multi_micro_fp8,
    moe_multi_micro_graph,
)
from kernels.moe_scaled_grouped_mm import scaled_grouped_mm_problem

# Up to this many tokens the decode MoE (which reads only the chosen experts) beats the
# grouped-GEMM path on a GPU.
DECODE_MOE_MAX_TOKENS = 16
FP8_ONLY_IMPLS = ("scaled_grouped_mm", "gluon")
MOE_IMPLS = ("eager", "graph") + MULTI_MICRO_IMPLS + FP8_ONLY_IMPLS
# What FP8 experts run: the others name variants of the model-dtype experts, which FP8 has not.
FP8_EXPERT_IMPLS = ("auto", "reference", "fused") + FP8_ONLY_IMPLS
# FP8 recipes whose weight scales are one per row (kernels/fp8_quant.py): "tensor" is held as channels.
ROWWISE_FP8_RECIPES = ("channels", "tensor")


def moe_impl_problem(impl: str, fp8_recipe: str | None) -> str | None:
    """Why the routed experts cannot run `impl`, in one line naming the option, or None.
    fp8_recipe: the FP8 experts' scale recipe, None for experts in the model dtype."""
    if impl not in MOE_IMPLS:
        return f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}"
    if fp8_recipe is not None and impl not in FP8_EXPERT_IMPLS:
        return (f"MoE implementation {impl!r} runs experts in the model dtype; FP8 experts (--moe-dtype fp8) "
                f"take {', '.join(FP8_EXPERT_IMPLS)}")
    if impl not in FP8_ONLY_IMPLS:
        return None
    if fp8_recipe is None:
        return f"MoE implementation {impl!r} runs FP8 experts only (--moe-dtype fp8)"
    if fp8_recipe not in ROWWISE_FP8_RECIPES:
        return (f"MoE implementation {impl!r} takes one scale per weight row (--fp8-scales "
                f"{' or '.join(ROWWISE_FP8_RECIPES)}), not {fp8_recipe!r}")
    return None


def moe_impl_device_problem(impl: str, device: torch.device) -> str | None:
    """Why `impl` cannot run on `device`, in one line naming the option, or None (asked on each
    rank before any weight is read: the launcher does not touch the GPU)."""
    if impl not in FP8_ONLY_IMPLS:
        return None
    device_problem = scaled_grouped_mm_problem if impl == "scaled_grouped_mm" else gluon_problem
    problem = fp8_support_problem(device) or device_problem(device)
    return f"MoE implementation {impl!r}: {problem}" if problem else None


def experts_impl(impl: str, eager: Callable) -> Callable:
    """The routed-experts callable for `impl` (experts_op's signature, bound): `eager` (the
    model's plain loop) for "eager", else `experts_op` with `impl`."""
    problem = moe_impl_problem(impl, None)
    if problem:
        raise ValueError(problem)
    return eager if impl == "eager" else partial(experts_op, impl=impl)


def experts_impl_fp8(impl: str) -> Callable:
    """The FP8 experts' callable for `impl`: always `experts_op_fp8` (only "reference" and the
    FP8-only impls change it)."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}")
    return partial(experts_op_fp8, impl=impl)


def experts_op(x, topk_ids, topk_weights, gate_and_up, down, *, impl: str):
    """Routed experts through the kernel ops (one graph node each under torch.compile).

    "graph": under torch.compile on the grouped-GEMM fast path, the multi-micro op's
    torch-level form instead, so that inductor sees (and, with GEMM autotuning, tunes) its
    grouped GEMMs; everywhere else the same as "auto".
    """
    if impl in ("auto", "graph") and x.is_cuda and x.shape[0] <= DECODE_MOE_MAX_TOKENS:
        return moe_decode(x, topk_ids, topk_weights, gate_and_up, down)
    if impl == "graph":
        if torch.compiler.is_compiling() and graph_path_usable(x, gate_and_up, down):
            return moe_multi_micro_graph(x, topk_ids, topk_weights, gate_and_up, down)
        impl = "auto"
    return moe_multi_micro(x, topk_ids, topk_weights, gate_and_up, down, impl=impl)


def experts_op_fp8(x, topk_ids, topk_weights, gate_and_up, gate_and_up_scale, down, down_scale, *, impl: str):
    """FP8 experts: up to DECODE_MOE_MAX_TOKENS tokens the decode op (weight-only FP8: it
    reads weights, so halving their bytes is what pays), above them `moe_multi_micro_fp8`
    (x and the activation in e4m3 too: it is compute-bound). On every device alike, so the
    CPU's torch emulations follow the GPU's numerics; impl "reference" forces them on CUDA.
    "scaled_grouped_mm" / "gluon": above DECODE_MOE_MAX_TOKENS, the GEMMs in torch._scaled_grouped_mm / the
    Gluon kernel."""
    if x.shape[0] <= DECODE_MOE_MAX_TOKENS:
        return moe_decode_fp8(x, topk_ids, topk_weights, gate_and_up, gate_and_up_scale, down, down_scale,
                              impl="reference" if impl == "reference" else "auto")
    # set_moe_impl binds one impl for both kinds of experts; a model-dtype one (refused for FP8
    # experts by moe_impl_problem) reaching here runs the default.
    impl = impl if impl in FP8_EXPERT_IMPLS else "auto"
    return moe_multi_micro_fp8(x, topk_ids, topk_weights, gate_and_up, gate_and_up_scale, down, down_scale, impl=impl)
