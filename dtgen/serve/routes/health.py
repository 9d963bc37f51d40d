"""`GET /health` (the process is up), `GET /ready` (503 until every rank has warmed up, and
again once the server cannot go on), `GET /metrics` (Prometheus), `GET /info` (the model,
what it makes, its defaults: what the UI reads)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .shared import ServedBy, error

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(served: ServedBy):
    if served.engine.ready.is_set():
        return {"status": "ready"}
    return error(503, served.engine.broken or "warming up")


@router.get("/metrics")
async def prometheus(served: ServedBy):
    return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/info")
async def info(served: ServedBy):
    return {"model": served.adapter.name, "kind": served.kind, "edits": served.can_edit,
            "defaults": served.adapter.defaults_dict()}
