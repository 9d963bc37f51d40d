"""Sequence-parallel attention kinds on 4 gloo ranks against single-process attention.

Core tests build q/k/v, slots and an image block directly, shard them with SequenceLayout,
run the kind's core (made by `make_core` from a real Topology) and compare the gathered
output with the model's own single-process core (`LocalAttention`, same mask, same cache
semantics). Each kind runs over several layouts (SP4; TP2 x SP2 with non-adjacent SP pairs;
Attention2D 2x2 with either axis as rows, 4x1, 1x4, 1x2), three shape cases (uneven length
with tail padding; B=2 with fewer KV heads than SP ranks; even length with 2+ KV heads per
rank so pipelined Ulysses splits), without a cache (one call over the whole sequence) and
with one (the denoise pattern: a call that fills the cache, a call feeding <timestep> +
image rows, then an AR-like call feeding a few rows whose queries read the previous call's
rows from the cache).

Each kind also runs under torch.compile(fullgraph=True, backend="aot_eager") with a cache and
must match eager exactly (ring's P2P loop is one custom op; the rest is functional
collectives and custom ops).

Model tests load the tiny checkpoint under the hybrid plan with each denoise kind (and
Attention2D 2x2 / 2x1 plans) and compare velocities and final latents with the
single-process pipeline.

Tolerances (float32 on CPU). Cores: max |diff| <= 1e-5 on outputs of size O(1) (convex
combinations of N(0, 1) values); the parallel paths only regroup the softmax sums (LSE
merging, different key blocks), which moves results by ~1e-7, while a wrong slot, head, mask
or cache row moves them by O(0.1) (checked: the causal-only mask differs by > 1e-2).
Model: max |diff| <= 1e-5 * max |reference| + 1e-6 for velocities and latents; the hybrid
Ulysses path, which only reorders sums, measures ~3e-6 absolute on values of a few units.
"""
import dataclasses

import pytest
import torch

from dtgen.attention import AttentionMeta, LayerKVCache, LocalAttention
from dtgen.launch import RankPool
from dtgen.plan import PhasePlan, Plan, PlanError, resolve
from dtgen.sequence import SequenceLayout, SlotHole
from dtgen.sp import cache_kv_heads, make_core, ulysses_kv_heads
from dtgen.sp.ulysses_pipelined import UlyssesPipelinedAttention, pipeline_groups
from dtgen.topology import Topology
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import get_plan

CORE_TOL = 1e-5


# ----------------------------------------------------------------------------- layouts


def _layout_plan(name, grid, tp, sp):
    return Plan(name=name, grid=grid, phases={"x": PhasePlan(tp=tp, sp=sp, attention="attn2d")}, params={})


LAYOUTS = {
    "sp4": _layout_plan("sp4", (("sp", 4),), (), ("sp",)),                             # attn2d: 1 x 4
    "tp2sp2": _layout_plan("tp2sp2", (("sp", 2), ("tp", 2)), ("tp",), ("sp",)),        # SP {0,2},{1,3}; 1 x 2
    "2x2": _layout_plan("2x2", (("r", 2), ("c", 2)), (), ("r", "c")),                  # rows r (outer axis)
    "2x2-rows-inner": _layout_plan("2x2-rows-inner", (("r", 2), ("c", 2)), (), ("c", "r")),
    "4x1": _layout_plan("4x1", (("r", 4), ("c", 1)), (), ("r", "c")),
}
FLAT_KINDS = ("ulysses", "ulysses-pipelined", "kv-allgather", "ring")
CORE_RUNS = ([(kind, layout) for kind in FLAT_KINDS for layout in ("sp4", "tp2sp2")]
             + [("attn2d", layout) for layout in LAYOUTS])

# Shape cases: (B, Hq, Hkv, D, S, timestep slot, image block [start, end)).
CASES = {
    "uneven": (1, 8, 4, 8, 29, 9, (10, 25)),
    "kv<sp-batch2": (2, 8, 2, 8, 29, 9, (10, 25)),
    "even-2kv-per-rank": (1, 16, 8, 8, 32, 5, (6, 30)),
}

_TOPOLOGY: dict[str, Topology] = {}   # per worker process: groups are created once per layout


def _groups(ctx, layout_name):
    if layout_name not in _TOPOLOGY:
        plan = LAYOUTS[layout_name]
        _TOPOLOGY[layout_name] = Topology(resolve(plan, ctx.world_size), ctx.rank)
    return _TOPOLOGY[layout_name].phases["x"]


def _calls(S, ts, image):
    """Fresh slots of each call: fill everything; <timestep> + image; <timestep> + 4 image rows."""
    img = list(range(*image))
    return [torch.arange(S), torch.tensor([ts] + img), torch.tensor([ts] + img[:4])]


