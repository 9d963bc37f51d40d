"""Placement plans for HunyuanImage-3.0, as data.

Parameter rules are the same in every plan (they say *how* a weight splits); the plans
differ in the device grid and in which grid axes each phase uses for TP and SP (they say
*how far*). See docs/placements.md for how to add one.
"""
from dtgen.plan import Output, PhasePlan, Plan, Rule, find_plan

PARAM_RULES = {
    "model.wte.weight": Rule.REPLICATE,
    "model.layers.*.input_layernorm.weight": Rule.REPLICATE,
    "model.layers.*.post_attention_layernorm.weight": Rule.REPLICATE,
    "model.layers.*.self_attn.qkv_proj.weight": Rule.COLUMN_KV_GROUPS,
    "model.layers.*.self_attn.o_proj.weight": Rule.ROW,
    "model.layers.*.self_attn.query_layernorm.weight": Rule.REPLICATE,
    "model.layers.*.self_attn.key_layernorm.weight": Rule.REPLICATE,
    "model.layers.*.mlp.gate.wg.weight": Rule.REPLICATE,
    "model.layers.*.mlp.shared_mlp.gate_and_up_proj": Rule.PAIR,
    "model.layers.*.mlp.shared_mlp.down_proj": Rule.ROW,
    "model.layers.*.mlp.experts.gate_and_up_proj": Rule.PAIR,
    "model.layers.*.mlp.experts.down_proj": Rule.ROW,
    "model.ln_f.weight": Rule.REPLICATE,
    "lm_head.weight": Rule.VOCAB,
    # Image-side modules and the VAE are small next to the decoder stack: replicated.
    "timestep_emb.*": Rule.REPLICATE,
    "time_embed.*": Rule.REPLICATE,
    "time_embed_2.*": Rule.REPLICATE,
    "guidance_emb.*": Rule.REPLICATE,      # Instruct-Distil only
    "timestep_r_emb.*": Rule.REPLICATE,    # Instruct-Distil only
    "patch_embed.*": Rule.REPLICATE,
    "final_layer.*": Rule.REPLICATE,
    "vae.*": Rule.REPLICATE,
    # Image editing: the condition is computed once per request on every rank (same inputs,
    # same rows), so no rank waits for another's encoder and nothing moves afterwards.
    "vision_model.*": Rule.REPLICATE,
    "vision_aligner.*": Rule.REPLICATE,
}

# Row-parallel weights make these modules' outputs partial sums: one all-reduce each
# (the MoE block sums routed experts and the shared MLP first, then reduces once).
TP_OUTPUTS = {
    "model.layers.*.self_attn": Output.PARTIAL_SUM,
    "model.layers.*.mlp": Output.PARTIAL_SUM,
    "lm_head": Output.VOCAB_SHARDED,
}


def _plan(name, grid, phases, summary):
    return Plan(name=name, grid=grid, phases=phases, params=PARAM_RULES, outputs=TP_OUTPUTS, summary=summary)


PLANS = {
    "single": _plan(
        "single", (), {"ar": PhasePlan(), "denoise": PhasePlan()},
        "one process, no parallelism"),
    # ABAB: denoise TP pairs are adjacent ranks ({0,1},{2,3}); SP pairs are {0,2},{1,3}.
    # AR TP spans both axes, tp major: logical TP rank = 2*tp + sp = [0, 2, 1, 3].
    "hybrid": _plan(
        "hybrid", (("sp", 2), ("tp", 2)),
        {"ar": PhasePlan(tp=("tp", "sp")),
         "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses")},
        "AR on TP4, denoise on TP2 x Ulysses SP2 (ABAB: TP pairs adjacent)"),
    # AABB: SP pairs adjacent ({0,1},{2,3}), TP pairs {0,2},{1,3}; the AR map is the identity.
    "hybrid-aabb": _plan(
        "hybrid-aabb", (("tp", 2), ("sp", 2)),
        {"ar": PhasePlan(tp=("tp", "sp")),
         "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses")},
        "AR on TP4, denoise on TP2 x Ulysses SP2 (AABB: SP pairs adjacent)"),
    "tp4": _plan(
        "tp4", (("tp", 4),),
        {"ar": PhasePlan(tp=("tp",)), "denoise": PhasePlan(tp=("tp",))},
        "TP4 in both phases (fixed topology baseline)"),
    "tp2sp2": _plan(
        "tp2sp2", (("sp", 2), ("tp", 2)),
        {"ar": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses"),
         "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses")},
        "TP2 x Ulysses SP2 in both phases (fixed topology baseline)"),
}


