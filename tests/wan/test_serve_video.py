"""The Wan server over real HTTP on 127.0.0.1 (`examples.serve --model wan`: the tiny Wan,
one process): async video jobs with progress through every phase, the MP4, cancellation,
one-line 4xx naming the field, and the UI in headless Chromium (progress, a video, a cancel)."""
from __future__ import annotations

import io
import re
import time

import pytest

pytest.importorskip("fastapi")
av = pytest.importorskip("av")

from tests.support.serve import assert_page_saw_phases_in_order, call, chromium_dom, needs_chromium, progress_log, running_server  # noqa: E402


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    log = tmp_path_factory.mktemp("wan") / "server.log"
    with running_server(log, "--model", "wan", "--steps", "2", "--ping", "0.2", module="examples.serve") as (base, _):
        yield base, log


def wait_video(base: str, job_id: str, timeout_s: float = 120) -> tuple[dict, list[str]]:
    seen, end = [], time.monotonic() + timeout_s
    while True:
        _, video, _ = call(base, "GET", f"/v1/videos/{job_id}")
        seen.append(f"{video['status']} {video['dtgen']['phase']} {video['progress']}")
        if video["status"] not in ("queued", "in_progress"):
            return video, seen
        assert time.monotonic() < end, video
        time.sleep(0.02)


