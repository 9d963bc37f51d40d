"""A Wan checkpoint that cannot be used is one line, once, before any weight loads (`dtgen run`
and `dtgen serve`): a truncated or corrupt safetensors file, a shard its index lists but the
folder lacks, a config.json that is not JSON (each naming the file), and heads a plan cannot
split on several ranks (the plan's error, once, not once per rank)."""
from __future__ import annotations

import json
import shutil

import pytest

from dtgen.cli import main
from models.wan.tiny import ensure_tiny_checkpoint


@pytest.fixture
def folder(tmp_path):
    copy = tmp_path / "wan"
    shutil.copytree(ensure_tiny_checkpoint(), copy)
    return copy


def one_line(capsys, argv: list[str], code: int) -> str:
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


def _truncate(folder):
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return f"error: {weights}: truncated safetensors file: tensors need"


def _corrupt(folder):
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8
    weights.write_bytes(bytes(data))
    return f"error: {weights}: corrupt safetensors header"


def _missing_shard(folder):
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": weights.name, "b": "diffusion_pytorch_model-00002.safetensors"}}))
    return f"error: {index} lists shard files that do not exist: ['diffusion_pytorch_model-00002.safetensors']"


def _bad_config(folder):
    config = folder / "transformer" / "config.json"
    config.write_text(config.read_text()[:-3] + ",\n}")
    return f"error: {config}: not valid JSON (Expecting property name enclosed in double quotes"


@pytest.mark.parametrize("damage", [_truncate, _corrupt, _missing_shard, _bad_config])
@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_checkpoint_that_cannot_be_read_is_one_line_before_loading(folder, capsys, damage, command):
    expected = damage(folder)
    line = one_line(capsys, [command, "--checkpoint", str(folder), "--world-size", "2", "--plan", "ulysses2",
                             "--steps", "1"], 2)
    assert line.startswith(expected), line


def test_heads_a_plan_cannot_split_are_one_line_once(folder, capsys, tmp_path):
    """1 head of 64 (the same weights as 4 of 16) over Ulysses 2: every rank raises the plan's
    error; it is printed once, without a traceback."""
    config = folder / "transformer" / "config.json"
    cfg = json.loads(config.read_text())
    cfg.update(num_attention_heads=1, attention_head_dim=cfg["num_attention_heads"] * cfg["attention_head_dim"])
    config.write_text(json.dumps(cfg))
    line = one_line(capsys, ["run", "--checkpoint", str(folder), "--world-size", "2", "--plan", "ulysses2",
                             "--steps", "1", "--height", "16", "--width", "16", "--num-frames", "1",
                             "--output", str(tmp_path / "o.mp4")], 1)
    assert line == ("error: plan 'ulysses2', phase 'denoise' (TP1 x SP2): Ulysses: 1 query heads per TP rank are "
                    "not divisible by the SP size 2"), line
