"""Image to video over real HTTP on 127.0.0.1 (`examples.serve --model wan --image-to-video`: the
tiny Wan2.1-I2V default, one process): OpenAI's `input_reference` as a multipart file makes a video of the
image's aspect ratio; a text-only request, a bad image or a bad frame count is one 422 naming
its field before any job is queued."""
from __future__ import annotations

import io
import time

import pytest

pytest.importorskip("fastapi")
av = pytest.importorskip("av")

from PIL import Image  # noqa: E402

from models.wan.tiny import ensure_tiny_i2v_checkpoint  # noqa: E402
from tests.support.serve import call, running_server  # noqa: E402


def multipart(fields: dict, files: dict) -> tuple[bytes, str]:
    """A multipart/form-data body (what `curl -F` sends): text fields and (filename, bytes) files."""
    boundary = "dtgen-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{name}"\r\n'
              f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
              for k, (name, data) in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    """The server on the tiny image-to-video default (--image-to-video: 48 x 64 px, 9 frames)."""
    import os
    cache = tmp_path_factory.mktemp("wan-i2v-cache")
    ensure_tiny_i2v_checkpoint(cache)
    before = os.environ.get("DTGEN_CACHE")
    os.environ["DTGEN_CACHE"] = str(cache)
    try:
        with running_server(cache / "server.log", "--model", "wan", "--image-to-video", "--steps", "2",
                            module="examples.serve") as (base, _):
            yield base
    finally:
        if before is None:
            del os.environ["DTGEN_CACHE"]
        else:
            os.environ["DTGEN_CACHE"] = before


def test_a_video_from_an_uploaded_image_keeps_its_aspect_ratio(i2v):
    body, kind = multipart({"prompt": "a fox runs", "seed": "1"}, {"input_reference": ("fox.png", _png(40, 80))})
    status, video, _ = call(i2v, "POST", "/v1/videos", body, content_type=kind)
    # 48 x 64 px of area at 1:2, each side a multiple of 16 (rounded down)
    assert status == 202 and video["size"] == "32x64", video
    end = time.monotonic() + 120
    while video["status"] in ("queued", "in_progress"):
        assert time.monotonic() < end, video
        time.sleep(0.05)
        video = call(i2v, "GET", f"/v1/videos/{video['id']}")[1]
    assert video["status"] == "completed", video
    import urllib.request
    raw = urllib.request.urlopen(f"{i2v}/v1/videos/{video['id']}/content", timeout=30).read()
    with av.open(io.BytesIO(raw)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (64, 32, 3)


@pytest.mark.parametrize("fields, files, field, message", [
    ({"prompt": "x"}, {}, "input_reference", "is required: this checkpoint makes video from an image"),
    ({"prompt": "x", "input_reference": "/etc/passwd"}, {}, "input_reference", "must be an image file"),
    ({"prompt": "x"}, {"input_reference": ("a.png", b"not an image")}, "input_reference", "not a readable image"),
    ({"prompt": "x"}, {"input_reference": ("a.png", _png(8, 40))}, "input_reference", "8x40 (WxH) is too small"),
    ({"prompt": "x"}, {"input_reference": ("a.png", b"")}, "input_reference", "the file is empty"),
    ({"prompt": "x"}, {"image": ("a.png", _png(40, 40))}, "image", "unknown file field"),
    ({"prompt": "x", "num_frames": "8"}, {"input_reference": ("a.png", _png(40, 40))}, "num_frames", "4k + 1"),
])
def test_bad_requests_are_one_422_naming_the_field(i2v, fields, files, field, message):
    body, kind = multipart(fields, files)
    status, answer, _ = call(i2v, "POST", "/v1/videos", body, content_type=kind)
    assert status == 422 and answer["error"]["field"] == field and message in answer["error"]["message"], answer
    assert "\n" not in answer["error"]["message"]


def test_image_to_video_with_a_checkpoint_is_one_line(tmp_path, capsys):
    from dtgen.cli import serve_main
    folder = ensure_tiny_i2v_checkpoint(tmp_path)
    assert serve_main(["--model", "wan", "--image-to-video", "--checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --image-to-video picks the tiny default") and "\n" not in err, err
