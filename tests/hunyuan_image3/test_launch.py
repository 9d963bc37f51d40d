"""Failures end the whole job, with the failing rank's message, under both launchers (CPU, gloo).

The NCCL side of the same behaviour (a peer blocked inside a CUDA-graphed collective) is
covered by tests/hunyuan_image3/test_multigpu.py on two GPUs.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtgen.controller import PhaseMismatchError
from dtgen.launch import RankFailure, RankPool
from models.hunyuan_image3.loading import load
from placements.hunyuan_image3 import get_plan

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--steps", "2", "--max-new-tokens", "2", "--image-size", "256x256", "--no-vae-parallel"]


def _torchrun(tiny_checkpoint, tmp_path, *args, timeout=240, faults=None):
    """The CLI on 2 torchrun ranks; `faults`: failures forced on them (tests/support/faults.py)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", DTGEN_CACHE=str(tiny_checkpoint.parent), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT)
    run = ["-m", "examples.hunyuan_t2i"] if faults is None else ["-m", "tests.support.faults", faults,
                                                                 "examples.hunyuan_t2i"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *run, "--output", str(tmp_path / "i.png"), *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_torchrun_failure_on_one_rank_ends_every_rank(tiny_checkpoint, tmp_path):
    proc, _ = _torchrun(tiny_checkpoint, tmp_path, "--plan", "hybrid2", *FAST, faults="1:denoise:1")
    err = proc.stderr
    assert proc.returncode != 0
    # (the exception's class is named with its module: tests.support.faults)
    assert "[rank 1] Traceback" in err and "InjectedFailure: injected failure: rank 1 fails" in err
    assert any(line.startswith("[rank 1] ") and "InjectedFailure: injected failure" in line for line in err.splitlines())
    # The peer names the failure once, without a second traceback of its own.
    assert "[rank 0] stopping: rank 1 failed: tests.support.faults.InjectedFailure" in err, err[-3000:]
    assert "[rank 0] Traceback" not in err


def test_torchrun_stall_prints_stacks_and_ends_the_job(tiny_checkpoint, tmp_path):
    proc, seconds = _torchrun(tiny_checkpoint, tmp_path, "--plan", "hybrid2", *FAST, "--stall-timeout", "4",
                              faults="1:ar:1:hang")
    err = proc.stderr
    assert proc.returncode != 0
    assert "[rank 1] no progress for" in err and "(last: ar 1/2)" in err, err[-3000:]
    assert "in progress" in err  # the hung rank's Python stack: the hook that hangs
    assert "StallError: no progress for" in err
    assert seconds < 120


def test_torchrun_world_size_mismatch_is_one_line(tiny_checkpoint, tmp_path):
    proc, _ = _torchrun(tiny_checkpoint, tmp_path, "--plan", "tp4")
    assert proc.returncode != 0  # torchrun reports a failed worker as 1, whatever its code
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: plan 'tp4' runs on 4 ranks, --world-size is 2"], proc.stderr[-2000:]


def job_fail_while_peer_waits(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # never completes: rank 1 is gone
    return "unreachable"


def test_rank_pool_stops_the_peers_of_a_failed_rank():
    start = time.monotonic()
    with RankPool(2, timeout_s=300) as pool:
        with pytest.raises(RankFailure) as err:
            pool.run(job_fail_while_peer_waits)
    assert "ValueError: rank 1 gives up" in str(err.value)
    assert time.monotonic() - start < 30  # not the 300 s collective timeout


def job_skip_agreement(ctx, ckpt):
    loaded = load(ckpt, get_plan("hybrid2"), ctx.rank, ctx.world_size, control_timeout_s=3)
    if ctx.rank == 1:
        return None  # never enters the phase
    start = time.monotonic()
    try:
        loaded.controller.activate("denoise")
    except PhaseMismatchError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_phase_agreement_has_its_own_short_timeout(tiny_checkpoint):
    with RankPool(2, timeout_s=300) as pool:
        message, seconds = pool.run(job_skip_agreement, tiny_checkpoint)[0]
    assert "phase agreement for 'denoise': not every rank arrived within 3 s" in message
    assert seconds < 20


def test_gpu_count_is_checked_before_joining(monkeypatch):
    from dtgen import launch
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="local rank 1, but this machine shows 1 GPU"):
        launch.init_from_torchrun()


def test_torchrun_success_reports_every_rank_and_exits_cleanly(tiny_checkpoint, tmp_path):
    """The clean path under torchrun: every rank checks in and leaves with status 0; rank 0's
    report holds both ranks' memory facts and the profile (whose NCCL kernel lists the ranks
    exchange over the control group)."""
    import json

    report = tmp_path / "r.json"
    proc, _ = _torchrun(tiny_checkpoint, tmp_path, "--plan", "tp2", *FAST, "--profile", str(tmp_path / "prof"),
                        "--profile-steps", "2", "--profile-top", "3", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["world_size"] == 2 and len(r["storage_bytes_per_rank"]) == 2
    assert r["storage_bytes_per_rank"][0] == r["storage_bytes_per_rank"][1] > 0
    regions = {row["region"]: row for row in r["profile"]["regions"]["denoise"]}
    assert regions["denoise_first_step"]["units"] == 1 and regions["denoise_step"]["units"] == 1
    assert (tmp_path / "prof" / "profile_rank1.json").is_file()
    assert all(len(kernels) <= 3 for kernels in r["profile"]["top_kernels"].values())   # --profile-top
    assert max(len(kernels) for kernels in r["profile"]["top_kernels"].values()) == 3
