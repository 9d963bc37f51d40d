"""Placement plans for HunyuanImage-3.0, as data.

Parameter rules are the same in every plan (they say *how* a weight splits); the plans
differ in the device grid and in which grid axes each phase uses for TP and SP (they say
*how far*). See docs/placements.md for how to add one.
"""
from dtgen.plan import Output, PhasePlan, Plan, Rule

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
    "patch_embed.*": Rule.REPLICATE,
    "final_layer.*": Rule.REPLICATE,
    "vae.*": Rule.REPLICATE,
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


def get_plan(name: str) -> Plan:
    try:
        return PLANS[name]
    except KeyError:
        raise KeyError(f"unknown plan {name!r}; shipped plans: {sorted(PLANS)}") from None
