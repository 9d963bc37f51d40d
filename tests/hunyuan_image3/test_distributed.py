"""The phase-aware core on 4 gloo ranks: every shipped plan against the single-process model.

One spawned group of 4 ranks serves the whole module. Jobs that expect an error catch it
and return the message, so the group stays healthy for the next test.
"""
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from dtgen.build import plan_problem
from dtgen.controller import PhaseMismatchError
from dtgen.launch import RankFailure, RankPool
from models.hunyuan_image3.config import HunyuanImage3Config
from models.hunyuan_image3.loading import HunyuanAdapter, load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import PLANS, get_plan
from tests.support.golden import GoldenCase, compare_case, compare_ti2i_case, discover_cases, discover_ti2i_cases

PLANS_4 = ["hybrid", "hybrid-aabb", "tp4", "tp2sp2"]
EVERY_PLAN_4 = [name for name, plan in PLANS.items() if plan.world_size == 4]  # attention kinds included
PROMPTS = ["a red fox", "a red fox!"]  # one byte apart: the denoise sequence lengths differ in parity


def _request(prompt):
    return T2IRequest(prompt=prompt, steps=3, max_new_tokens=3, temperature=0.0, image_size="auto", seed=7)


def _generate(ckpt, plan_name, rank, world, prompt):
    loaded = load(ckpt, get_plan(plan_name), rank, world)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0)
    return loaded, pipe, pipe.generate(_request(prompt))


def _summary(result):
    return {"tokens": result.tokens, "ratio": result.ratio_index, "ar_logits": result.record["ar_logits"],
            "velocity": result.record["velocity"], "latents": result.latents, "image": result.image}


# ---- jobs (run on every rank) --------------------------------------------------------------
# Plans that renumber another plan's ranks (the same math): the first prompt only, no repeat.
RENUMBERED = {"hybrid-aabb": "hybrid"}


def job_generate(ctx, ckpt, plan_name):
    out = []
    loaded, pipe, first_result = _generate(ckpt, plan_name, ctx.rank, ctx.world_size, PROMPTS[0])
    # The second prompt (a denoise sequence of the other parity) matters where the sequence is split.
    split = any(p.sp_size > 1 for p in loaded.controller.topology.resolved.phases.values())
    prompts = PROMPTS if split and plan_name not in RENUMBERED else PROMPTS[:1]
    for i, prompt in enumerate(prompts):
        first = first_result if i == 0 else pipe.generate(_request(prompt))
        same = True
        if i == 0 and plan_name not in RENUMBERED:  # switching back and forth must change nothing
            for _ in range(3):
                loaded.controller.activate("denoise")
                loaded.controller.activate("ar")
            again = pipe.generate(_request(prompt))
            same = all(torch.equal(a, b) for a, b in zip(first.record["velocity"], again.record["velocity"]))
            same &= torch.equal(first.latents, again.latents) and first.tokens == again.tokens
        out.append({"summary": _summary(first) if ctx.rank == 0 else None, "repeat_identical": same,
                    "denoise_len": first.record["denoise_length"][0]})
    return out


def job_storage(ctx, ckpt, plan_name):
    loaded = load(ckpt, get_plan(plan_name), ctx.rank, ctx.world_size)
    storage, controller = loaded.storage, loaded.controller
    facts = {"bytes_read": storage.bytes_read, "shard_bytes": storage.checkpoint_bytes(loaded.reader),
             "checkpoint_bytes": sum(math.prod(i.shape) * i.dtype.itemsize for i in loaded.reader.tensors.values()),
             "outside": {}, "switch": {}, "placements": {}, "global_shapes": {}}
    for phase in ["denoise", "ar", "denoise"]:
        before = controller.param_bytes()
        controller.activate(phase)
        report = controller.last_switch
        facts["switch"][phase] = report.as_dict()
        facts["outside"][phase] = controller.weights_outside_storage()
        assert controller.param_bytes() == before == storage.nbytes
        for name, resident in storage.tensors.items():
            module, attr = controller._param_slots[name]
            p = getattr(module, attr)
            assert p.untyped_storage().data_ptr() == resident.untyped_storage().data_ptr(), name
            dt = controller.dtensors[phase][name]
            assert dt.to_local().data_ptr() == p.data_ptr(), name
    for phase in ("ar", "denoise"):
        dts = controller.dtensors[phase]
        for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                     "model.layers.0.mlp.experts.gate_and_up_proj", "model.ln_f.weight", "lm_head.weight"):
            facts["placements"][(phase, name)] = [repr(p) for p in dts[name].placements]
            facts["global_shapes"][(phase, name)] = tuple(dts[name].shape)
    return facts


