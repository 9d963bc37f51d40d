"""Whole sampling runs against the official implementation: the Taylor cache (every official
knob the cases exercise, the P1 default), the CFG-distilled meanflow sampler, with and without
the cache. One process; tests/hunyuan_image3/test_step_cache_distributed.py replays them on 4 ranks.

Cases: every folder of ../shared/golden-taylor plus $DTGEN_GOLDEN_TAYLOR_DIRS; the run names
and their knobs come from each case's golden.json.
"""
import pytest
import torch

from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from placements.hunyuan_image3 import get_plan
from tests.support.golden import (GoldenCase, compare_sampling_run, discover_taylor_cases, sampling_request,
                                 sampling_runs)

CASES = discover_taylor_cases()
# What a run feeds in rather than checks: nothing (the noise comes from the seed, the
# sequence from the prompt); the shared template tensors are checked once per run.


def _params():
    if not CASES:
        return [pytest.param(None, id="no-golden", marks=pytest.mark.skip(reason="no Taylor golden case folders"))]
    return [pytest.param((c, run), id=f"{c.name}-{run}") for c in CASES for run in sampling_runs(GoldenCase(c))]


@pytest.fixture(scope="module")
def pipes():
    """One pipeline per case, shared by its runs: a run must leave nothing behind for the next."""
    made = {}

    def get(folder):
        if folder not in made:
            case = GoldenCase(folder)
            loaded = load(case.folder, get_plan("single"), dtype=torch.float32)
            made[folder] = (case, HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu"))
        return made[folder]
    return get


@pytest.mark.parametrize("case_run", _params())
def test_sampling_run_matches_official(pipes, case_run):
    folder, run = case_run
    case, pipe = pipes(folder)
    checks = compare_sampling_run(case, pipe, run)
    bad = [(c.name, f"{c.max_abs:.3e}", c.detail[:160]) for c in checks if not c.ok]
    assert not bad, f"{folder.name}/{run}: {bad}"
    # Nothing in golden.safetensors for this run goes unchecked.
    names = {c.name for c in checks}
    mine = {n for n in case.t if _run_of(n, sampling_runs(case)) in (run, None)}
    assert mine <= names, f"never compared: {sorted(mine - names)}"


def _run_of(tensor: str, runs: list[str]) -> str | None:
    """The run a tensor belongs to (`<run>_<what>`; the longest matching name, since one run's
    name can begin another's), or None for the tensors every run shares."""
    owners = [r for r in runs if tensor.startswith(f"{r}_")]
    return max(owners, key=len) if owners else None


@pytest.mark.parametrize("folder", [pytest.param(c, id=c.name) for c in CASES] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no Taylor golden case folders"))])
def test_cached_run_then_uncached_run(pipes, folder):
    """A cache lives one request: an uncached run right after a cached one on the same
    pipeline is the official uncached run (the official code keeps its cache on the model)."""
    case, pipe = pipes(folder)
    runs = sampling_runs(case)
    cached = [r for r in runs if sampling_request(case, r).step_cache is not None]
    plain = [r for r in runs if sampling_request(case, r).step_cache is None]
    assert cached and plain, f"{folder.name} needs a cached and an uncached run"
    assert all(c.ok for c in compare_sampling_run(case, pipe, cached[0], image=False))
    checks = compare_sampling_run(case, pipe, plain[0], image=False)
    assert all(c.ok for c in checks), [(c.name, c.max_abs) for c in checks if not c.ok]


@pytest.mark.parametrize("folder", [pytest.param(c, id=c.name) for c in CASES] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no Taylor golden case folders"))])
def test_a_wrong_cache_fails_the_comparison(pipes, folder):
    """The harness tells cached from uncached sampling and a wrong schedule from the right one:
    the first cached run, replayed with a full step every step, must fail its checks."""
    from dataclasses import replace

    import tests.support.golden as golden
    case, pipe = pipes(folder)
    run = next(r for r in sampling_runs(case) if sampling_request(case, r).step_cache is not None)
    original = golden.sampling_request

    def every_step_full(c, r):
        req = original(c, r)
        return replace(req, step_cache=replace(req.step_cache, interval=1))
    golden.sampling_request = every_step_full
    try:
        checks = {c.name: c for c in compare_sampling_run(case, pipe, run, image=False)}
    finally:
        golden.sampling_request = original
    assert not checks[f"{run}_step_full_compute"].ok
    assert not checks[f"{run}_final_latents"].ok
