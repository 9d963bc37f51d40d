"""The model registry (dtgen/registry.py, models/registry.py): each spec's pieces are there,
a checkpoint folder is detected by its layout (one line when no model's), reading the specs
loads no model code, and every request type checks itself in `RequestError`s that the CLI
and the server rename alike."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtgen.buckets import ShapeBuckets, pad_rows
from dtgen.requests import RequestError, flag_line, parse_size, renamed
from models import registry

ROOT = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path, name: str, files: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for file, content in files.items():
        (folder / file).write_text(json.dumps(content))
    return folder


def test_every_spec_offers_what_its_callers_use():
    names = registry.names()
    assert names[0] == registry.default().name == "hunyuan-image3" and len(set(names)) == len(names)
    assert {s.name: s.makes for s in registry.specs()} == {"hunyuan-image3": "image", "wan": "video",
                                                           "qwen-image": "image"}
    for spec in registry.specs():
        assert callable(spec.load("loader")), spec.name
        # the bucket is named by the model's request: its fields, or properties read off them
        # (CFG on or off); every model here batches
        request = spec.load("request")
        named = {f.name for f in dataclasses.fields(request)} | {
            n for n in dir(request) if isinstance(getattr(request, n), property)}
        assert set(spec.buckets.sizes + spec.buckets.batch) <= named, spec.name
        assert spec.batches, spec.name
        cli = spec.load("cli")
        for name in ("build_parser", "finish_args", "prepare", "build_pipeline", "request_from_args",
                     "serve_adapter", "main"):
            assert callable(getattr(cli, name, None)), (spec.name, name)
        assert "single" in spec.load("plans").PLANS, spec.name
        assert callable(spec.load("request").check) and callable(spec.load("tiny")), spec.name
        # the server's parser: the CLI's flags without those only the CLI reads
        args = cli.finish_args(cli.build_parser("x", "y", cli=False).parse_args([]))
        assert args.world_size == 1 and args.plan == "single" and args.check is False


def test_a_bucket_is_its_size_fields_and_its_padded_rows():
    assert [pad_rows(n, 16) for n in (1, 16, 17)] == [16, 16, 32] and pad_rows(17, 0) == 17
    assert pad_rows(17, 16, limit=20) == 20 and pad_rows(21, 16, limit=20) == 21   # never below n
    video = ShapeBuckets(sizes=("num_frames", "height", "width"))
    req = dataclasses.make_dataclass("R", [("num_frames", int), ("height", int), ("width", int), ("steps", int)])
    assert video.key(req(9, 48, 64, 4)) == video.key(req(9, 48, 64, 50)) == (9, 48, 64)
    assert video.key(req(13, 48, 64, 4)) != video.key(req(9, 48, 64, 4))
    batched = ShapeBuckets(sizes=("height",), text_rows=256, batch=("steps",))
    assert batched.key(req(9, 48, 64, 4), text_rows=pad_rows(300, batched.text_rows)) == (48, 512, 4)


def test_a_checkpoint_is_detected_by_its_layout(tmp_path):
    found = {name: registry.detect(_folder(tmp_path, name, files)).name for name, files in {
        "hunyuan": {"config.json": {}},
        "wan": {"model_index.json": {"_class_name": "WanPipeline"}},
        "qwen": {"model_index.json": {"_class_name": "QwenImagePipeline"}}}.items()}
    assert found == {"hunyuan": "hunyuan-image3", "wan": "wan", "qwen": "qwen-image"}
    flux = _folder(tmp_path, "flux", {"model_index.json": {"_class_name": "FluxPipeline"}})
    with pytest.raises(ValueError) as e:
        registry.detect(flux)
    assert str(e.value).startswith(f"--checkpoint {flux}: a diffusers folder of 'FluxPipeline'; known: "
                                   "HunyuanImage-3 (") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no checkpoint of a known model; known: .*QwenImagePipeline"):
        registry.detect(_folder(tmp_path, "empty", {}))
    with pytest.raises(ValueError, match="no such folder"):
        registry.detect(tmp_path / "nowhere")
    # a model's own CLI names the model a folder holds
    assert registry.checkpoint_problem("wan", str(tmp_path / "wan"), "-") is None
    assert registry.checkpoint_problem("qwen-image", str(tmp_path / "wan"), "-") == \
        f"--checkpoint {tmp_path / 'wan'} holds Wan; this runs Qwen-Image (dtgen run --model wan runs it)"
    assert registry.checkpoint_problem("wan", str(tmp_path / "empty"), "no model_index.json there") == \
        f"--checkpoint {tmp_path / 'empty'}: no model_index.json there"
    assert registry.checkpoint_problem("wan", str(flux), "-") == (f"--checkpoint {flux}: a diffusers folder of "
                                                                  "'FluxPipeline'; Wan's is a diffusers folder, "
                                                                  "model_index.json naming WanPipeline or "
                                                                  "WanImageToVideoPipeline")
    # Wan's image-to-video folders are Wan's too (one command; --image picks image to video)
    i2v = _folder(tmp_path, "wan-i2v", {"model_index.json": {"_class_name": "WanImageToVideoPipeline"}})
    assert registry.detect(i2v).name == "wan" and registry.checkpoint_problem("wan", str(i2v), "-") is None


def test_the_server_chooses_the_model_from_the_checkpoint_or_model(tmp_path):
    from dtgen.cli import choose_model
    qwen = _folder(tmp_path, "qwen", {"model_index.json": {"_class_name": "QwenImagePipeline"}})
    assert choose_model([])[0].name == "hunyuan-image3"
    assert choose_model(["--model", "qwen-image"])[0].name == "qwen-image"
    assert choose_model(["--checkpoint", str(qwen), "--port", "1"])[0].name == "qwen-image"
    assert choose_model(["--checkpoint", str(qwen), "--model", "wan"]) == \
        (None, f"--model wan, but --checkpoint {qwen} holds qwen-image")
    assert choose_model(["--checkpoint", str(qwen)], only="hunyuan-image3")[1] == \
        f"--checkpoint {qwen} holds qwen-image; this launcher serves hunyuan-image3 (use dtgen serve)"


CLI_ONLY = ("--check", "--output", "--report", "--profile", "--prompt")   # what a server has no use for


@pytest.mark.parametrize("launcher, model", [("serve", "hunyuan-image3"), ("serve", "wan"), ("serve", "qwen-image"),
                                             ("hunyuan_serve", "hunyuan-image3"), ("dtgen", "qwen-image")])
def test_a_server_help_lists_no_cli_only_flags(launcher, model, capsys):
    """`--help` of a launcher lists the server's flags and the model's (plan, request
    defaults), none that only its CLI reads; the model's CLI does list those."""
    import importlib
    import re
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    with pytest.raises(SystemExit) as done:
        if launcher == "dtgen":
            from dtgen.cli import main
            main(["serve", "--model", model, "--help"])
        else:
            importlib.import_module(f"examples.{launcher}").main(["--model", model, "--help"])
    assert done.value.code == 0
    served = set(flag.findall(capsys.readouterr().out))
    assert {"--port", "--max-queued", "--deadline", "--plan", "--steps", "--seed"} <= served, sorted(served)
    assert not served & set(CLI_ONLY), sorted(served & set(CLI_ONLY))
    cli = set(flag.findall(registry.spec(model).load("cli").build_parser(cli=True).format_help()))
    assert set(CLI_ONLY) <= cli, sorted(set(CLI_ONLY) - cli)
    # failures are forced by the tests' own hook (tests/support/faults.py), never by a flag
    assert "--inject-failure" not in served | cli


