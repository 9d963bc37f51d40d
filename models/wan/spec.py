"""Wan 2.1 / 2.2 text-to-video and image-to-video in the registry (models/registry.py)."""
from dtgen.registry import DiffusersFolder, ModelSpec, ShapeBuckets

SPEC = ModelSpec(
    name="wan", title="Wan", makes="video", detect=DiffusersFolder("WanPipeline", also=("WanImageToVideoPipeline",)),
    layout="a diffusers folder, model_index.json naming WanPipeline or WanImageToVideoPipeline",
    cli="models.wan.cli:COMMAND", loader="models.wan.model:load", plans="placements.wan",
    request="models.wan.pipeline:T2VRequest", tiny="models.wan.tiny:ensure_tiny_checkpoint",
    # Image to video (`image`, a reference first frame) batches alike: the condition is each member's own.
    # A batch shares its video's size (every prompt is 512 text rows), the schedule (steps,
    # sampler, shift: one set of timesteps, one expert switch), the step cache and which
    # experts' steps run CFG (each member's rows of a call are then alike); the seed, the
    # prompts and the guidance values are each member's own.
    buckets=ShapeBuckets(sizes=("num_frames", "height", "width"),
                         batch=("steps", "sampler", "shift", "step_cache", "guided")),
    fields="models.wan.serving:FIELDS")
