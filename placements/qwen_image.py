"""Placement plans for Qwen-Image text-to-image, as data.

Three phases over one resident copy of the weights: `encode` (the Qwen2.5-VL text path),
`denoise` (the MMDiT) and `decode` (the VAE; split spatially by the pipeline's VAE group,
not by the plan). Unlike Wan's DiT, this one's QK norms are per head, so it splits by heads
(TP, diffusers' `_tp_plan`), by sequence (SP) and by CFG branch. The TP rules are the same in
every phase; a phase's `tp` axes say how far they go.
"""
from dtgen.plan import Output, PhasePlan, Plan, Rule, diffusion_plan, find_plan

_BLOCK = "transformer.transformer_blocks.*."
_LAYER = "text_encoder.model.layers.*."
_COLUMNS = [_BLOCK + f"attn.{p}.{w}" for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
            for w in ("weight", "bias")] + \
           [_BLOCK + f"{s}_mlp.net.0.proj.{w}" for s in ("img", "txt") for w in ("weight", "bias")] + \
           [_LAYER + f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")] + \
           [_LAYER + f"mlp.{p}_proj.weight" for p in ("gate", "up")]
# Row-parallel: a partial sum, all-reduced after the module (biases: added after it, once).
_ROWS = [_BLOCK + "attn.to_out.0", _BLOCK + "attn.to_add_out", _BLOCK + "img_mlp.net.2", _BLOCK + "txt_mlp.net.2",
         _LAYER + "self_attn.o_proj", _LAYER + "mlp.down_proj"]
PARAM_RULES = {**{name: Rule.COLUMN for name in _COLUMNS},
               **{name + ".weight": Rule.ROW for name in _ROWS},
               **{name + ".bias": Rule.REPLICATE for name in _ROWS[:4]},
               _BLOCK + "attn.norm_*": Rule.REPLICATE, _BLOCK + "img_mod.*": Rule.REPLICATE,
               _BLOCK + "txt_mod.*": Rule.REPLICATE, _LAYER + "*_layernorm.weight": Rule.REPLICATE,
               "text_encoder.model.embed_tokens.weight": Rule.REPLICATE, "text_encoder.model.norm.weight": Rule.REPLICATE,
               "transformer.time_text_embed.*": Rule.REPLICATE, "transformer.txt_norm.*": Rule.REPLICATE,
               "transformer.img_in.*": Rule.REPLICATE, "transformer.txt_in.*": Rule.REPLICATE,
               "transformer.norm_out.*": Rule.REPLICATE, "transformer.proj_out.*": Rule.REPLICATE,
               "vae.*": Rule.REPLICATE}
TP_OUTPUTS = {name: Output.PARTIAL_SUM for name in _ROWS}


def _plan(name, grid, phase: PhasePlan, summary, encode: PhasePlan | None = None):
    # TP plans keep the text encoder and the VAE's phase on the same TP axes, so the storage is
    # sharded (the storage axes are those of the phase with the fewest TP ranks).
    other = PhasePlan(tp=phase.tp) if phase.tp else None
    return diffusion_plan(name, grid, phase, summary, params=PARAM_RULES, outputs=TP_OUTPUTS, encode=encode or other,
                          decode=other)


PLANS = {
    "single": _plan("single", (), PhasePlan(), "one process, no parallelism"),
    "tp2": _plan("tp2", (("tp", 2),), PhasePlan(tp=("tp",)), "text encoder and MMDiT on TP2 (half the weights a rank)"),
    "ulysses2": _plan("ulysses2", (("sp", 2),), PhasePlan(sp=("sp",), attention="ulysses"),
                      "denoise on Ulysses SP2; text encoder replicated"),
    "cfg2": _plan("cfg2", (("cfg", 2),), PhasePlan(cfg=("cfg",)),
                  "denoise on CFG2: conditional and unconditional branch on separate ranks"),
}


def get_plan(name: str) -> Plan:
    return find_plan(PLANS, name, "Qwen-Image")
