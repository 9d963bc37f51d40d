"""Qwen-Image text-to-image in the registry (models/registry.py)."""
from dtgen.registry import DiffusersFolder, ModelSpec, ShapeBuckets

SPEC = ModelSpec(
    name="qwen-image", title="Qwen-Image", makes="image", detect=DiffusersFolder("QwenImagePipeline"),
    layout="a diffusers folder, model_index.json naming QwenImagePipeline", cli="models.qwen_image.cli:COMMAND",
    loader="models.qwen_image.model:load", plans="placements.qwen_image",
    request="models.qwen_image.pipeline:T2IRequest", tiny="models.qwen_image.tiny:ensure_tiny_checkpoint",
    # A batch shares its image size, the steps (one dynamic-shift schedule), the step cache and
    # whether CFG is on; each member's prompts keep their own lengths (a call pads its rows'
    # text to the longest and masks the padding per row), seeds and guidance. Compiled, a call's
    # text pads to a multiple of 64 rows: a prompt of up to 64 tokens reuses the warmed-up graphs.
    buckets=ShapeBuckets(sizes=("height", "width"), text_rows=64, batch=("steps", "step_cache", "guided")),
    fields="models.qwen_image.serving:FIELDS")
