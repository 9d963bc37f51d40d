"""`conv3d`: F.conv3d, with float32 on the CPU sent to oneDNN whatever the input's size.

PyTorch's CPU dispatch keeps small convolutions off oneDNN ("for some case, native is faster"):
it compares N*C*dim2*dim3 of the input with a threshold of 20480. For a 5-D input that product is
N*C*T*H, which leaves out the width, so a one-sample video conv such as [1, 32, 4, 128, 128] *
[32, 32, 3, 3, 3] lands in the unfold + GEMM fallback (`slow_conv3d`): 0.73 s there against 0.13 s
through oneDNN on one EPYC core (the same sums in another order: 2e-4 apart on outputs of ~30).
bf16 / fp16 on the CPU take the same oneDNN float32 conv on the upcast operands, the output rounded
back: what a GPU's conv does (half operands, float32 accumulation), where the CPU's own half conv
without bf16 units runs ~100x slower (a tiny VAE decode in bf16: ~30 s against well under 1 s).
GPUs and traced graphs (inductor picks its own conv) go through F.conv3d as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_MKLDNN = torch.backends.mkldnn.is_available()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           padding: tuple[int, int, int]) -> torch.Tensor:
    """Stride 1, no dilation, one group (the only 3-D convs the VAEs run)."""
    if _MKLDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and not torch.compiler.is_compiling():
        if x.dtype == torch.float32:
            return torch.mkldnn_convolution(x, weight, bias, padding, (1, 1, 1), (1, 1, 1), 1)
        out = torch.mkldnn_convolution(x.float(), weight.float(), None if bias is None else bias.float(), padding,
                                       (1, 1, 1), (1, 1, 1), 1)
        return out.to(x.dtype)
    return F.conv3d(x, weight, bias, padding=padding)
