"""The HunyuanImage-3 server over real HTTP on 127.0.0.1: 2 gloo ranks, the tiny model.

One server for the module (start-up and warm-up take ~20 s on 2 CPU cores), its tests in
file order: a request failing on rank 1 at a step boundary (injected) fails alone, with
rank 1's message; an out-of-memory error inside a step on both ranks answers 503 and the
server goes on; generation; a non-square size (WIDTHxHEIGHT); an edit; one-line 4xx naming
the field (an edit's image past its pixel limits too); a job's progress and
cancellation (DELETE); the same request after the cancel giving the same image; a burst
of jobs against the queue limit (429s, queued jobs cancelled free their slots at once,
nothing lost, the metrics agree); the UI in headless Chromium (progress, an image, a
cancel); last, rank 1 raising INSIDE a step, while rank 0 waits for it in a collective:
the job answers with rank 1's message and the server exits 1 with it, within 30 s.
"""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import re
import socket
import time

import pytest

from tests.support.serve import assert_page_saw_phases_in_order, call, chromium_dom, needs_chromium, progress_log, running_server, wait_done

FOX = {"prompt": "a red fox in fresh snow", "size": "256x256", "num_inference_steps": 2, "seed": 7}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # Injected, each once: rank 1 raises after AR token 2 (a step boundary); both ranks run out
    # of memory inside denoise step 2; rank 1 raises inside the step after AR token 10, which
    # only the last test's request (12 new tokens) reaches.
    with running_server(log, "--world-size", "2", "--plan", "tp2", "--steps", "2", "--max-new-tokens", "4",
                        "--ignore-eos", "--ping", "0.2", "--max-queued", "4", "--max-upload-mb", "1",
                        faults="1:ar:2,*:denoise:1:oom,1:ar:10:inside") as (base, proc):
        yield base, proc, log


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _png_size(b64: str) -> tuple[int, int]:
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


def test_generation_failure_jobs_cancel_and_metrics(server):
    server, _, _ = server
    before = call(server, "GET", "/metrics")[1]
    assert call(server, "GET", "/health")[0] == 200
    # The server runs with the fault 1:ar:2: rank 1 raises once, after AR token 2. The
    # job fails on both ranks at that step; the server goes on.
    status, body, _ = call(server, "POST", "/v1/images/generations", FOX)
    assert status == 500 and body["error"]["message"].startswith(
        "rank 1: RuntimeError: injected failure: rank 1 fails after ar step 2"), body
    # Out of memory inside a step, on both ranks at the same point: 503, the caches freed, and
    # the ranks in step, so the server goes on.
    status, body, _ = call(server, "POST", "/v1/images/generations", FOX)
    assert status == 503 and "out of memory" in body["error"]["message"], body
    status, body, _ = call(server, "POST", "/v1/images/generations", FOX)
    assert status == 200, body
    first = body["data"][0]["b64_json"]
    assert _png_size(first) == (256, 256) and body["dtgen"]["size"] == "256x256"
    assert body["dtgen"]["image_encode_ms"] > 0   # the PNG's time, outside the pipeline's total

    # A long job: progress shows, DELETE stops it on both ranks.
    status, job, headers = call(server, "POST", "/v1/jobs", dict(FOX, num_inference_steps=400))
    assert status == 202 and headers["location"] == f"/v1/jobs/{job['id']}", job
    deadline = time.monotonic() + 60
    while True:
        _, seen, _ = call(server, "GET", f"/v1/jobs/{job['id']}")
        if seen["phase"] == "denoise" and seen["progress"]["done"] >= 2:
            break
        assert time.monotonic() < deadline and seen["status"] in ("queued", "running"), seen
        time.sleep(0.1)
    assert seen["progress"]["total"] == 400
    assert call(server, "DELETE", f"/v1/jobs/{job['id']}")[0] == 200
    while seen["status"] == "running":
        time.sleep(0.1)
        _, seen, _ = call(server, "GET", f"/v1/jobs/{job['id']}")
    assert seen["status"] == "cancelled" and seen["error"] == "cancelled by DELETE"
    assert seen["progress"]["done"] < 400

    # After the cancel the ranks are in step: the same request, as a job, gives the same image.
    status, job, _ = call(server, "POST", "/v1/jobs", FOX)
    job = wait_done(server, job["id"])
    assert job["status"] == "succeeded" and job["result"]["data"][0]["b64_json"] == first

    _, metrics, _ = call(server, "GET", "/metrics")
    for name, more in (('dtgen_jobs_total{state="succeeded"}', 2), ('dtgen_jobs_total{state="cancelled"}', 1),
                       ('dtgen_jobs_total{state="failed"}', 2), ('dtgen_requests_total{outcome="accepted"}', 5)):
        assert metric(metrics, name) - metric(before, name) == more, name
    assert metric(metrics, "dtgen_queue_depth") == 0


