"""Parsing --device and --dtype, with errors that name the bad value."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def named_dtype(name: str, what: str) -> torch.dtype:
    """A load option's dtype by its torch name (e.g. a VAE's), or one line naming `what`."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{what} must be one of {sorted(FLOAT_DTYPES)}, got {name!r}")
    return FLOAT_DTYPES[name]


def parse_device(text: str | None) -> torch.device:
    """None/'auto' -> cuda when available, else cpu. Accepts 'cpu', 'cuda', 'cuda:N'."""
    if text in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {text!r}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {text!r}; use 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {text!r} asked for, but CUDA is not available on this machine")
    return device


def parse_dtype(text: str | None, device: torch.device) -> torch.dtype:
    """None/'auto' -> bfloat16 on GPU, float32 on CPU."""
    if text in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[text]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}; use one of {sorted(DTYPES)}") from None
