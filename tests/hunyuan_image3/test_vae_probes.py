"""The VAE probes count and time what they say: bench/probes/vae_flops.py's per-convolution
count agrees with torch's FLOP counter on the released decoder, and every variant of
bench/probes/vae_conv_probe.py computes the 3x3x3 convolution conv3d computes (CPU shapes)."""
from __future__ import annotations

import json

import pytest
import torch

from bench.probes import vae_conv_probe, vae_flops


def test_vae_flops_counts_the_released_decode(tmp_path):
    out = tmp_path / "f.json"
    assert vae_flops.main(["--sizes", "1024", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["flops_counter_matches_now"] and run["frames_decoded"] == 4
    # 10 of the 12 frame-taps at 4 frames are needed: the three 4-frame levels dominate
    assert 0.8 < run["flops_needed"] / run["flops_now"] < 0.9
    assert sum(run["needed_tflop_by_level"].values()) * 1e12 == pytest.approx(run["flops_needed"], rel=1e-9)
    floors = run["floor_ms_of_needed"]
    assert floors["fp32 (datasheet, no tensor cores)"] > floors["tf32 (datasheet, dense)"] > \
        floors["bf16 (measured GEMM rate, bench/floors.py)"]


def test_every_conv_variant_computes_conv3d():
    rows = vae_conv_probe.probe(vae_conv_probe.SHAPES["tiny"], [torch.float32], iters=1, device=torch.device("cpu"))
    assert [r["variant"] for r in rows[:5]] == ["conv3d", "conv3d_cl_resident", "taps2d", "taps2d_cl_resident", "fold2d"]
    assert len(rows) == 2 * 5   # two shapes (4 frames and 3), five variants
    assert all(r["max_rel_diff_vs_conv3d"] < 1e-5 for r in rows), [(r["variant"], r["max_rel_diff_vs_conv3d"]) for r in rows]
