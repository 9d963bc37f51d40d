"""The docs' tiny DiT's plans: one phase, every weight on every rank; one process, or its rows
split over 2 ranks by each sequence-parallel kind (tests/framework/test_tiny_dit.py)."""
from dtgen.plan import PhasePlan, Plan, Rule

PARAMS = {"*": Rule.REPLICATE}   # every weight whole on every rank
SP_KINDS = ("ulysses", "ulysses-pipelined", "kv-allgather", "ring", "attn2d")
PLANS = {"single": Plan("single", (), {"denoise": PhasePlan()}, params=PARAMS),
         **{f"{kind}2": Plan(f"{kind}2", (("sp", 2),), {"denoise": PhasePlan(sp=("sp",), attention=kind)},
                             params=PARAMS) for kind in SP_KINDS}}
