"""The FP8 attention kernels' shared constants: head sizes, the INT8 scale blocks of `quantize_qkv`'s
operands, and the bit trick that reads the int32 logits as float32 (kernels/fp8_attention.py, and its
Gluon kernel in kernels/fp8_attention_gluon.py)."""
from __future__ import annotations

import math

import triton.language as tl

from .fp8_quant import FP8_MAX, INTERPRETED

HEAD_DIMS = (64, 128)          # the kernel's head sizes; a smaller head is padded to the next
MAX_HEAD_DIM = HEAD_DIMS[-1]
LOG2E = 1.4426950408889634
LOG2_FP8_MAX = math.log2(FP8_MAX)
INT8_MAX = 127.0
# int32 x in [-2^22, 2^22) plus these bits reads as the float32 1.5 * 2^23 + x, exactly.
# A logit of D products of two int8 values is at most 128 * 127^2 < 2^21 in magnitude.
# (constexpr: the kernel reads them)
MAGIC_BITS, MAGIC_FLOAT = tl.constexpr(0x4B400000), tl.constexpr(12582912.0)
LOG2_FP8_MAX_C = tl.constexpr(LOG2_FP8_MAX)
# The scale blocks: SCALE_M query rows (SCALE_N key rows) of a head share one INT8 scale.
# The interpreter runs small blocks (it is slow per element, and the tests use odd lengths).
SCALE_M, SCALE_N = (16, 16) if INTERPRETED else (128, 128)
