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



def test_a_sequence_too_long_for_the_positions_names_the_requests_field():
    """Found once the ranks build the sequence (an edit's reference tokens are known only then):
    a RequestError naming the field (`image`, `max_new_tokens`), which the ranks print once in
    one line (tests/framework/test_launch_one_line.py) and a server answers with a 422."""
    import pytest

    from dtgen.requests import RequestError
    from models.hunyuan_image3.stack import DecoderStack
    from models.hunyuan_image3.tiny import tiny_config
    from types import SimpleNamespace
    stack = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=tiny_config(1)["max_position_embeddings"]))
    with pytest.raises(RequestError) as err:
        DecoderStack.check_budget(stack, 3756, "AR sequence (the reference image's tokens + prompt)", "image")
    assert err.value.field == "image" and str(err.value) == (
        "image: AR sequence (the reference image's tokens + prompt) needs 3756 positions; the model's "
        "max_position_embeddings is 2048")
    with pytest.raises(ValueError, match="^warm-up shape needs 3000 positions"):   # not a request's: no field
        DecoderStack.check_budget(stack, 3000, "warm-up shape")
