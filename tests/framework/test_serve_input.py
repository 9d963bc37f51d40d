"""The server's input checks and job ids over real HTTP in this process (a model-free adapter
behind the real engine, job board and routes): ids that no restart repeats, a 404 that says
jobs do not survive one, bounded JSON nesting, JSON only under a JSON content type, and a
job's result with the fields of the synchronous answer."""
from __future__ import annotations

import re

import pytest

from dtgen.requests import RequestError
from dtgen.serve.forms import MAX_JSON_DEPTH, WrongContentType, json_depth, parse_body, parse_json
from dtgen.serve.jobs import JobBoard
from tests.support.engine import serving
from tests.support.serve import call, wait_done

JOB_ID = re.compile(r"job-[0-9a-f]{32}")
DEEP = b"[" * 100000 + b"]" * 100000


class EchoAdapter:
    """Makes nothing: a request is its fields (`prompt`, `seed`); the answer reports the seed
    and a timing as a model's does, and an image already encoded."""

    name = "echo"

    def __init__(self, kind: str = "image"):
        self.kind = kind

    def parse(self, fields: dict, form: bool = False) -> dict:
        unknown = sorted(set(fields) - {"prompt", "seed"})
        if unknown:
            raise RequestError(unknown[0], "unknown field")
        return dict(fields)

    def phases(self, request) -> tuple[str, ...]:
        return ("denoise",)

    def describe(self, request) -> dict:
        return {}

    def defaults_dict(self) -> dict:
        return {}

    def generate(self, request, progress) -> dict:
        progress("denoise", 1, 1)
        answer = {"seed": request.get("seed", 0), "timings_ms": {"denoise": 1.0, "total": 2.0}}
        return {**answer, "image": {"b64_json": "AA=="}} if self.kind == "image" else {**answer, "video": b"mp4"}

    def warm_up(self, progress) -> None:
        pass

    def free_caches(self) -> None:
        pass

    def on_step(self, phase: str, done: int, total: int) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    with serving(EchoAdapter("image"), max_batch=1) as (base, board):
        board.release()
        yield base


@pytest.fixture(scope="module")
def video_server():
    with serving(EchoAdapter("video"), max_batch=1) as (base, board):
        board.release()
        yield base


def refused_invalid(base: str) -> float:
    _, text, _ = call(base, "GET", "/metrics")
    found = re.search(r'^dtgen_requests_total\{outcome="invalid"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_job_ids_never_repeat_across_boards():
    """A restarted server is a new board: its first ids are not the old one's."""
    first, second = JobBoard(4), JobBoard(4)
    ids = [first.submit("a").id, first.submit("b").id, second.submit("a").id]
    assert all(JOB_ID.fullmatch(i) for i in ids) and len(set(ids)) == 3, ids
    assert [j.id for j in first.queued()] == ids[:2]


def test_an_unknown_job_is_a_404_saying_jobs_do_not_survive_a_restart(image_server, video_server):
    for base, method, path in ((image_server, "GET", "/v1/jobs/job-1"), (image_server, "DELETE", "/v1/jobs/job-1"),
                               (video_server, "GET", "/v1/videos/job-1"), (video_server, "DELETE", "/v1/videos/job-1")):
        status, answer, _ = call(base, method, path)
        message = answer["error"]["message"]
        assert status == 404 and "'job-1'" in message and "do not survive a restart" in message, (path, answer)
    status, job, _ = call(image_server, "POST", "/v1/jobs", {"prompt": "x"})
    assert status == 202 and JOB_ID.fullmatch(job["id"]), job


def test_deeply_nested_json_is_refused_naming_the_limit_and_counted(image_server, video_server):
    assert json_depth({"a": [[1], {"b": []}]}) == 4 and json_depth(5) == 0
    with pytest.raises(RequestError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        parse_json(b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}")
    assert parse_json(b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}")
    for base, path in ((image_server, "/v1/images/generations"), (image_server, "/v1/jobs"),
                       (video_server, "/v1/videos"), (video_server, "/v1/jobs")):
        before = refused_invalid(base)
        for body in (DEEP, b'{"prompt": ' + DEEP + b"}"):
            status, answer, _ = call(base, "POST", path, body)
            assert status == 422 and answer["error"] == {
                "message": f"body: JSON nests deeper than {MAX_JSON_DEPTH} levels (the limit)", "field": "body"}, \
                (path, status, answer)
        assert refused_invalid(base) == before + 2, path


def test_a_json_body_needs_a_json_content_type(image_server, video_server):
    with pytest.raises(WrongContentType, match="Content-Type: text/plain: the body must be application/json"):
        parse_body("text/plain", b"{}")
    assert parse_body("application/json; charset=utf-8", b'{"prompt": "x"}') == ({"prompt": "x"}, {}, False)
    for base, path in ((image_server, "/v1/images/generations"), (image_server, "/v1/jobs"),
                       (video_server, "/v1/videos"), (video_server, "/v1/jobs")):
        for kind, named in (("text/plain", "text/plain"), ("", "none given")):
            status, answer, _ = call(base, "POST", path, {"prompt": "x"}, content_type=kind)
            assert status == 415 and answer["error"]["field"] == "Content-Type", (path, kind, answer)
            assert answer["error"]["message"].startswith(f"Content-Type: {named}: the body must be"), answer


def test_a_jobs_result_has_the_fields_of_the_synchronous_answer(image_server, video_server):
    status, now, _ = call(image_server, "POST", "/v1/images/generations", {"prompt": "x", "seed": 5})
    assert status == 200 and now["dtgen"]["seed"] == 5, now
    _, job, _ = call(image_server, "POST", "/v1/jobs", {"prompt": "x", "seed": 5})
    result = wait_done(image_server, job["id"])["result"]
    assert set(result) == set(now) and result["data"] == now["data"] and result["dtgen"] == now["dtgen"], result
    _, video, _ = call(video_server, "POST", "/v1/jobs", {"prompt": "x", "seed": 6})
    result = wait_done(video_server, video["id"])["result"]
    assert result == {"content": f"/v1/videos/{video['id']}/content",
                      "dtgen": {"seed": 6, "timings_ms": {"denoise": 1.0, "total": 2.0}}}, result
