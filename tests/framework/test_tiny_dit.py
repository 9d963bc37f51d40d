"""The docs' tiny DiT (models/tiny_dit, docs/placements.md) through the registry: loaded from
its tiny checkpoint and run under every sequence-parallel kind on 2 gloo ranks, each equal to
one process (its step, and its pipeline's requests alone and batched). The framework splits
and gathers its rows as its `seq_splits` declares; the model shards nothing by hand. Its
pipeline: a batch equals each request alone, guidance is applied, a step cache reuses steps
through its split points. CPU, a few seconds."""
import pytest
import torch

from dtgen.batching import per_member
from dtgen.launch import RankPool
from dtgen.registry import find
from dtgen.requests import RequestError
from models import registry
from models.tiny_dit.model import velocity
from models.tiny_dit.pipeline import TinyPipeline, TinyRequest
from models.tiny_dit.spec import SPEC

PLANS = SPEC.load("plans").PLANS
QUIET = per_member([lambda *progress: None] * 2)
# Two requests of one batch key (rows, steps, CFG on) that differ in noise and guidance.
PAIR = (TinyRequest(rows=7, seed=1), TinyRequest(rows=7, seed=2, guidance=5.0))
CACHED = TinyRequest(rows=7, steps=8, step_cache="taylor")   # cached steps run the head alone


def _inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """7 rows (2 ranks pad one) and 8, one timestep for every row and one per row."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, rows, 8, generator=g), t) for rows in (7, 8)
            for t in (torch.tensor([500.0, 20.0]), torch.rand(2, rows, generator=g) * 1000)]


def _velocities(ctx, folder, plan: str, inputs):
    built = SPEC.load("loader")(folder, PLANS[plan], ctx.rank, ctx.world_size)
    with built.controller.phase("denoise") as rt:
        out = {"sp": rt.sp_size, "core": type(built.model.blocks[0].core).__name__,
               "out": [velocity(rt, built.model, x, t) for x, t in inputs]}
    pipe = TinyPipeline(built, SPEC.buckets)
    out["latents"] = [r.latents for r in pipe.generate_batch(list(PAIR), QUIET)] + [pipe.generate(CACHED).latents]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return SPEC.load("tiny")(tmp_path_factory.mktemp("tiny"))


def test_the_registry_finds_builds_and_checks_it(folder):
    specs = registry.specs() + [SPEC]
    assert find(specs, "tiny-dit") is SPEC and registry.registry.detect(specs, folder) is SPEC
    assert SPEC.cli is None and SPEC.batches
    with pytest.raises(ValueError, match="TinyDiT has no cli"):
        SPEC.load("cli")
    with pytest.raises(RequestError) as e:
        SPEC.load("request")(rows=0).check()
    assert (e.value.field, e.value.message) == ("rows", "must be >= 1 and <= 4096, got 0")
    with pytest.raises(RequestError) as e:
        SPEC.load("request")(guidance=21.0).check()
    assert e.value.field == "guidance"


@pytest.fixture(scope="module")
def pipe(folder):
    return TinyPipeline(SPEC.load("loader")(folder, PLANS["single"]), SPEC.buckets)


def test_a_batch_is_each_request_alone(pipe):
    batched = pipe.generate_batch(list(PAIR), QUIET)
    for got, req in zip(batched, PAIR, strict=True):
        torch.testing.assert_close(got.latents, pipe.generate(req).latents, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(batched[0].latents, batched[1].latents)
    # one request of another key is refused by name, a bad one leaves alone
    with pytest.raises(ValueError, match="^steps: the requests of one batch must share it"):
        pipe.generate_batch([PAIR[0], TinyRequest(rows=7, steps=3)], QUIET)
    bad, good = pipe.generate_batch([TinyRequest(rows=7, seed=-1), PAIR[0]], QUIET)
    assert isinstance(bad, RequestError) and bad.field == "seed"
    torch.testing.assert_close(good.latents, batched[0].latents, rtol=1e-5, atol=1e-6)


def test_guidance_is_applied(pipe):
    """CFG mixes the branches by the request's scale: the record's first step equals
    uncond + s (cond - uncond) of the two branches computed by hand."""
    req = TinyRequest(rows=7, seed=3, guidance=4.0)
    got = pipe.generate(req, record=True)
    x = torch.randn(pipe.latent_shape(req), generator=torch.Generator().manual_seed(req.seed))
    t = pipe.sampler(req).timesteps[0].expand(2)
    with pipe.controller.phase("denoise") as rt:
        cond, null = velocity(rt, pipe.model, x.expand(2, -1, -1), t, torch.tensor([1.0, 0.0])).chunk(2)
    torch.testing.assert_close(got.record["noise"][0], null + 4.0 * (cond - null), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cond, null)   # the learned condition moves the prediction
    unguided = pipe.generate(TinyRequest(rows=7, seed=3, guidance=1.0), record=True)
    torch.testing.assert_close(unguided.record["noise"][0], cond, rtol=1e-5, atol=1e-5)


def test_a_step_cache_reuses_steps(pipe):
    got = pipe.generate(CACHED)
    report = got.record["step_cache"]
    assert report["method"] == "taylor" and report["cached_steps"], report
    full = pipe.generate(TinyRequest(rows=7, steps=8))
    assert not torch.equal(got.latents, full.latents) and torch.isfinite(got.latents).all()


def test_every_sp_kind_on_two_ranks_equals_one_process(folder):
    inputs = _inputs()
    one = _velocities(type("Ctx", (), {"rank": 0, "world_size": 1}), folder, "single", inputs)
    assert [v.shape for v in one["out"]] == [x.shape for x, _ in inputs]
    sp_plans = [name for name, plan in PLANS.items() if plan.world_size == 2]
    assert len(sp_plans) == 5
    cores = set()
    with RankPool(2, timeout_s=120) as pool:
        for plan in sp_plans:
            for rank, got in enumerate(pool.run(_velocities, folder, plan, inputs)):
                assert got["sp"] == 2 and got["core"] != one["core"] == "LocalAttention", plan
                cores.add(got["core"])
                for a, b in zip(got["out"] + got["latents"], one["out"] + one["latents"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"plan {plan}, rank {rank}")
    assert len(cores) == len(sp_plans), cores   # each plan ran its own kind's core
