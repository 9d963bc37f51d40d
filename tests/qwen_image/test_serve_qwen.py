"""The Qwen-Image server over real HTTP on 127.0.0.1 (`dtgen serve --model qwen-image`: the
tiny default, one process, 2 steps): an image through /v1/images/generations and /v1/jobs,
the same image as the pipeline run directly, one-line 422s naming the field, and the routes
it does not serve."""
from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("fastapi")

from tests.support.serve import call, running_server, wait_done  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen") / "server.log"
    with running_server(log, "--model", "qwen-image", "--steps", "2", "--ping", "0.2",
                        module="dtgen serve") as (base, _):
        yield base


def _png(b64: str):
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_an_image_through_generations_and_a_job(qwen):
    status, info, _ = call(qwen, "GET", "/info")
    assert status == 200 and info["model"] == "Qwen-Image" and info["kind"] == "image" and not info["edits"], info
    assert info["defaults"]["size"] == "64x48"
    status, answer, _ = call(qwen, "POST", "/v1/images/generations", {"prompt": "a red fox", "seed": 1})
    assert status == 200, answer
    assert _png(answer["data"][0]["b64_json"]).size == (64, 48) and answer["dtgen"]["size"] == "64x48"
    assert set(answer["dtgen"]["timings_ms"]) >= {"encode", "denoise", "decode", "total"}
    assert answer["dtgen"]["image_encode_ms"] > 0
    # the pipeline's own image for the same request (the server's defaults: the CLI's flags)
    import numpy as np
    from models.qwen_image.model import load
    from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest
    from models.qwen_image.tiny import ensure_tiny_checkpoint
    from placements.qwen_image import get_plan
    loaded = load(ensure_tiny_checkpoint(), get_plan("single"))
    want = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu").generate(
        T2IRequest("a red fox", width=64, height=48, steps=2, seed=1)).image.numpy()
    assert (np.asarray(_png(answer["data"][0]["b64_json"])) == want).all()
    # a job with its own size and no CFG (true_cfg_scale <= 1: the conditional branch alone)
    status, job, _ = call(qwen, "POST", "/v1/jobs", {"prompt": "a red fox", "size": "32x48", "true_cfg_scale": 1.0})
    assert status == 202, job
    done = wait_done(qwen, job["id"])
    assert done["status"] == "succeeded", done
    assert _png(done["result"]["data"][0]["b64_json"]).size == (32, 48)


def test_the_answer_comes_as_the_output_format_asks(qwen):
    """OpenAI's `output_format` / `output_compression`: the same image as a PNG (the pixels
    exact), a JPEG and a WebP at the quality asked; the job route likewise."""
    import numpy as np
    _, png, _ = call(qwen, "POST", "/v1/images/generations", {"prompt": "a red fox", "seed": 4})
    pixels = np.asarray(_png(png["data"][0]["b64_json"]))
    assert png["dtgen"]["output_format"] == "png" and "pixels" not in png["dtgen"]
    sizes = {}
    for fmt, quality in (("jpeg", 95), ("jpeg", 20), ("webp", 90)):
        status, answer, _ = call(qwen, "POST", "/v1/images/generations",
                                 {"prompt": "a red fox", "seed": 4, "output_format": fmt, "output_compression": quality})
        assert status == 200 and answer["dtgen"]["output_format"] == fmt, answer
        image = _png(answer["data"][0]["b64_json"])
        assert image.format == fmt.upper() and image.size == (64, 48)
        assert np.abs(np.asarray(image.convert("RGB")).astype(int) - pixels).mean() < (8 if quality > 50 else 40)
        sizes[fmt, quality] = len(answer["data"][0]["b64_json"])
    assert sizes["jpeg", 20] < sizes["jpeg", 95]
    status, job, _ = call(qwen, "POST", "/v1/jobs", {"prompt": "a red fox", "output_format": "jpeg"})
    done = wait_done(qwen, job["id"])
    assert _png(done["result"]["data"][0]["b64_json"]).format == "JPEG"


@pytest.mark.parametrize("body, field, message", [
    ({"prompt": "x", "output_format": "gif"}, "output_format", "must be one of png, jpeg, webp, got 'gif'"),
    ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, "output_compression",
     "must be an integer from 0 to 100, got 101"),
    ({"prompt": "x", "output_compression": 50}, "output_compression", "applies to jpeg and webp; a png is lossless"),
    ({"prompt": "x", "size": "70x48"}, "size", "width 70 must be a multiple of 16"),
    ({"prompt": "x", "size": "big"}, "size", "'big' is not 'WIDTHxHEIGHT'"),
    ({"prompt": "x", "num_inference_steps": "2"}, "num_inference_steps", "must be an integer"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "must be >= 1 and <= 1000, got 0"),
    ({"prompt": "x", "true_cfg_scale": -1}, "true_cfg_scale", "must be >= 0"),
    ({"prompt": " "}, "prompt", "must be a non-empty string"),
    ({"size": "64x48"}, "prompt", "is required"),
    ({"prompt": "x", "n": 2}, "n", "must be 1"),
    ({"prompt": "x", "guidance": 3}, "guidance", "unknown field"),
    ({"prompt": "x", "quality": "hd"}, "quality", "output_format, output_compression"),   # named as accepted
    ({"prompt": "x", "step_cache": "nocache"}, "step_cache.method", "nocache"),
    ({"prompt": ""}, "prompt", "must be a non-empty string"),
    # within the schema's 4096 px sides, past the server's pixel bound: refused before it is queued
    ({"prompt": "x", "size": "4096x4096"}, "size", "4096x4096 is 16777216 pixels; this server takes at most 1048576 "
                                                   "(the larger of 4 times its default 64x48 and 1024x1024)"),
])
def test_bad_fields_get_422_naming_the_field(qwen, body, field, message):
    status, answer, _ = call(qwen, "POST", "/v1/images/generations", body)
    error = answer["error"]
    assert status == 422 and error["field"] == field and message in error["message"], answer


def test_routes_it_does_not_serve_are_refused_in_one_line(qwen):
    status, answer, _ = call(qwen, "POST", "/v1/images/edits", {"prompt": "x"})
    assert status == 404 and "text to image only" in answer["error"]["message"], answer
    status, answer, _ = call(qwen, "POST", "/v1/videos", {"prompt": "x"})
    assert status == 404 and answer["error"]["message"] == (
        "POST /v1/videos: this server makes images (Qwen-Image); video routes need a video model (a Wan "
        "checkpoint). Here: POST /v1/images/generations, /v1/jobs"), answer