def test_a_client_that_disconnects_cancels_its_job(server):
    """The synchronous route: the client goes away mid-job; the job stops (cancelled) and
    the server goes on."""
    base, _, _ = server
    before = call(base, "GET", "/metrics")[1]
    body = json.dumps(dict(FOX, num_inference_steps=400)).encode()
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        end = time.monotonic() + 60
        while metric(call(base, "GET", "/metrics")[1], "dtgen_queue_seconds_count") == metric(
                before, "dtgen_queue_seconds_count"):  # not started yet
            assert time.monotonic() < end
            time.sleep(0.1)
    end = time.monotonic() + 30
    name = 'dtgen_jobs_total{state="cancelled"}'
    while metric(call(base, "GET", "/metrics")[1], name) == metric(before, name):
        assert time.monotonic() < end, "the job went on after its client left"
        time.sleep(0.1)


@pytest.mark.parametrize("body, field, message", [
    ({"prompt": "x", "sizes": "256x256"}, "sizes", "unknown field"),
    ({"size": "256x256"}, "prompt", "is required"),
    ({"prompt": ""}, "prompt", "must be a non-empty string"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "must be >= 1 and <= 1000, got 0"),
    ({"prompt": "x", "num_inference_steps": 2.5}, "num_inference_steps", "must be an integer"),
    ({"prompt": "x", "size": "123x45"}, "size", "123x45 is not one of the model's sizes"),
    ({"prompt": "x", "n": 2}, "n", "must be 1"),
    ({"prompt": "x", "response_format": "url"}, "response_format", "must be 'b64_json'"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", "must be >= 0"),
    ({"prompt": "x " * 5000}, "prompt", "positions; the model has"),
    # the new tokens, not the prompt, are what does not fit: named as such
    ({"prompt": "x", "max_new_tokens": 100000}, "max_new_tokens", "positions; the model has 2048 (at most"),
    (["x"], "body", "must be a JSON object"),
    ({"prompt": "x", "step_cache": "taylor:interval=0"}, "step_cache.interval", "must be >= 1, got 0"),
    ({"prompt": "x", "step_cache": {"method": "taylor", "intervall": 5}}, "step_cache.intervall", "is not a knob"),
    ({"prompt": "x", "step_cache": "first-block"}, "step_cache", "runs the step caches taylor, taylorseer"),
    # in the model's table, but over the tiny model's 2048 positions: refused before it is queued
    ({"prompt": "x", "size": "1024x768"}, "size", "a 1024x768 image with this prompt and 4 new tokens needs"),
    ({"prompt": "x", "size": "256"}, "size", "is not 'auto' or 'WIDTHxHEIGHT'"),
])
def test_bad_fields_get_422_naming_the_field(server, body, field, message):
    server, _, _ = server
    for route in ("/v1/images/generations", "/v1/jobs"):
        status, answer, _ = call(server, "POST", route, body)
        assert status == 422, answer
        error = answer["error"]
        assert error["field"] == field and message in error["message"] and "\n" not in error["message"], error
    assert "object at 0x" not in error["message"], "the message names the upload, not a Python object"


def test_a_step_cache_request_reports_its_steps(server):
    """`step_cache` reaches the pipeline: a 2-step request with the official Taylor cache runs
    step 0 in full and reuses it at step 1 (the warm-up compiled the cached step's graph)."""
    server, _, _ = server
    status, body, _ = call(server, "POST", "/v1/images/generations", dict(FOX, step_cache="taylor"))
    assert status == 200, body
    report = body["dtgen"]["step_cache"]
    assert report["method"] == "taylor" and report["full_steps"] == [0] and report["cached_steps"] == [1]
    status, plain, _ = call(server, "POST", "/v1/images/generations", FOX)
    assert plain["dtgen"]["step_cache"] is None
    assert plain["data"][0]["b64_json"] != body["data"][0]["b64_json"]   # the cache changed the image


def test_a_non_square_size_is_width_by_height(server):
    """`size` is WIDTHxHEIGHT (OpenAI's order): 384x128, from the tiny model's table, answers
    an image 384 wide and 128 high (a transposed path would give 128x384)."""
    base, _, _ = server
    status, body, _ = call(base, "POST", "/v1/images/generations", dict(FOX, size="384x128"))
    assert status == 200, body
    assert _png_size(body["data"][0]["b64_json"]) == (384, 128) and body["dtgen"]["size"] == "384x128", body["dtgen"]


def multipart(fields: dict, files: dict) -> tuple[bytes, str]:
    """A multipart/form-data body (what `curl -F` sends): text fields and (filename, bytes) files."""
    boundary = "dtgen-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{name}"\r\n'
              f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
              for k, (name, data) in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.new(mode, (width, height), (200, 40, 30) if mode == "RGB" else 0).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_edit_through_the_openai_multipart_route(server):
    base, _, _ = server
    body, kind = multipart({"prompt": "make it blue", "num_inference_steps": "1", "max_new_tokens": "0", "seed": "3",
                            "output_format": "webp", "output_compression": "80"},   # form text, as curl -F sends
                           {"image": ("fox.png", _png(64, 64))})
    status, answer, _ = call(base, "POST", "/v1/images/edits", body, content_type=kind)
    assert status == 200, answer
    assert _png_size(answer["data"][0]["b64_json"]) == (256, 256)   # the reference's bucket
    from PIL import Image
    assert Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))).format == "WEBP"


