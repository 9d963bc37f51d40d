"""What every route family shares: the app's one `Served` object (the engine, the job board,
the metrics, the limits), handed to a route as a dependency, and the error body."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from dtgen.requests import RequestError

from ..adapters import ImageOutput, encode_answer, take_image_output
from ..engine import Engine, can_batch
from ..forms import TooLarge, WrongContentType, parse_body, read_body
from ..jobs import SUCCEEDED, Job, JobBoard, QueueFull
from ..loras import ServedLoras
from ..metrics import Metrics


def error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message}}
    if field is not None:
        body["error"]["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def image_answer(result: dict) -> dict:
    """A finished image job's answer (its image encoded): OpenAI's `created` and `data`, and
    under `dtgen` what else the job reports (seed, size, timings, the step cache's decisions).
    The synchronous routes and a job's result both answer this."""
    return {"created": int(time.time()), "data": [result["image"]],
            "dtgen": {k: v for k, v in result.items() if k != "image"}}


def unknown_job(job_id: str, what: str = "job") -> JSONResponse:
    """404 for an id this server does not hold: ids are never reused, so the job is gone, not someone else's."""
    return error(404, f"no {what} {job_id!r} on this server: jobs live in the server's memory (the last finished "
                      "ones are kept) and do not survive a restart")


@dataclass(eq=False)
class Served:
    """One per app (`app.state.served`): what the routes read and the request steps they share.
    `models`: (what it makes, its title) of every model the launcher knows (dtgen knows none):
    a route of the other kind is refused naming the models that serve it."""

    engine: Engine
    board: JobBoard
    metrics: Metrics
    deadline_s: float | None = None
    retry_after_s: int = 5
    max_upload_bytes: int = 32 << 20
    models: tuple[tuple[str, str], ...] = ()
    loras: ServedLoras | None = None   # the resident LoRA adapters (None: the model takes none)
    # a job's answer being encoded, by job id: concurrent readers wait for the one encoding
    encoding: dict[str, asyncio.Task] = field(default_factory=dict)

    @property
    def adapter(self):
        return self.engine.adapter

    @property
    def kind(self) -> str:
        return self.engine.adapter.kind

    @property
    def can_edit(self) -> bool:
        return bool(getattr(self.engine.adapter, "can_edit", False))

    def refuse(self, status: int, message: str, field: str | None = None, outcome: str = "invalid") -> JSONResponse:
        self.metrics.requests.labels(outcome).inc()
        return error(status, message, field)

    def wrong_kind(self, path: str) -> JSONResponse:
        """A route of the kind of model this server does not run (404, naming what it runs)."""
        kind, adapter = self.kind, self.adapter
        if kind == "image":
            need = "video routes need a video model"
            here = "/v1/images/generations" + (", /v1/images/edits" if self.can_edit else "")
        else:
            need, here = "image routes need an image model", "/v1/videos"
        makers = " or ".join(title for makes, title in self.models if makes != kind)
        if makers:
            need += f" (a {makers} checkpoint)"
        return self.refuse(404, f"{path}: this server makes {kind}s ({adapter.name}); {need}. "
                                f"Here: POST {here}, /v1/jobs", outcome="wrong_route")

    async def submit(self, request: Request, route: str) -> Job | JSONResponse:
        """Read, parse and queue a request for `route` ("generations", "edits", "videos", "jobs")."""
        try:
            body = await read_body(request, self.max_upload_bytes)
        except TooLarge as e:
            what = "image" if route == "edits" else "body"
            return self.refuse(413, f"{what}: {e}", what)
        try:
            parsed, output = await self._parse(request, body, route)
        except WrongContentType as e:
            return self.refuse(415, str(e), e.field)
        except RequestError as e:
            return self.refuse(422, str(e), e.field)
        return await self._queue(parsed, output)

    async def _parse(self, request: Request, body: bytes, route: str) -> tuple[Any, ImageOutput | None]:
        """The adapter's request from the body, and how its answer's image is encoded."""
        adapter = self.adapter
        fields, files, form = parse_body(request.headers.get("content-type", ""), body)
        output = None
        if self.kind == "image":   # how the answer's image is encoded: this side's, not the model's
            output, fields = take_image_output(fields, form)
        if route == "jobs":  # an image model's job with an image file is an edit
            route = "videos" if self.kind == "video" else "edits" if files and self.can_edit else "generations"
        if route == "edits":
            if not form:
                raise RequestError("body", "an edit is a multipart/form-data upload (an image file and the fields)")
            # decoding the image and sizing its condition is CPU work: off the event loop
            return await asyncio.to_thread(adapter.parse_edit, fields, files, form), output
        if files and self.kind == "video":   # a video's reference image: the adapter takes or refuses it
            return await asyncio.to_thread(adapter.parse, fields, form, files), output
        if files:
            name = sorted(files)[0]
            raise RequestError(name, "a file is not taken here (image edits: POST /v1/images/edits)")
        return await asyncio.to_thread(adapter.parse, fields, form), output

    async def _queue(self, parsed: Any, output: ImageOutput | None) -> Job | JSONResponse:
        """A parsed request on the board, or why not (503 not ready, 429 the queue is full)."""
        engine, adapter = self.engine, self.adapter
        key = await asyncio.to_thread(adapter.batch_key, parsed) if engine.max_batch > 1 and can_batch(adapter) \
            else None
        if not engine.ready.is_set():
            self.metrics.requests.labels("not_ready").inc()
            return error(503, engine.broken or "warming up: see /ready",
                         headers={"Retry-After": str(self.retry_after_s)})
        held = ()
        if self.loras is not None:   # the adapters it names stay resident until its job ends
            try:
                held = self.loras.hold(getattr(getattr(adapter, "request_of", lambda r: r)(parsed), "loras", ()))
            except RequestError as e:
                return self.refuse(422, str(e), e.field)
        try:
            job = self.board.submit(parsed, self.deadline_s, kind=self.kind, phases=adapter.phases(parsed),
                                    batch_key=key, output=output)
        except QueueFull as e:
            if held:
                self.loras.release(held)
            self.metrics.requests.labels("queue_full").inc()
            return error(429, f"queue full: {e}", headers={"Retry-After": str(self.retry_after_s)})
        if held:
            job.when_finished(lambda: self.loras.release(held))
        self.metrics.requests.labels("accepted").inc()
        return job

    async def encoded(self, job: Job) -> None:
        """A succeeded image job's pixels encoded into its answer, once (on a worker thread:
        neither the engine nor the event loop waits for the PNG); concurrent readers share it."""
        if job.kind != "image" or job.state != SUCCEEDED or "pixels" not in (job.result or {}):
            return
        task = self.encoding.get(job.id)
        if task is None:
            task = self.encoding[job.id] = asyncio.ensure_future(
                asyncio.to_thread(encode_answer, job.result, job.output))

            def store(t: asyncio.Task) -> None:   # even when every reader has left meanwhile
                self.encoding.pop(job.id, None)
                if not t.cancelled() and t.exception() is None:
                    job.result = t.result()
            task.add_done_callback(store)
        await asyncio.shield(task)   # a reader that leaves does not cancel the others' encoding


async def _served(request: Request) -> Served:
    # async: a plain function dependency would run on the thread pool, a hop per request
    return request.app.state.served


# A route's parameter of this type is the app's `Served`.
ServedBy = Annotated[Served, Depends(_served)]
