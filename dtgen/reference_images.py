"""Reference images a user hands in (an edit's image, image-to-video's first frame): opened as
RGB, upright, with every problem one line naming the file or field before any pixel is decoded.

Size and mode come from the header: a side outside [min_side, max_side] or a mode whose RGB
conversion would change the colours is refused before decoding. Modes taken
(`RGB_CONVERTIBLE_MODES`) keep the colours as displayed: grey, bilevel and palette images are
expanded, RGBX drops padding, and alpha is DROPPED without compositing (what transformers'
`load_image`, the reference pipelines' loader, does). Refused: 16/32-bit integer and float modes
(convert clips to 0..255 instead of rescaling, so a 16-bit image turns mostly white) and CMYK
(converted by a naive formula that ignores the ICC profile, so colours shift).

A model that starts from a reference image declares how it takes one (`ReferenceInput`: its
request field, its upload, the sides it opens, the multiple its output's sides keep); the
command line (`--image FILE`) and the server (a multipart file) open it through that one
declaration, and where no size is given the image's aspect ratio sizes the output.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .requests import RequestError

RGB_CONVERTIBLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX")

PathLike = Union[str, Path]


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def open_image_file(path: PathLike, min_side: int, max_side: int, label: str | None = None) -> Image.Image:
    """The image at `path` as RGB, upright (EXIF orientation applied). ValueError (one line,
    `label`: default "reference image PATH") for a missing or unreadable file, a mode outside
    `RGB_CONVERTIBLE_MODES`, or a side outside [min_side, max_side]."""
    path = Path(path)
    label = label or f"reference image {path}"
    if not path.exists():
        raise ValueError(f"{label}: no such file")
    if not path.is_file():
        raise ValueError(f"{label}: not a file")
    return _open_checked(path, label, min_side, max_side)


def open_image_bytes(data: bytes, name: str, min_side: int, max_side: int) -> Image.Image:
    """An uploaded image (a server's form file `name`), with the checks of `open_image_file`."""
    if not data:
        raise ValueError(f"{name}: the file is empty")
    return _open_checked(io.BytesIO(data), name, min_side, max_side)


def _open_checked(source, label: str, min_side: int, max_side: int) -> Image.Image:
    try:
        with Image.open(source) as image:
            width, height = image.size
            if min(width, height) < min_side:
                raise ValueError(f"{label}: {width}x{height} (WxH) is too small, "
                                 f"each side must be at least MIN_SIDE={min_side} px")
            if max(width, height) > max_side:
                raise ValueError(f"{label}: {width}x{height} (WxH) is too large, "
                                 f"each side must be at most MAX_SIDE={max_side} px")
            if image.mode not in RGB_CONVERTIBLE_MODES:
                raise ValueError(f"{label}: mode {image.mode!r} is not supported "
                                 f"(supported: {', '.join(RGB_CONVERTIBLE_MODES)}); convert it to 8-bit RGB first")
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError as err:
        raise ValueError(f"{label}: too large to decode safely "
                         f"(MAX_SIDE={max_side} px): {_one_line(err)}") from None
    except UnidentifiedImageError:   # its message names the source: an upload's is a BytesIO's repr
        raise ValueError(f"{label}: not a readable image file (no image format PIL reads: PNG, JPEG, WebP, "
                         "...)") from None
    except (OSError, SyntaxError) as err:  # some plugins raise SyntaxError
        raise ValueError(f"{label}: not a readable image file ({_one_line(err)})") from None


class ReferenceImage:
    """A user's reference image, opened and checked: `pixels` uint8 [H, W, 3] (RGB, upright) and
    `name`, where it came from (a path, an upload's file name). A request holds one as a value:
    compared by identity, written in reports as its name and size, never as its pixels."""

    __slots__ = ("pixels", "name")

    def __init__(self, pixels: torch.Tensor, name: str):
        if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != 3:
            raise ValueError(f"{name}: reference pixels must be uint8 [H, W, 3], got {pixels.dtype} "
                             f"{list(pixels.shape)}")
        self.pixels, self.name = pixels, name

    @classmethod
    def from_pil(cls, image: Image.Image, name: str) -> "ReferenceImage":
        return cls(torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8, copy=True)), name)

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    def pil(self) -> Image.Image:
        return Image.fromarray(self.pixels.numpy())

    def __str__(self) -> str:
        return f"{self.name} ({self.width}x{self.height})"

    __repr__ = __str__


def aspect_size(image: ReferenceImage, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) of about `area` pixels with the image's aspect ratio, each a multiple of
    `multiple` (the model's VAE x patch side), as diffusers' WanImageToVideoPipeline example sizes it."""
    aspect = image.height / image.width
    height = round(math.sqrt(area * aspect)) // multiple * multiple
    width = round(math.sqrt(area / aspect)) // multiple * multiple
    return max(height, multiple), max(width, multiple)


def vae_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """diffusers' VideoProcessor.preprocess of a PIL image: Lanczos resize to (width, height),
    / 255 in float32, to [-1, 1]: [1, 3, height, width]."""
    resized = np.array(image.resize((width, height), resample=Image.Resampling.LANCZOS)).astype(np.float32) / 255.0
    return torch.from_numpy(resized).permute(2, 0, 1)[None] * 2.0 - 1.0


@dataclass(frozen=True)
class ReferenceInput:
    """How a model takes a reference image: the request's attribute (`--image FILE` on the
    command line) and the server's multipart file field, the sides it opens (outside them the
    file is refused before decoding), and the multiple its output's sides keep where the image
    sizes the output (`output_size`)."""
    min_side: int
    max_side: int
    multiple: int                       # the output's sides: the model's VAE x patch side
    field: str = "image"                # the request's attribute
    upload: str = "input_reference"     # the server's file field (OpenAI's videos API name)

    def open_file(self, path: PathLike) -> ReferenceImage:
        """`path` opened and checked (`RequestError` naming the request's field otherwise)."""
        try:
            return ReferenceImage.from_pil(open_image_file(path, self.min_side, self.max_side, str(path)), str(path))
        except ValueError as e:
            raise RequestError(self.field, str(e)) from None

    def open_upload(self, given: list[tuple[str | None, bytes]], per: str = "request") -> ReferenceImage:
        """The one uploaded (filename, bytes) of the upload field, opened and checked
        (`RequestError` naming the upload field otherwise; `per`: what one image is for)."""
        if len(given) > 1:
            raise RequestError(self.upload, f"one image per {per}, got {len(given)}")
        filename, data = given[0]
        try:
            image = open_image_bytes(data, filename or self.upload, self.min_side, self.max_side)
        except ValueError as e:
            raise RequestError(self.upload, str(e)) from None
        return ReferenceImage.from_pil(image, filename or self.upload)

    def output_size(self, image: ReferenceImage, area: int) -> tuple[int, int]:
        """(height, width): about `area` pixels (the default size's) at the image's aspect ratio."""
        return aspect_size(image, area, self.multiple)
