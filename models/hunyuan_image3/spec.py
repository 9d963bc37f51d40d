"""HunyuanImage-3.0 in the registry (models/registry.py): text-to-image and image editing."""
from pathlib import Path

from dtgen.registry import ModelSpec, ShapeBuckets


def is_checkpoint(folder: Path) -> bool:
    """The official layout: config.json (and safetensors) at the top, not a diffusers folder."""
    return (folder / "config.json").is_file() and not (folder / "model_index.json").is_file()


# One bucket per size of the resolution table and per 256 prompt rows (--prompt-bucket): the
# denoise text (prompt and CoT) pads to its bucket; a batch also shares the schedule, the CFG
# mode and the step cache (serving.batch_key adds an edit's reference shape).
BUCKETS = ShapeBuckets(sizes=("image_size",), text_rows=256, batch=("steps", "flow_shift", "cfg_mode", "step_cache"))

SPEC = ModelSpec(
    name="hunyuan-image3", title="HunyuanImage-3", makes="image", detect=is_checkpoint,
    layout="the official folder, config.json at the top", cli="models.hunyuan_image3.cli",
    loader="models.hunyuan_image3.loading:load", plans="placements.hunyuan_image3",
    request="models.hunyuan_image3.requests:T2IRequest", tiny="models.hunyuan_image3.tiny:ensure_tiny_checkpoint",
    buckets=BUCKETS, fields="models.hunyuan_image3.serving:FIELDS")
