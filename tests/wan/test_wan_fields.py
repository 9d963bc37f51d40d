"""Wan's request flags refused in one line before any work, as HunyuanImage-3's and
Qwen-Image's are: --fps out of range (0 must not fall back to a default, -5 must not reach
the encoder after the whole job), an empty prompt, an MP4 written into a .png, a prompt
longer than the text encoder reads (refused, never cut short silently)."""
from __future__ import annotations

import pytest

from models.wan.cli import COMMAND as cli


@pytest.mark.parametrize("argv, line", [
    (["--fps", "0"], "--fps must be >= 1 and <= 120, got 0"),
    (["--fps", "-5"], "--fps must be >= 1 and <= 120, got -5"),
    (["--prompt", ""], "--prompt must be a non-empty string"),
    (["--output", "o.png"], "--output o.png: a video is written as an MP4; name a .mp4 file"),
    (["--prompt", "fox " * 600], "--prompt is 601 tokens; Wan's text encoder reads at most 512: shorten it (it is "
                                 "not cut short silently)"),
    (["--negative-prompt", "fox " * 600], "--negative-prompt is 601 tokens; Wan's text encoder reads at most 512"),
])
def test_a_bad_flag_is_one_line_before_any_work(argv, line):
    problem, tiny = cli.prepare(cli.parse_args(argv))
    assert tiny and problem is not None and problem.startswith(line), problem


def test_the_longest_prompt_the_encoder_reads_is_taken():
    assert cli.prepare(cli.parse_args(["--prompt", "fox " * 511]))[0] is None
