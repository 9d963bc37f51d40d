"""OpenAI's video routes: `POST /v1/videos` (JSON or a multipart form; 202 and a video
object), `GET /v1/videos/{id}` (status, progress 0-100), `GET /v1/videos/{id}/content` (the
MP4; 409 before it is made), `DELETE /v1/videos/{id}`. An image model's server answers them
404, naming the routes it has."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..jobs import FINISHED, SUCCEEDED, Job
from .shared import Served, ServedBy, error, unknown_job

router = APIRouter()

# OpenAI's video statuses for dtgen's job states
_VIDEO_STATUS = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
                 "cancelled": "cancelled"}


def video_body(served: Served, job: Job) -> dict:
    adapter = served.adapter
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


def video_job(served: Served, job_id: str) -> Job | JSONResponse:
    job = served.board.get(job_id)
    if job is None:
        return unknown_job(job_id, "video")
    if job.kind != "video":
        return error(404, f"{job_id} is an image job: GET /v1/jobs/{job_id}")
    return job


@router.post("/v1/videos")
async def create_video(request: Request, served: ServedBy):
    if served.kind != "video":
        return served.wrong_kind("POST /v1/videos")
    job = await served.submit(request, "videos")
    if isinstance(job, JSONResponse):
        return job
    return JSONResponse(video_body(served, job), status_code=202, headers={"Location": f"/v1/videos/{job.id}"})


@router.get("/v1/videos/{job_id}")
async def read_video(job_id: str, served: ServedBy):
    if served.kind != "video":
        return served.wrong_kind(f"GET /v1/videos/{job_id}")
    job = video_job(served, job_id)
    return job if isinstance(job, JSONResponse) else video_body(served, job)


@router.get("/v1/videos/{job_id}/content")
async def video_content(job_id: str, served: ServedBy):
    if served.kind != "video":
        return served.wrong_kind(f"GET /v1/videos/{job_id}/content")
    job = video_job(served, job_id)
    if isinstance(job, JSONResponse):
        return job
    if job.state != SUCCEEDED:
        where = f" ({job.phase} {job.done}/{job.total})" if job.phase and job.state not in FINISHED else ""
        return error(409, f"{job_id} is {job.state}{where}" + (f": {job.error}" if job.error else
                                                                "; its content is there once it is completed"))
    return Response(job.result["video"], media_type="video/mp4",
                    headers={"Content-Disposition": f'inline; filename="{job_id}.mp4"'})


@router.delete("/v1/videos/{job_id}")
async def cancel_video(job_id: str, served: ServedBy):
    if served.kind != "video":
        return served.wrong_kind(f"DELETE /v1/videos/{job_id}")
    job = video_job(served, job_id)
    if isinstance(job, JSONResponse):
        return job
    served.board.cancel(job, "cancelled by DELETE")
    return video_body(served, job)
