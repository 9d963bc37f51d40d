"""Whether the Triton kernels can run in this test run, and the skip marker for those that need them.

They run on CUDA, or on the CPU when `triton.jit` built them as interpreted functions. Every
kernel module decides that when it is imported (its `TRITON_INTERPRETED`, or fp8_quant's
`INTERPRETED`, is `not isinstance(kernel, JITFunction)`): `triton.jit` consults
`triton.knobs.runtime.interpret`, Triton's reading of $TRITON_INTERPRET, at each decoration.
tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA before anything imports
triton or a kernel, so within a test run that knob answers for every kernel module, and
this marker depends on none of them.
"""
import pytest
import torch
from triton import knobs

TRITON_RUNS = torch.cuda.is_available() or knobs.runtime.interpret

needs_triton = pytest.mark.skipif(
    not TRITON_RUNS,
    reason="Triton needs CUDA, or TRITON_INTERPRET=1 set before triton is imported (conftest does it on CPU)")
