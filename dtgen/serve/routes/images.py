"""`POST /v1/images/generations` and `POST /v1/images/edits`: OpenAI's image routes, each
answered when its image is made; a client that disconnects cancels its job."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..jobs import CANCELLED, FAILED, SUCCEEDED, Job
from .shared import Served, ServedBy, error, image_answer

router = APIRouter()


async def finished_image(served: Served, job: Job) -> JSONResponse:
    if job.state == SUCCEEDED:
        await served.encoded(job)
        return JSONResponse(image_answer(job.result))
    return error(job.http_status if job.state in (FAILED, CANCELLED) else 500, job.error or job.state)


async def answer_when_done(served: Served, request: Request, job: Job) -> JSONResponse:
    # Woken by the engine's thread the moment the job ends (polling every 50 ms cost a
    # request 25 ms on average); the timeout only paces the client-disconnect check.
    loop, woken = asyncio.get_running_loop(), asyncio.Event()
    job.when_finished(lambda: loop.call_soon_threadsafe(woken.set))
    while not job.finished.is_set():
        if await request.is_disconnected():
            served.board.cancel(job, "the client disconnected")
        try:
            await asyncio.wait_for(woken.wait(), 0.25)
        except asyncio.TimeoutError:
            pass
    return await finished_image(served, job)


@router.post("/v1/images/generations")
async def generations(request: Request, served: ServedBy):
    if served.kind != "image":
        return served.wrong_kind("POST /v1/images/generations")
    job = await served.submit(request, "generations")
    return job if isinstance(job, JSONResponse) else await answer_when_done(served, request, job)


@router.post("/v1/images/edits")
async def edits(request: Request, served: ServedBy):
    if served.kind != "image":
        return served.wrong_kind("POST /v1/images/edits")
    if not served.can_edit:
        return served.refuse(404, "POST /v1/images/edits: this server was started without image editing ("
                                  f"{served.adapter.edit_problem})", outcome="wrong_route")
    job = await served.submit(request, "edits")
    return job if isinstance(job, JSONResponse) else await answer_when_done(served, request, job)
