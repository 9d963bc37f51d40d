"""FP8 (e4m3) dense linear: y = x W^T + b with W stored in e4m3, one scale per output channel.

The weight is quantized once at load (`kernels.fp8_quant.quantize_weight_channels`: scale
[N] = row amax / 448, the experts' "channels" recipe); activations are quantized per token
on every call (dynamic: scale [M] = row amax / 448). Both scales are constant along K, so
the GEMM accumulates plain e4m3 products in float32 and applies scale_x[m] * scale_w[n] in
its epilogue:

- CUDA, at most DECODE_GEMV_MAX_ROWS (16) rows (an AR decode step): `kernels.decode_gemv`, a
  bandwidth-bound Triton GEMV that reads the e4m3 weight once and quantizes x itself, with
  the reference's numerics (at M = 1 `_scaled_mm` plus the separate quantization kernels were
  slower than the bf16 linear). Any K and N.
- CUDA (compute capability 8.9+), more rows, K and N multiples of 16: `torch._scaled_mm` with rowwise
  scales (float32 scale_a [M, 1] and scale_b [1, N], bf16 out; cuBLASLt/CUTLASS, and
  inductor's lowering under torch.compile). The bias is added after it, in the output
  dtype, where inductor fuses it into whatever follows.
- everywhere else (the CPU, odd shapes): `fp8_linear_reference`, the same quantization of
  x in torch, then both operands dequantized to float32 and multiplied. Its numerics are
  the GPU path's up to the float32 summation order, so CPU tests stand for the GPU's error.

The activation quantization is plain torch (amax, divide, clamp, cast): under
torch.compile it fuses into the producer of x (a LayerNorm with its modulation, an
activation), which a separate Triton kernel could not.
"""
from __future__ import annotations

import torch

from .decode_gemv import decode_gemv, gemv_suits
from .fp8_quant import FP8_DTYPE, quantize_activation_rows  # noqa: F401 (re-exported)

# "auto": the GEMV at <= DECODE_GEMV_MAX_ROWS rows on CUDA, else _scaled_mm where usable, else
# the reference; "scaled_mm": never the GEMV (today's GEMM path at any rows, for comparison);
# "reference": the torch path everywhere.
IMPLS = ("auto", "reference", "scaled_mm")


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be a 2-D {FP8_DTYPE} tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {tuple(weight.shape)} takes "
                         f"{weight.shape[1]}")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: weight_scale must be float32 [{weight.shape[0]}] (one per output channel), "
                         f"got {tuple(weight_scale.shape)} {weight_scale.dtype}")


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K]; weight [N, K] e4m3; weight_scale [N] float32; bias [N] or None ->
    [..., N] in x's dtype. x quantized per row as on the GPU, then dequantize + matmul in
    float32."""
    _check(x, weight, weight_scale)
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activation_rows(flat)
    y = (q.float() * scale) @ (weight.float() * weight_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def scaled_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the rowwise `torch._scaled_mm` path takes these operands (CUDA; cuBLASLt
    needs K and N to be multiples of 16; the weight's transpose column-major)."""
    n, k = weight.shape
    return x.is_cuda and k % 16 == 0 and n % 16 == 0 and weight.stride(1) == 1


def fp8_gemv_suits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether "auto" takes the decode GEMV: CUDA, at most DECODE_GEMV_MAX_ROWS rows, a
    K-contiguous weight, x in float32/bf16/fp16."""
    return gemv_suits(x, weight) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """y = x W^T + b with FP8 W (see the module docstring and IMPLS)."""
    if impl not in IMPLS:
        raise ValueError(f"fp8_linear impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto" and fp8_gemv_suits(x, weight):
        _check(x, weight, weight_scale)
        # x quantized by torch ops, which inductor fuses into x's producer (a norm, an
        # activation); the GEMV only streams the e4m3 weight. Quantizing in the GEMV instead
        # (every program its own amax pass) left it at ~1.3 TB/s on an H200.
        q, scale = quantize_activation_rows(x.reshape(-1, x.shape[-1]))
        return decode_gemv(q.view(x.shape), weight, weight_scale, bias, x_scale=scale.view(-1),
                           out_dtype=x.dtype)
    if impl == "reference" or not scaled_mm_usable(x, weight):
        return fp8_linear_reference(x, weight, weight_scale, bias)
    _check(x, weight, weight_scale)
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activation_rows(flat)
    y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