@pytest.mark.parametrize("fields, files, status, field, message", [
    ({"prompt": "x"}, {}, 422, "image", "is required"),
    ({"prompt": "x"}, {"image": ("a.png", b"not an image")}, 422, "image", "not a readable image file"),
    ({"prompt": "x"}, {"image": ("a.png", b"\0" * (1 << 20) + b"more")}, 413, "image", "the limit is"),
    # the pixel limits (16-8192 px a side, 8-bit), read from the header before any pixel is decoded
    ({"prompt": "x"}, {"image": ("a.png", "8x40")}, 422, "image", "a.png: 8x40 (WxH) is too small, each side must be"),
    ({"prompt": "x"}, {"image": ("a.png", "8193x16")}, 422, "image", "8193x16 (WxH) is too large, each side must be"),
    ({"prompt": "x"}, {"image": ("a.png", "64x64:I;16")}, 422, "image", "mode 'I;16' is not supported"),
    ({"prompt": "x"}, {"image": ("a.png", b"png"), "mask": ("m.png", b"png")}, 422, "mask", "not supported"),
    ({"prompt": "x", "num_inference_steps": "two"}, {"image": ("a.png", b"png")}, 422, "num_inference_steps",
     "must be an integer, got 'two'"),
    ({"prompt": "x", "num_frames": "9"}, {"image": ("a.png", b"png")}, 422, "num_frames", "unknown field"),
    ({"prompt": "x", "output_format": "jpeg", "output_compression": "high"}, {"image": ("a.png", b"png")}, 422,
     "output_compression", "must be an integer, got 'high'"),
])
def test_bad_edits_get_4xx_naming_the_field(server, fields, files, status, field, message):
    base, _, _ = server
    if files.get("image", (0, b""))[1] == b"png":
        files = dict(files, image=("a.png", _png(64, 64)))
    elif isinstance(files.get("image", (0, b""))[1], str):   # "WxH[:mode]": a PNG made here
        size, _, mode = files["image"][1].partition(":")
        files = dict(files, image=("a.png", _png(*map(int, size.split("x")), mode=mode or "RGB")))
    body, kind = multipart(fields, files)
    got, answer, _ = call(base, "POST", "/v1/images/edits", body, content_type=kind)
    assert got == status, answer
    error = answer["error"]
    assert error["field"] == field and message in error["message"] and "\n" not in error["message"], error
    assert "object at 0x" not in error["message"], "the message names the upload, not a Python object"


