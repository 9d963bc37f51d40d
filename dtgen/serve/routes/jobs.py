"""`POST /v1/jobs` (202 and an id, any model), `GET /v1/jobs/{id}` (status, phase, progress,
the image when done), `DELETE /v1/jobs/{id}` (cancel: a queued job leaves the queue now)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..jobs import SUCCEEDED, Job
from .shared import Served, ServedBy, error

router = APIRouter()


async def job_body(served: Served, job: Job) -> dict:
    body = job.as_dict()
    if body["status"] == SUCCEEDED:   # the state read once: the engine may end the job meanwhile
        await served.encoded(job)
        body["result"] = ({"data": [job.result["image"]]} if job.kind == "image"
                          else {"content": f"/v1/videos/{job.id}/content"})
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
        return error(404, f"no job {job_id!r}")
    return await job_body(served, job)


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, served: ServedBy):
    job = served.board.get(job_id)
    if job is None:
        return error(404, f"no job {job_id!r}")
    served.board.cancel(job, "cancelled by DELETE")
    return await job_body(served, job)
