"""The docs' tiny DiT's plans: every weight on every rank; one process, or its denoise rows
split over 2 ranks by each sequence-parallel kind (tests/framework/test_tiny_dit.py). Its
encode and decode phases compute nothing of the DiT: one process runs them, or both ranks alike."""
from dtgen.plan import PhasePlan, Plan, Rule

PARAMS = {"*": Rule.REPLICATE}   # every weight whole on every rank
SP_KINDS = ("ulysses", "ulysses-pipelined", "kv-allgather", "ring", "attn2d")
SAME = PhasePlan(replicate=("sp",))
PLANS = {"single": Plan("single", (), {"encode": PhasePlan(), "denoise": PhasePlan(), "decode": PhasePlan()},
                        params=PARAMS),
         **{f"{kind}2": Plan(f"{kind}2", (("sp", 2),),
                             {"encode": SAME, "denoise": PhasePlan(sp=("sp",), attention=kind), "decode": SAME},
                             params=PARAMS) for kind in SP_KINDS}}
