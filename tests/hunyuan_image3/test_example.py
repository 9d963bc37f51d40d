"""`python -m examples.hunyuan_t2i` end to end on the tiny default."""
import json

import pytest
from PIL import Image

from models.hunyuan_image3.cli import main

REPORT_KEYS = {"plan", "world_size", "device", "timings_ms", "tokens_generated", "image_size", "phase_switch"}
TIMING_KEYS = {"ar_prefill", "ar_decode_per_token", "denoise_step", "denoise_first_step", "vae_decode", "total"}


@pytest.fixture
def cache_env(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))


def _run(tmp_path, *extra):
    report = tmp_path / "r.json"
    out = tmp_path / "img.png"
    assert main(["--steps", "3", "--max-new-tokens", "4", "--output", str(out), "--report", str(report),
                 *extra]) == 0
    return json.loads(report.read_text()), Image.open(out)


def test_single_process_run_writes_png_and_report(cache_env, tmp_path):
    report, image = _run(tmp_path, "--image-size", "256x256")
    assert REPORT_KEYS <= set(report) and TIMING_KEYS <= set(report["timings_ms"])
    assert report["plan"] == "single" and report["world_size"] == 1
    assert report["image_size"] == [256, 256] and image.size == (256, 256)
    assert report["tokens_generated"] <= 4
    assert all(v >= 0 for v in report["timings_ms"].values())
    assert report["requests"][0]["image_write_ms"] > 0   # what bench_serve sets beside the server's PNG


def test_a_non_square_image_size_is_width_by_height(cache_env, tmp_path, capsys):
    """--image-size is WIDTHxHEIGHT (the server's `size`, OpenAI's order): 384x128 from the tiny
    model's table writes a PNG 384 wide and 128 high; the summary prints it the same way."""
    report, image = _run(tmp_path, "--image-size", "384x128", "--max-new-tokens", "0")
    assert image.size == (384, 128)
    assert report["image_size"] == [128, 384]   # the report's is (height, width), as the pipeline's
    assert "3 steps, 384x128;" in capsys.readouterr().out


def test_the_demo_edits_an_image(cache_env, tmp_path):
    """--image on the tiny default: the condition is encoded once and the image keeps the
    reference's bucket. (Its parallel plans against one process: tests/hunyuan_image3/test_distributed.py's
    TI2I golden jobs, the encoders included.)"""
    ref = tmp_path / "ref.png"
    Image.effect_mandelbrot((64, 64), (-2.0, -1.2, 1.0, 1.2), 60).convert("RGB").save(ref)
    report, image = _run(tmp_path, "--image", str(ref), "--prompt", "make the sky red",
                         "--system-prompt", "Edit the image.")
    assert report["edit"] == {"image": str(ref), "system_prompt": "Edit the image."}
    assert report["timings_ms"]["condition_encode"] > 0
    assert tuple(report["image_size"]) == (image.size[1], image.size[0]) == (256, 256)


def test_bad_arguments_exit_with_a_message(cache_env, capsys):
    assert main(["--plan", "nope"]) == 2
    assert "unknown HunyuanImage-3 plan 'nope'; known: [" in capsys.readouterr().err
    assert main(["--world-size", "2", "--plan", "hybrid"]) == 2
    assert "runs on 4 ranks" in capsys.readouterr().err
    assert main(["--dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err
    assert main(["--output", "out.imgx"]) == 2   # before the run, not after it
    assert "--output out.imgx: no image format has the suffix '.imgx'" in capsys.readouterr().err


def test_random_weights_fixed_length_run(cache_env, tmp_path):
    """--random-weights: no checkpoint read; a fixed prompt length and token count for benchmarks."""
    report = tmp_path / "r.json"
    assert main(["--random-weights", "tiny", "--layers", "1", "--steps", "2", "--max-new-tokens", "5",
                 "--ignore-eos", "--prompt-tokens", "40", "--image-size", "256x256",
                 "--output", str(tmp_path / "i.png"), "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["tokens_generated"] == 5 and r["checkpoint"] == "random:tiny:1-layers"
    assert main(["--random-weights", "tiny", "--check"]) == 2
    assert main(["--layers", "3"]) == 2


def test_several_prompts_in_one_run(cache_env, tmp_path):
    """--prompt repeated and --prompts-file: one process, one image and one timing row per
    request. (Which request compiled graphs, with --compile: tests/hunyuan_image3/test_compile.py's
    warm-up test.)"""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a lighthouse at dusk\n\n  a red fox in fresh snow, golden hour  \n")
    report = tmp_path / "r.json"
    out = tmp_path / "img.png"
    assert main(["--steps", "2", "--max-new-tokens", "2", "--ignore-eos", "--image-size", "256x256",
                 "--prompt", "a fox", "--prompts-file", str(prompts), "--output", str(out), "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    requests = r["requests"]
    assert len(requests) == 3
    assert len({q["prompt_tokens"] for q in requests}) == 3      # three prompt lengths, in the given order
    assert requests[0]["prompt_tokens"] < requests[2]["prompt_tokens"]
    assert all(TIMING_KEYS <= set(q["timings_ms"]) and q["image_size"] == [256, 256] for q in requests)
    assert all(r["timings_ms"][k] == requests[0]["timings_ms"][k] for k in TIMING_KEYS)
    for path in (out, tmp_path / "img-1.png", tmp_path / "img-2.png"):
        assert Image.open(path).size == (256, 256)
