"""The `dtgen` command (dtgen/cli.py): `dtgen models`, `dtgen run` of every registered model on
its tiny default, and its one-line refusals. (`dtgen serve` runs the Qwen-Image server's
tests: tests/qwen_image/test_serve_qwen.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtgen.cli import main, model_rows
from models import registry

ROOT = Path(__file__).resolve().parents[2]


def _dtgen(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dtgen", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_models_lists_every_registered_model_with_its_plans():
    rows = {r["model"]: r for r in model_rows()}
    assert list(rows) == registry.names()
    for spec in registry.specs():
        plans = spec.load("plans").PLANS
        assert rows[spec.name]["plans"] == {name: plan.world_size for name, plan in plans.items()}
        assert rows[spec.name]["makes"] == spec.makes and rows[spec.name]["checkpoint"] == spec.layout
    out = _dtgen("models", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["model"] for r in json.loads(out.stdout)] == registry.names()


@pytest.mark.parametrize("model, output, flags", [
    ("qwen-image", "q.png", ("--steps", "2")),
    ("wan", "w.mp4", ("--steps", "2")),
    ("hunyuan-image3", "h.png", ("--steps", "2", "--max-new-tokens", "2", "--image-size", "256x256")),
])
def test_run_makes_each_models_output_from_its_tiny_default(model, output, flags, tmp_path):
    """`--check` spelled out on the command line is the model's flag, never taken for the
    model choice's --checkpoint (argparse's prefix matching)."""
    out = _dtgen("run", "--model", model, "--output", str(tmp_path / output), "--report", str(tmp_path / "r.json"),
                 *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / output).stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["plan"] == "single"


def test_run_takes_the_models_own_check_flag(tmp_path):
    out = _dtgen("run", "--model", "qwen-image", "--steps", "2", "--check", "--output", str(tmp_path / "q.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "check max_abs_diff_latents" in out.stdout


@pytest.mark.parametrize("argv, line", [
    (["bake"], "error: unknown command 'bake'; choose from run, serve, models, bench"),
    (["run", "--model", "flux"], None),   # argparse's own line: invalid choice, naming the choices
    (["run", "--model", "wan", "--steps", "0"], "error: --steps must be >= 1 and <= 1000, got 0"),
    # the tiny Qwen-Image's scheduler stretches its schedule to a shift_terminal: NaN at one step
    (["run", "--model", "qwen-image", "--steps", "1"], "error: --steps must be >= 2 with this checkpoint's scheduler "
                                                       "(its shift_terminal stretch divides 0 by 0 at one step: "
                                                       "diffusers' schedule is NaN)"),
])
def test_bad_commands_are_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) if line is None else _no_raise():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if line is None:
        assert err[-1].startswith("dtgen run: error: argument --model: invalid choice: 'flux'"), err
    else:
        assert err == [line]


@pytest.mark.parametrize("model, suffix", [("qwen-image", "png"), ("wan", "mp4"), ("hunyuan-image3", "png")])
def test_an_output_that_cannot_be_written_is_one_line_before_loading(model, suffix, tmp_path, capsys):
    """Refused while the command line is checked: no rank starts, no tiny checkpoint is made."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [
        ("--output", str(blocker / "sub" / f"out.{suffix}"), f"{blocker} is a file, not a folder"),
        ("--output", str(tmp_path), None),
        ("--report", str(blocker / "report.json"), f"{blocker} is a file, not a folder"),
    ]
    for flag, path, why in cases:
        assert main(["run", "--model", model, flag, path]) == 2
        line = f"error: {flag} {path}: {why}" if why else f"error: {flag} {path} is a folder; name the file to write"
        assert capsys.readouterr().err.strip().splitlines() == [line]


@pytest.mark.parametrize("model, pipeline, components", [
    ("wan", "WanPipeline", "['text_encoder', 'tokenizer', 'transformer', 'vae']"),
    ("qwen-image", "QwenImagePipeline", "['text_encoder', 'transformer', 'vae', 'tokenizer', 'scheduler']"),
])
def test_a_checkpoint_folder_without_its_components_is_one_line(model, pipeline, components, tmp_path, capsys):
    """A folder whose model_index.json names the model but that holds no component folders:
    one line naming what it lacks, before any work (never a traceback)."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    assert main(["run", "--model", model, "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path} is missing the component folder(s) {components} "
                                               "(a diffusers-format"), err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_lists_the_suites_of_the_checkout(capsys):
    from bench.suites import SUITES
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(suite.name in out for suite in SUITES), out
