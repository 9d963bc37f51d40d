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
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from kernels.moe_decode import moe_decode, moe_decode_fp8
from kernels.moe_multi_micro import (
    MULTI_MICRO_IMPLS,
    graph_path_usable,
    moe_multi_micro,
    moe_multi_micro_fp8,
    moe_multi_micro_graph,
)

# Up to this many tokens the decode MoE (which reads only the chosen experts) beats the
# grouped-GEMM path on a GPU.
DECODE_MOE_MAX_TOKENS = 16
MOE_IMPLS = ("eager", "graph") + MULTI_MICRO_IMPLS


def experts_impl(impl: str, eager: Callable) -> Callable:
    """The routed-experts callable for `impl` (experts_op's signature, bound): `eager` (the
    model's plain loop) for "eager", else `experts_op` with `impl`."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}")
    return eager if impl == "eager" else partial(experts_op, impl=impl)


def experts_impl_fp8(impl: str) -> Callable:
    """The FP8 experts' callable for `impl`: always `experts_op_fp8` (only "reference" changes it)."""
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
    CPU's torch emulations follow the GPU's numerics; impl "reference" forces them on CUDA."""
    impl = "reference" if impl == "reference" else "auto"
    op = moe_decode_fp8 if x.shape[0] <= DECODE_MOE_MAX_TOKENS else moe_multi_micro_fp8
    return op(x, topk_ids, topk_weights, gate_and_up, gate_and_up_scale, down, down_scale, impl=impl)
