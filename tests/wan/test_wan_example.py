"""`python -m examples.wan_t2v` end to end on its tiny default (a diffusers-format folder)."""
import json

import pytest

from models.wan.cli import main
from models.wan.tiny import ensure_tiny_checkpoint


@pytest.fixture
def cache_env(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("wan-cache")
    ensure_tiny_checkpoint(root)
    monkeypatch.setenv("DTGEN_CACHE", str(root))


def test_two_rank_ulysses_with_check_writes_mp4_and_report(cache_env, tmp_path):
    av = pytest.importorskip("av")
    report, video = tmp_path / "r.json", tmp_path / "v.mp4"
    assert main(["--world-size", "2", "--plan", "ulysses2", "--steps", "2", "--check", "--output", str(video),
                 "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["plan"] == "ulysses2" and r["world_size"] == 2 and r["tokens_per_step"] == 36
    assert r["phase_switch"]["weights_copied"] == 0
    assert all(v <= 1e-5 for v in r["check"].values()), r["check"]
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)


def test_step_cache_report_says_which_steps_ran_in_full(cache_env, tmp_path, capsys):
    pytest.importorskip("av")
    report = tmp_path / "r.json"
    assert main(["--steps", "6", "--step-cache", "first-block:threshold=0.05", "--output", str(tmp_path / "v.mp4"),
                 "--report", str(report)]) == 0
    r = json.loads(report.read_text())["step_cache"]
    assert r["method"] == "first-block" and r["config"] == {"method": "first-block", "threshold": 0.05}
    assert r["full_steps"] and r["cached_steps"] and sorted(r["full_steps"] + r["cached_steps"]) == list(range(6))
    assert len(r["full_rows"]) == 6 and all(len(rows) == 2 for rows in r["full_rows"])
    timings = json.loads(report.read_text())["timings_ms"]
    assert timings["denoise_full_step"] > 0 and timings["denoise_cached_step"] > 0
    out = capsys.readouterr().out
    assert "step cache" in out and "reused steps" in out and "full / reused step" in out


@pytest.mark.parametrize("args, message", [
    (["--step-cache", "first-block:thresh=1"], "error: --step-cache thresh: is not a knob of first-block; its knobs: "
                                               "threshold"),
    (["--step-cache", "taylorseer:interval=0"], "error: --step-cache interval: must be >= 1, got 0"),
    (["--step-cache", "magcache"], "error: --step-cache mag_ratios: are required"),
    (["--step-cache", "teacache"], "error: --step-cache method: unknown method 'teacache'"),
    (["--num-frames", "80"], "error: --num-frames 80 does not map to whole latent frames (it must be 4k + 1); "
                             "nearest valid: 77 or 81"),
    (["--width", "70"], "error: --width 70 must be a multiple of 16 (VAE x patch size); nearest valid: 64 or 80"),
    (["--world-size", "2", "--plan", "ulysses4"], "error: plan 'ulysses4' runs on 4 ranks, --world-size is 2"),
    (["--plan", "nope"], "error: unknown Wan plan 'nope'; known: "),
    (["--compile-regions"], "error: --compile-regions needs --compile (without it every step runs eagerly)"),
    (["--compile-mode", "regions"], "error: --compile-mode needs --compile"),
    (["--vae-parallel"], "error: --vae-parallel splits the VAE decode over several ranks; this run has --world-size 1"),
])
def test_bad_command_lines_are_refused_in_one_line(cache_env, capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err
