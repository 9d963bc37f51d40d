"""HunyuanImage-3's command line checks before any rank starts: `--max-new-tokens` past the
model's positions is refused under its own name, not the prompt's (the prompt alone fits),
with how many new tokens this prompt leaves room for; a checkpoint that cannot be read is one
line naming the file."""
from __future__ import annotations

import shutil

from models.hunyuan_image3 import cli


def test_too_many_new_tokens_name_max_new_tokens():
    problem, _ = cli.prepare(cli.parse_args(["--max-new-tokens", "100000"]))
    assert problem.startswith("--max-new-tokens ") and problem.endswith(
        "+ 100000 new tokens + 2 image-head tokens need 100050 positions; the model has 2048 (at most 1998 new "
        "tokens with this prompt)"), problem


def test_a_checkpoint_that_cannot_be_read_is_one_line_before_loading(tmp_path):
    """A truncated shard, a shard the index lists but the folder lacks, a config.json that is
    not JSON: each one line naming the file, from the command's check (before any rank starts)."""
    from models.hunyuan_image3.tiny import ensure_tiny_checkpoint
    source = ensure_tiny_checkpoint()
    cases = {}
    for name in ("truncated", "missing", "config"):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        shard = folder / "model-00002-of-00002.safetensors"
        if name == "truncated":
            shard.write_bytes(shard.read_bytes()[:-64])
            cases[name] = (folder, f"{shard}: truncated safetensors file: tensors need")
        elif name == "missing":
            shard.unlink()
            cases[name] = (folder, f"{folder / 'model.safetensors.index.json'} lists shard files that do not exist: "
                                   "['model-00002-of-00002.safetensors']")
        else:
            (folder / "config.json").write_text('{"model_type": "hunyuan_image_3_moe",\n}')
            cases[name] = (folder, f"{folder / 'config.json'}: not valid JSON (Expecting property name")
    for folder, line in cases.values():
        problem, tiny = cli.prepare(cli.parse_args(["--checkpoint", str(folder)]))
        assert not tiny and problem is not None and problem.startswith(line), problem


def test_an_edit_too_long_for_the_model_is_one_line_naming_the_image(tmp_path):
    """A reference image whose tokens, with the prompt, overflow the tiny model's positions is
    found once the ranks process it: one line naming `image` on 1 and on 2 ranks (no traceback),
    and nothing written."""
    import subprocess
    import sys

    import numpy as np
    from PIL import Image

    from tests.support.serve import ROOT
    image = tmp_path / "wide.png"
    Image.fromarray((np.random.default_rng(0).random((90, 160, 3)) * 255).astype("uint8")).save(image)
    for ranks in (["--world-size", "1"], ["--world-size", "2", "--plan", "tp2"]):
        output = tmp_path / "edit.png"
        done = subprocess.run([sys.executable, "-m", "dtgen", "run", "--model", "hunyuan-image3", "--image", str(image),
                               "--output", str(output), *ranks], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines() == [
            "error: image: AR sequence (the reference image's tokens + prompt + max_new_tokens + <boi><img_size>) "
            "needs 3756 positions; the model's max_position_embeddings is 2048"], done.stderr
        assert not output.exists()
