"""The HTTP side (rank 0): OpenAI-style image and video routes, job routes, health, metrics, a UI.

Routes (an image model's server; a video model's has the video ones instead):
- `POST /v1/images/generations`: the request's JSON fields; answers when the image is made
  (`{"created", "data": [{"b64_json"}]}`). A client that disconnects cancels its job.
- `POST /v1/images/edits`: OpenAI's multipart form: an `image` file, `prompt` and the other
  fields of a generation; answers as the generations route.
- `POST /v1/videos` (JSON or a multipart form; 202 and a video object), `GET /v1/videos/{id}`
  (status, progress 0-100), `GET /v1/videos/{id}/content` (the MP4), `DELETE /v1/videos/{id}`.
- `POST /v1/jobs` (202 and an id, any model), `GET /v1/jobs/{id}` (status, phase, progress,
  the image when done), `DELETE /v1/jobs/{id}` (cancel: a queued job leaves the queue now).
- `POST /v1/loras` (load a LoRA adapter on the server's disk under a name, on every rank),
  `GET /v1/loras` (the resident ones), `DELETE /v1/loras/{name}`; a request's `loras` names
  resident adapters (dtgen/serve/loras.py).
- `GET /health` (the process is up), `GET /ready` (503 until every rank has warmed up, and
  again once the server cannot go on), `GET /metrics` (Prometheus), `GET /info` (the model,
  what it makes, its defaults), `GET /` (a one-page UI).

Statuses: 422 a bad field (one line naming it), 413 a body over the upload limit, 415 a
body neither JSON nor a multipart form, 404 a route of the other kind of model or an unknown
job (ids are random: a restarted server never answers an old one), 409 a video's content before it is
made, 429 the queue is full (Retry-After), 503 out of memory or not ready, 504 the
server-side deadline passed, 499 cancelled, 500 a job that failed (its message).
Every request writes one line to the log (its status and time; an error's message).
The event loop only queues, reads and cancels jobs; the engine thread runs them. Each family
of routes is a router of its own (dtgen/serve/routes/); this module puts them on one app.
"""
from __future__ import annotations

import json
import time
from typing import Callable

from fastapi import FastAPI

from .engine import Engine
from .jobs import JobBoard
from .loras import ServedLoras
from .metrics import Metrics
from .routes import ROUTERS
from .routes.shared import Served


class AccessLog:
    """ASGI middleware: one line per HTTP request (method, path, status, milliseconds) and,
    for an answer of 400 or more, its error message."""

    def __init__(self, app, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        seen = {"status": None, "body": b""}

        async def sending(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and (seen["status"] or 0) >= 400 and len(seen["body"]) < 4096:
                seen["body"] += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            status = seen["status"] or "-"
            line = f'{scope.get("client", ("-",))[0]} "{scope["method"]} {scope["path"]}" {status} ' \
                   f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
            if isinstance(status, int) and status >= 400:
                try:
                    line += ": " + json.loads(seen["body"])["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
            self.log(line)


def create_app(engine: Engine, board: JobBoard, metrics: Metrics, deadline_s: float | None = None,
               retry_after_s: int = 5, max_upload_bytes: int = 32 << 20,
               log: Callable[[str], None] | None = None, models: tuple[tuple[str, str], ...] = (),
               max_loras: int = 8) -> FastAPI:
    """`models`: (what it makes, its title) of every model the launcher knows (dtgen knows
    none): a route of the other kind is refused naming the models that serve it. `max_loras`:
    the most LoRA adapters resident at once (the least recently used one no job holds is evicted)."""
    app = FastAPI(title="dtgen", docs_url=None, redoc_url=None)
    app.state.served = Served(engine, board, metrics, deadline_s=deadline_s, retry_after_s=retry_after_s,
                              max_upload_bytes=max_upload_bytes, models=models,
                              loras=ServedLoras.of(engine.adapter, max_loras))
    for router in ROUTERS:
        app.include_router(router)
    return AccessLog(app, log) if log is not None else app