def test_a_video_request_to_an_image_model_is_refused_in_one_line(server):
    base, _, _ = server
    for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos/job-1"), ("GET", "/v1/videos/job-1/content")):
        status, answer, _ = call(base, method, path, {"prompt": "x"} if method == "POST" else None)
        assert status == 404 and answer["error"]["message"] == (
            f"{method} {path}: this server makes images (HunyuanImage-3); video routes need a video model (a Wan "
            "checkpoint). Here: POST /v1/images/generations, /v1/images/edits, /v1/jobs"), answer


def test_not_json_and_unknown_job(server):
    server, _, _ = server
    status, answer, _ = call(server, "POST", "/v1/images/generations", b"{not json")
    assert status == 422 and answer["error"] == {"message": "body: is not JSON", "field": "body"}, answer
    for method in ("GET", "DELETE"):
        status, answer, _ = call(server, method, "/v1/jobs/job-999")
        assert status == 404 and "do not survive a restart" in answer["error"]["message"], answer


def test_a_burst_of_jobs_meets_the_queue_limit(server):
    """20 job submissions at concurrency 4, queue limit 4: the ones past the limit get 429
    (with Retry-After); every accepted job ends succeeded or cancelled (all but the first
    are cancelled while they wait, to keep this short); the metrics count the same."""
    base, _, _ = server
    before = call(base, "GET", "/metrics")[1]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: call(base, "POST", "/v1/jobs", dict(FOX, seed=i)), range(20)))
    accepted = [a[1]["id"] for a in answers if a[0] == 202]
    refused = [a for a in answers if a[0] == 429]
    assert len(accepted) + len(refused) == 20 and 1 <= len(accepted) <= 5 and refused
    assert all(a[2]["retry-after"] and "queue full" in a[1]["error"]["message"] for a in refused)
    assert len(set(accepted)) == len(accepted), "no job twice"
    for job_id in accepted[1:]:
        status, answer, _ = call(base, "DELETE", f"/v1/jobs/{job_id}")
        # a queued job leaves the queue at once: the DELETE and a GET say so
        assert answer["status"] in ("cancelled", "running"), answer
        if answer["status"] == "cancelled":
            assert call(base, "GET", f"/v1/jobs/{job_id}")[1]["status"] == "cancelled"
    # The first job may still wait for the engine (a loaded machine finishes the previous
    # test's job late): once it runs, nothing is queued: every cancelled job freed its slot.
    end = time.monotonic() + 60
    while call(base, "GET", f"/v1/jobs/{accepted[0]}")[1]["status"] == "queued":
        assert time.monotonic() < end, "the first job never started"
        time.sleep(0.05)
    assert metric(call(base, "GET", "/metrics")[1], "dtgen_queue_depth") == 0, "the slots are free"
    status, extra, _ = call(base, "POST", "/v1/jobs", dict(FOX, seed=99))
    assert status == 202, extra
    accepted.append(extra["id"])
    states = [wait_done(base, job_id)["status"] for job_id in accepted]
    assert all(s in ("succeeded", "cancelled") for s in states) and "succeeded" in states, states
    _, metrics, _ = call(base, "GET", "/metrics")
    delta = lambda name: metric(metrics, name) - metric(before, name)  # noqa: E731
    assert delta('dtgen_requests_total{outcome="accepted"}') == len(accepted)
    assert delta('dtgen_requests_total{outcome="queue_full"}') == len(refused)
    assert (delta('dtgen_jobs_total{state="succeeded"}') + delta('dtgen_jobs_total{state="cancelled"}')
            == len(accepted))
    assert metric(metrics, "dtgen_queue_depth") == 0


