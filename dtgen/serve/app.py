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
- `GET /health` (the process is up), `GET /ready` (503 until every rank has warmed up, and
  again once the server cannot go on), `GET /metrics` (Prometheus), `GET /info` (the model,
  what it makes, its defaults), `GET /` (a one-page UI).

Statuses: 422 a bad field (one line naming it), 413 a body over the upload limit, 404 a
route of the other kind of model or an unknown job, 409 a video's content before it is
made, 429 the queue is full (Retry-After), 503 out of memory or not ready, 504 the
server-side deadline passed, 499 cancelled, 500 a job that failed (its message).
Every request writes one line to the log (its status and time; an error's message).
The event loop only queues, reads and cancels jobs; the engine thread runs them.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .adapters import encode_answer, take_image_output
from .engine import Engine, can_batch
from .errors import RequestError
from .forms import TooLarge, parse_body, read_body
from .jobs import CANCELLED, FAILED, FINISHED, SUCCEEDED, Job, JobBoard, QueueFull

UI_PAGE = Path(__file__).with_name("ui.html")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# OpenAI's video statuses for dtgen's job states
_VIDEO_STATUS = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
                 "cancelled": "cancelled"}


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
        self.batch_size = Histogram("dtgen_job_batch_size", "jobs that ran together with a job (itself included)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self._also = board.on_finish
        board.on_finish = self.finished

    def started(self, job: Job) -> None:
        self.queue_s.observe(job.started - job.created)
        self.batch_size.observe(job.batch_size)

    def finished(self, job: Job) -> None:
        self.jobs.labels(job.state).inc()
        self.e2e_s.observe(time.monotonic() - job.created)
        if job.state == FAILED:
            self.errors.labels("out_of_memory" if job.http_status == 503 else "job_failed").inc()
        timings = (job.result or {}).get("timings_ms", {}) if isinstance(job.result, dict) else {}
        for phase, ms in timings.items():
            if isinstance(ms, (int, float)):
                self.phase_s.labels(phase).observe(ms / 1e3)
        if self._also is not None:
            self._also(job)


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message}}
    if field is not None:
        body["error"]["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


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
               log: Callable[[str], None] | None = None, models: tuple[tuple[str, str], ...] = ()) -> FastAPI:
    """`models`: (what it makes, its title) of every model the launcher knows (dtgen knows
    none): a route of the other kind is refused naming the models that serve it."""
    app = FastAPI(title="dtgen", docs_url=None, redoc_url=None)
    adapter = engine.adapter
    kind = adapter.kind

    def refuse(status: int, message: str, field: str | None = None, outcome: str = "invalid") -> JSONResponse:
        metrics.requests.labels(outcome).inc()
        return _error(status, message, field)

    async def submit(request: Request, route: str) -> Job | JSONResponse:
        """Read, parse and queue a request for `route` ("generations", "edits", "videos")."""
        try:
            body = await read_body(request, max_upload_bytes)
        except TooLarge as e:
            return refuse(413, f"{'image' if route == 'edits' else 'body'}: {e}", "image" if route == "edits" else "body")
        try:
            fields, files, form = parse_body(request.headers.get("content-type", ""), body)
            output = None
            if kind == "image":   # how the answer's image is encoded: this side's, not the model's
                output, fields = take_image_output(fields, form)
            if route == "jobs":  # an image model's job with an image file is an edit
                route = "videos" if kind == "video" else "edits" if files and getattr(adapter, "can_edit", False) \
                    else "generations"
            if route == "edits":
                if not form:
                    raise RequestError("body", "an edit is a multipart/form-data upload (an image file and the fields)")
                # decoding the image and sizing its condition is CPU work: off the event loop
                parsed = await asyncio.to_thread(adapter.parse_edit, fields, files, form)
            else:
                if files:
                    name = sorted(files)[0]
                    raise RequestError(name, "a file is not taken here (image edits: POST /v1/images/edits)")
                parsed = await asyncio.to_thread(adapter.parse, fields, form)
        except RequestError as e:
            return refuse(422, str(e), e.field)
        key = await asyncio.to_thread(adapter.batch_key, parsed) if engine.max_batch > 1 and can_batch(adapter) \
            else None
        if not engine.ready.is_set():
            metrics.requests.labels("not_ready").inc()
            return _error(503, engine.broken or "warming up: see /ready", headers={"Retry-After": str(retry_after_s)})
        try:
            job = board.submit(parsed, deadline_s, kind=kind, phases=adapter.phases(parsed), batch_key=key,
                               output=output)
        except QueueFull as e:
            metrics.requests.labels("queue_full").inc()
            return _error(429, f"queue full: {e}", headers={"Retry-After": str(retry_after_s)})
        metrics.requests.labels("accepted").inc()
        return job

    def wrong_kind(path: str) -> JSONResponse:
        if kind == "image":
            need = "video routes need a video model"
            here = "/v1/images/generations" + (", /v1/images/edits" if getattr(adapter, "can_edit", False) else "")
        else:
            need, here = "image routes need an image model", "/v1/videos"
        makers = " or ".join(title for makes, title in models if makes != kind)
        if makers:
            need += f" (a {makers} checkpoint)"
        return refuse(404, f"{path}: this server makes {kind}s ({adapter.name}); {need}. Here: POST {here}, /v1/jobs",
                      outcome="wrong_route")

    encoding: dict[str, asyncio.Task] = {}

    async def encoded(job: Job) -> None:
        """A succeeded image job's pixels encoded into its answer, once (on a worker thread:
        neither the engine nor the event loop waits for the PNG); concurrent readers share it."""
        if job.kind != "image" or job.state != SUCCEEDED or "pixels" not in (job.result or {}):
            return
        task = encoding.get(job.id)
        if task is None:
            task = encoding[job.id] = asyncio.ensure_future(asyncio.to_thread(encode_answer, job.result, job.output))

            def store(t: asyncio.Task) -> None:   # even when every reader has left meanwhile
                encoding.pop(job.id, None)
                if not t.cancelled() and t.exception() is None:
                    job.result = t.result()
            task.add_done_callback(store)
        await asyncio.shield(task)   # a reader that leaves does not cancel the others' encoding

    async def finished_image(job: Job) -> JSONResponse:
        if job.state == SUCCEEDED:
            await encoded(job)
            return JSONResponse({"created": int(time.time()), "data": [job.result["image"]],
                                 "dtgen": {k: v for k, v in job.result.items() if k != "image"}})
        return _error(job.http_status if job.state in (FAILED, CANCELLED) else 500, job.error or job.state)

    async def answer_when_done(request: Request, job: Job) -> JSONResponse:
        # Woken by the engine's thread the moment the job ends (polling every 50 ms cost a
        # request 25 ms on average); the timeout only paces the client-disconnect check.
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        job.when_finished(lambda: loop.call_soon_threadsafe(woken.set))
        while not job.finished.is_set():
            if await request.is_disconnected():
                board.cancel(job, "the client disconnected")
            try:
                await asyncio.wait_for(woken.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        return await finished_image(job)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        if kind != "image":
            return wrong_kind("POST /v1/images/generations")
        job = await submit(request, "generations")
        return job if isinstance(job, JSONResponse) else await answer_when_done(request, job)

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        if kind != "image":
            return wrong_kind("POST /v1/images/edits")
        if not getattr(adapter, "can_edit", False):
            return refuse(404, "POST /v1/images/edits: this server was started without image editing ("
                               f"{adapter.edit_problem})", outcome="wrong_route")
        job = await submit(request, "edits")
        return job if isinstance(job, JSONResponse) else await answer_when_done(request, job)

    # ---- jobs (any model) ---------------------------------------------------------------
    async def job_body(job: Job) -> dict:
        body = job.as_dict()
        if body["status"] == SUCCEEDED:   # the state read once: the engine may end the job meanwhile
            await encoded(job)
            body["result"] = ({"data": [job.result["image"]]} if job.kind == "image"
                              else {"content": f"/v1/videos/{job.id}/content"})
        return body

    @app.post("/v1/jobs", status_code=202)
    async def create_job(request: Request):
        job = await submit(request, "jobs")
        if isinstance(job, JSONResponse):
            return job
        return JSONResponse(await job_body(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})

    @app.get("/v1/jobs/{job_id}")
    async def read_job(job_id: str):
        job = board.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return await job_body(job)

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str):
        job = board.get(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        board.cancel(job, "cancelled by DELETE")
        return await job_body(job)

    # ---- videos -------------------------------------------------------------------------
    def video_body(job: Job) -> dict:
        body = {"id": job.id, "object": "video", "model": adapter.name, "status": _VIDEO_STATUS[job.state],
                "progress": job.percent(), "created_at": int(time.time() - (time.monotonic() - job.created)),
                **adapter.describe(job.request), "dtgen": {"phase": job.phase, "done": job.done, "total": job.total}}
        if job.error is not None:
            body["error"] = {"message": job.error}
        if job.state == SUCCEEDED:
            body["content"] = f"/v1/videos/{job.id}/content"
            # what the job reports besides the MP4: timings, the step cache's decisions
            body["dtgen"].update({k: v for k, v in job.result.items() if k != "video"})
        return body

    def video_job(job_id: str) -> Job | JSONResponse:
        job = board.get(job_id)
        if job is None:
            return _error(404, f"no video {job_id!r}")
        if job.kind != "video":
            return _error(404, f"{job_id} is an image job: GET /v1/jobs/{job_id}")
        return job

    @app.post("/v1/videos")
    async def create_video(request: Request):
        if kind != "video":
            return wrong_kind("POST /v1/videos")
        job = await submit(request, "videos")
        if isinstance(job, JSONResponse):
            return job
        return JSONResponse(video_body(job), status_code=202, headers={"Location": f"/v1/videos/{job.id}"})

    @app.get("/v1/videos/{job_id}")
    async def read_video(job_id: str):
        if kind != "video":
            return wrong_kind(f"GET /v1/videos/{job_id}")
        job = video_job(job_id)
        return job if isinstance(job, JSONResponse) else video_body(job)

    @app.get("/v1/videos/{job_id}/content")
    async def video_content(job_id: str):
        if kind != "video":
            return wrong_kind(f"GET /v1/videos/{job_id}/content")
        job = video_job(job_id)
        if isinstance(job, JSONResponse):
            return job
        if job.state != SUCCEEDED:
            where = f" ({job.phase} {job.done}/{job.total})" if job.phase and job.state not in FINISHED else ""
            return _error(409, f"{job_id} is {job.state}{where}" + (f": {job.error}" if job.error else
                                                                     "; its content is there once it is completed"))
        return Response(job.result["video"], media_type="video/mp4",
                        headers={"Content-Disposition": f'inline; filename="{job_id}.mp4"'})

    @app.delete("/v1/videos/{job_id}")
    async def cancel_video(job_id: str):
        if kind != "video":
            return wrong_kind(f"DELETE /v1/videos/{job_id}")
        job = video_job(job_id)
        if isinstance(job, JSONResponse):
            return job
        board.cancel(job, "cancelled by DELETE")
        return video_body(job)

    # ---- the rest -------------------------------------------------------------------------
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

    @app.get("/info")
    async def info():
        return {"model": adapter.name, "kind": kind, "edits": bool(getattr(adapter, "can_edit", False)),
                "defaults": adapter.defaults_dict()}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return UI_PAGE.read_text()

    return AccessLog(app, log) if log is not None else app
