"""HunyuanImage-3.0 in the registry (models/registry.py): text-to-image and image editing."""
from pathlib import Path

from dtgen.registry import ModelSpec


def is_checkpoint(folder: Path) -> bool:
    """The official layout: config.json (and safetensors) at the top, not a diffusers folder."""
    return (folder / "config.json").is_file() and not (folder / "model_index.json").is_file()


SPEC = ModelSpec(
    name="hunyuan-image3", title="HunyuanImage-3", makes="image", detect=is_checkpoint,
    layout="the official folder, config.json at the top", cli="examples.hunyuan_t2i",
    plans="placements.hunyuan_image3", request="models.hunyuan_image3.requests:T2IRequest",
    tiny="models.hunyuan_image3.tiny:ensure_tiny_checkpoint", batches=True)
