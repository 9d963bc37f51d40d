"""`--max-new-tokens` past the model's positions is refused under its own name, not the
prompt's (the prompt alone fits), with how many new tokens this prompt leaves room for."""
from __future__ import annotations

from models.hunyuan_image3 import cli


def test_too_many_new_tokens_name_max_new_tokens():
    problem, _ = cli.prepare(cli.parse_args(["--max-new-tokens", "100000"]))
    assert problem.startswith("--max-new-tokens ") and problem.endswith(
        "+ 100000 new tokens + 2 image-head tokens need 100050 positions; the model has 2048 (at most 1998 new "
        "tokens with this prompt)"), problem
