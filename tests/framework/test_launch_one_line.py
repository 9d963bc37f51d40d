"""How spawned ranks' failures are told: an error whose message says it all (a plan or a
checkpoint that cannot be used), raised on every rank alike, is one line, once; any other
error keeps every rank's traceback; a rank that dies is named in one line."""
from __future__ import annotations

import os

import pytest

from dtgen.checkpoint import CheckpointError
from dtgen.launch import RankFailure, run_on_ranks
from dtgen.plan import PlanError
from dtgen.requests import RequestError

HEADS = "plan 'ulysses2', phase 'denoise' (TP1 x SP2): Ulysses: cannot split 1 query / 1 KV heads over 2 ranks"


def _plan_error_everywhere(ctx):
    raise PlanError(HEADS)


def _checkpoint_error_on_rank_0(ctx):
    if ctx.rank == 0:
        raise CheckpointError("/ckpt/transformer/x.safetensors: truncated safetensors file")
    raise RuntimeError("a bug on rank 1")


def _request_error_everywhere(ctx):
    raise RequestError("image", "the reference image's tokens need 3756 positions; the model has 2048")


def _dies(ctx):
    if ctx.rank == 1:
        os._exit(7)
    return ctx.rank


def test_a_plan_error_on_every_rank_is_one_line_once():
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_plan_error_everywhere, 2, timeout_s=30)
    assert err.value.line == HEADS and err.value.report() == HEADS and not err.value.told
    assert "--- rank 1 ---" in str(err.value), "the tracebacks stay in the exception"


def test_a_request_the_model_cannot_take_is_one_line_once_and_so_in_one_process(capsys):
    """A request error found on the ranks (a sequence longer than the model's positions): one
    line naming the field, once; in one process the command says the same line (exit 1)."""
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_request_error_everywhere, 2, timeout_s=30)
    line = "image: the reference image's tokens need 3756 positions; the model has 2048"
    assert err.value.report() == line
    from argparse import Namespace

    from dtgen.harness import example_main
    code = example_main(Namespace(world_size=1, stall_timeout=60.0), lambda args: (None, False),
                        lambda ctx, args: _request_error_everywhere(ctx), lambda *a: None)
    assert code == 1 and capsys.readouterr().err.splitlines() == [f"error: {line}"]


def test_another_error_beside_it_keeps_every_traceback():
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_checkpoint_error_on_rank_0, 2, timeout_s=30)
    assert err.value.line is None
    assert "RuntimeError: a bug on rank 1" in err.value.report() and "Traceback" in err.value.report()


def test_a_dead_rank_is_one_line():
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_dies, 2, timeout_s=30)
    assert err.value.report() == "rank 1 died (exit code 7)"
