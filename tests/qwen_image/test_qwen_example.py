"""`dtgen run --model qwen-image` end to end on its tiny default (a diffusers-format folder)."""
import json

import pytest

from models.qwen_image.cli import main
from models.qwen_image.tiny import ensure_tiny_checkpoint


@pytest.fixture
def cache_env(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("qwen-cache")
    ensure_tiny_checkpoint(root)
    monkeypatch.setenv("DTGEN_CACHE", str(root))


def test_two_rank_cfg2_with_check_writes_png_and_report(cache_env, tmp_path):
    from PIL import Image
    report, image = tmp_path / "r.json", tmp_path / "i.png"
    assert main(["--world-size", "2", "--plan", "cfg2", "--steps", "2", "--check", "--output", str(image),
                 "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["plan"] == "cfg2" and r["world_size"] == 2 and r["phase_switch"]["weights_copied"] == 0
    assert all(v <= 1e-5 for v in r["check"].values()), r["check"]
    assert Image.open(image).size == (64, 48)


def test_bad_flags_are_refused_in_one_line(cache_env, capsys):
    assert main(["--image-size", "70x48"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --image-size width 70 must be a multiple of 16 (VAE x patch size); nearest valid: 64 or 80"
    assert main(["--image-size", "big"]) == 2
    assert "--image-size 'big' is not 'WIDTHxHEIGHT'" in capsys.readouterr().err
    assert main(["--output", "q.imgx"]) == 2
    assert "--output q.imgx: no image format has the suffix '.imgx'" in capsys.readouterr().err


def test_bench_peers_smoke_run_writes_its_json(tmp_path):
    """bench/bench_peers.py for qwen-image at tiny shapes on the CPU (eager): both modules on the same
    weights compute the same forward (float32: rounding level), the JSON holds the figures."""
    pytest.importorskip("diffusers")
    from bench.bench_peers import main as bench_main
    out = tmp_path / "b.json"
    assert bench_main(["--model", "qwen-image", "--tiny", "--image-size", "128x128", "--text-rows", "8", "--warmup",
                       "0", "--iters", "1", "--variants", "bf16,dense-fp8", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["sizes"]["tiny"]["image_rows"] == 64 and {row["mode"] for row in r["rows"]} == {"eager"}
    dtgen = {row["variant"]: row for row in r["rows"] if row["who"] == "dtgen"}
    assert dtgen["bf16"]["rel_l2_vs_diffusers"] < 1e-5
    fp8 = dtgen["dense-fp8"]     # measured: 2.3e-3
    assert 0 < fp8["rel_l2_vs_dtgen_bf16"] < 2e-2 and fp8["ms"] > 0