def _case_without_vae(folder) -> GoldenCase:
    """The case without its VAE tensors (so `compare_case` skips the VAE). The VAE is
    replicated in every plan and decoded by the plain module, so its golden check says
    nothing about a plan; it is the slow part on CPU, and it is checked against the golden
    outputs in one process (tests/hunyuan_image3/test_golden.py) and, through the images, every plan
    against one process (test_plan_equals_single_process)."""
    case = GoldenCase(folder)
    case.t = {k: v for k, v in case.t.items() if not k.startswith("vae_")}
    return case


def job_golden(ctx, case_folder, plan_name):
    loaded = load(case_folder, get_plan(plan_name), ctx.rank, ctx.world_size)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=ctx.rank == 0)
    return [(c.name, c.max_abs, c.ok) for c in compare_case(_case_without_vae(case_folder), pipe, localisation=False)]


def job_golden_ti2i(ctx, case_folder, plan_name, editing):
    loaded = load(case_folder, get_plan(plan_name), ctx.rank, ctx.world_size, image_editing=editing)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=ctx.rank == 0)
    case = GoldenCase(case_folder)
    return [(c.name, c.max_abs, c.ok) for c in compare_ti2i_case(case, pipe, localisation=False)]


def job_disagree(ctx, ckpt, wrong_name):
    loaded = load(ckpt, get_plan("hybrid"), ctx.rank, ctx.world_size)
    start = time.monotonic()
    try:
        loaded.controller.activate(wrong_name if ctx.rank == 0 else "denoise")
    except PhaseMismatchError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def job_die(ctx):
    dist.barrier()
    if ctx.rank == 1:
        os._exit(7)
    for _ in range(100):  # the peer is gone: this must raise, not hang
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
    return "no error"


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout_s=90) as p:
        yield p


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return [_summary(_generate(tiny_checkpoint, "single", 0, 1, p)[2]) for p in PROMPTS]


def _rel(a, b):
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("plan_name", PLANS_4)
def test_plan_equals_single_process(pool, reference, tiny_checkpoint, plan_name):
    results = pool.run(job_generate, tiny_checkpoint, plan_name)
    lengths = set()
    for run, ref in zip(results[0], reference):
        got = run["summary"]
        assert got["tokens"] == ref["tokens"] and got["ratio"] == ref["ratio"]
        # fp32: parallel paths only regroup sums (all-reduce, all-to-all); 1e-5 of the largest value.
        assert len(got["ar_logits"]) == len(ref["ar_logits"])
        for a, b in zip(got["ar_logits"], ref["ar_logits"]):
            assert _rel(a, b) < 1e-5
        for a, b in zip(got["velocity"], ref["velocity"]):
            assert _rel(a, b) < 1e-5
        assert _rel(got["latents"], ref["latents"]) < 1e-5
        assert _rel(got["image"], ref["image"]) < 1e-5
        lengths.add(run["denoise_len"] % 2)
    if len(results[0]) == len(PROMPTS):   # plans that split the sequence run both parities (RENUMBERED: one)
        assert lengths == {0, 1}, "both an even and an odd (padded) denoise sequence must run"
    assert all(run["repeat_identical"] for rank in results for run in rank)


@pytest.mark.parametrize("plan_name", PLANS_4)
def test_phase_views_share_resident_storage(pool, tiny_checkpoint, plan_name):
    facts = pool.run(job_storage, tiny_checkpoint, plan_name)
    for f in facts:
        assert all(v == 0 for v in f["outside"].values())
        for phase, switch in f["switch"].items():
            assert switch["weights_copied"] == 0 and switch["allocated_bytes_delta"] == 0
            assert switch["param_bytes_before"] == switch["param_bytes_after"]
            assert len(switch["collectives"]) == 1 and "phase agreement" in switch["collectives"][0]
        # Each rank reads exactly its storage shard from the checkpoint.
        assert f["bytes_read"] == f["shard_bytes"]
        assert f["bytes_read"] < f["checkpoint_bytes"]
    place = facts[0]["placements"]
    shapes = facts[0]["global_shapes"]
    if plan_name in ("hybrid", "hybrid-aabb"):
        assert place[("ar", "model.layers.0.self_attn.qkv_proj.weight")] == [repr(Shard(0))]
        assert place[("ar", "model.layers.0.self_attn.o_proj.weight")] == [repr(Shard(1))]
        denoise = place[("denoise", "model.layers.0.self_attn.qkv_proj.weight")]
        assert sorted(denoise) == sorted([repr(Shard(0)), repr(Replicate())])
    # Plain-layout parameters have the official global shape in every phase.
    for phase in ("ar", "denoise"):
        assert shapes[(phase, "model.layers.0.self_attn.qkv_proj.weight")] == (512, 256)
        assert shapes[(phase, "model.layers.0.self_attn.o_proj.weight")] == (256, 256)
        assert shapes[(phase, "lm_head.weight")] == (512, 256)


