"""Plan resolution: layouts of the shipped plans, and every kind of invalid plan with its message."""
import dataclasses

import pytest

from dtgen.build import plan_problem
from dtgen.plan import PhasePlan, PlanError, Rule, match_outputs, match_rules, resolve
from dtgen.storage import check_divisible
from models.hunyuan_image3.config import HunyuanImage3Config
from models.hunyuan_image3.loading import HunyuanAdapter, build_on_meta, check_plan_fits, load, param_specs
from models.hunyuan_image3.tiny import tiny_config
from placements.hunyuan_image3 import PLANS, get_plan


def test_hybrid_abab_layout():
    r = resolve(get_plan("hybrid"), 4)
    assert r.storage_tp == 2 and r.num_micros == 2 and r.storage_rank == (0, 1, 0, 1)
    ar, dn = r.phases["ar"], r.phases["denoise"]
    assert ar.tp_rank == (0, 2, 1, 3)                      # logical AR TP rank of physical ranks 0..3
    assert dn.tp_groups == ((0, 1), (2, 3)) and dn.sp_groups == ((0, 2), (1, 3))
    assert ar.micros_per_rank == 1 and dn.micros_per_rank == 2
    assert [ar.micro_group(q, 2) for q in range(4)] == [0, 0, 1, 1]
    assert ar.mesh_shape == (4,) and dn.mesh_shape == (2, 2) and dn.mesh_dim_names == ("sp", "tp")


def test_hybrid_aabb_layout_is_identity():
    r = resolve(get_plan("hybrid-aabb"), 4)
    assert r.phases["ar"].tp_rank == (0, 1, 2, 3)
    assert r.phases["denoise"].tp_groups == ((0, 2), (1, 3)) and r.phases["denoise"].sp_groups == ((0, 1), (2, 3))
    assert r.storage_rank == (0, 0, 1, 1)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_shipped_plans_resolve_and_cover_the_model(name):
    plan = get_plan(name)
    r = resolve(plan, plan.world_size)
    model = build_on_meta(HunyuanImage3Config.from_dict(tiny_config()))
    rules = match_rules(plan, [n for n, _ in model.named_parameters()], model.unbuilt_modules())
    match_outputs(plan, [n for n, _ in model.named_modules()])
    check_plan_fits(model.cfg, r)
    for n, spec in param_specs(model, rules, None).items():
        check_divisible(n, spec, r.storage_tp * r.num_micros)


def _model():
    return build_on_meta(HunyuanImage3Config.from_dict(tiny_config()))


def test_world_size_mismatch():
    with pytest.raises(PlanError, match=r"plan 'hybrid' is laid out for 4 ranks .* but the world size is 2"):
        resolve(get_plan("hybrid"), 2)


def test_not_nested():
    bad = dataclasses.replace(get_plan("hybrid"), phases={
        "ar": PhasePlan(tp=("sp", "tp")),  # sp major: a rank's AR shard is not inside its storage shard
        "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses")})
    with pytest.raises(PlanError, match=r"phase 'ar' shards weights over \('sp', 'tp'\), but storage is sharded "
                                        r"over \('tp',\).*sub-view"):
        resolve(bad, 4)


def test_replica_count_must_equal_tp_ratio():
    bad = dataclasses.replace(get_plan("hybrid"), grid=(("x", 2), ("sp", 2), ("tp", 2)))
    with pytest.raises(PlanError, match=r"grid axes \['x'\] have no role.*4 copies .*TP_phase / TP_storage"):
        resolve(bad, 8)


def test_attention_kind_needs_sequence_axes():
    bad = dataclasses.replace(get_plan("tp4"), phases={"ar": PhasePlan(tp=("tp",)),
                                                       "denoise": PhasePlan(tp=("tp",), attention="ulysses")})
    with pytest.raises(PlanError, match="attention 'ulysses' needs sequence-parallel axes"):
        resolve(bad, 4)
    bad = dataclasses.replace(get_plan("hybrid"), phases={"ar": PhasePlan(tp=("tp", "sp")),
                                                          "denoise": PhasePlan(tp=("tp",), sp=("sp",))})
    with pytest.raises(PlanError, match="cannot shard the sequence"):
        resolve(bad, 4)


