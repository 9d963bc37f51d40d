"""The docs' tiny DiT (models/tiny_dit, docs/placements.md) through the registry: loaded from
its tiny checkpoint and run under every sequence-parallel kind on 2 gloo ranks, each equal to
one process. The framework splits and gathers its rows as its `seq_splits` declares; the model
shards nothing by hand. CPU, a few seconds."""
import pytest
import torch

from dtgen.launch import RankPool
from dtgen.registry import find
from dtgen.serve.errors import RequestError
from models import registry
from models.tiny_dit.model import velocity
from models.tiny_dit.spec import SPEC

PLANS = SPEC.load("plans").PLANS


def _inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """7 rows (2 ranks pad one) and 8, one timestep for every row and one per row."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, rows, 8, generator=g), t) for rows in (7, 8)
            for t in (torch.tensor([500.0, 20.0]), torch.rand(2, rows, generator=g) * 1000)]


def _velocities(ctx, folder, plan: str, inputs):
    built = SPEC.load("loader")(folder, PLANS[plan], ctx.rank, ctx.world_size)
    with built.controller.phase("denoise") as rt:
        return {"sp": rt.sp_size, "core": type(built.model.blocks[0].core).__name__,
                "out": [velocity(rt, built.model, x, t) for x, t in inputs]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return SPEC.load("tiny")(tmp_path_factory.mktemp("tiny"))


def test_the_registry_finds_builds_and_checks_it(folder):
    specs = registry.specs() + [SPEC]
    assert find(specs, "tiny-dit") is SPEC and registry.registry.detect(specs, folder) is SPEC
    assert SPEC.cli is None and not SPEC.batches
    with pytest.raises(ValueError, match="TinyDiT has no cli"):
        SPEC.load("cli")
    with pytest.raises(RequestError) as e:
        SPEC.load("request")(rows=0).check()
    assert (e.value.field, e.value.message) == ("rows", "must be >= 1 and <= 4096, got 0")


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
                for a, b in zip(got["out"], one["out"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"plan {plan}, rank {rank}")
    assert len(cores) == len(sp_plans), cores   # each plan ran its own kind's core
