"""`conv3d`: F.conv3d, with float32 on the CPU sent to oneDNN whatever the input's size.

PyTorch's CPU dispatch keeps small convolutions off oneDNN ("for some case, native is faster"):
it compares N*C*dim2*dim3 of the input with a threshold of 20480. For a 5-D input that product is
N*C*T*H, which leaves out the width, so a one-sample video conv such as [1, 32, 4, 128, 128] *
[32, 32, 3, 3, 3] lands in the unfold + GEMM fallback (`slow_conv3d`): 0.73 s there against 0.13 s
through oneDNN on one EPYC core (the same sums in another order: 2e-4 apart on outputs of ~30).
GPUs, other dtypes and traced graphs (inductor picks its own conv) go through F.conv3d as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_MKLDNN = torch.backends.mkldnn.is_available()


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           padding: tuple[int, int, int]) -> torch.Tensor:
    """Stride 1, no dilation, one group (the only 3-D convs the VAEs run)."""
    if _MKLDNN and x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.mkldnn_convolution(x, weight, bias, padding, (1, 1, 1), (1, 1, 1), 1)
    return F.conv3d(x, weight, bias, padding=padding)
