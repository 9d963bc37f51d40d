"""Building blocks shared by the models: plain modules and functions, no process groups.

A model imports what it uses from here, never from a sibling model. Each kind of block
has one file, and where models round differently (upcast order, which dtype a norm
returns), the block takes that as an option, so every model keeps its own reference's
arithmetic to the bit:

    linear.py       parameters built without initialisation (meta at load time), Linear, GeluProj
    norms.py        RMSNorm (four rounding conventions), the Wan VAE's channel RMS norm, FP32 LayerNorm
    rope.py         rotary tables from per-axis positions, and applying them (pair layouts)
    embeddings.py   the timestep sinusoid and the two-layer embedder MLP
    config.py       reading a config.json into a frozen dataclass (known keys, refusals)
    t5.py           the UMT5 text encoder (Wan's) and its tokenizer; t5_rules.py its TP rules for plans
    wan_vae.py      the Wan 2.1 VAE decoder (Wan's, and Qwen-Image's: the same architecture)
    wan_vae_parallel.py  that decoder split over a process group (the group is passed in)
    flow_match.py   flow-matching schedules and samplers (Euler, UniPC), classifier-free guidance
    latent_packing.py  2 x 2 latent patches as token rows and back (Qwen-Image's, FLUX's layout)

Nothing here is imported by `dtgen/__init__.py`: a model pays only for the blocks it uses.
"""
