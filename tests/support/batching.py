"""What the batch tests of every model share: a batch hook that lets every member stay, and
latents compared relative to their scale."""
from __future__ import annotations

import torch

from dtgen.batching import per_member


def quiet(n: int):
    """A batch hook for n members, none of which ever leaves."""
    return per_member([lambda *a: None] * n)


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rtol: float, where: str = "") -> None:
    """|got - want| <= rtol x max |want| everywhere (a batch's rows change the GEMM blocking)."""
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    assert diff <= rtol * scale, f"{where}: {diff} > {rtol} x {scale}"
