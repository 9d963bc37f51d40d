"""Qwen-Image text-to-image in the registry (models/registry.py)."""
from pathlib import Path

from dtgen.registry import ModelSpec, ShapeBuckets, diffusers_class


def is_checkpoint(folder: Path) -> bool:
    return diffusers_class(folder) == "QwenImagePipeline"


SPEC = ModelSpec(
    name="qwen-image", title="Qwen-Image", makes="image", detect=is_checkpoint,
    layout="a diffusers folder, model_index.json naming QwenImagePipeline", cli="models.qwen_image.cli",
    loader="models.qwen_image.model:load", plans="placements.qwen_image",
    request="models.qwen_image.pipeline:T2IRequest", tiny="models.qwen_image.tiny:ensure_tiny_checkpoint",
    buckets=ShapeBuckets(sizes=("height", "width")), fields="models.qwen_image.serving:FIELDS")