def test_a_video_job_runs_through_every_phase_and_gives_an_mp4(wan):
    base, log = wan
    status, video, headers = call(base, "POST", "/v1/videos", {"prompt": "a fox runs", "seed": 1, "num_frames": 9})
    assert status == 202 and video["object"] == "video" and video["status"] == "queued", video
    assert headers["location"] == f"/v1/videos/{video['id']}" and video["size"] == "64x48"
    done, seen = wait_video(base, video["id"])
    assert done["status"] == "completed" and done["progress"] == 100, done
    progress = [int(s.split()[-1]) for s in seen]
    assert progress == sorted(progress), "progress only goes up"
    status, _, _ = call(base, "GET", f"/v1/videos/{video['id']}/content")
    assert status == 200
    import urllib.request
    raw = urllib.request.urlopen(f"{base}/v1/videos/{video['id']}/content", timeout=30).read()
    with av.open(io.BytesIO(raw)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    assert f'"GET /v1/videos/{video["id"]}/content" 200' in log.read_text()


def test_seconds_as_openai_writes_it_a_string(wan):
    """OpenAI's API, and this server's own video objects, write `seconds` as a string."""
    base, _ = wan
    for seconds in ("0.5", 0.5):
        status, video, _ = call(base, "POST", "/v1/videos", {"prompt": "a fox", "seconds": seconds,
                                                             "num_inference_steps": 1})
        assert status == 202 and video["num_frames"] == 9 and video["seconds"] == "0.5", video
        assert wait_video(base, video["id"])[0]["status"] == "completed"


def test_a_video_job_is_cancelled_and_its_content_says_so(wan):
    base, _ = wan
    status, video, _ = call(base, "POST", "/v1/videos", {"prompt": "a fox", "num_inference_steps": 400})
    end = time.monotonic() + 60
    while call(base, "GET", f"/v1/videos/{video['id']}")[1]["dtgen"]["done"] < 2:
        assert time.monotonic() < end
        time.sleep(0.05)
    status, answer, _ = call(base, "GET", f"/v1/videos/{video['id']}/content")
    assert status == 409 and "in_progress" not in answer["error"]["message"] and "running" in answer["error"]["message"]
    assert call(base, "DELETE", f"/v1/videos/{video['id']}")[0] == 200
    done, _ = wait_video(base, video["id"])
    assert done["status"] == "cancelled" and done["error"]["message"] == "cancelled by DELETE", done


def test_a_video_job_takes_its_own_step_cache(wan):
    """`step_cache` per request: the job reports the cache's decisions; the next job without
    the field runs every step in full (the server's default: none)."""
    base, _ = wan
    runs = {}
    for name, extra in (("cached", {"step_cache": "first-block:threshold=1000"}), ("plain", {})):
        _, video, _ = call(base, "POST", "/v1/videos", {"prompt": "a fox", "num_frames": 5,
                                                        "num_inference_steps": 4, **extra})
        runs[name], _ = wait_video(base, video["id"])
        assert runs[name]["status"] == "completed", runs[name]
    report = runs["cached"]["dtgen"]["step_cache"]
    assert report["method"] == "first-block" and len(report["full_steps"]) < 4, report
    assert runs["plain"]["dtgen"]["step_cache"] is None


@pytest.mark.parametrize("body, field, message", [
    ({"prompt": "x", "num_frames": 10}, "num_frames", "4k + 1); nearest valid: 9 or 13"),
    ({"prompt": "x", "size": "63x48"}, "size", "width 63 must be a multiple of 16"),
    ({"prompt": "x", "seconds": 1, "num_frames": 17}, "seconds", "not both"),
    # JSON's Infinity and NaN (Python's json reads both) and a length past num_frames' bound: 422, never a 500
    ({"prompt": "x", "seconds": float("inf")}, "seconds", "must make from 1 to 1001 frames at 16 fps"),
    ({"prompt": "x", "seconds": float("nan")}, "seconds", "must be a number"),
    ({"prompt": "x", "seconds": 1e300}, "seconds", "must make from 1 to 1001 frames at 16 fps"),
    ({"prompt": "x", "seconds": 63, "fps": 16}, "seconds", "got 63"),
    ({"prompt": "x", "seconds": -1}, "seconds", "got -1"),
    ({"prompt": "x", "seconds": 0.3}, "seconds", "0.3 s at 16 fps is 5.8 frames; it must make 4k + 1 frames"),
    ({"prompt": "x", "seconds": "four"}, "seconds", "must be a number of seconds (4 or \"4\"), got 'four'"),
    ({"prompt": "x", "seconds": "0.3"}, "seconds", "0.3 s at 16 fps is 5.8 frames; it must make 4k + 1 frames"),
    ({"prompt": "x", "guidance_scale_2": 3.0}, "guidance_scale_2", "one transformer (Wan 2.1)"),
    ({"prompt": "x", "input_reference": "a.png"}, "input_reference", "text only"),
    ({"prompt": "x", "num_inference_steps": "2"}, "num_inference_steps", "must be an integer"),
    ({"size": "64x48"}, "prompt", "is required"),
    ({"prompt": "x", "step_cache": "nocache"}, "step_cache.method", "nocache"),
    ({"prompt": "x", "step_cache": "first-block:threshold=-1"}, "step_cache.threshold", "threshold"),
    ({"prompt": ""}, "prompt", "must be a non-empty string"),   # as HunyuanImage-3 and Qwen-Image refuse it
    ({"prompt": "x", "fps": 0}, "fps", "must be >= 1 and <= 120, got 0"),
    ({"prompt": "x", "fps": -5}, "fps", "must be >= 1 and <= 120, got -5"),
    # longer than the text encoder reads: refused, never cut short silently
    ({"prompt": "fox " * 600}, "prompt", "is 601 tokens; Wan's text encoder reads at most 512"),
    ({"prompt": "x", "negative_prompt": "fox " * 600}, "negative_prompt", "is 601 tokens"),
    # a frame past the server's pixel bound (4 x its 64x48 default, or 1024x1024): one request cannot hold it
    ({"prompt": "x", "size": "2048x2048"}, "size", "2048x2048 is 4194304 pixels; this server takes at most 1048576"),
])
def test_bad_video_fields_get_422_naming_the_field(wan, body, field, message):
    base, _ = wan
    status, answer, _ = call(base, "POST", "/v1/videos", body)
    assert status == 422 and answer["error"]["field"] == field and message in answer["error"]["message"], answer


def test_an_uploaded_reference_to_a_text_to_video_checkpoint_is_refused(wan):
    """OpenAI's `input_reference` as the multipart file it is: one 422 naming it, before any job."""
    from tests.wan.test_serve_i2v import _png, multipart
    base, _ = wan
    body, kind = multipart({"prompt": "x"}, {"input_reference": ("a.png", _png(32, 32))})
    status, answer, _ = call(base, "POST", "/v1/videos", body, content_type=kind)
    assert status == 422 and answer["error"]["field"] == "input_reference", answer
    assert "text only" in answer["error"]["message"] and "WanImageToVideoPipeline" in answer["error"]["message"]


def test_an_image_request_to_a_video_model_is_refused_in_one_line(wan):
    base, _ = wan
    for path in ("/v1/images/generations", "/v1/images/edits"):
        status, answer, _ = call(base, "POST", path, {"prompt": "x"})
        message = answer["error"]["message"]
        assert status == 404 and message.startswith(f"POST {path}: this server makes videos (Wan") and message.endswith(
            "); image routes need an image model (a HunyuanImage-3 or Qwen-Image checkpoint). Here: POST /v1/videos, "
            "/v1/jobs"), answer


@needs_chromium
def test_video_ui_in_headless_chromium(wan, tmp_path):
    """The page, told by /info it serves video, follows a video job through its phases to
    100% and shows the MP4; a second one is cancelled from its button at denoise step 2."""
    base, _ = wan
    dom = chromium_dom(f"{base}/?prompt=a+fox&steps=2&frames=9&go=1", tmp_path / "a")
    assert '<progress id="bar" max="100" value="100">' in dom and '<div id="status">completed' in dom, dom[-2000:]
    assert_page_saw_phases_in_order(dom, ["encode", "denoise", "decode"])
    video = r'<video id="video" controls="" class="" src="/v1/videos/job-[0-9a-f]{32}/content">'
    assert re.search(video, dom), dom[-2000:]
    dom = chromium_dom(f"{base}/?prompt=a+fox&steps=400&frames=9&go=1&cancel_at=denoise:2", tmp_path / "b")
    log = progress_log(dom)
    # the page polls every 200 ms, so it may see step 3 first: it cancels at the first step >= 2
    reached = [int(m) for m in re.findall(r"in_progress, denoise (\d+)/400", "\n".join(log))]
    assert reached and max(reached) >= 2 and "cancel requested" in log, log
    assert '<div id="status">cancelled' in dom, log
