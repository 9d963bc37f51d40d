"""The HTTP side (rank 0): an OpenAI-style image route, job routes, health, metrics, a UI.

Routes:
- `POST /v1/images/generations`: the request's JSON fields; answers when the image is made
  (`{"created", "data": [{"b64_json"}]}`). A client that disconnects cancels its job.
- `POST /v1/jobs` (202 and an id), `GET /v1/jobs/{id}` (status, progress, the result when
  done), `DELETE /v1/jobs/{id}` (cancel).
- `GET /health` (the process is up), `GET /ready` (503 until every rank has warmed up, and
  again once a rank is gone), `GET /metrics` (Prometheus), `GET /` (a one-page UI).

Statuses: 422 a bad field (one line naming it), 429 the queue is full (Retry-After),
503 out of memory or not ready, 504 the server-side deadline passed, 499 cancelled.
The event loop only queues, reads and cancels jobs; the engine thread runs them.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import Engine
from .errors import RequestError
from .jobs import CANCELLED, FAILED, SUCCEEDED, Job, JobBoard, QueueFull

UI_PAGE = Path(__file__).with_name("ui.html")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    """The server's Prometheus series, in a registry of its own (one per app)."""

    def __init__(self, board: JobBoard):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("dtgen_queue_depth", "jobs waiting", registry=r)
        self.queue_depth.set_function(board.depth)
        self.requests = Counter("dtgen_requests", "requests by answer", ["outcome"], registry=r)
        self.jobs = Counter("dtgen_jobs", "finished jobs by state", ["state"], registry=r)
        self.queue_s = Histogram("dtgen_queue_seconds", "waiting before running", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.e2e_s = Histogram("dtgen_end_to_end_seconds", "submission to the end", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self.phase_s = Histogram("dtgen_phase_seconds", "time per phase of a job", ["phase"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("dtgen_errors", "failed jobs by kind", ["kind"], registry=r)
        board.on_finish = self.finished

    def started(self, job: Job) -> None:
        self.queue_s.observe(job.started - job.created)

    def finished(self, job: Job) -> None:
        self.jobs.labels(job.state).inc()
        self.e2e_s.observe(time.monotonic() - job.created)
        if job.state == FAILED:
            self.errors.labels("out_of_memory" if job.http_status == 503 else "job_failed").inc()
        timings = (job.result or {}).get("timings_ms", {}) if isinstance(job.result, dict) else {}
        for phase, ms in timings.items():
            self.phase_s.labels(phase).observe(ms / 1e3)


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message}}
    if field is not None:
        body["error"]["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: Engine, board: JobBoard, metrics: Metrics, deadline_s: float | None = None,
               retry_after_s: int = 5) -> FastAPI:
    app = FastAPI(title="dtgen", docs_url=None, redoc_url=None)
    adapter = engine.adapter

    async def submit(request: Request) -> Job | JSONResponse:
        try:
            fields = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            metrics.requests.labels("invalid").inc()
            return _error(422, "the body is not JSON")
        try:
            if not isinstance(fields, dict):
                raise RequestError("body", "must be a JSON object")
            parsed = adapter.parse(fields)
        except RequestError as e:
            metrics.requests.labels("invalid").inc()
            return _error(422, str(e), e.field)
        if not engine.ready.is_set():
            metrics.requests.labels("not_ready").inc()
            return _error(503, engine.broken or "warming up: see /ready", headers={"Retry-After": str(retry_after_s)})
        try:
            job = board.submit(parsed, deadline_s)
        except QueueFull as e:
            metrics.requests.labels("queue_full").inc()
            return _error(429, f"queue full: {e}", headers={"Retry-After": str(retry_after_s)})
        metrics.requests.labels("accepted").inc()
        return job

    def finished_response(job: Job) -> JSONResponse:
        if job.state == SUCCEEDED:
            return JSONResponse({"created": int(time.time()), "data": [job.result["image"]],
                                 "dtgen": {k: v for k, v in job.result.items() if k != "image"}})
        return _error(job.http_status if job.state in (FAILED, CANCELLED) else 500, job.error or job.state)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        job = await submit(request)
        if isinstance(job, JSONResponse):
            return job
        while not job.finished.is_set():
            if await request.is_disconnected():
                board.cancel(job, "the client disconnected")
            await asyncio.sleep(0.05)
        return finished_response(job)

    @app.post("/v1/jobs", status_code=202)
    async def create_job(request: Request):
        job = await submit(request)
        if isinstance(job, JSONResponse):
            return job
        return JSONResponse(job.as_dict(), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})

    @app.get("/v1/jobs/{job_id}")
    async def read_job(job_id: str):
        job = board.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        body = job.as_dict()
        if job.state == SUCCEEDED:
            body["result"] = {"data": [job.result["image"]]}
        return body

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str):
        job = board.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        board.cancel(job, "cancelled by DELETE")
        return job.as_dict()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.ready.is_set():
            return {"status": "ready"}
        return _error(503, engine.broken or "warming up")

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return UI_PAGE.read_text()

    return app