# More topologies. The nesting rule decides what is valid (dtgen.plan.resolve): every
# phase shards weights over the storage axes (the TP axes of its coarsest phase) first,
# and spends every other grid axis on micro shards, sequence or CFG.
PLANS.update({
    # 4 ranks ---------------------------------------------------------------------------
    # CFG as a mesh axis: conditional rows on ranks {0,1}, unconditional on {2,3}; one
    # all-gather of the two velocities per step. The CFG replicas hold the AR micros.
    "hybrid-cfg": _plan(
        "hybrid-cfg", (("cfg", 2), ("tp", 2)),
        {"ar": PhasePlan(tp=("tp", "cfg")),
         "denoise": PhasePlan(tp=("tp",), cfg=("cfg",))},
        "AR on TP4, denoise on CFG2 x TP2"),
    # Storage TP1: every rank holds a full replica (AR TP4 uses one quarter of it). Meant
    # for models that fit one device; Attention2D rows 'r' x cols 'c'.
    "hybrid-attn2d": _plan(
        "hybrid-attn2d", (("r", 2), ("c", 2)),
        {"ar": PhasePlan(tp=("r", "c")), "denoise": PhasePlan(sp=("r", "c"), attention="attn2d")},
        "AR on TP4, denoise on TP1 x Attention2D 2x2 (full replica per rank: for models that fit one device)"),
    # 2 ranks ---------------------------------------------------------------------------
    # The fixed-topology baseline: storage TP2, so the 32-layer model fits two H200s
    # (~80 GB of bf16 weights per rank); both phases all-reduce twice per layer.
    "tp2": _plan(
        "tp2", (("tp", 2),),
        {"ar": PhasePlan(tp=("tp",)), "denoise": PhasePlan(tp=("tp",))},
        "TP2 in both phases (fixed topology baseline; half the weights per rank)"),
    "hybrid2": _plan(
        "hybrid2", (("sp", 2),),
        {"ar": PhasePlan(tp=("sp",)), "denoise": PhasePlan(sp=("sp",), attention="ulysses")},
        "AR on TP2, denoise on TP1 x Ulysses SP2 (full replica per rank)"),
    # Serial CFG's two branches on two ranks: no communication inside a denoise step, one
    # all-gather of the two velocities per step.
    "hybrid2-cfg": _plan(
        "hybrid2-cfg", (("cfg", 2),),
        {"ar": PhasePlan(tp=("cfg",)), "denoise": PhasePlan(cfg=("cfg",))},
        "AR on TP2, denoise on CFG2 over a full replica per rank"),
    # 8 ranks ---------------------------------------------------------------------------
    # SP4 as a ring of 2 ('ring', outer) over Ulysses 2 ('uly', inner: adjacent ranks).
    "hybrid8": _plan(
        "hybrid8", (("ring", 2), ("uly", 2), ("tp", 2)),
        {"ar": PhasePlan(tp=("tp", "ring", "uly")),
         "denoise": PhasePlan(tp=("tp",), sp=("ring", "uly"), attention="ulysses-ring")},
        "AR on TP8, denoise on TP2 x SP4 (ring 2 x Ulysses 2)"),
    "hybrid8-tp4": _plan(
        "hybrid8-tp4", (("sp", 2), ("tp", 4)),
        {"ar": PhasePlan(tp=("tp", "sp")),
         "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention="ulysses")},
        "AR on TP8, denoise on TP4 x Ulysses SP2"),
    "hybrid8-cfg": _plan(
        "hybrid8-cfg", (("cfg", 2), ("sp", 2), ("tp", 2)),
        {"ar": PhasePlan(tp=("tp", "sp", "cfg")),
         "denoise": PhasePlan(tp=("tp",), sp=("sp",), cfg=("cfg",), attention="ulysses")},
        "AR on TP8, denoise on CFG2 x TP2 x Ulysses SP2"),
})


# The other sequence-parallel attention kinds, as 'hybrid' with another denoise kind
# (AR TP4; denoise TP2 x SP2, ABAB). With one sp axis, attn2d is 1 x 2 there.
def _hybrid_denoise(name, kind, summary):
    return _plan(name, (("sp", 2), ("tp", 2)),
                 {"ar": PhasePlan(tp=("tp", "sp")), "denoise": PhasePlan(tp=("tp",), sp=("sp",), attention=kind)},
                 summary)


PLANS.update({
    "hybrid-ulysses-pipelined": _hybrid_denoise(
        "hybrid-ulysses-pipelined", "ulysses-pipelined",
        "AR on TP4, denoise on TP2 x Ulysses SP2 in pipelined head groups"),
    "hybrid-kvgather": _hybrid_denoise(
        "hybrid-kvgather", "kv-allgather", "AR on TP4, denoise on TP2 x SP2 with K/V all-gather"),
    "hybrid-ring": _hybrid_denoise(
        "hybrid-ring", "ring", "AR on TP4, denoise on TP2 x SP2 ring attention"),
    "hybrid-attn2d-1x2": _hybrid_denoise(
        "hybrid-attn2d-1x2", "attn2d", "AR on TP4, denoise on TP2 x Attention2D 1x2"),
})


def get_plan(name: str) -> Plan:
    return find_plan(PLANS, name, "HunyuanImage-3")