def _rows(gen, B, n, heads, D):
    return torch.randn(B, n, heads, D, generator=gen)


# --------------------------------------------------------------------------- core jobs


def job_core(ctx, kind, layout_name, min_group_bytes=0):
    """Every case, without and with a cache; returns {(case, cached, call): error facts}."""
    groups = _groups(ctx, layout_name)
    P = groups.sp_size
    seq = SequenceLayout(groups.sp_group, P, groups.sp_rank)
    core = make_core(kind, LocalAttention(), groups)
    if isinstance(core, UlyssesPipelinedAttention):
        core.min_group_bytes = min_group_bytes   # split even at these tiny shapes
    facts = {}
    for c, (case, (B, Hq, Hkv, D, S, ts, image)) in enumerate(CASES.items()):
        for cached in (False, True):
            gen = torch.Generator().manual_seed(10 * c + cached)   # the same data on every rank
            cache_heads = cache_kv_heads(kind, groups.layout, Hq, Hkv)
            length = S + P - 1
            cache = LayerKVCache(torch.zeros(B, cache_heads, length, D), torch.zeros(B, cache_heads, length, D)) \
                if cached else None
            ref_cache = LayerKVCache(torch.zeros(B, Hkv, length, D), torch.zeros(B, Hkv, length, D)) \
                if cached else None
            calls = _calls(S, ts, image) if cached else [torch.arange(S)]
            # With a cache, the text also holds bucket padding (a hole) before the <timestep>.
            hole = SlotHole(torch.tensor(2), ts - 1) if cached else None
            for i, slots in enumerate(calls):
                n = slots.shape[0]
                q, k, v = _rows(gen, B, n, Hq, D), _rows(gen, B, n, Hkv, D), _rows(gen, B, n, Hkv, D)
                ref = LocalAttention()(q, k, v, AttentionMeta(slots, (image,), hole=hole), ref_cache)
                causal_only = LocalAttention()(q, k, v, AttentionMeta(slots, ()), None) if i == 0 else None
                meta = AttentionMeta(seq.pad_slots(slots, S), (image,), hole=hole)
                local = core(seq.shard(q, 1), seq.shard(k, 1), seq.shard(v, 1), meta, cache)
                out = seq.gather(local, 1, n)
                fact = {"err": float((out - ref).abs().max()), "shape_ok": tuple(out.shape) == tuple(ref.shape)}
                if causal_only is not None:
                    fact["causal_only_diff"] = float((causal_only - ref).abs().max())
                if cached and i == 0:   # the fill call leaves the full sequence of this rank's KV heads
                    heads = (ulysses_kv_heads(Hq, Hkv, P)[groups.sp_rank] if kind.startswith("ulysses")
                             else list(range(Hkv)))
                    fact["cache_ok"] = bool(torch.equal(cache.k[:, :, :S], k[:, :, heads].transpose(1, 2))
                                            and torch.equal(cache.v[:, :, :S], v[:, :, heads].transpose(1, 2)))
                facts[(case, cached, i)] = fact
    if isinstance(core, UlyssesPipelinedAttention):
        q = torch.empty(1, 2674, 16, 128, dtype=torch.bfloat16)   # HunyuanImage-3 per TP2 rank (sizes only)
        facts["groups_at_tp2_shapes"] = UlyssesPipelinedAttention(None, None, 2).head_groups(q, q[:, :, :4])
    return facts if ctx.rank == 0 else None


def job_pipelined_equals_plain(ctx):
    """Pipelined Ulysses with G = 2 and 4 gives the plain Ulysses output bit for bit."""
    groups = _groups(ctx, "tp2sp2")
    seq = SequenceLayout(groups.sp_group, groups.sp_size, groups.sp_rank)
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, S = 1, 16, 8, 8, 31
    q, k, v = _rows(gen, B, S, Hq, D), _rows(gen, B, S, Hkv, D), _rows(gen, B, S, Hkv, D)
    meta = AttentionMeta(seq.pad_slots(torch.arange(S), S), ((4, 20),))
    args = (seq.shard(q, 1), seq.shard(k, 1), seq.shard(v, 1), meta, None)
    plain = make_core("ulysses", LocalAttention(), groups)(*args)
    out = {}
    for max_groups in (2, 4):
        core = UlyssesPipelinedAttention(LocalAttention(), groups.sp_group, groups.sp_size, max_groups, 0)
        out[max_groups] = (core.head_groups(args[0], args[1]), bool(torch.equal(core(*args), plain)))
    return out


