"""The golden sampling runs (Taylor cache, distilled sampler) on 4 gloo ranks, through the
plans the issue names: `hybrid` and `tp2sp2` (a rank holds a slice of the tokens: the cache
keeps the gathered stack output, so the FFT band split spans the whole sequence) and the
CFG-parallel `hybrid-cfg` (each half of the ranks keeps its branch's cache). Every golden
tensor on every rank, against the official outputs. One spawned group for the module.
"""
import json

import pytest

from dtgen.launch import RankPool
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from placements.hunyuan_image3 import get_plan
from tests.support.golden import GoldenCase, compare_sampling_run, discover_taylor_cases, sampling_runs

CASES = discover_taylor_cases()
PLANS = ["hybrid", "tp2sp2", "hybrid-cfg"]


def job_sampling_runs(ctx, case_folder, plan_name):
    """Every run of the case under the plan, in one loaded model (so a run's cache state must
    not reach the next). Returns, per run, the failing checks and the names checked."""
    loaded = load(case_folder, get_plan(plan_name), ctx.rank, ctx.world_size)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=ctx.rank == 0)
    case = GoldenCase(case_folder)
    out = {}
    for run in sampling_runs(case):
        try:
            checks = compare_sampling_run(case, pipe, run)
        except ValueError as e:   # a plan the case cannot use says so in one line
            out[run] = str(e)
            continue
        out[run] = ([(c.name, c.max_abs) for c in checks if not c.ok], {c.name for c in checks})
    return out


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout_s=120) as p:
        yield p


def _distilled(folder) -> bool:
    return bool(json.loads((folder / "config.json").read_text()).get("cfg_distilled"))


def _params():
    if not CASES:
        return [pytest.param(None, None, id="no-golden", marks=pytest.mark.skip(reason="no Taylor golden cases"))]
    return [pytest.param(c, p, id=f"{c.name}-{p}") for c in CASES for p in PLANS]


@pytest.mark.parametrize("case, plan_name", _params())
def test_golden_sampling_runs_through_plans(pool, case, plan_name):
    results = pool.run(job_sampling_runs, case, plan_name)
    for rank, per_run in enumerate(results):
        for run, got in per_run.items():
            if _distilled(case) and get_plan(plan_name).phases["denoise"].cfg:
                # A CFG-distilled checkpoint has no unconditional row to put on the other half.
                assert isinstance(got, str) and "CFG-distilled" in got and plan_name in got, got
                continue
            assert not isinstance(got, str), f"{case.name}/{run} under {plan_name}, rank {rank}: {got}"
            bad, names = got
            assert not bad, f"{case.name}/{run} under {plan_name}, rank {rank}: {bad}"
            assert f"{run}_final_latents" in names and f"{run}_step_full_compute" in names
            if rank == 0:
                assert f"{run}_image_uint8" in names   # the main rank decodes the image
