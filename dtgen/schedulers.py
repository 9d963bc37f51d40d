"""Flow-matching Euler sampling (the HunyuanImage-3 scheduler)."""
from __future__ import annotations

import torch


def flow_match_sigmas(steps: int, shift: float) -> torch.Tensor:
    """sigmas [steps + 1] from 1 to 0, shifted: s*sigma / (1 + (s - 1)*sigma), in float32 with
    the official scheduler's ops (so 1000 * sigma is bit for bit the timestep it feeds)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """x + v * (sigma_next - sigma), in float32 (sigma and sigma_next float32 values: their
    difference rounds to the float32 one the official scheduler multiplies by)."""
    return x.float() + velocity.float() * (sigma_next - sigma)


def classifier_free_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    return v_uncond + scale * (v_cond - v_uncond)