def job_compiled(ctx, kind, layout_name):
    """The core under torch.compile(fullgraph=True) (aot_eager) with a cache: same output and cache."""
    torch._dynamo.reset()
    groups = _groups(ctx, layout_name)
    P = groups.sp_size
    seq = SequenceLayout(groups.sp_group, P, groups.sp_rank)
    core = make_core(kind, LocalAttention(), groups)
    if isinstance(core, UlyssesPipelinedAttention):
        core.min_group_bytes = 0
    B, Hq, Hkv, D, S, _, image = CASES["even-2kv-per-rank"]
    gen = torch.Generator().manual_seed(5)
    q, k, v = _rows(gen, B, S, Hq, D), _rows(gen, B, S, Hkv, D), _rows(gen, B, S, Hkv, D)
    meta = AttentionMeta(seq.pad_slots(torch.arange(S), S), (image,))
    heads = cache_kv_heads(kind, groups.layout, Hq, Hkv)
    caches = [LayerKVCache(torch.zeros(B, heads, S + P - 1, D), torch.zeros(B, heads, S + P - 1, D)) for _ in range(2)]

    def step(core, cache):
        return core(seq.shard(q, 1), seq.shard(k, 1), seq.shard(v, 1), meta, cache)

    eager = step(core, caches[0])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(core, caches[1])
    return (float((compiled - eager).abs().max()),
            bool(torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)))


def job_errors(ctx):
    """Bad shapes raise clear errors on every rank (caught, so the pool stays healthy)."""
    groups = _groups(ctx, "sp4")
    seq = SequenceLayout(groups.sp_group, groups.sp_size, groups.sp_rank)
    messages = {}
    q = torch.zeros(1, 2, 6, 8)
    kv = torch.zeros(1, 2, 3, 8)
    for kind in ("ulysses", "ulysses-pipelined", "ring", "kv-allgather", "attn2d"):
        core = make_core(kind, LocalAttention(), groups)
        try:  # 6 query heads over 4 ranks (Ulysses); 7 slots for 4 x 2 rows (the others)
            slots = seq.pad_slots(torch.arange(8), 8) if kind.startswith("ulysses") else torch.arange(7)
            core(q, kv, kv, AttentionMeta(slots), None)
            messages[kind] = None
        except ValueError as e:
            messages[kind] = str(e)
    try:
        make_core("nope", LocalAttention(), groups)
    except ValueError as e:
        messages["unknown"] = str(e)
    return messages


# ---------------------------------------------------------------------------- model jobs

REQUEST = T2IRequest(steps=2, max_new_tokens=2, temperature=0.0, image_size="256x256")


def _run_model(ckpt, plan, rank, world, min_group_bytes=None):
    loaded = load(ckpt, plan, rank, world)
    if min_group_bytes is not None:
        loaded.controller.activate("denoise")
        for module in loaded.model.modules():
            if isinstance(module, UlyssesPipelinedAttention):
                module.min_group_bytes = min_group_bytes
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0)
    result = pipe.generate(REQUEST)
    return {"velocity": result.record["velocity"], "latents": result.latents, "tokens": result.tokens}


def job_model(ctx, ckpt, plan, min_group_bytes=None):
    out = _run_model(ckpt, plan, ctx.rank, ctx.world_size, min_group_bytes)
    return out if ctx.rank == 0 else None


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as p:
        yield p


@pytest.fixture(scope="module")
def single_process(tiny_checkpoint):
    return _run_model(str(tiny_checkpoint), get_plan("single"), 0, 1)


# ---------------------------------------------------------------------------------- tests


def test_pipeline_group_rule():
    mib = 1 << 20
    assert pipeline_groups(2, 16 * mib, 4, mib) == 2          # HunyuanImage-3 TP2 x SP2: 2 KV heads per rank
    assert pipeline_groups(4, 16 * mib, 4, mib) == 4
    assert pipeline_groups(4, 3 * mib, 4, mib) == 2           # 4 groups would be < 1 MiB each
    assert pipeline_groups(6, 64 * mib, 4, mib) == 3          # largest divisor <= max_groups
    assert pipeline_groups(1, 64 * mib, 4, mib) == 1          # one (duplicated) KV head: plain path
    assert pipeline_groups(2, mib, 4, mib) == 1               # too small to split: plain path


def test_resolve_checks_attention_axes():
    ok = resolve(LAYOUTS["2x2"], 4).phases["x"]
    assert [a for a, _ in ok.sp_axis_groups] == ["r", "c"]
    three = Plan("three", (("a", 2), ("b", 2), ("c", 1)), {"x": PhasePlan(sp=("a", "b", "c"), attention="attn2d")}, {})
    with pytest.raises(PlanError, match=r"'attn2d' takes at most 2 sp axes"):
        resolve(three, 4)
    resolve(dataclasses.replace(three, phases={"x": PhasePlan(sp=("a", "b", "c"), attention="ring")}), 4)
    for kind in ("ring", "kv-allgather", "ulysses-pipelined", "attn2d"):
        with pytest.raises(PlanError, match="needs sequence-parallel axes"):
            resolve(Plan("nosp", (("tp", 4),), {"x": PhasePlan(tp=("tp",), attention=kind)}, {}), 4)
    with pytest.raises(PlanError, match="unknown attention kind 'zigzag'"):
        resolve(Plan("z", (("sp", 4),), {"x": PhasePlan(sp=("sp",), attention="zigzag")}, {}), 4)