@needs_chromium
def test_ui_in_headless_chromium(server, tmp_path):
    """The page submits a prompt (a link fills the form and starts it), follows the job's
    phases in order to 100% and shows the image; a second job is cancelled from its
    Cancel button once it reaches denoise step 2."""
    base, _, _ = server
    # a non-square size, as the page's field says (WIDTHxHEIGHT): the image is 384 wide, 128 high
    dom = chromium_dom(f"{base}/?prompt=a+fox+in+the+snow&size=384x128&steps=2&seed=3&go=1", tmp_path / "a")
    assert '<label for="size">Size (auto or WIDTHxHEIGHT)</label>' in dom
    body = dom[dom.find("<progress"):][:3000]
    assert '<progress id="bar" max="100" value="100">' in body, body
    assert '<div id="status">succeeded' in body and '<div id="error"></div>' in body, body
    assert_page_saw_phases_in_order(dom, ["ar", "denoise", "vae"])
    image = re.search(r'<img id="image" alt="" class="" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert image, body
    assert _png_size(image.group(1)) == (384, 128)

    dom = chromium_dom(f"{base}/?prompt=a+fox&size=256x256&steps=400&go=1&cancel_at=denoise:2", tmp_path / "b")
    log = progress_log(dom)
    # the page polls every 200 ms, so it may see step 3 first: it cancels at the first step >= 2
    reached = [int(m) for m in re.findall(r"running, denoise (\d+)/400", "\n".join(log))]
    assert reached and max(reached) >= 2 and "cancel requested" in log, log
    assert re.search(r'<div id="status">cancelled', dom) and "cancelled: cancelled by DELETE" in dom, log


def test_a_rank_raising_inside_a_step_ends_the_server_with_its_message(server):
    """Last: rank 1 raises inside the step after AR token 10 (injected into its last decoder
    layer), after the earlier layers' collectives; rank 0 waits for it in the next one. The
    job answers at once with rank 1's message, /ready goes 503 and the server exits 1 with
    the message, well within 30 s (it used to stay "running" until the stall watch)."""
    base, proc, log = server
    t0 = time.monotonic()
    status, body, _ = call(base, "POST", "/v1/images/generations", dict(FOX, max_new_tokens=12), timeout=60)
    assert status == 500 and body["error"]["message"].startswith(
        "rank 1: RuntimeError: injected failure: rank 1 fails inside the step after ar step 10"), body
    assert proc.wait(30) == 1
    assert time.monotonic() - t0 < 30
    text = log.read_text()
    assert "error: the server stops: rank 1: RuntimeError: injected failure" in text, text[-3000:]
    assert '"POST /v1/images/generations" 500' in text, "the failed request has its log line"


def test_a_compiled_server_compiles_nothing_after_ready(tmp_path):
    """One process, compiled (dynamo's eager backend: tracing without code generation), with a
    warm-up bucket: /ready waits for the bucket's graphs, and requests with prompts of other
    lengths in that bucket compile no graph (the response's `new_graphs`)."""
    with running_server(tmp_path / "server.log", "--steps", "2", "--max-new-tokens", "3", "--compile",
                        "--compile-backend", "eager", "--warmup-shapes", "8:256x256") as (base, _):
        for prompt in ("a fox", "a red fox asleep in fresh snow under a pine tree"):
            status, answer, _ = call(base, "POST", "/v1/images/generations", dict(FOX, prompt=prompt))
            assert status == 200, answer
            assert answer["dtgen"]["new_graphs"] == 0, answer["dtgen"]
