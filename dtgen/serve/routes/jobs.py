"""`POST /v1/jobs` (202 and an id, any model), `GET /v1/jobs/{id}` (status, phase, progress,
the image when done), `DELETE /v1/jobs/{id}` (cancel: a queued job leaves the queue now)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..jobs import SUCCEEDED, Job
from .shared import Served, ServedBy, image_answer, unknown_job

router = APIRouter()


async def job_body(served: Served, job: Job) -> dict:
    body = job.as_dict()
    if body["status"] == SUCCEEDED:   # the state read once: the engine may end the job meanwhile
        await served.encoded(job)
        # what the synchronous route answers (a video: where its MP4 is, and the same `dtgen` fields)
        body["result"] = (image_answer(job.result) if job.kind == "image" else
                          {"content": f"/v1/videos/{job.id}/content",
                           "dtgen": {k: v for k, v in job.result.items() if k != "video"}})
    return body


@router.post("/v1/jobs", status_code=202)
async def create_job(request: Request, served: ServedBy):
    job = await served.submit(request, "jobs")
    if isinstance(job, JSONResponse):
        return job
    return JSONResponse(await job_body(served, job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


@router.get("/v1/jobs/{job_id}")
async def read_job(job_id: str, served: ServedBy):
    job = served.board.get(job_id)
    if job is None:
        return unknown_job(job_id)
    return await job_body(served, job)


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, served: ServedBy):
    job = served.board.get(job_id)
    if job is None:
        return unknown_job(job_id)
    served.board.cancel(job, "cancelled by DELETE")
    return await job_body(served, job)