def _through_plans(cases, plans, editing=lambda plan: False):
    """(case, plan, editing) for every case and plan. A plan the case's model does not fit
    (heads per rank, a split that does not divide) is a skip whose reason is the plan's own
    refusal (`dtgen.build.plan_problem`: the checks `load` makes before reading a byte)."""
    if not cases:   # only without DTGEN_REQUIRE_GOLDEN=1 (discover_cases raises under it)
        return [pytest.param(None, None, False, id="no-golden", marks=pytest.mark.skip(reason="no golden cases"))]
    params = []
    for case in cases:
        cfg = HunyuanImage3Config.from_json(case / "config.json")
        for plan in plans:
            problem = plan_problem(HunyuanAdapter(cfg, editing(plan)), get_plan(plan), 4)
            marks = [pytest.mark.skip(reason=f"{case.name} cannot run under {plan}: {problem}")] if problem else []
            params.append(pytest.param(case, plan, editing(plan), id=f"{case.name}-{plan}", marks=marks))
    return params


@pytest.mark.parametrize("case,plan_name,editing", _through_plans(discover_cases(), EVERY_PLAN_4))
def test_golden_cases_through_plans(pool, case, plan_name, editing, request):
    """Every golden tensor of every T2I case but the VAE's (`_case_without_vae`) on every
    rank, under every 4-rank plan that fits the case."""
    assert case.name in request.node.name and plan_name in request.node.name
    for rank_checks in pool.run(job_golden, case, plan_name):
        bad = [(n, m) for n, m, ok in rank_checks if not ok]
        assert not bad, f"{case.name} under {plan_name}: {bad}"
        assert {n for n, _, _ in rank_checks} >= {"ar_prefill_logits", "ar_decode_logits", "diff_pred_step1",
                                                   "diff_pred_step2_cached"}


# The encoders (replicated, so the same on every plan) run under one plan (CPU 3-D
# convolutions are slow); under the others the condition comes from the case's tensors.
@pytest.mark.parametrize("case,plan_name,editing",
                         _through_plans(discover_ti2i_cases(), EVERY_PLAN_4, editing=lambda plan: plan == "hybrid"))
def test_ti2i_golden_cases_through_plans(pool, case, plan_name, editing):
    """Image editing on 4 CPU ranks: the condition encoded on every rank (replicated encoders),
    its section in the AR prompt and in both CFG rows of the denoise sequence, under every
    4-rank plan that fits the case (each attention kind meets the condition's bidirectional
    blocks), every golden tensor on every rank."""
    for rank_checks in pool.run(job_golden_ti2i, case, plan_name, editing):
        bad = [(n, m) for n, m, ok in rank_checks if not ok]
        assert not bad, f"{case.name} under {plan_name}: {bad}"
        assert {n for n, _, _ in rank_checks} >= {"ar_prefill_logits", "ar_decode_logits", "diff_pred_step1",
                                                   "diff_pred_step2_cached", "diff_pred_step2_full"}


@pytest.mark.parametrize("wrong", ["ar", "no-such-phase"])
def test_phase_disagreement_fails_every_rank(pool, tiny_checkpoint, wrong):
    results = pool.run(job_disagree, tiny_checkpoint, wrong)
    for message, seconds in results:
        assert message is not None and "ranks disagree on the phase" in message
        assert "rank 0:" in message and seconds < 10


def test_dead_rank_makes_the_others_fail_not_hang():
    start = time.monotonic()
    with RankPool(2, timeout_s=20) as pool:
        with pytest.raises(RankFailure) as err:
            pool.run(job_die)
    message = str(err.value)
    assert "rank 1 died (exit code 7)" in message
    assert "--- rank 0 ---" in message and "did not finish" not in message  # rank 0 raised by itself
    assert time.monotonic() - start < 60
