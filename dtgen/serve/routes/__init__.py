"""The HTTP routes, one `APIRouter` per family: images (generations, edits), jobs, videos,
LoRA adapters, health (readiness, metrics, info) and the UI page. Every route reads the app's one `Served`
object (`shared.py`: the engine, the job board, the metrics, the limits) as a dependency."""
from __future__ import annotations

from . import health, images, jobs, loras, ui, videos

# In this order on the app (the order of its OpenAPI document).
ROUTERS = (images.router, jobs.router, videos.router, loras.router, health.router, ui.router)
