"""Placement plans for Wan text-to-video and image-to-video, as data.

Three phases over one resident copy of the weights: `encode` (the UMT5 text encoder; for image
to video also the CLIP image encoder and the VAE encode of the reference frame: every rank makes
the same condition, the encode split spatially by the harness's VAE group as the decode is),
`denoise` (the DiT) and `decode` (the VAE; split spatially by the harness's VAE group, not by
the plan). The DiT is never tensor-parallel: its QK norms are RMSNorms across all heads, so it
runs replicated and spreads over ranks by sequence (SP) and by CFG branch. The text encoder
is replicated (every rank encodes the same prompt, nothing moves) or TP over the ranks.
"""
from functools import partial

from dtgen.layers.t5_rules import tp_rules
from dtgen.plan import PhasePlan, Plan, Rule, diffusion_plan, find_plan

# The UMT5 text encoder splits by heads and FFN columns (its rules: dtgen/layers/t5_rules.py); the
# rest of Wan's weights are replicated.
_TEXT_RULES, TP_OUTPUTS = tp_rules("text_encoder.")
PARAM_RULES = {
    **_TEXT_RULES,
    "transformer.*": Rule.REPLICATE,
    "transformer_2.*": Rule.REPLICATE,   # Wan2.2-A14B's low-noise expert
    "vae.*": Rule.REPLICATE,
    "image_encoder.*": Rule.REPLICATE,   # Wan2.1-I2V's CLIP vision tower
}


# A plan of Wan's three phases: the DiT's as given, the text encoder's replicated unless given.
_plan = partial(diffusion_plan, params=PARAM_RULES, outputs=TP_OUTPUTS)


PLANS = {
    "single": _plan("single", (), PhasePlan(), "one process, no parallelism"),
    # 2 ranks --------------------------------------------------------------------------------
    "ulysses2": _plan("ulysses2", (("sp", 2),), PhasePlan(sp=("sp",), attention="ulysses"),
                      "denoise on Ulysses SP2; text encoder replicated"),
    "ulysses2-te-tp2": _plan("ulysses2-te-tp2", (("sp", 2),), PhasePlan(sp=("sp",), attention="ulysses"),
                             "denoise on Ulysses SP2; text encoder on TP2", encode=PhasePlan(tp=("sp",))),
    "ulysses2-pipelined": _plan("ulysses2-pipelined", (("sp", 2),),
                                PhasePlan(sp=("sp",), attention="ulysses-pipelined"),
                                "denoise on Ulysses SP2 in pipelined head groups"),
    "ring2": _plan("ring2", (("sp", 2),), PhasePlan(sp=("sp",), attention="ring"), "denoise on ring attention SP2"),
    "attn2d-1x2": _plan("attn2d-1x2", (("sp", 2),), PhasePlan(sp=("sp",), attention="attn2d"),
                        "denoise on Attention2D 1 x 2"),
    "cfg2": _plan("cfg2", (("cfg", 2),), PhasePlan(cfg=("cfg",)),
                  "denoise on CFG2: conditional and unconditional branch on separate ranks"),
    # 4 ranks --------------------------------------------------------------------------------
    "cfg2-ulysses2": _plan("cfg2-ulysses2", (("cfg", 2), ("sp", 2)),
                           PhasePlan(sp=("sp",), cfg=("cfg",), attention="ulysses"),
                           "denoise on CFG2 x Ulysses SP2"),
    "ulysses4": _plan("ulysses4", (("sp", 4),), PhasePlan(sp=("sp",), attention="ulysses"),
                      "denoise on Ulysses SP4; text encoder on TP4", encode=PhasePlan(tp=("sp",))),
    "attn2d-2x2": _plan("attn2d-2x2", (("r", 2), ("c", 2)), PhasePlan(sp=("r", "c"), attention="attn2d"),
                        "denoise on Attention2D 2 x 2"),
    "ring2-ulysses2": _plan("ring2-ulysses2", (("ring", 2), ("uly", 2)),
                            PhasePlan(sp=("ring", "uly"), attention="ulysses-ring"),
                            "denoise on SP4: a ring of 2 over Ulysses 2"),
    "ulysses2-attn2d2": _plan("ulysses2-attn2d2", (("c", 2), ("uly", 2)),
                              PhasePlan(sp=("c", "uly"), attention="ulysses-attn2d"),
                              "denoise on SP4: Attention2D 1 x 2 over Ulysses 2"),
}


def get_plan(name: str) -> Plan:
    return find_plan(PLANS, name, "Wan")
