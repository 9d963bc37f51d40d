"""The tiny DiT in the registry: not listed in models/registry.py (no launcher runs it)."""
from pathlib import Path

from dtgen.registry import ModelSpec, ShapeBuckets


def is_checkpoint(folder: Path) -> bool:   # the checkpoint layout its loader reads
    return (folder / "tiny_dit.safetensors").is_file()


SPEC = ModelSpec(
    name="tiny-dit", title="TinyDiT", makes="image", detect=is_checkpoint,
    layout="a folder holding tiny_dit.safetensors", loader="models.tiny_dit.model:load",
    plans="placements.tiny_dit", request="models.tiny_dit.pipeline:TinyRequest",
    tiny="models.tiny_dit.tiny:ensure_tiny_checkpoint",
    # a batch's requests share their rows (the steps' shapes), schedule, CFG on or off, step cache
    buckets=ShapeBuckets(sizes=("rows",), batch=("steps", "guided", "step_cache")))
