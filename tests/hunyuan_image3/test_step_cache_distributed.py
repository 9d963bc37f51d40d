"""The golden sampling runs (Taylor cache, distilled sampler) on gloo ranks, through every
2- and 4-rank plan that fits the case: a plan that splits the tokens (`hybrid`, `tp2sp2`:
the cache keeps the gathered stack output, so the FFT band split spans the whole sequence),
a CFG-parallel one (`hybrid-cfg`, `hybrid2-cfg`: each half of the ranks keeps its branch's
cache), plain TP. A plan the case's model does not fit (heads per rank, a split that does
not divide: 6 query / 2 KV heads under TP2 x SP2, say) is a skip whose reason is the plan's
own refusal (`dtgen.build.plan_problem`, the checks `load` makes before reading a byte), as
in the T2I and TI2I golden-through-plans tests. Every golden tensor on every rank, against
the official outputs. One spawned group a world size, shared by the module's tests.
"""
import json

import pytest

from dtgen.build import plan_problem
from dtgen.launch import RankPool
from models.hunyuan_image3.config import HunyuanImage3Config
from models.hunyuan_image3.loading import HunyuanAdapter, load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from placements.hunyuan_image3 import PLANS, get_plan
from tests.support.golden import GoldenCase, compare_sampling_run, discover_taylor_cases, sampling_runs

CASES = discover_taylor_cases()
WORLD_SIZES = (4, 2)
PLANS_BY_WORLD = {w: [name for name, plan in PLANS.items() if plan.world_size == w] for w in WORLD_SIZES}


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
        except ValueError as e:   # a request the plan cannot serve says so in one line
            out[run] = str(e)
            continue
        out[run] = ([(c.name, c.max_abs) for c in checks if not c.ok], {c.name for c in checks})
    return out


@pytest.fixture(scope="module")
def pools():
    """pools(world_size): the module's rank group of that size. One group is alive at a time
    (the parameters come grouped by world size); a group that failed is replaced."""
    held = {}

    def get(world_size):
        pool = held.get(world_size)
        if pool is None or pool.broken:
            for other in list(held):
                held.pop(other).close()
            pool = held[world_size] = RankPool(world_size, timeout_s=120)
        return pool
    yield get
    for pool in held.values():
        pool.close()


def _distilled(folder) -> bool:
    return bool(json.loads((folder / "config.json").read_text()).get("cfg_distilled"))


def _problem(case, plan_name) -> str | None:
    plan = get_plan(plan_name)
    return plan_problem(HunyuanAdapter(HunyuanImage3Config.from_json(case / "config.json")), plan, plan.world_size)


def _params():
    if not CASES:
        return [pytest.param(None, None, id="no-golden", marks=pytest.mark.skip(reason="no Taylor golden cases"))]
    params = []
    for world in WORLD_SIZES:
        for case in CASES:
            for plan_name in PLANS_BY_WORLD[world]:
                problem = _problem(case, plan_name)
                reason = f"{case.name} cannot run under {plan_name}: {problem}"
                marks = [pytest.mark.skip(reason=reason)] if problem else []
                params.append(pytest.param(case, plan_name, id=f"{case.name}-{plan_name}", marks=marks))
    return params


@pytest.mark.parametrize("case, plan_name", _params())
def test_golden_sampling_runs_through_plans(pools, case, plan_name):
    plan = get_plan(plan_name)
    results = pools(plan.world_size).run(job_sampling_runs, case, plan_name)
    assert len(results) == plan.world_size
    for rank, per_run in enumerate(results):
        assert sorted(per_run) == sorted(sampling_runs(GoldenCase(case))), (rank, sorted(per_run))
        for run, got in per_run.items():
            if _distilled(case) and plan.phases["denoise"].cfg:
                # A CFG-distilled checkpoint has no unconditional row to put on the other half.
                assert isinstance(got, str) and "CFG-distilled" in got and plan_name in got, got
                continue
            assert not isinstance(got, str), f"{case.name}/{run} under {plan_name}, rank {rank}: {got}"
            bad, names = got
            assert not bad, f"{case.name}/{run} under {plan_name}, rank {rank}: {bad}"
            assert f"{run}_final_latents" in names and f"{run}_step_full_compute" in names
            if rank == 0:
                assert f"{run}_image_uint8" in names   # the main rank decodes the image


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no Taylor golden cases"))])
def test_every_case_runs_under_some_plan(case):
    """The skips above never cover a whole case: at least one 2- or 4-rank plan fits its heads."""
    fitting = [p for w in WORLD_SIZES for p in PLANS_BY_WORLD[w] if _problem(case, p) is None]
    assert fitting, f"{case.name}: no 2- or 4-rank plan fits its heads"
