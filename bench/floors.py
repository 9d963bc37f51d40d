"""The peaks every floor in bench/ and docs/performance.md is computed with, and the MoE
decode's bytes per expert (one formula for bench_moe and for bench.report, which recomputes
the stored runs with it).

HBM: 4.3 TB/s, the copy bandwidth measured on this workplace's H200 (what a kernel can
reach; the datasheet's 4.8 TB/s is not reachable), so a memory floor is an achievable time.
Compute: 694 TFLOP/s, a dense bf16 GEMM (32768 x 4096 x 3072) measured on the same GPU.
TF32 and plain fp32 are not measured here: the H100/H200 SXM datasheet's dense figures (TF32
989 TFLOP/s with 2:4 sparsity, so 494.7 dense; fp32 without tensor cores 67), upper bounds,
so floors computed with them are times nothing runs under.
"""
from __future__ import annotations

HBM_TBPS = 4.3
DENSE_BF16_TFLOPS = 694.0
TF32_DATASHEET_TFLOPS = 494.7
FP32_DATASHEET_TFLOPS = 67.0
FP8_BLOCK = 128  # the "blocks" recipe's weight block (kernels/fp8_quant.py)

# The decode MoE's weight kinds (bench_moe's row suffixes): what one expert's matrices
# (gate/up [2I, H] and down [H, I], one micro) cost to read.
DECODE_KINDS = ("bf16", "fp8_channels", "fp8_blocks", "fp8_tensor")


def moe_decode_expert_bytes(kind: str, hidden: int, inter: int) -> int:
    """Bytes the decode MoE reads per selected expert: the weights in their storage dtype
    (bf16: 2 B, e4m3: 1 B) plus the float32 scales the FP8 kernels read with them
    (channels and tensor: one per gate/up row and per down row; blocks: one per 128 x 128)."""
    weights = 3 * inter * hidden
    if kind == "bf16":
        return 2 * weights
    if kind in ("fp8_channels", "fp8_tensor"):
        return weights + 4 * (2 * inter + hidden)
    if kind == "fp8_blocks":
        blocks = (2 * inter // FP8_BLOCK) * (hidden // FP8_BLOCK) + (hidden // FP8_BLOCK) * (inter // FP8_BLOCK)
        return weights + 4 * blocks
    raise ValueError(f"unknown decode weight kind {kind!r}; known: {DECODE_KINDS}")


def decode_kind_of(variant: str) -> str:
    """bench_moe's decode row name -> its weight kind ("decode_triton_fp8_channels_best_config"
    -> "fp8_channels"; rows without an FP8 recipe read bf16 weights)."""
    for kind in DECODE_KINDS[1:]:
        if f"_{kind}" in variant:
            return kind
    return "bf16"