def test_glob_matching_nothing_and_uncovered_parameter():
    model = _model()
    names, unbuilt = [n for n, _ in model.named_parameters()], model.unbuilt_modules()
    plan = get_plan("single")
    with pytest.raises(PlanError, match=r"globs \['model.nothing.\*'\] match no parameter"):
        match_rules(dataclasses.replace(plan, params={**plan.params, "model.nothing.*": Rule.REPLICATE}), names, unbuilt)
    rules = {k: v for k, v in plan.params.items() if k != "lm_head.weight"}
    with pytest.raises(PlanError, match=r"no rule covers parameters \['lm_head.weight'\]"):
        match_rules(dataclasses.replace(plan, params=rules), names, unbuilt)
    with pytest.raises(PlanError, match="matches several rules"):
        match_rules(dataclasses.replace(plan, params={**plan.params, "lm_head.*": Rule.REPLICATE}), names, unbuilt)


@pytest.mark.parametrize("field,value,pattern", [
    ("num_key_value_heads", 6, r"qkv_proj.weight: 6 KV-head groups .* not divisible by the finest TP split of 4"),
    ("moe_intermediate_size", [66, 66], r"gate_and_up_proj: 66 rows .*per half.* not divisible by the finest TP"),
    ("vocab_size", 510, r"lm_head.weight: 510 rows .* not divisible by the finest TP split of 4"),
])
def test_model_that_does_not_divide(field, value, pattern):
    cfg = {**tiny_config(), field: value}
    if field == "num_key_value_heads":
        cfg["num_attention_heads"] = 12
    model = build_on_meta(HunyuanImage3Config.from_dict(cfg))
    plan = get_plan("hybrid")
    r = resolve(plan, 4)
    specs = param_specs(model, match_rules(plan, [n for n, _ in model.named_parameters()], model.unbuilt_modules()),
                        None)
    with pytest.raises(PlanError, match=pattern):
        for n, spec in specs.items():
            check_divisible(n, spec, r.storage_tp * r.num_micros)


def test_heads_that_ulysses_cannot_split():
    r = resolve(get_plan("tp2sp2"), 4)
    cfg = HunyuanImage3Config.from_dict({**tiny_config(), "num_attention_heads": 12, "num_key_value_heads": 4})
    check_plan_fits(cfg, r)  # 6 q heads / 2 KV per TP rank over SP2: fine
    cfg6 = HunyuanImage3Config.from_dict({**tiny_config(), "num_attention_heads": 6, "num_key_value_heads": 2})
    with pytest.raises(PlanError, match=r"plan 'tp2sp2', phase 'ar' \(TP2 x SP2\): Ulysses: 3 query heads per TP "
                                        r"rank are not divisible by the SP size 2"):
        check_plan_fits(cfg6, r)


def test_plan_problem_is_the_build_refusal():
    """`plan_problem` (what the golden-through-plans tests skip on) says what `load` would
    refuse, without reading or allocating: None where the plan fits."""
    fits = HunyuanAdapter(HunyuanImage3Config.from_dict(tiny_config()))
    assert plan_problem(fits, get_plan("hybrid"), 4) is None
    six_two = HunyuanAdapter(HunyuanImage3Config.from_dict({**tiny_config(), "num_attention_heads": 6,
                                                             "num_key_value_heads": 2}))
    assert "3 query heads per TP rank are not divisible by the SP size 2" in plan_problem(six_two, get_plan("hybrid"), 4)
    assert "2 KV-head groups along dim 0" in plan_problem(six_two, get_plan("tp4"), 4)
    assert "laid out for 2 ranks" in plan_problem(fits, get_plan("tp2"), 4)


def test_load_checks_the_plan_before_reading(tiny_checkpoint):
    with pytest.raises(PlanError, match="but the world size is 1"):
        load(tiny_checkpoint, get_plan("hybrid"), 0, 1)
