"""dtgen.image_files: the PNG the CLI writes and the server answers is an ordinary PNG with the
exact pixels, however it is sliced across threads; other suffixes go through Pillow; a bad
path or bad pixels get one line naming them, and no file is left half-written."""
from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from dtgen import image_files
from dtgen.image_files import encode_png, image_path_problem, save_image


def _read(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return np.asarray(im)


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (48, 64, 3), (33, 5, 4), (9, 11, 1), (300, 257, 3)])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_png_round_trips_the_exact_pixels(shape, threads, monkeypatch):
    # tiny slices, so that small images are cut into several sync-flushed pieces too
    monkeypatch.setattr(image_files, "MIN_SLICE_BYTES", 16)
    g = torch.Generator().manual_seed(sum(shape) + threads)
    pixels = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    back = _read(encode_png(pixels, threads=threads))
    assert back.shape == (shape[:2] if shape[2] == 1 else shape)
    assert np.array_equal(back.reshape(shape), pixels.numpy())


def test_png_stream_is_one_valid_zlib_stream_whatever_the_slicing(monkeypatch):
    """The IDAT payload inflates with plain zlib (header and Adler-32 included) to the
    Up-filtered scanlines, sliced or not; slicing changes the bytes, not what they hold."""
    monkeypatch.setattr(image_files, "MIN_SLICE_BYTES", 64)
    pixels = np.arange(40 * 50 * 3, dtype=np.uint32).reshape(40, 50, 3).astype(np.uint8)

    def idat(data: bytes) -> bytes:
        start = data.index(b"IDAT") + 4
        length = int.from_bytes(data[start - 8:start - 4], "big")
        return data[start:start + length]

    one, four = idat(encode_png(pixels, threads=1)), idat(encode_png(pixels, threads=4))
    assert one != four
    raw = zlib.decompress(four)
    assert raw == zlib.decompress(one) and len(raw) == 40 * (50 * 3 + 1)
    assert raw[0] == 2 and raw[1:151] == pixels[0].tobytes()          # row 0: filter Up, unchanged
    row1 = np.frombuffer(raw[152:302], dtype=np.uint8)
    assert np.array_equal(row1, (pixels[1].astype(int) - pixels[0].astype(int)).reshape(-1) % 256)


def test_png_of_a_smooth_image_compresses():
    y, x = np.mgrid[0:256, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], -1).astype(np.uint8)
    assert len(encode_png(smooth)) < smooth.nbytes / 10


@pytest.mark.parametrize("bad, message", [
    (np.zeros((4, 4, 3), dtype=np.float32), "uint8 [H, W, 1|3|4] pixels, got float32 [4, 4, 3]"),
    (np.zeros((4, 4, 2), dtype=np.uint8), "got uint8 [4, 4, 2]"),
    (np.zeros((0, 4, 3), dtype=np.uint8), "got uint8 [0, 4, 3]"),
])
def test_bad_pixels_are_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("|", r"\|")):
        encode_png(bad)


def test_save_image_writes_png_and_pillow_formats_whole(tmp_path):
    pixels = torch.randint(0, 256, (24, 40, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ms = save_image(tmp_path / "a.png", pixels)
    assert ms >= 0 and np.array_equal(np.asarray(Image.open(tmp_path / "a.png")), pixels.numpy())
    save_image(tmp_path / "b.jpg", pixels)
    assert Image.open(tmp_path / "b.jpg").format == "JPEG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.jpg"]   # no partial file left


def test_an_unknown_suffix_is_refused_before_and_at_writing(tmp_path):
    assert image_path_problem("out.png") is None and image_path_problem("x/out.JPG") is None
    assert image_path_problem("out.imgx") == ("--output out.imgx: no image format has the suffix '.imgx' "
                                              "(write .png, .jpg, .webp, ...)")
    with pytest.raises(ValueError, match="no image format has the suffix '.imgx'"):
        save_image(tmp_path / "out.imgx", np.zeros((2, 2, 3), dtype=np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_encode_image_formats_and_refusals():
    pixels = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    assert np.array_equal(_read(image_files.encode_image(pixels)), pixels)
    for fmt in ("jpeg", "webp"):
        with Image.open(io.BytesIO(image_files.encode_image(pixels, fmt, 90))) as im:
            assert im.format == fmt.upper() and im.size == (30, 20)
    with pytest.raises(ValueError, match="a PNG takes no quality"):
        image_files.encode_image(pixels, "png", 50)
    with pytest.raises(ValueError, match="unknown image format 'gif'"):
        image_files.encode_image(pixels, "gif")
    with pytest.raises(ValueError, match="a JPEG holds no alpha channel"):
        image_files.encode_image(np.zeros((2, 2, 4), dtype=np.uint8), "jpeg")


def test_the_servers_output_fields_are_read_and_checked_before_the_model_sees_the_rest():
    from dtgen.requests import RequestError
    from dtgen.serve.adapters import ImageOutput, encode_answer, take_image_output
    output, rest = take_image_output({"prompt": "x", "output_format": "JPEG", "output_compression": "70"}, form=True)
    assert output == ImageOutput("jpeg", 70) and rest == {"prompt": "x"}
    assert take_image_output({"prompt": "x"}, form=False) == (ImageOutput("png", None), {"prompt": "x"})
    for fields, field in (({"output_format": 3}, "output_format"), ({"output_compression": 7}, "output_compression"),
                          ({"output_format": "webp", "output_compression": True}, "output_compression"),
                          ({"output_format": "webp", "output_compression": -1}, "output_compression")):
        with pytest.raises(RequestError) as e:
            take_image_output(fields, form=False)
        assert e.value.field == field
    pixels = torch.randint(0, 256, (8, 12, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    answer = encode_answer({"pixels": pixels, "seed": 1}, None)
    assert set(answer) == {"image", "seed", "output_format", "image_encode_ms"} and answer["output_format"] == "png"
    import base64
    assert np.array_equal(_read(base64.b64decode(answer["image"]["b64_json"])), pixels.numpy())
