"""`POST /v1/loras` (load an adapter file on the server's disk under a name, on every rank),
`GET /v1/loras` (the resident adapters), `DELETE /v1/loras/{name}` (unload one). How a load
runs on every rank and what it evicts: dtgen/serve/loras.py."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..loras import DEFAULT_TARGET, LoraRefused
from .shared import Served, ServedBy, error

router = APIRouter()

LOAD_KEYS = ("name", "path", "expert")


def _no_loras(served: Served) -> JSONResponse:
    return served.refuse(404, f"{served.adapter.name}'s server takes no LoRA adapters", outcome="wrong_route")


async def _on_every_rank(served: Served, command: dict) -> dict | JSONResponse:
    """Rank 0's answer of a LoRA command once every rank ran it (between two jobs)."""
    engine = served.engine
    if not engine.ready.is_set():
        return error(503, engine.broken or "warming up: see /ready", headers={"Retry-After": str(served.retry_after_s)})
    try:
        return await asyncio.wrap_future(engine.between_jobs(command))
    except Exception as e:   # a rank gone: the server stops
        return error(503, str(e))


def _load_body(raw: bytes) -> tuple[str, str, str]:
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        raise LoraRefused(422, f"not JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise LoraRefused(422, 'must be a JSON object {"name": ..., "path": ...}', "body")
    unknown = sorted(set(body) - set(LOAD_KEYS))
    if unknown:
        raise LoraRefused(422, f"unknown key; accepted: {', '.join(LOAD_KEYS)}", unknown[0])
    for key in ("name", "path"):
        if key not in body:
            raise LoraRefused(422, "is required", key)
        if not isinstance(body[key], str) or not body[key].strip():
            raise LoraRefused(422, f"must be a non-empty string, got {body[key]!r}", key)
    if "/" in body["name"]:
        raise LoraRefused(422, f"must not hold '/' (it names the adapter in /v1/loras/NAME), got {body['name']!r}",
                          "name")
    target = body.get("expert", DEFAULT_TARGET)
    if not isinstance(target, str):
        raise LoraRefused(422, f"must be a string, got {target!r}", "expert")
    return body["name"], body["path"], target


@router.post("/v1/loras")
async def load_lora(request: Request, served: ServedBy):
    book = served.loras
    if book is None:
        return _no_loras(served)
    try:
        name, path, target = _load_body(await request.body())
        victim = book.begin_load(name, path, target)
    except LoraRefused as e:
        return served.refuse(e.status, e.message, e.field)
    answer: dict | JSONResponse = {"ok": False, "status": 503, "message": "not run"}
    try:
        answer = await _on_every_rank(served, {"op": "load", "name": name, "path": path, "target": target,
                                               "evict": victim})
    finally:
        book.end_load(name, path, target, victim, answer if isinstance(answer, dict) else {"ok": False})
    if isinstance(answer, JSONResponse):
        return answer
    if not answer["ok"]:
        return served.refuse(answer["status"], answer["message"], "path")
    listed = next(e for e in book.listing() if e["name"] == name)
    return JSONResponse({**listed, "evicted": victim}, status_code=201)


@router.get("/v1/loras")
async def list_loras(served: ServedBy):
    book = served.loras
    if book is None:
        return _no_loras(served)
    return {"data": book.listing(), "max_loras": book.max_loras, "experts": list(book.targets)}


@router.delete("/v1/loras/{name}")
async def unload_lora(name: str, served: ServedBy):
    book = served.loras
    if book is None:
        return _no_loras(served)
    try:
        book.begin_unload(name)
    except LoraRefused as e:
        return served.refuse(e.status, e.message, e.field)
    answer: dict | JSONResponse = {"ok": False}
    try:
        answer = await _on_every_rank(served, {"op": "unload", "name": name})
    finally:
        book.end_unload(name, answer if isinstance(answer, dict) else {"ok": False})
    if isinstance(answer, JSONResponse):
        return answer
    if not answer["ok"]:
        return served.refuse(answer["status"], answer["message"], "name")
    return {"name": name, "deleted": True}
