"""More topologies: CFG parallel, 2-, 4- and 8-rank plans, Attention2D and Ulysses-ring plans.

Every plan runs a whole request (AR, phase switch, denoise, the parallel VAE decode over all
ranks) on spawned gloo ranks, one pool per world size, against one single-process run of the
same request. 8 ranks on 2 cores is slow but fine for the tiny model. (The example's own
--check path runs in tests/hunyuan_image3/test_compile.py, on 4 ranks.)
"""
import dataclasses

import pytest
import torch.distributed as dist

from dtgen.launch import RankPool
from dtgen.plan import PhasePlan, PlanError, resolve
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import get_plan

# At 8 ranks (slow on 2 cores) the Ulysses-ring plan only: hybrid8-tp4 and hybrid8-cfg use the
# mechanisms of tp2sp2 / hybrid-cfg at 4 ranks with larger groups (their layouts: test_cfg_layouts).
# tp2 (TP in both phases) runs as tp4 and tp2sp2 in test_distributed.py, and as itself in
# test_fp8_experts.py (--check) and behind the server in test_serve_http.py.
PLANS = {2: ["hybrid2", "hybrid2-cfg"], 4: ["hybrid-cfg", "hybrid-attn2d"], 8: ["hybrid8"]}
REQUEST = T2IRequest(prompt="a lighthouse", steps=3, max_new_tokens=3, temperature=0.0, image_size="256x256", seed=3)


def _outputs(result) -> dict:
    return {"tokens": result.tokens, "ar_logits": result.record["ar_logits"], "velocity": result.record["velocity"],
            "latents": [result.latents], "image": [result.image]}


def job_plan(ctx, ckpt, plan):
    loaded = load(ckpt, get_plan(plan), ctx.rank, ctx.world_size)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=ctx.rank == 0,
                              vae_group=dist.group.WORLD)
    result = pipe.generate(REQUEST)
    return {"outputs": _outputs(result) if ctx.rank == 0 else None, "switch": loaded.controller.last_switch.as_dict()}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    loaded = load(tiny_checkpoint, get_plan("single"))
    return _outputs(HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu").generate(REQUEST))


@pytest.mark.parametrize("world", sorted(PLANS))
def test_plans_end_to_end_match_single_process(tiny_checkpoint, reference, world):
    with RankPool(world, timeout_s=240) as pool:
        for plan in PLANS[world]:
            results = pool.run(job_plan, tiny_checkpoint, plan)
            got = results[0]["outputs"]
            assert got["tokens"] == reference["tokens"], plan
            # float32: the parallel paths regroup sums only; guidance (x5) and 3 Euler steps amplify.
            for key in ("ar_logits", "velocity", "latents", "image"):
                for a, b in zip(got[key], reference[key], strict=True):
                    assert float((a - b).abs().max()) < 1e-4, (plan, key)
            for r in results:
                switch = r["switch"]
                assert switch["weights_copied"] == 0 and switch["allocated_bytes_delta"] == 0, plan
                assert switch["param_bytes_before"] == switch["param_bytes_after"], plan


def test_storage_tp1_plans_hold_a_full_replica():
    for name in ("hybrid-attn2d", "hybrid2", "hybrid2-cfg"):
        r = resolve(get_plan(name), get_plan(name).world_size)
        assert r.storage_tp == 1 and r.num_micros == r.phases["ar"].tp_size


def test_tp2_halves_every_split_weight_in_both_phases():
    r = resolve(get_plan("tp2"), 2)
    assert r.storage_tp == 2 and r.num_micros == 1
    assert all(p.tp_size == 2 and p.sp_size == 1 for p in r.phases.values())


def test_cfg_layouts():
    r = resolve(get_plan("hybrid8-cfg"), 8)
    dn = r.phases["denoise"]
    assert dn.cfg_size == 2 and dn.cfg_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert r.phases["ar"].tp_size == 8 and r.storage_tp == 2 and r.num_micros == 4


def test_invalid_cfg_and_usp_plans():
    plan = get_plan("hybrid-cfg")
    wide = dataclasses.replace(plan, grid=(("cfg", 4), ("tp", 2)))
    with pytest.raises(PlanError, match=r"cfg axes \('cfg',\) must hold exactly 2 ranks"):
        resolve(wide, 8)
    usp = get_plan("hybrid8")
    one_axis = dataclasses.replace(usp, grid=(("sp", 4), ("tp", 2)), phases={
        "ar": PhasePlan(tp=("tp", "sp")), "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses-ring")})
    with pytest.raises(PlanError, match="needs exactly 2 sp axes"):
        resolve(one_axis, 8)
