"""The VAE's FLOP count says what it measures: `bench/bench_vae.py --flops`'s per-convolution count agrees
with torch's FLOP counter on the released decoder."""
from __future__ import annotations

import json

import pytest

from bench import bench_vae


def test_vae_flops_counts_the_released_decode(tmp_path):
    out = tmp_path / "f.json"
    assert bench_vae.main(["--flops", "--sizes", "1024", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["flops_counter_matches_now"] and run["frames_decoded"] == 4
    # 10 of the 12 frame-taps at 4 frames are needed: the three 4-frame levels dominate
    assert 0.8 < run["flops_needed"] / run["flops_now"] < 0.9
    assert sum(run["needed_tflop_by_level"].values()) * 1e12 == pytest.approx(run["flops_needed"], rel=1e-9)
    floors = run["floor_ms_of_needed"]
    assert floors["fp32 (datasheet, no tensor cores)"] > floors["tf32 (datasheet, dense)"] > \
        floors["bf16 (measured GEMM rate, bench/floors.py)"]

