"""The failures the error-path tests force (tests/support/faults.py): each item fires once, on
its rank, at its step; inside a step it raises from the block's next forward; a bad spec is one
line."""
import pytest
import torch

from tests.support.faults import Injections, parse


def test_each_fault_fires_once_on_its_rank_at_its_step():
    assert parse("1:ar:2,*:denoise:1:oom") == [(1, "ar", 2, ""), ("*", "denoise", 1, "oom")]
    block = torch.nn.Linear(2, 2)
    mine = Injections(parse("1:ar:2,*:denoise:1:oom"), 1, lambda: block)
    other = Injections(parse("1:ar:2"), 0)
    mine.at("ar", 1)       # not due yet
    other.at("ar", 2)      # not its rank
    with pytest.raises(RuntimeError, match="^injected failure: rank 1 fails after ar step 2$"):
        mine.at("ar", 2)
    mine.at("ar", 2)       # once
    mine.at("denoise", 1)  # the block's next forward raises, inside the step
    with pytest.raises(torch.OutOfMemoryError, match="rank 1 fails .out of memory. inside the step after denoise"):
        block(torch.zeros(1, 2))
    block(torch.zeros(1, 2))  # once


def test_a_bad_spec_is_one_line_and_a_cli_cannot_fail_inside_a_step():
    for bad in ("1:vae", "x:ar:1", "1:ar:one", "1:ar:2:later"):
        with pytest.raises(ValueError, match=r"expected RANK:PHASE:STEP\[:hang\|:inside\|:oom\|:hang_inside\]"):
            parse(bad)
    with pytest.raises(ValueError, match="give them to a server"):
        Injections(parse("1:ar:2:inside"), 1)   # a CLI's hook has no block to raise from