@pytest.mark.parametrize("kind,layout", CORE_RUNS, ids=[f"{k}-{l}" for k, l in CORE_RUNS])
def test_core_matches_single_process(pool, kind, layout):
    facts = pool.run(job_core, kind, layout)[0]
    for key, fact in facts.items():
        if key == "groups_at_tp2_shapes":
            assert fact == 2
            continue
        assert fact["shape_ok"], key
        assert fact["err"] <= CORE_TOL, (key, fact)
        if "causal_only_diff" in fact:
            assert fact["causal_only_diff"] > 1e-2, (key, "the image block must matter in this test")
        if "cache_ok" in fact:
            assert fact["cache_ok"], (key, "the fill call must leave the full sequence in the cache")
    assert {k for k in facts if k != "groups_at_tp2_shapes"} == {
        (c, cached, i) for c in CASES for cached, calls in ((False, 1), (True, 3)) for i in range(calls)}


COMPILE_RUNS = [(kind, "sp4") for kind in FLAT_KINDS] + [("attn2d", "2x2")]


@pytest.mark.parametrize("kind,layout", COMPILE_RUNS, ids=[k for k, _ in COMPILE_RUNS])
def test_core_compiles_fullgraph(pool, kind, layout):
    """Functional collectives and custom ops (ring's P2P loop is one) keep every kind in one graph."""
    for err, cache_same in pool.run(job_compiled, kind, layout):
        assert err <= CORE_TOL and cache_same


def test_pipelined_is_plain_ulysses(pool):
    out = pool.run(job_pipelined_equals_plain)
    for rank_out in out:
        assert rank_out == {2: (2, True), 4: (4, True)}


def test_bad_shapes_raise_clear_errors(pool):
    messages = pool.run(job_errors)
    for m in messages:
        assert "not divisible by the SP size 4" in m["ulysses"]
        assert "not divisible by the SP size 4" in m["ulysses-pipelined"]
        for kind in ("ring", "kv-allgather", "attn2d"):
            assert f"{kind}: meta.slots must hold every SP rank's rows, 4 x 2 = 8" in m[kind]
        assert "unknown attention kind 'nope'" in m["unknown"]


def _denoise(kind):
    hybrid = get_plan("hybrid")
    return dataclasses.replace(hybrid, name=f"hybrid-{kind}",
                               phases={**hybrid.phases, "denoise": dataclasses.replace(hybrid.phases["denoise"],
                                                                                      attention=kind)})


# Attention2D 2 x 1 (P x 1): two sp axes, the cols axis of size 1; AR keeps TP4 over all axes.
ATTN2D_2X1 = Plan("attn2d-2x1", (("sp", 2), ("one", 1), ("tp", 2)),
                  {"ar": PhasePlan(tp=("tp", "sp", "one")),
                   "denoise": PhasePlan(tp=("tp",), sp=("sp", "one"), attention="attn2d")},
                  get_plan("hybrid").params, get_plan("hybrid").outputs)

# (Ulysses is plan hybrid and Attention2D 2 x 2 plan hybrid-attn2d: test_distributed and
# test_topologies run those end to end.)
MODEL_RUNS = {
    "ulysses-pipelined": (_denoise("ulysses-pipelined"), 0),   # 0: split into 2 groups at tiny shapes
    "kv-allgather": (_denoise("kv-allgather"), None),
    "ring": (_denoise("ring"), None),
    "attn2d-1x2": (_denoise("attn2d"), None),
    "attn2d-2x1": (ATTN2D_2X1, None),
}


@pytest.mark.parametrize("name", list(MODEL_RUNS))
def test_model_matches_single_process(pool, tiny_checkpoint, single_process, name):
    plan, min_group_bytes = MODEL_RUNS[name]
    got = pool.run(job_model, str(tiny_checkpoint), plan, min_group_bytes)[0]
    ref = single_process
    assert got["tokens"] == ref["tokens"]
    assert len(got["velocity"]) == len(ref["velocity"]) == REQUEST.steps
    for a, b in zip(got["velocity"] + [got["latents"]], ref["velocity"] + [ref["latents"]]):
        assert a.shape == b.shape
        bound = 1e-5 * float(b.abs().max()) + 1e-6
        assert float((a - b).abs().max()) <= bound, (name, float((a - b).abs().max()), bound)
