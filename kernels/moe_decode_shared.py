"""Decode MoE with the shared expert folded in: routed experts + a shared GatedMLP in one op.

    out[t] = sum_k w[t, k] * y_{topk_ids[t, k]}(x[t]) + shared(x[t])

where the shared expert is a GatedMLP held as the experts are (``down(x1 * silu(x2))``):
shared_gate_up [M, 2I, H] (M micro packs, each [x1 rows; x2 rows]) and shared_down
[H, M*I] (the packs' column blocks, micro-major), with the experts' M and I. The routed
experts follow `kernels.moe_decode` (weights [M, E, 2I, H] and [M, E, H, I], in x's dtype
or e4m3 in either recipe of `kernels.fp8_quant`); the shared expert is in x's dtype or
e4m3 with one scale per output channel (scales [M, 2I] and [H], a GatedMLP's FP8 storage),
independently of the experts (FP8 experts beside a bf16 shared expert, and the reverse).

Why: at decode (T <= 16) both the routed experts and the shared MLP only stream weights.
Run apart, the shared MLP is two GEMV launches plus an activation-quantize kernel a layer,
~2.6 TB/s, and the experts' sum and the shared output are each rounded to x's dtype before
they are added. Here the decode kernels give the shared expert one more "pair" per chunk
of 16 tokens: it reads the shared weights once per chunk, at the routed kernels' bandwidth
(3.1-3.5 TB/s on an H200), its rows sit after the T*K pair rows, and the finalize adds
them with weight 1 in float32, rounding once. Three launches a layer in all.

Numerics against the separate path (`MoE.forward` without the fold): the FP8 shared expert
becomes weight-only FP8 as the FP8 experts are (x and its activation stay in x's dtype;
the separate `fp8_linear` rounds both to e4m3 per row, ~2.6% rms each), and the routed and
shared outputs are summed in float32 and rounded once instead of three times. Both only
remove roundings. In x's dtype the shared expert's math is the GatedMLP's up to summation
order and the rounding of its activation to x's dtype (the GEMV path rounds it too).

The torch reference (`moe_decode_shared_reference`) is the decode op's reference for the
experts (weights dequantized to float32, then rounded to x's dtype, float32 math) plus the
same for the shared expert, summed in float32: what CPU runs, so CPU tests see the GPU's
numerics up to summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_quant import FP8_DTYPE
from kernels.moe_decode import DECODE_IMPLS, moe_decode_triton
from kernels.moe_multi_micro import (
    check_fp8_scales,
    check_moe_inputs,
    dequantize_experts,
    moe_multi_micro_reference,
    require_triton_device,
)


def check_shared_inputs(x, w_gate_up, shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale) -> None:
    """The shared expert's shapes and dtypes against the experts' M, I and x's H; ValueError
    naming the tensor."""
    micros, _, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    want = {"shared_gate_up": (micros, two_inter, hidden), "shared_down": (hidden, micros * inter)}
    for name, t in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"MoE inputs: {name} must be {want[name]} (the experts' M = {micros} micros of "
                             f"I = {inter}, H = {hidden}), got shape {tuple(t.shape)}")
    fp8 = shared_gate_up_scale is not None
    if fp8 != (shared_down_scale is not None):
        raise ValueError("MoE inputs: shared_gate_up_scale and shared_down_scale must be given together")
    dtype = FP8_DTYPE if fp8 else x.dtype
    if shared_gate_up.dtype != dtype or shared_down.dtype != dtype:
        raise ValueError(f"MoE inputs: shared_gate_up {shared_gate_up.dtype} and shared_down {shared_down.dtype} "
                         f"must both be {dtype} ({'e4m3 with scales' if fp8 else 'no scales: x dtype'})")
    if fp8:
        for name, scale, shape in (("shared_gate_up_scale", shared_gate_up_scale, (micros, two_inter)),
                                   ("shared_down_scale", shared_down_scale, (hidden,))):
            if tuple(scale.shape) != shape or scale.dtype != torch.float32:
                raise ValueError(f"MoE inputs: {name} must be float32 {shape} (one scale per output channel), "
                                 f"got {scale.dtype} {tuple(scale.shape)}")
    tensors = (shared_gate_up, shared_down) + ((shared_gate_up_scale, shared_down_scale) if fp8 else ())
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"MoE inputs: the shared expert's tensors must be on x's device {x.device}")


def shared_expert_suits(x, w_gate_up, shared_gate_up, shared_gate_up_scale, shared_down) -> bool:
    """Whether this shared expert folds beside these experts (the dispatch asks; the op
    checks the rest): the experts' M and I, and weights in x's dtype, or e4m3 with scales."""
    micros, _, two_inter, hidden = w_gate_up.shape
    dtype = FP8_DTYPE if shared_gate_up_scale is not None else x.dtype
    return (tuple(shared_gate_up.shape) == (micros, two_inter, hidden)
            and tuple(shared_down.shape) == (hidden, micros * two_inter // 2)
            and shared_gate_up.dtype == dtype and shared_down.dtype == dtype)


def check_decode_shared_inputs(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                               shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale) -> None:
    """Experts (in x's dtype without scales, e4m3 with either recipe's) and shared expert."""
    if (w_gate_up_scale is None) != (w_down_scale is None):
        raise ValueError("MoE inputs: w_gate_up_scale and w_down_scale must be given together")
    fp8 = w_gate_up_scale is not None
    dims = check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, weight_dtype=FP8_DTYPE if fp8 else None)
    if fp8:
        check_fp8_scales(dims, w_gate_up_scale, w_down_scale)
    check_shared_inputs(x, w_gate_up, shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)


def shared_mlp_reference(x, shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale) -> torch.Tensor:
    """The shared GatedMLP in float32 [T, H], weight-only FP8: the weights dequantized and
    rounded to x's dtype (as `moe_decode_fp8_reference` does the experts'), x not quantized."""
    gate_up, down = shared_gate_up.float(), shared_down.float()
    if shared_gate_up_scale is not None:
        gate_up = (gate_up * shared_gate_up_scale[..., None]).to(x.dtype).float()
        down = (down * shared_down_scale[:, None]).to(x.dtype).float()
    micros = gate_up.shape[0]
    u = (x.float() @ gate_up.flatten(0, 1).T).unflatten(-1, (micros, 2, -1))
    return (u[..., 0, :] * F.silu(u[..., 1, :])).flatten(-2) @ down.T


def moe_decode_shared_reference(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                                shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale):
    """The experts as the decode op's references compute them (FP8: dequantized, rounded to
    x's dtype) plus `shared_mlp_reference`, summed in float32 and rounded once to x's dtype."""
    if w_gate_up_scale is not None:
        w_gate_up = dequantize_experts(w_gate_up, w_gate_up_scale).to(x.dtype)
        w_down = dequantize_experts(w_down, w_down_scale).to(x.dtype)
    routed = moe_multi_micro_reference(x, topk_ids, topk_weights, w_gate_up, w_down, out_dtype=torch.float32)
    shared = shared_mlp_reference(x, shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    return (routed + shared).to(x.dtype)


@torch.library.custom_op("dtgen::moe_decode_shared", mutates_args=())
def _moe_decode_shared_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor | None, w_down: torch.Tensor,
                          w_down_scale: torch.Tensor | None, shared_gate_up: torch.Tensor,
                          shared_gate_up_scale: torch.Tensor | None, shared_down: torch.Tensor,
                          shared_down_scale: torch.Tensor | None, impl: str) -> torch.Tensor:
    args = (x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
            shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    if impl == "reference" or (impl == "auto" and not x.is_cuda):
        return moe_decode_shared_reference(*args)
    return moe_decode_triton(x, topk_ids, topk_weights, w_gate_up, w_down, w_gate_up_scale=w_gate_up_scale,
                             w_down_scale=w_down_scale, shared_gate_up=shared_gate_up, shared_down=shared_down,
                             shared_gate_up_scale=shared_gate_up_scale, shared_down_scale=shared_down_scale)


@_moe_decode_shared_op.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, shared_gate_up,
      shared_gate_up_scale, shared_down, shared_down_scale, impl):
    return x.new_empty(x.shape)


def moe_decode_shared(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                      shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                      impl: str = "auto") -> torch.Tensor:
    """Routed experts plus the shared expert for few tokens (see the module docstring).
    Experts: in x's dtype (scales None) or e4m3 (either recipe); shared expert: in x's dtype
    (scales None) or e4m3 with per-channel scales. impl: "auto" (CPU: the reference; CUDA:
    the decode kernels), "reference", "triton" (on CPU only under TRITON_INTERPRET=1). ONE
    node of dtgen::moe_decode_shared under torch.compile. Correct for any T; built for T <= 16."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    check_decode_shared_inputs(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                               shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    if impl == "triton":
        require_triton_device(x)
    return torch.ops.dtgen.moe_decode_shared(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down,
                                             w_down_scale, shared_gate_up, shared_gate_up_scale, shared_down,
                                             shared_down_scale, impl)
