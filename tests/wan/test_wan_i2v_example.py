"""`python -m examples.wan_t2v --image FILE` end to end on the tiny image-to-video default, and the
command's one-line refusals of image-to-video mistakes."""
import json

import pytest
from PIL import Image

from models.wan.cli import main
from models.wan.tiny import ensure_tiny_checkpoint, ensure_tiny_i2v_checkpoint


@pytest.fixture
def cache_env(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("wan-i2v-cache")
    ensure_tiny_checkpoint(root)
    ensure_tiny_i2v_checkpoint(root)
    monkeypatch.setenv("DTGEN_CACHE", str(root))
    return root


@pytest.fixture
def reference(tmp_path):
    path = tmp_path / "ref.png"
    Image.new("RGB", (120, 80), (30, 120, 200)).save(path)   # 3:2 landscape
    return path


def test_two_rank_cfg_with_check_makes_a_video_of_the_images_aspect(cache_env, reference, tmp_path):
    av = pytest.importorskip("av")
    report, video = tmp_path / "r.json", tmp_path / "v.mp4"
    assert main(["--image", str(reference), "--world-size", "2", "--plan", "cfg2", "--steps", "2", "--check",
                 "--output", str(video), "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["request"]["height"] == 32 and r["request"]["width"] == 64   # 48 x 64 px of area at 3:2
    assert r["request"]["image"].endswith("ref.png (120x80)")
    assert all(v <= 1e-5 for v in r["check"].values()), r["check"]
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 64, 3)


def test_a_given_size_wins_over_the_images_aspect(cache_env, reference, tmp_path):
    report = tmp_path / "r.json"
    assert main(["--image", str(reference), "--height", "48", "--width", "48", "--steps", "1",
                 "--output", str(tmp_path / "v.mp4"), "--report", str(report)]) == 0
    r = json.loads(report.read_text())["request"]
    assert (r["height"], r["width"]) == (48, 48)


def test_bad_command_lines_are_refused_in_one_line(cache_env, reference, tmp_path, capsys):
    t2v, i2v = ensure_tiny_checkpoint(cache_env), ensure_tiny_i2v_checkpoint(cache_env)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    Image.new("RGB", (8, 40)).save(tmp_path / "small.png")
    Image.new("L", (8193, 16)).save(tmp_path / "large.png")
    cases = [
        (["--image", str(reference), "--checkpoint", str(t2v)], "error: --image this checkpoint makes video from "
                                                                 "text (WanPipeline)"),
        (["--checkpoint", str(i2v)], "error: --image is required: this checkpoint makes video from an image"),
        (["--image", str(tmp_path / "bad.png")], f"error: --image {tmp_path / 'bad.png'}: not a readable image"),
        (["--image", str(tmp_path / "none.png")], f"error: --image {tmp_path / 'none.png'}: no such file"),
        (["--image", str(tmp_path / "small.png")], "error: --image " + str(tmp_path / "small.png") +
         ": 8x40 (WxH) is too small"),
        (["--image", str(tmp_path / "large.png")], "error: --image " + str(tmp_path / "large.png") +
         ": 8193x16 (WxH) is too large"),
        (["--image", str(reference), "--num-frames", "8"], "error: --num-frames 8 does not map to whole latent "
                                                           "frames (it must be 4k + 1)"),
    ]
    for args, message in cases:
        assert main([*args, "--output", str(tmp_path / "v.mp4")]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and "\n" not in err, err
