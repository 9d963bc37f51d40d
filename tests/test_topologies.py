"""More topologies: CFG parallel, 2-, 4- and 8-rank plans, Attention2D and Ulysses-ring plans.

Each plan runs end to end through the example on spawned gloo ranks with --check (the
single-process model on the same inputs, seed and tokens) and the parallel VAE decode.
8 ranks on 2 cores is slow but fine for the tiny model.
"""
import dataclasses
import json

import pytest

from dtgen.plan import PhasePlan, PlanError, resolve
from examples.hunyuan_t2i import main
from placements.hunyuan_image3 import get_plan

PLANS = [("hybrid-cfg", 4), ("hybrid-attn2d", 4), ("hybrid2", 2), ("tp2", 2), ("hybrid2-cfg", 2),
         ("hybrid8", 8), ("hybrid8-tp4", 8), ("hybrid8-cfg", 8)]


@pytest.mark.parametrize("plan,world", PLANS)
def test_plan_end_to_end_matches_single_process(tiny_checkpoint, monkeypatch, tmp_path, plan, world):
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    report = tmp_path / "r.json"
    assert main(["--world-size", str(world), "--plan", plan, "--steps", "3", "--max-new-tokens", "3",
                 "--image-size", "256x256", "--check", "--output", str(tmp_path / "i.png"),
                 "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    check, switch = r["check"], r["phase_switch"]
    # float32: the parallel paths regroup sums only; guidance (x5) and 3 Euler steps amplify.
    assert check["max_abs_diff_logits"] < 1e-4 and check["max_abs_diff_velocity"] < 1e-4
    assert check["max_abs_diff_latents"] < 1e-4 and check["max_abs_diff_image"] < 1e-4
    assert switch["weights_copied"] == 0 and switch["allocated_bytes_delta"] == 0
    assert switch["param_bytes_before"] == switch["param_bytes_after"]


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
