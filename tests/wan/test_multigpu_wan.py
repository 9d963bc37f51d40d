"""Wan on two GPUs through torchrun and NCCL (marker `multigpu`; skipped with fewer than 2 GPUs).

Every 2-rank Wan plan (Ulysses, pipelined Ulysses, ring, Attention2D 1 x 2, CFG 2, and the
text encoder on TP2), with the denoise step compiled by inductor (one region per block),
float32: `python -m examples.wan_t2v --check` against the single-process model on rank 0,
no graph break, nothing recompiled after the warm-up, nothing copied by the phase switches.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).resolve().parents[2]
PLANS = ["ulysses2", "ulysses2-te-tp2", "ulysses2-pipelined", "ring2", "attn2d-1x2", "cfg2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun job per plan, all at once (the tiny model leaves the GPUs nearly idle)."""
    from models.wan.tiny import ensure_tiny_checkpoint
    folder = tmp_path_factory.mktemp("multigpu-wan")
    ensure_tiny_checkpoint(folder / "cache")
    env = dict(os.environ, PYTHONUNBUFFERED="1", DTGEN_CACHE=str(folder / "cache"),
               PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    jobs = {}
    for plan in PLANS:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "examples.wan_t2v", "--world-size", "2", "--plan", plan, "--dtype", "float32", "--check",
               "--compile", "--compile-regions", "--steps", "3", "--report", str(folder / f"{plan}.json"),
               "--output", str(folder / f"{plan}.mp4")]
        log = open(folder / f"{plan}.log", "w")
        jobs[plan] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    out = {}
    for plan, (proc, log) in jobs.items():
        rc = proc.wait(timeout=600)
        log.close()
        report = folder / f"{plan}.json"
        out[plan] = (rc, json.loads(report.read_text()) if report.exists() else None,
                     (folder / f"{plan}.log").read_text()[-3000:])
    return out


@pytest.mark.parametrize("plan", PLANS)
def test_wan_plan_on_two_gpus_matches_one_process(runs, plan):
    rc, report, log = runs[plan]
    assert rc == 0 and report is not None, log
    assert all(v <= 1e-4 for v in report["check"].values()), report["check"]
    c = report["compile"]
    assert c["graph_breaks"] == 0 and c["recompiles_after_warmup"] == 0, c
    assert report["phase_switch"]["weights_copied"] == 0