def test_reading_the_specs_loads_no_model_code():
    """Every spec read (detect, --model choices) imports neither torch nor a model's modules;
    a Wan server's code imports nothing of the other models."""
    code = ("import sys; from models import registry; registry.specs(); "
            "bad = [m for m in sys.modules if m == 'torch' or (m.startswith('models.') and m.count('.') > 1 "
            "and not m.endswith('.spec'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    code = ("import sys; from dtgen.cli import choose_model; spec, _ = choose_model(['--model', 'wan']); "
            "spec.load('cli'); import models.wan.serving; "
            "print(sorted(m for m in sys.modules if m.startswith(('models.hunyuan_image3.', 'models.qwen_image.', "
            "'examples.hunyuan', 'examples.qwen')) and not m.endswith('.spec')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _error(fn) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn()
    return e.value


def test_each_request_checks_itself_and_front_ends_rename_the_field():
    from models.hunyuan_image3.requests import Limits, T2IRequest as HunyuanRequest
    from models.qwen_image.pipeline import T2IRequest as QwenRequest
    from models.wan.pipeline import T2VRequest
    e = _error(lambda: HunyuanRequest(steps=0).check(Limits()))
    assert (e.field, e.message) == ("steps", "must be >= 1 and <= 1000, got 0")
    assert flag_line(e, {"steps": "--steps"}) == "--steps must be >= 1 and <= 1000, got 0"
    e = _error(lambda: HunyuanRequest(cfg_mode="batch").check(Limits(distilled=True)))
    assert e.field == "cfg_mode" and "CFG-distilled" in e.message
    e = _error(lambda: T2VRequest("a fox", num_frames=10).check(4, 16))
    assert (e.field, e.message) == ("num_frames", "10 does not map to whole latent frames (it must be 4k + 1); "
                                                  "nearest valid: 9 or 13")
    e = _error(lambda: T2VRequest("a fox", width=70).check(4, 16))
    # width and height are one JSON field (size): the message says which
    assert str(renamed(e, {"width": "size", "height": "size"})) == \
        "size: width 70 must be a multiple of 16 (VAE x patch size); nearest valid: 64 or 80"
    e = _error(lambda: T2VRequest("a fox", guidance_scale_2=2.0).check(4, 16, two_experts=False))
    assert e.field == "guidance_scale_2" and "one transformer (Wan 2.1)" in e.message
    T2VRequest("a fox", guidance_scale_2=2.0).check(4, 16)   # the experts not known: not checked
    e = _error(lambda: QwenRequest("a fox", max_sequence_length=0).check())
    assert (e.field, e.message) == ("max_sequence_length", "must be >= 1 and <= 1024, got 0")
    e = _error(lambda: QwenRequest("a fox", step_cache="first-block:threshold=-1").check())
    assert e.field == "step_cache" and e.message.startswith("threshold:")
    assert parse_size("64x48", "size", "1x1") == (64, 48) and parse_size("auto", "size", "1x1", auto=True) is None
    assert _error(lambda: parse_size("64", "size", "832x480")).message == "'64' is not 'WIDTHxHEIGHT' (e.g. 832x480)"
